"""Fused Triton lightning-indexer scores + GPU top-k (spec §4.2), chunked so ``[T, HI, C]`` is never formed.

    I[t, s] = sum_h w[t, h] * ReLU(<q_idx[t, h], k_idx[s]>),   -inf unless (s_local + 1) * ratio <= t_rel + 1

Schedule: the query rows of each document are cut into blocks of BLOCK_T rows (blocks never straddle documents);
one program per (row block, block of BLOCK_N entries of that document) keeps its key tile in shared memory and loops
over the HI heads: per head one [BLOCK_T, DI] x [DI, BLOCK_N] MMA, then ReLU and the per-row head weight are folded
into an fp32 accumulator. Tiles entirely past the block's last visible entry are skipped (causal prefix only).
Top-k streams (:mod:`.topk_streaming`): per chunk of rows, tiles of entries are scored into a ``[rows, tile]`` fp32
buffer and merged into a running ``[rows, topk]`` best (CUDA top-k keeps the lowest positions among ties, the
running best is kept in (value desc, entry asc) order, so ties go to the lower entry: the rule of oracle I6).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csa_kernels._triton_utils import check_triton_device, interpreting, next_pow2
from csa_kernels.ops.indexer.topk_streaming import TILE_ELEMENTS, default_entry_tile, stream_chunk_topk
from dsv4_primitives.varlen import SeqBoundaries, upload_host_ints


@triton.jit
def _indexer_scores_kernel(
    Q,
    K,
    W,
    OUT,
    BLK_T0,
    BLK_T1,
    BLK_POS0,
    BLK_C0,
    BLK_NC,
    stride_qt,
    stride_qh,
    stride_kc,
    stride_wt,
    stride_ot,
    row0,
    col0,
    ratio,
    HI,
    DI: tl.constexpr,
    BLOCK_DI: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    nb = tl.program_id(1)
    t0 = tl.load(BLK_T0 + b)
    t1 = tl.load(BLK_T1 + b)
    p0 = tl.load(BLK_POS0 + b)
    c0 = tl.load(BLK_C0 + b)
    n_c = tl.load(BLK_NC + b)
    max_vis = (p0 + (t1 - t0)) // ratio  # visible entries of the block's last row
    if col0 + nb * BLOCK_N < max_vis:
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mt = offs_t < t1
        pos = p0 + tl.arange(0, BLOCK_T)
        n_vis = (pos + 1) // ratio  # [BLOCK_T]
        offs_j = col0 + nb * BLOCK_N + tl.arange(0, BLOCK_N)  # local entry ids of the document
        mj = offs_j < n_c
        offs_d = tl.arange(0, BLOCK_DI)
        md = offs_d < DI
        k = tl.load(
            K + (c0 + offs_j).to(tl.int64)[:, None] * stride_kc + offs_d[None, :],
            mask=mj[:, None] & md[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_DI]
        if UPCAST:
            k = k.to(tl.float32)
        q_ptr = Q + offs_t.to(tl.int64)[:, None] * stride_qt + offs_d[None, :]
        w_ptr = W + offs_t.to(tl.int64) * stride_wt
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for h in range(HI):
            q = tl.load(
                q_ptr + h * stride_qh, mask=mt[:, None] & md[None, :], other=0.0
            )  # [BLOCK_T, BLOCK_DI]
            if UPCAST:
                q = q.to(tl.float32)
            w = tl.load(w_ptr + h, mask=mt, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            acc += w[:, None] * tl.maximum(s, 0.0)
        vis = offs_j[None, :] < n_vis[:, None]
        acc = tl.where(vis, acc, -float("inf"))
        tl.store(
            OUT + (offs_t - row0).to(tl.int64)[:, None] * stride_ot + (offs_j - col0)[None, :],
            acc,
            mask=mt[:, None] & mj[None, :],
        )


def _row_blocks(cu: list[int], cuc: list[int], block_t: int) -> list[tuple[int, int, int, int, int]]:
    """(t0, t1, doc-relative pos of t0, entry start, entries of the doc) for blocks of rows inside documents."""
    out = []
    for i in range(len(cu) - 1):
        for t0 in range(cu[i], cu[i + 1], block_t):
            out.append((t0, min(t0 + block_t, cu[i + 1]), t0 - cu[i], cuc[i], cuc[i + 1] - cuc[i]))
    return out


# Benchmarks may pin the score kernel's (BLOCK_T, BLOCK_N, num_warps, num_stages) here; None = the default below.
SCORE_CONFIG_OVERRIDE: tuple[int, int, int, int] | None = None


def _config(DI: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_N, num_warps, num_stages); fp32 inputs take smaller tiles (shared memory) and IEEE dots."""
    if interpreting():
        return 16, 16, 4, 1
    if SCORE_CONFIG_OVERRIDE is not None:
        return SCORE_CONFIG_OVERRIDE
    if dtype == torch.float32:
        return 64, 64, 4, 2
    return 128, 64, 8, 3  # H200, S 8192, C 2048: BLOCK_N 64 1.184 ms vs 128 1.228 ms (whole top-k call)


