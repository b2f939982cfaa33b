"""Small-M routed experts for decoding: each expert that has rows has its weights read once, the others not at all.

The grouped path (:func:`hash_moe.grouped_gemm.grouped_mm` with device counts, ``torch._grouped_mm`` padded to the
static worst case) reads every local expert's weights whatever the routing. At decode sizes (``M = tokens · topk``
rows, a few to a few hundred) the step is bound by those reads: at batch 1 with top-6 of 16 experts, 10 of the 16
weight sets are read for nothing. These kernels (:mod:`hash_moe.kernels.routed_experts_triton`) read only the
experts with rows, with a static grid and the counts on the device (no host sync, CUDA-graph capturable):

```
routed_mm:              out[r] = x[r] @ w[e_r].T                                   rows r sorted by expert e_r
routed_swiglu_experts:  [a | b] = round(x[r] @ gate_up[e_r].T)                     (fc1 + SwiGLU: one kernel)
                        h[r]    = round(silu(min(a, L)) · clamp(b, -L, L) · p[r])  (fp32 math)
                        y[r]    = h[r] @ down[e_r].T                               (fc2: routed_mm)
```

``round`` is the cast to the input dtype, as in :func:`hash_moe.experts.grouped_swiglu_experts` (the reference:
the same roundings, the sums in another order). Rows past ``Σ counts`` are filler (zero output), as for
``grouped_mm``'s device counts; a device tensor's sum is trusted not to exceed ``M`` (host counts are checked). An
expert's weights are read once per block of up to 64 of its rows (:func:`launch_config`): once at decode sizes.

**Inference only**: no backward. The functions raise ``ValueError`` when autograd would need one (grad mode on and
an operand that requires grad); :class:`hash_moe.megatron.ClampedSwiGLUExperts` takes this path only without grad
and falls back to the grouped GEMM otherwise. fp32 / bf16 / fp16 operands, any ``K`` / ``N`` (no alignment), CUDA
tensors or the Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors).

Shape legend: ``M`` rows, ``G`` experts, ``S = min(M, G)`` expert slots, ``K`` input width, ``N`` output width,
``H`` hidden size, ``F`` expert width.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton

from dsv4_primitives.dispatch import triton_usable
from hash_moe.grouped_gemm import _counts_list
from hash_moe.kernels.routed_experts_triton import _routed_gate_up_kernel, _routed_mm_kernel
from hash_moe.swiglu import check_swiglu_limit

ROUTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# GPU tiles: BN output columns per program (many programs at M = 1: 6 experts x H / 32 columns), BK = 128 inputs
BLOCK_N = 32
BLOCK_K = 128
NUM_WARPS = 4


def launch_config(dtype: torch.dtype, m: int, g: int) -> tuple[int, int]:
    """``(BLOCK_M, num_stages)`` of a launch on ``M`` rows over ``G`` experts: ``BLOCK_M`` is the expected rows per
    expert (``M / G``) rounded up to a power of two within ``[16, 64]`` (``tl.dot`` needs 16; more rows per block
    re-read the weight tile less often), 4 pipeline stages; fp32 tiles: ``BLOCK_M <= 32`` and 2 stages (sm_90: the
    fused gate-up kernel at 64 rows and 4 stages spills registers and takes 192 KiB of shared memory;
    ``tests/test_routed_experts_sm90_compile.py``)."""
    wide = dtype == torch.float32
    block_m = max(16, min(32 if wide else 64, triton.next_power_of_2(max(1, -(-m // max(g, 1))))))
    return block_m, (2 if wide else 4)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _store_dtype(dtype: torch.dtype) -> torch.dtype:
    """The interpreter truncates fp32 -> bf16 / fp16 stores (the GPU rounds to nearest even): interpreted kernels
    write fp32 and PyTorch rounds afterwards."""
    return torch.float32 if _interpreting() and dtype in (torch.bfloat16, torch.float16) else dtype


def _check_operands(
    name: str, x: torch.Tensor, ws: Sequence[torch.Tensor], probs: torch.Tensor | None
) -> None:
    if x.dtype not in ROUTED_DTYPES or any(w.dtype != x.dtype for w in ws):
        raise ValueError(
            f"{name} needs fp32 / bf16 / fp16 operands of one dtype, got {x.dtype} and "
            f"{[str(w.dtype) for w in ws]}; use hash_moe.grouped_swiglu_experts for other dtypes"
        )
    if not triton_usable(x) or any(w.device != x.device for w in ws):
        raise ValueError(
            f"{name} runs Triton kernels: pass tensors on one CUDA device (or set TRITON_INTERPRET=1 for CPU); got "
            f"{x.device} and {[str(w.device) for w in ws]}"
        )
    tensors = [x, *ws] + ([probs] if probs is not None else [])
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError(
            f"{name} is inference only (no backward): call it under torch.no_grad() / inference_mode(), or use "
            "hash_moe.grouped_swiglu_experts for training"
        )


def _checked_counts(counts: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``counts`` as a contiguous integer ``[G]`` tensor on ``device`` (the kernels find each slot's expert from it,
    reading it with stride 1); ``ValueError`` otherwise."""
    if (
        counts.dim() != 1
        or counts.dtype.is_floating_point
        or counts.dtype == torch.bool
        or counts.device != device
    ):
        raise ValueError(
            f"tokens_per_expert must be an integer [G] tensor on {device}, got {counts.dtype} "
            f"{tuple(counts.shape)} on {counts.device}"
        )
    return counts.contiguous()


