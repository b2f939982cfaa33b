"""Configuration of one manifold-constrained hyper-connection (dsv4-architecture.md §6)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BACKENDS = ("auto", "triton", "reference")


@dataclass(kw_only=True, slots=True)
class MHCConfig:
    """Settings shared by every mHC instance of a model.

    Attributes:
        hidden_size: ``d``, the width of one stream (the model's hidden size).
        num_streams: ``n_hc``, number of residual streams (4 in DSv4).
        sinkhorn_iters: ``t_max`` of the Sinkhorn-Knopp projection (20 in DSv4).
        norm_eps: ``rms_norm_eps``, epsilon of the RMS over all ``n·d`` stream values.
        hc_eps: ``hc_eps``, the ``+eps`` of ``pre``, of Sinkhorn and of the HyperHead weights.
        init_gating_factor: initial value of the gating factors ``scale`` (Megatron ``mhc_init_gating_factor``).
        init_std: std of the normal initialisation of the ``fn`` projections.
        stream_dtype: storage dtype of the streams between layers (fp32 for training; bf16 halves the traffic).
        backend: ``"auto"`` (Triton on CUDA, reference on CPU), ``"triton"`` or ``"reference"``; the environment
            variable ``MHC_BACKEND`` overrides ``"auto"``.
        recompute_coefficients: recompute the coefficient math (RMS, projection, Sinkhorn) in backward instead of
            keeping its intermediates (the Triton backend always recomputes Sinkhorn; this flag additionally
            checkpoints the whole coefficient computation on the reference backend).
    """

    hidden_size: int
    num_streams: int = 4
    sinkhorn_iters: int = 20
    norm_eps: float = 1e-6
    hc_eps: float = 1e-6
    init_gating_factor: float = 0.01
    init_std: float = 0.02
    stream_dtype: torch.dtype = torch.float32
    backend: str = "auto"
    recompute_coefficients: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size <= 0:
            raise ValueError(f"MHCConfig.hidden_size must be positive, got {self.hidden_size}")
        if self.num_streams < 1:
            raise ValueError(f"MHCConfig.num_streams must be >= 1, got {self.num_streams}")
        if self.sinkhorn_iters < 1:
            raise ValueError(f"MHCConfig.sinkhorn_iters must be >= 1, got {self.sinkhorn_iters}")
        if self.norm_eps <= 0 or self.hc_eps < 0:
            raise ValueError(f"MHCConfig eps values must be positive, got {self.norm_eps=} {self.hc_eps=}")
        if self.init_gating_factor < 0:
            raise ValueError(f"MHCConfig.init_gating_factor must be >= 0, got {self.init_gating_factor}")
        if not self.stream_dtype.is_floating_point:
            raise ValueError(f"MHCConfig.stream_dtype must be a floating dtype, got {self.stream_dtype}")
        if self.backend not in _BACKENDS:
            raise ValueError(f"MHCConfig.backend must be one of {_BACKENDS}, got {self.backend!r}")

    @property
    def num_mixes(self) -> int:
        """Rows of ``fn``/``base``: ``(2 + n) · n`` = ``[pre(n), post(n), comb(n·n)]``."""
        return (2 + self.num_streams) * self.num_streams
