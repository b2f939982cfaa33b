"""The one RoPE entry point of this package: dsv4-primitives' dispatching ``apply_rope``."""

from __future__ import annotations

import torch

from dsv4_primitives import RopeConfig, apply_rope


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cfg: RopeConfig,
    inverse: bool = False,
    max_position: int | None = None,
    inplace: bool = False,
) -> torch.Tensor:
    """Rotate the last ``cfg.rope_dim`` channels of ``x [*P, *H, D]`` at ``positions [*P]``.

    ``max_position``: a host bound of ``|positions|`` (:attr:`TokenLayout.max_rope_position`); without it the table
    size is read back from the device (one synchronisation per call). ``inplace``: rotate ``x`` itself (only the
    ``rope_dim`` channels are read and written: ``rope_dim / D`` of the out-of-place traffic); ``x`` must be a
    fresh activation no other op saved for its backward (e.g. an RMSNorm output: the norm saves its input).
    """
    # eager torch path off-GPU: the Triton interpreter would only slow CPU runs down
    backend = "auto" if x.is_cuda else "reference"
    return apply_rope(
        x, positions, cfg, inverse=inverse, backend=backend, max_position=max_position, inplace=inplace
    )