def _as_counts(tokens_per_expert: torch.Tensor | Sequence[int], m: int, device: torch.device) -> torch.Tensor:
    """The counts on ``device``. Host counts (a list, or a CPU tensor with CUDA rows) are checked (non-negative, sum
    <= ``M``) and uploaded without a sync; device counts are trusted (checking would need the host)."""
    on_host = not isinstance(tokens_per_expert, torch.Tensor) or (
        tokens_per_expert.device.type == "cpu" and device.type != "cpu"
    )
    if not on_host:
        return tokens_per_expert
    if isinstance(tokens_per_expert, torch.Tensor) and (
        tokens_per_expert.dtype.is_floating_point or tokens_per_expert.dtype == torch.bool
    ):
        raise ValueError(f"tokens_per_expert must hold integers, got {tokens_per_expert.dtype}")
    host = _counts_list(tokens_per_expert)
    if any(c < 0 for c in host) or sum(host) > m:
        raise ValueError(f"tokens_per_expert must be non-negative and sum to at most M={m}, got {host}")
    return torch.tensor(host, dtype=torch.int64).to(device, non_blocking=True)


def _device_counts(
    tokens_per_expert: torch.Tensor | Sequence[int], m: int, g: int, device: torch.device
) -> torch.Tensor:
    """The ``[G]`` counts on ``device`` (:func:`_as_counts`), checked to have ``g`` entries."""
    counts = _checked_counts(_as_counts(tokens_per_expert, m, device), device)
    if counts.shape[0] != g:
        raise ValueError(f"tokens_per_expert has {counts.shape[0]} entries for {g} experts")
    return counts


def _grid_args(counts: torch.Tensor, m: int) -> tuple[int, int]:
    """``(S, G_BLOCK)``: the static slot count ``min(M, G)`` and the kernels' power-of-two width over ``G``."""
    g = counts.shape[0]
    return min(m, g), triton.next_power_of_2(max(g, 1))


def _dot_flags(dtype: torch.dtype) -> dict:
    """The kernels' ``IEEE`` / ``UPCAST`` switches: exact fp32 products for fp32 and in the interpreter, whose
    bf16 / fp16 ``tl.dot`` is wrong (it multiplies those tiles in fp32 instead)."""
    return dict(
        IEEE=dtype == torch.float32 or _interpreting(), UPCAST=_interpreting() and dtype != torch.float32
    )


def _launch_mm(x, w, counts, out) -> None:
    """``out[r] = x[r] @ w[e_r].T`` for the routed rows (``out`` preallocated ``[M, N]``; filler rows untouched)."""
    m, k = x.shape
    n = w.shape[1]
    block_m, stages = launch_config(x.dtype, m, w.shape[0])
    slots, g_block = _grid_args(counts, m)
    _routed_mm_kernel[(slots, triton.cdiv(n, BLOCK_N))](
        x,
        w,
        out,
        counts,
        counts.shape[0],
        n,
        k,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        G_BLOCK=g_block,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        **_dot_flags(x.dtype),
        num_warps=NUM_WARPS,
        num_stages=stages,
    )


