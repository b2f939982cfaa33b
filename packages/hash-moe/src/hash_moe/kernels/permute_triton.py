"""Row gather and gather-sum in Triton: MoE token movement without atomics (reference: :mod:`hash_moe.row_gather`);
and the permutation's index maps in two launches (reference: :func:`hash_moe.permute.permute_map_torch`).

```
gather_rows:      out[i] = src[idx[i]]                   (0 where idx[i] < 0)          idx: [R]
gather_sum_rows:  out[t] = Σ_k src[idx[t, k]]  k = 0..K-1 (terms with idx[t, k] < 0 skipped; fp32 sum, fp64 for fp64)
permute_map:      row_of_pair, pair_of_row, token_of_row, rows_of_token of a routing map (no sort, no atomics)
```

Every output row is written by exactly one program and ``gather_sum_rows`` adds its ``K`` terms in the order of
``k``: results are deterministic and equal to the PyTorch path of :mod:`hash_moe.row_gather` bit for bit (same
fp32 additions, one rounding to the output dtype). These two kernels are the whole data path of the MoE
permute / unpermute (:mod:`hash_moe.permute`) and of the grouped GEMM's alignment padding, forward and backward:
each one is the other's adjoint when ``idx`` of one is the inverse map of the other.

Shape legend: ``R`` output rows, ``T`` tokens, ``K`` source rows summed per output row, ``C`` columns, ``E`` experts,
``P`` programs of the map kernels.
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


# ----------------------------------------------------------------------------------------------------------------
# The permutation's index maps (see hash_moe.permute.build_permute_map): two launches, no sort, no atomics.
# Program p owns the token range [p * TP, (p + 1) * TP) (TP = n_sub tiles of BLOCK_T tokens).
#   1. _route_counts_kernel:  counts[p, e] = routed tokens of program p for expert e                     [P, BE]
#   2. _permute_map_kernel:   row of (t, e) = Σ_{e' < e} n_e' (all programs) + Σ_{p' < p} counts[p', e]
#                                            + routed tokens of expert e before t in program p's range
#      (a per-expert carry over the program's tiles, an in-tile scan along the tokens); then every map entry is
#      written by exactly one program: row_of_pair (dense), pair_of_row / token_of_row (unique rows, plus program
#      p's share of the empty rows [min(n_routed, R), R)), rows_of_token (a scan along the experts gives each pair's
#      slot; the slots past the token's kept pairs get -1).
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _route_counts_kernel(
    rm_ptr,
    counts_ptr,
    n_tokens,
    n_experts,
    n_sub,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    es = tl.arange(0, BLOCK_E)  # [BE]
    e_ok = es < n_experts
    acc = tl.zeros([BLOCK_E], dtype=tl.int32)
    for i in range(n_sub):
        tok = (pid * n_sub + i) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
        mask = (tok < n_tokens)[:, None] & e_ok[None, :]
        offs = tok[:, None].to(tl.int64) * n_experts + es[None, :]  # [BT, BE]
        acc += tl.sum(tl.load(rm_ptr + offs, mask=mask, other=0).to(tl.int32), axis=0)
    tl.store(counts_ptr + pid * BLOCK_E + es, acc)  # padded experts: 0


@triton.jit
def _permute_map_kernel(
    rm_ptr,
    counts_ptr,
    row_of_pair_ptr,
    rows_of_token_ptr,
    pair_of_row_ptr,
    token_of_row_ptr,
    n_tokens,
    n_experts,
    n_slots,
    num_out,
    n_progs,
    n_sub,
    fill_per_prog,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    pid = tl.program_id(0)
    es = tl.arange(0, BLOCK_E)  # [BE]
    e_ok = es < n_experts
    # routed pairs per expert: of all programs, and of the programs before this one
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, n_progs, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)  # [BP]
        c = tl.load(counts_ptr + ps[:, None] * BLOCK_E + es[None, :], mask=(ps < n_progs)[:, None], other=0)
        total += tl.sum(c, axis=0)
        before += tl.sum(tl.where((ps < pid)[:, None], c, 0), axis=0)
    n_routed = tl.sum(total, axis=0)
    carry = tl.cumsum(total, axis=0) - total + before  # [BE]: row of this program's first pair of each expert
    ks = tl.arange(0, BLOCK_K)  # [BK]
    for i in range(n_sub):
        tok = (pid * n_sub + i) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
        t_ok = tok < n_tokens
        mask = t_ok[:, None] & e_ok[None, :]
        pair = tok[:, None].to(tl.int64) * n_experts + es[None, :]  # [BT, BE] flat index t * E + e
        routed = tl.load(rm_ptr + pair, mask=mask, other=0).to(tl.int32)  # [BT, BE]
        row = carry[None, :] + tl.cumsum(routed, axis=0) - 1  # [BT, BE]
        carry += tl.sum(routed, axis=0)
        kept = (routed != 0) & (row < num_out)
        tl.store(row_of_pair_ptr + pair, tl.where(kept, row, -1).to(tl.int64), mask=mask)
        tl.store(pair_of_row_ptr + row, pair, mask=kept)
        tok_b = tl.broadcast_to(tok[:, None], [BLOCK_T, BLOCK_E]).to(tl.int64)
        tl.store(token_of_row_ptr + row, tok_b, mask=kept)
        # a token's kept pairs are its first routed ones (its rows increase with e): slot j of its j-th pair
        slot = tl.cumsum(routed, axis=1) - 1  # [BT, BE]
        put = kept & (slot < n_slots)
        base = tok[:, None].to(tl.int64) * n_slots  # [BT, 1]
        tl.store(rows_of_token_ptr + base + slot, row.to(tl.int64), mask=put)
        n_put = tl.sum(put.to(tl.int32), axis=1)  # [BT]
        empty = t_ok[:, None] & (ks[None, :] < n_slots) & (ks[None, :] >= n_put[:, None])  # [BT, BK]
        tl.store(
            rows_of_token_ptr + base + ks[None, :], tl.full([BLOCK_T, BLOCK_K], -1, tl.int64), mask=empty
        )
    # this program's share of the empty rows [min(n_routed, num_out), num_out) (disjoint from the kept rows)
    for f0 in range(0, fill_per_prog, BLOCK_F):
        rs = pid * fill_per_prog + f0 + tl.arange(0, BLOCK_F)  # [BF]
        tail = (rs >= n_routed) & (rs < num_out) & (f0 + tl.arange(0, BLOCK_F) < fill_per_prog)
        minus = tl.full([BLOCK_F], -1, tl.int64)
        tl.store(pair_of_row_ptr + rs, minus, mask=tail)
        tl.store(token_of_row_ptr + rs, minus, mask=tail)


# GPU map tiles: 1024 (token, expert) pairs per tile at 4 warps (sm_90: 160-170 registers, no spills); at most
# _MAP_PROGRAMS programs, each looping over its tiles, so the count table every program reads stays small. The
# interpreter takes large tiles.
_MAP_TILE = 1024
_MAP_PROGRAMS = 128
_MAP_FILL = 512


def permute_map_triton(
    routing_map: torch.Tensor,
    num_out: int,
    k: int,
    *,
    block_t: int | None = None,
    num_programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token_of_row [R], pair_of_row [R], row_of_pair [T, E], rows_of_token [T, K])`` of ``routing_map [T, E]``
    (bool, ``T, E >= 1``) for ``R = num_out`` rows and ``1 <= K <= E``: two kernel launches, no host sync, results
    equal to :func:`hash_moe.permute.permute_map_torch`.

    ``block_t`` (tokens per tile, a power of two) and ``num_programs`` (most programs) override the tiling (tests).
    """
    t, e = routing_map.shape
    assert routing_map.dtype == torch.bool and t >= 1 and 1 <= k <= e and num_out >= 0
    assert t * (e + 1) + num_out < 2**31, "int32 row arithmetic"
    dev, i64 = routing_map.device, torch.int64
    interpret = _interpreting(routing_map)
    rm = routing_map.contiguous().view(torch.uint8)  # [T, E]
    block_e = triton.next_power_of_2(e)
    if block_t is None:
        tile = 1 << 14 if interpret else _MAP_TILE
        block_t = max(1, min(tile // block_e, triton.next_power_of_2(t)))
    n_tiles = triton.cdiv(t, block_t)
    n_sub = triton.cdiv(n_tiles, num_programs or _MAP_PROGRAMS)
    n_progs = triton.cdiv(n_tiles, n_sub)
    block_p = max(1, min(triton.next_power_of_2(n_progs), max(_MAP_TILE // block_e, 1)))
    counts = torch.empty(n_progs, block_e, device=dev, dtype=torch.int32)  # [P, BE]
    row_of_pair = torch.empty(t, e, device=dev, dtype=i64)  # [T, E]
    rows_of_token = torch.empty(t, k, device=dev, dtype=i64)  # [T, K]
    rows = torch.empty(2, max(num_out, 1), device=dev, dtype=i64)  # [2, R]: pair_of_row, token_of_row
    pair_of_row, token_of_row = rows[0, :num_out], rows[1, :num_out]
    _route_counts_kernel[(n_progs,)](rm, counts, t, e, n_sub, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4)
    _permute_map_kernel[(n_progs,)](
        rm,
        counts,
        row_of_pair,
        rows_of_token,
        pair_of_row,
        token_of_row,
        t,
        e,
        k,
        num_out,
        n_progs,
        n_sub,
        triton.cdiv(num_out, n_progs),
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(k),
        BLOCK_P=block_p,
        BLOCK_F=_MAP_FILL,
        num_warps=4,
    )
    return token_of_row, pair_of_row, row_of_pair, rows_of_token
