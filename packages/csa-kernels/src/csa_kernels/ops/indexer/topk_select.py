"""Fused row top-k of the streaming indexer (radix select + a sort of the ``k`` selected), one program per row.

Each row's candidates are ``cat([best [kb], tile [n]])`` (the running best, kept in canonical order, then a new tile
of scores; the concatenation is never formed: the kernel reads both). The result is the ``kk = min(k, kb + n)``
largest candidates in canonical order (value descending, position ascending among ties). Since every id of ``best``
is lower than every id of the tile and ``best`` is canonical, "position ascending" is "entry ascending": the tie rule
of oracle I6, with no separate reordering pass.

Per row (``ord`` maps fp32 bits to a signed int32 in float order, ``-0.0`` counted as ``+0.0``):

1. ``tau`` = the ``kk``-th largest key, by a 32-step binary search on the key bits
   (``tau`` = the largest value with ``#{key >= tau} >= kk``);
2. selected = ``key > tau`` plus the first ``kk - #{key > tau}`` positions with ``key == tau``;
3. the selected are compacted (exclusive prefix sum) into a per-row scratch of ``BLOCK_K`` int64 composite keys
   ``ord << 32 | (2^31 - 1 - position)``, sorted descending (bitonic, ``tl.sort``), decoded to positions and written
   as values (read back from the input, bit-exact) and ids.

Work per row: ``O((kb + n) * 32)`` compares and one sort of ``next_pow2(k)`` keys, instead of a full-row
``torch.topk`` plus an int64 composite-key sort of ``[rows, k]`` between merges.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csa_kernels._triton_utils import next_pow2


@triton.jit
def _row_topk_kernel(
    BEST_V,
    BEST_I,
    TILE,
    OUT_V,
    OUT_I,
    SCRATCH,
    ENTRY0,
    kb,
    n,
    kk,
    id0,
    stride_bv,
    stride_bi,
    stride_t,
    stride_ov,
    stride_oi,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FINAL: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)  # candidate positions: [0, kb) the running best, [kb, kb + n) the tile
    in_best = offs < kb
    in_tile = (offs >= kb) & (offs < kb + n)
    vb = tl.load(BEST_V + r * stride_bv + offs, mask=in_best, other=0.0)
    vt = tl.load(TILE + r * stride_t + (offs - kb), mask=in_tile, other=0.0)
    v = tl.where(in_best, vb, vt) + 0.0  # + 0.0: -0.0 -> +0.0 (equal values, equal keys)
    bits = v.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)  # float order as signed ints
    key = tl.where(in_best | in_tile, key, -(2**31) - 1)  # padding below every real key (-inf included)
    # 1. tau = kk-th largest key: binary search over the bits of u = key + 2^31 in [0, 2^32)
    u = key + 2**31
    tau = tl.zeros([], dtype=tl.int64)
    for i in tl.static_range(32):
        cand = tau | (1 << (31 - i))
        cnt = tl.sum((u >= cand).to(tl.int32), 0)
        tau = tl.where(cnt >= kk, cand, tau)
    # 2. everything above tau, and the lowest positions among the keys equal to tau
    gt = u > tau
    eq = u == tau
    need = kk - tl.sum(gt.to(tl.int32), 0)
    eq_i = eq.to(tl.int32)
    sel = gt | (eq & ((tl.cumsum(eq_i, 0) - eq_i) < need))
    sel_i = sel.to(tl.int32)
    dest = tl.cumsum(sel_i, 0) - sel_i  # [BLOCK] slot of each selected candidate, < kk
    # 3. compact into the row's scratch, sort (value desc, position asc), decode
    comp = (key << 32) | (0x7FFFFFFF - offs).to(tl.int64)
    tl.store(SCRATCH + r * BLOCK_K + dest, comp, mask=sel)
    tl.debug_barrier()
    offs_k = tl.arange(0, BLOCK_K)
    mk = offs_k < kk
    c = tl.load(SCRATCH + r * BLOCK_K + offs_k, mask=mk, other=-0x7FFFFFFFFFFFFFFF)  # [BLOCK_K]; padding last
    c = tl.sort(c, 0, descending=True)
    pos = 0x7FFFFFFF - (c & 0xFFFFFFFF)  # [BLOCK_K] candidate positions, canonical order
    from_best = pos < kb
    val = tl.where(
        from_best,
        tl.load(BEST_V + r * stride_bv + pos, mask=mk & from_best, other=0.0),
        tl.load(TILE + r * stride_t + (pos - kb), mask=mk & (pos >= kb), other=0.0),
    )
    ids = tl.where(
        from_best,
        tl.load(BEST_I + r * stride_bi + pos, mask=mk & from_best, other=0),
        id0 + pos - kb,
    )
    tl.store(OUT_V + r * stride_ov + offs_k, val, mask=mk)
    if FINAL:  # global compressed rows, int32, -1 where nothing visible was left (-inf)
        glob = tl.where(val == -float("inf"), -1, ids + tl.load(ENTRY0 + r))
        tl.store(OUT_I + r * stride_oi + offs_k, glob.to(tl.int32), mask=mk)
    else:
        tl.store(OUT_I + r * stride_oi + offs_k, ids.to(tl.int64), mask=mk)


# Benchmarks may pin the row top-k kernel's num_warps here; None = 4 up to 2048 candidates, else 8.
ROW_TOPK_WARPS_OVERRIDE: int | None = None


def row_topk(
    best_v: torch.Tensor | None,  # [rows, kb] fp32, canonical order
    best_i: torch.Tensor | None,  # [rows, kb] int64 entry ids (all below id0)
    tile: torch.Tensor,  # [rows, n] fp32 scores of entries id0 .. id0 + n - 1
    k: int,
    id0: int,
    final: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``min(k, kb + n)`` of ``cat([best, tile])`` per row in canonical order: ``(values fp32, ids int64)``.

    ``best_v`` / ``best_i`` ``None`` means ``kb = 0`` (the first tile). Ties go to the lower position, which is the
    lower entry id (``best`` holds lower ids, in canonical order). ``final = (values [rows, >= kk] fp32, indices
    [rows, >= kk] int32, entry0 [rows] int64)``: the last merge writes its first ``kk`` columns in place, indices as
    global rows ``entry0 + id`` (``-1`` where the value is ``-inf``), and returns those two views.
    """
    rows, n = tile.shape
    kb = 0 if best_v is None else best_v.shape[1]
    kk = min(k, kb + n)
    if final is None:
        out_v = torch.empty((rows, kk), dtype=torch.float32, device=tile.device)
        out_i = torch.empty((rows, kk), dtype=torch.int64, device=tile.device)
        entry0 = out_i  # never read
    else:
        out_v, out_i, entry0 = final[0][:, :kk], final[1][:, :kk], final[2]
    if rows == 0 or kk == 0:
        return out_v, out_i
    if best_v is None:
        best_v, best_i = out_v, out_i  # never read (kb = 0)
    tile = tile if tile.stride(1) == 1 else tile.contiguous()
    block, block_k = next_pow2(kb + n), next_pow2(kk)
    scratch = torch.empty((rows, block_k), dtype=torch.int64, device=tile.device)
    _row_topk_kernel[(rows,)](
        best_v,
        best_i,
        tile,
        out_v,
        out_i,
        scratch,
        entry0,
        kb,
        n,
        kk,
        id0,
        best_v.stride(0),
        best_i.stride(0),
        tile.stride(0),
        out_v.stride(0),
        out_i.stride(0),
        BLOCK=block,
        BLOCK_K=block_k,
        FINAL=final is not None,
        num_warps=ROW_TOPK_WARPS_OVERRIDE or (4 if block <= 2048 else 8),
    )
    return out_v, out_i