def routed_mm(
    x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor | Sequence[int]
) -> torch.Tensor:
    """``[M, K] x [G, N, K] -> [M, N]`` on expert-sorted rows, reading only experts with rows (inference only).

    Args:
        x: ``[M, K]`` rows sorted by expert.
        w: ``[G, N, K]`` per-expert weights (``nn.Linear`` layout).
        tokens_per_expert: ``[G]`` row counts (an integer tensor on ``x``'s device: no sync; or host ints). Rows past
            their sum are filler (zeros).
    """
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(
            f"routed_mm expects x [M, K] and w [G, N, K] with equal K; got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    _check_operands("routed_mm", x, (w,), None)
    counts = _device_counts(tokens_per_expert, x.shape[0], w.shape[0], x.device)
    x, w = x.contiguous(), w.contiguous()
    out = torch.zeros(
        x.shape[0], w.shape[1], device=x.device, dtype=_store_dtype(x.dtype)
    )  # [M, N]; filler: 0
    if x.shape[0] and w.shape[1] and w.shape[0]:
        _launch_mm(x, w, counts, out)
    return out.to(x.dtype)


def routed_swiglu_experts(
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor | Sequence[int],
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    limit: float | None,
    probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed clamped-SwiGLU experts on expert-sorted rows, ``[M, H] -> [M, H]``, reading only experts with rows.

    Same arguments and result (within rounding) as :func:`hash_moe.experts.grouped_swiglu_experts`; inference only
    (see the module docstring).

    Args:
        x: ``[M, H]`` rows grouped by expert.
        tokens_per_expert: ``[G]`` rows per expert (integer tensor on ``x``'s device, or host ints); rows past their
            sum are filler (zero output).
        gate_up: ``[G, 2F, H]`` fused ``[w1; w3]`` weights.
        down: ``[G, H, F]`` ``w2`` weights.
        limit: SwiGLU clamp (``None`` = plain SwiGLU).
        probs: ``[M]`` routing weight of each row, multiplied into ``h`` in fp32 (``None`` = 1).
    """
    check_swiglu_limit(limit)
    g, m, h_in = gate_up.shape[0], x.shape[0], x.shape[-1]
    if (
        x.dim() != 2
        or gate_up.dim() != 3
        or down.dim() != 3
        or gate_up.shape[1] % 2
        or gate_up.shape[2] != h_in
        or down.shape != (g, h_in, gate_up.shape[1] // 2)
    ):
        raise ValueError(
            f"routed_swiglu_experts expects x [M, H], gate_up [G, 2F, H], down [G, H, F]; got {tuple(x.shape)}, "
            f"{tuple(gate_up.shape)}, {tuple(down.shape)}"
        )
    if probs is not None and probs.shape != (m,):
        raise ValueError(f"probs must be [M] = ({m},), got {tuple(probs.shape)}")
    _check_operands("routed_swiglu_experts", x, (gate_up, down), probs)
    counts = _device_counts(tokens_per_expert, m, g, x.device)
    f = down.shape[2]
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    h = torch.empty(m, f, device=x.device, dtype=_store_dtype(x.dtype))  # [M, F]; filler rows never read
    if m and f and g:
        p = probs.contiguous() if probs is not None else x
        block_m, stages = launch_config(x.dtype, m, g)
        slots, g_block = _grid_args(counts, m)
        _routed_gate_up_kernel[(slots, triton.cdiv(f, BLOCK_N))](
            x,
            gate_up,
            p,
            h,
            counts,
            g,
            f,
            h_in,
            x.stride(0),
            gate_up.stride(0),
            gate_up.stride(1),
            h.stride(0),
            float(limit) if limit is not None else 0.0,
            G_BLOCK=g_block,
            BLOCK_M=block_m,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            **_dot_flags(x.dtype),
            ROUND_BF16_BY_BITS=_interpreting() and x.dtype == torch.bfloat16,
            HAS_LIMIT=limit is not None,
            HAS_PROBS=probs is not None,
            num_warps=NUM_WARPS,
            num_stages=stages,
        )
    h = h.to(x.dtype)  # the interpreter's fp32 h rounds here (on the GPU it is stored rounded)
    out = torch.zeros(m, h_in, device=x.device, dtype=_store_dtype(x.dtype))  # [M, H]; filler rows: 0
    if m and h_in and g:
        _launch_mm(h, down, counts, out)
    return out.to(x.dtype)