def _prepare_scores(q_idx, k_idx, weights, cu: list[int], cuc: list[int]):
    """Contiguous inputs, launch config and the per-row-block metadata ``[5, nblocks]`` of the score kernel."""
    q_idx, k_idx, weights, cfg = _prepare_inputs(q_idx, k_idx, weights)
    blocks = _row_blocks(cu, cuc, cfg[0])
    meta = upload_host_ints([list(col) for col in zip(*blocks)], q_idx.device)  # [5, nblocks], non-blocking
    return q_idx, k_idx, weights, cfg, blocks, meta


def _prepare_inputs(q_idx, k_idx, weights):
    """Contiguous inputs and the launch config of the score kernel (shared with the device-planned form)."""
    q_idx = q_idx if q_idx.stride(-1) == 1 else q_idx.contiguous()
    return q_idx, k_idx.contiguous(), weights.contiguous(), _config(q_idx.shape[2], q_idx.dtype)


def _launch_scores(
    q_idx, k_idx, weights, out, meta, r0: int, ratio: int, width: int, cfg, col0: int = 0
) -> None:
    """Fused score pass of the row blocks in ``meta`` into ``out`` (row ``r0`` of the pack = row 0 of ``out``),
    over the entries ``[col0, width)`` of each document (entry ``col0`` = column 0 of ``out``)."""
    block_t, block_n, warps, stages = cfg
    _, HI, DI = q_idx.shape
    _indexer_scores_kernel[(meta.shape[1], triton.cdiv(width - col0, block_n))](
        q_idx,
        k_idx,
        weights,
        out,
        meta[0],
        meta[1],
        meta[2],
        meta[3],
        meta[4].clamp(max=width),
        q_idx.stride(0),
        q_idx.stride(1),
        k_idx.stride(0),
        weights.stride(0),
        out.stride(0),
        r0,
        col0,
        ratio,
        HI,
        DI=DI,
        BLOCK_DI=next_pow2(DI),
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        UPCAST=interpreting(),
        PRECISION="ieee" if q_idx.dtype == torch.float32 else "tf32",
        num_warps=warps,
        num_stages=stages,
    )


