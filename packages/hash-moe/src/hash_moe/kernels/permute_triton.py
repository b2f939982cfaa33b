"""Row gather and gather-sum in Triton: MoE token movement without atomics (reference: :mod:`hash_moe.row_gather`).

```
gather_rows:      out[i] = src[idx[i]]                   (0 where idx[i] < 0)          idx: [R]
gather_sum_rows:  out[t] = Σ_k src[idx[t, k]]  k = 0..K-1 (terms with idx[t, k] < 0 skipped; fp32 sum, fp64 for fp64)
```

Every output row is written by exactly one program and ``gather_sum_rows`` adds its ``K`` terms in the order of
``k``: results are deterministic and equal to the PyTorch path of :mod:`hash_moe.row_gather` bit for bit (same
fp32 additions, one rounding to the output dtype). These two kernels are the whole data path of the MoE
permute / unpermute (:mod:`hash_moe.permute`) and of the grouped GEMM's alignment padding, forward and backward:
each one is the other's adjoint when ``idx`` of one is the inverse map of the other.

Shape legend: ``R`` output rows, ``T`` tokens, ``K`` source rows summed per output row, ``C`` columns.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_rows_kernel(
    src_ptr,
    idx_ptr,
    out_ptr,
    n_rows,
    n_cols,
    stride_src,
    stride_out,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    src_row = tl.load(idx_ptr + rows, mask=row_ok, other=-1).to(tl.int64)  # [BR]
    load_mask = (src_row >= 0)[:, None] & col_ok[None, :]
    v = tl.load(
        src_ptr + src_row[:, None] * stride_src + cols[None, :], mask=load_mask, other=0.0
    )  # [BR, BC]
    out_offs = rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out_ptr + out_offs, v, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gather_sum_rows_kernel(
    src_ptr,
    idx_ptr,
    out_ptr,
    n_rows,
    n_cols,
    stride_src,
    stride_idx,
    stride_out,
    K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ACC_FP64: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    idx_row = idx_ptr + rows.to(tl.int64) * stride_idx
    if ACC_FP64:
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    # out[t] = Σ_k src[idx[t, k]], in the order of k (the PyTorch path adds in the same order)
    for k in range(K):
        src_row = tl.load(idx_row + k, mask=row_ok, other=-1).to(tl.int64)  # [BR]
        load_mask = (src_row >= 0)[:, None] & col_ok[None, :]
        v = tl.load(src_ptr + src_row[:, None] * stride_src + cols[None, :], mask=load_mask, other=0.0)
        acc += v.to(acc.dtype)
    out_offs = rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# GPU tiles: 4096 elements and 4 warps = 32 elements (four 128-bit bf16 vectors) per thread; rows of up to 1024
# columns per tile, so a 4096-wide row is 4 programs and narrow rows pack several per program.
_TILE = 4096
_MAX_BLOCK_C = 1024
_NUM_WARPS = 4


def _interpreting(t: torch.Tensor) -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1" or not t.is_cuda


def _blocks(n_rows: int, n_cols: int, interpret: bool) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_C)``: GPU tiles of ``_TILE`` elements; the interpreter takes whole (small) problems."""
    block_c = triton.next_power_of_2(max(n_cols, 1))
    if not interpret:
        block_c = min(_MAX_BLOCK_C, block_c)
    tile = 1 << 16 if interpret else _TILE
    block_r = max(1, min(tile // block_c, triton.next_power_of_2(max(n_rows, 1))))
    return block_r, block_c


def _check_rows(src: torch.Tensor, idx: torch.Tensor, idx_dim: int) -> None:
    assert src.dim() == 2 and src.stride(1) == 1, "src must be [N, C] with unit column stride"
    assert idx.dim() == idx_dim and idx.is_contiguous() and not idx.is_floating_point()


def gather_rows_triton(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``out [R, C]``, ``out[i] = src[idx[i]]`` (zero rows where ``idx[i] < 0``); ``src [N, C]``, ``idx [R]``."""
    _check_rows(src, idx, 1)
    n_rows, n_cols = idx.shape[0], src.shape[1]
    out = torch.empty(n_rows, n_cols, device=src.device, dtype=src.dtype)  # [R, C]
    if n_rows == 0 or n_cols == 0:
        return out
    if src.shape[0] == 0:  # every index is -1
        return out.zero_()
    block_r, block_c = _blocks(n_rows, n_cols, _interpreting(src))
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))
    _gather_rows_kernel[grid](
        src,
        idx,
        out,
        n_rows,
        n_cols,
        src.stride(0),
        out.stride(0),
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=_NUM_WARPS,
    )
    return out


def gather_sum_rows_triton(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``out [T, C]``, ``out[t] = Σ_k src[idx[t, k]]`` over ``idx[t, k] >= 0`` (fp32 sum, fp64 for fp64 ``src``).

    The output takes ``src.dtype``. Under the interpreter the kernel writes fp32 and PyTorch rounds afterwards (the
    interpreter truncates fp32 -> bf16 stores; the GPU rounds to nearest even, as PyTorch does).
    """
    _check_rows(src, idx, 2)
    n_rows, k = idx.shape
    n_cols = src.shape[1]
    interpret = _interpreting(src)
    narrow = src.dtype in (torch.bfloat16, torch.float16)
    store_dtype = torch.float32 if interpret and narrow else src.dtype
    out = torch.empty(n_rows, n_cols, device=src.device, dtype=store_dtype)  # [T, C]
    if n_rows == 0 or n_cols == 0 or k == 0 or src.shape[0] == 0:
        return out.zero_().to(src.dtype)
    block_r, block_c = _blocks(n_rows, n_cols, interpret)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))
    _gather_sum_rows_kernel[grid](
        src,
        idx,
        out,
        n_rows,
        n_cols,
        src.stride(0),
        idx.stride(0),
        out.stride(0),
        K=k,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        ACC_FP64=src.dtype == torch.float64,
        num_warps=_NUM_WARPS,
    )
    return out.to(src.dtype)
