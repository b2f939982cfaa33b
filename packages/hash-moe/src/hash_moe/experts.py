"""Expert MLPs with clamped SwiGLU (§7.3): the grouped routed experts and the single shared expert (math only).

Routed experts, rows sorted by expert (``tokens_per_expert`` rows each), routing weight ``p`` per row:

```
[a | b] = x @ gate_up[e].T          # gate_up[e] = [w1; w3]: [2F, H]   (HF gate_up_proj layout)
h       = silu(min(a, L)) · clamp(b, -L, L) · p        (fp32)
y       = h @ down[e].T             # down[e] = w2: [H, F]              (HF down_proj layout)
```

The shared expert is the same MLP with ``p = 1`` on every token (clamped too: the bug other ports shipped was
leaving it unclamped).

Shape legend: ``M`` rows, ``G`` local experts, ``H`` hidden size, ``F`` expert width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hash_moe.grouped_gemm import GroupedBackend, grouped_mm
from hash_moe.swiglu import SwiGLUBackend, clamped_swiglu


def grouped_swiglu_experts(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor | Sequence[int],
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    limit: float | None,
    probs: torch.Tensor | None = None,
    backend: GroupedBackend = "auto",
    activation_backend: SwiGLUBackend = "auto",
) -> torch.Tensor:
    """Routed experts on expert-sorted rows: ``[M, H] -> [M, H]``.

    Args:
        x: ``[M, H]`` rows grouped by expert.
        tokens_per_expert: ``[G]`` rows per local expert.
        gate_up: ``[G, 2F, H]`` fused ``[w1; w3]`` weights.
        down: ``[G, H, F]`` ``w2`` weights.
        limit: SwiGLU clamp (``None`` = plain SwiGLU).
        probs: ``[M]`` routing weight of each row, multiplied into ``h`` in fp32 (``None`` = 1).
        backend: grouped GEMM backend (:mod:`hash_moe.grouped_gemm`).
        activation_backend: :func:`hash_moe.swiglu.clamped_swiglu` backend (``"auto"``: fused Triton on CUDA).
    """
    gate_up_out = grouped_mm(x, gate_up, tokens_per_expert, backend=backend)  # [M, 2F]
    h = clamped_swiglu(gate_up_out, limit, probs, backend=activation_backend)  # [M, F]
    return grouped_mm(h, down, tokens_per_expert, backend=backend)  # [M, H]


def swiglu_mlp(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    limit: float | None,
    activation_backend: SwiGLUBackend = "auto",
) -> torch.Tensor:
    """One clamped-SwiGLU MLP (the shared expert): ``[..., H] -> [..., H]`` with ``gate_up [2F, H]``, ``down [H, F]``."""
    h = clamped_swiglu(x @ gate_up.t(), limit, backend=activation_backend)
    return h @ down.t()