def indexer_topk_triton(
    q_idx: torch.Tensor,  # [T, HI, DI]
    k_idx: torch.Tensor,  # [Tc, DI]
    weights: torch.Tensor,  # [T, HI]
    ratio: int,
    topk: int,
    bounds: SeqBoundaries,
    chunk_size: int | None = None,
    *,
    entry_tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused scores + streaming top-k over HOST boundaries (the launches planned from ``bounds``' host copy):
    ``(indices [T, topk] int32 global compressed rows, -1 padded; scores [T, topk] fp32)``; :mod:`.topk_streaming`
    (``[T, C]`` is never formed, memory ``O(T * topk)``). Static boundaries: :mod:`.device_plan`.

    Scores are not differentiable here (the caller re-attaches a gradient path, see the public ``indexer_topk``).
    ``chunk_size`` bounds the rows of one chunk (default: as many rows as keep one score tile plus the running top-k
    at ``TILE_ELEMENTS`` fp32); ``entry_tile`` the entries of one tile (default
    ``topk_streaming.default_entry_tile(topk)``).
    """
    check_triton_device(q_idx, k_idx, weights)
    T = q_idx.shape[0]
    cu, cuc = list(bounds.host), list(bounds.compressed(ratio).host)
    indices = torch.full((T, topk), -1, dtype=torch.int32, device=q_idx.device)
    values = torch.full((T, topk), float("-inf"), dtype=torch.float32, device=q_idx.device)
    c_max = max((cuc[i + 1] - cuc[i] for i in range(len(cuc) - 1)), default=0)
    if T == 0 or c_max == 0:
        return indices, values
    q_idx, k_idx, weights, cfg, blocks, meta = _prepare_scores(q_idx, k_idx, weights, cu, cuc)
    tile = min(entry_tile or default_entry_tile(topk), c_max)
    if chunk_size is None:
        chunk_size = max(cfg[0], TILE_ELEMENTS // max(tile + topk, 1))
    # chunks of whole row blocks; per chunk, tiles of entries merged into a running top-k (never [T, C])
    i = 0
    while i < len(blocks):
        j, rows = i, 0
        while j < len(blocks) and (rows == 0 or rows + blocks[j][1] - blocks[j][0] <= chunk_size):
            rows += blocks[j][1] - blocks[j][0]
            j += 1
        r0, r1 = blocks[i][0], blocks[j - 1][1]
        n_vis_max = max((b[2] + b[1] - b[0]) // ratio for b in blocks[i:j])
        width = min(c_max, n_vis_max)
        if width > 0:
            chunk_meta = meta[:, i:j]

            def score_tile(c0, c1, chunk_meta=chunk_meta, r0=r0, r1=r1):
                buf = torch.full((r1 - r0, c1 - c0), float("-inf"), dtype=torch.float32, device=q_idx.device)
                _launch_scores(q_idx, k_idx, weights, buf, chunk_meta, r0, ratio, c1, cfg, col0=c0)
                return buf

            entry0 = torch.repeat_interleave(
                meta[3, i:j].long(), (meta[1, i:j] - meta[0, i:j]).long(), output_size=r1 - r0
            )  # [rows] first global entry of each row's document
            final = (values[r0:r1], indices[r0:r1], entry0)
            vals, cols = stream_chunk_topk(score_tile, r1 - r0, width, topk, tile, q_idx.device, final)
            if vals is not None:  # not the fused path: convert here
                k = vals.shape[1]
                glob = torch.where(torch.isneginf(vals), -1, cols + entry0[:, None]).to(torch.int32)
                indices[r0:r1, :k] = glob
                values[r0:r1, :k] = vals
        i = j
    return indices, values


def indexer_scores_triton(
    q_idx: torch.Tensor,  # [T, HI, DI]
    k_idx: torch.Tensor,  # [Tc, DI]
    weights: torch.Tensor,  # [T, HI]
    ratio: int,
    cu: list[int],
    cuc: list[int],
    max_entries: int,
) -> torch.Tensor:
    """Dense scores ``[T, max_entries]`` fp32 (column = local entry, ``-inf`` invisible) from the fused score pass.

    ``cu`` / ``cuc`` are the validated host lists of ``cu_seqlens`` / ``cu_seqlens_c``. Not differentiable (see
    :class:`csa_kernels.ops.indexer.scores_autograd.IndexerScoresTritonFunction`).
    """
    check_triton_device(q_idx, k_idx, weights)
    T = q_idx.shape[0]
    out = torch.full((T, max_entries), float("-inf"), dtype=torch.float32, device=q_idx.device)
    c_max = max((cuc[i + 1] - cuc[i] for i in range(len(cuc) - 1)), default=0)
    if T == 0 or c_max == 0:
        return out
    q_idx, k_idx, weights, cfg, _, meta = _prepare_scores(q_idx, k_idx, weights, cu, cuc)
    _launch_scores(q_idx, k_idx, weights, out, meta, 0, ratio, c_max, cfg)
    return out
