"""Streaming indexer top-k: the fused score pass in tiles of entries, merged into a running top-k per row.

Never forms ``[T, C]`` (nor ``[T, HI, C]``): the query rows of the pack are processed in chunks of whole row blocks
(blocks never straddle documents, see :mod:`.triton`), and for each chunk the visible entries in tiles of
``entry_tile`` columns; a tile's fp32 scores ``[rows, entry_tile]`` are merged with the chunk's running best
``[rows, topk]`` (values + local entry ids) and dropped. Memory: the outputs ``8 * T * topk`` bytes plus one tile
and one merge buffer, ``O(rows * (topk + entry_tile))``, whatever ``T`` and ``C``.

Selection rule (the reference's, oracle I6): the ``min(topk, visible)`` highest scores in descending order, ties
toward the LOWER entry index; ``-1`` / ``-inf`` in the trailing slots. Exactness of the merge: every selection is
made over ``cat([best, tile])``, where ``best`` holds lower entry ids than the tile and is kept in canonical order
(value descending, entry ascending), so "lowest position among ties" is "lowest entry among ties". On CUDA and in
the Triton interpreter each merge is the fused row top-k of :mod:`.topk_select` (radix select + a sort of the
selected, canonical order directly; the last merge writes the global rows in place). Without it (``FUSED_SELECT``
off, benchmarks only) ``torch.topk`` selects on CUDA (lowest positions among ties, unspecified order among tied
values, hence the int64 composite-key reorder ``canonical_order`` after every merge) and a stable descending sort on
CPU. Rows see only their causal prefix: a chunk stops at the entries visible to its last row, and tiles past a row
block's last visible entry are skipped by the kernel.
"""

from __future__ import annotations

import torch

from csa_kernels._triton_utils import interpreting
from csa_kernels.ops.indexer.topk_select import row_topk

# default merge width (running best + one tile of entries: the tile is ENTRY_TILE - topk entries when
# topk <= ENTRY_TILE / 2, so the fused row top-k works on a power-of-two row) and the bound (elements) of one chunk's
# score tile (2^25 fp32 = 128 MiB: one chunk at S = 8192, C = 2048)
ENTRY_TILE = 4096
TILE_ELEMENTS = 1 << 25


def default_entry_tile(topk: int) -> int:
    """Entries per tile when the caller does not choose: ``ENTRY_TILE - topk`` (merge width a power of two; H200,
    S 65536, top-k 512: 36.9 ms vs 45.5 ms at 4096) unless top-k is more than half of ``ENTRY_TILE``."""
    return ENTRY_TILE - topk if 2 * topk <= ENTRY_TILE else ENTRY_TILE


# the fused row top-k (:mod:`.topk_select`) on CUDA / in the interpreter; benchmarks may switch it off to time the
# ``torch.topk`` + composite-key sort merge it replaced
FUSED_SELECT = True


def canonical_order(vals: torch.Tensor, ents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder each row by (value descending, entry ascending): one descending sort of the int64 key
    ``ord(value) << 32 | (2^31 - 1 - entry)`` (``ord`` maps fp32 bits to a signed int in float order)."""
    bits = (vals + 0.0).contiguous().view(torch.int32)  # + 0.0: -0.0 -> +0.0 (equal values, equal keys)
    ordv = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)  # float order as signed ints
    key = (ordv << 32) | (0x7FFFFFFF - ents.to(torch.int64))
    order = key.sort(dim=1, descending=True).indices
    return vals.gather(1, order), ents.gather(1, order)


def select_topk(cand: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` best of each row, lowest position among ties: CUDA top-k, or a stable descending sort on CPU."""
    if cand.is_cuda:
        return cand.topk(k, dim=1, sorted=True)
    vals, pos = torch.sort(cand, dim=1, descending=True, stable=True)
    return vals[:, :k], pos[:, :k]


def stream_chunk_topk(score_tile, rows: int, width: int, topk: int, entry_tile: int, device, final=None):
    """Top-k of one chunk of rows over the local entries ``[0, width)``.

    ``score_tile(col0, col1) -> [rows, col1 - col0]`` fp32 (``-inf`` where invisible) computes one tile.
    Returns ``(values [rows, k], local entry ids [rows, k] int64)`` with ``k = min(topk, width)``, descending,
    ties toward the lower entry. On CUDA (and in the Triton interpreter) each merge is the fused row top-k of
    :mod:`.topk_select`, which returns the canonical order directly; elsewhere ``select_topk`` + ``canonical_order``.
    ``final = (values, indices int32, entry0 [rows])`` (fused path only, see :func:`.topk_select.row_topk`): the last
    merge writes global rows and values there in place and returns ``(None, None)``; without the fused path
    ``final`` is ignored and the caller converts.
    """
    fused = FUSED_SELECT and (torch.device(device).type == "cuda" or interpreting())
    best_v = best_i = None
    n_tiles = -(-width // entry_tile)
    for tile in range(n_tiles):
        c0, c1 = tile * entry_tile, min(width, (tile + 1) * entry_tile)
        buf = score_tile(c0, c1)  # [rows, c1 - c0]
        if fused:
            last = final if tile + 1 == n_tiles else None
            best_v, best_i = row_topk(best_v, best_i, buf, topk, c0, last)
            if last is not None:
                return None, None
            continue
        ids = torch.arange(c0, c1, device=device, dtype=torch.int32)
        if best_v is None:
            cand_v, cand_i = buf, None
        else:
            cand_v = torch.cat([best_v, buf], 1)
            cand_i = torch.cat([best_i, ids.expand(rows, -1)], 1)
        k = min(topk, cand_v.shape[1])
        best_v, pos = select_topk(cand_v, k)
        best_i = pos + c0 if cand_i is None else cand_i.gather(1, pos)
        if (
            tile + 1 < n_tiles or best_v.is_cuda
        ):  # CUDA's order among ties is not specified: make it canonical
            best_v, best_i = canonical_order(best_v, best_i)
    return best_v, best_i
