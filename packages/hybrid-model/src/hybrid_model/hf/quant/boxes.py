"""Dequantizing one box ``[r0, r1) x [c0, c1)`` of a block-scaled weight from only the codes and scales it covers.

A box of an FP8 weight needs the code box itself and the scale box ``[r0 // bm, ceil(r1 / bm)) x [c0 // bn,
ceil(c1 / bn))``; a box that starts inside a scale block uses that block's scale for its first ``bm - r0 % bm``
rows (columns alike), and a box that ends at the weight's edge the partial edge block's scale. An FP4 box needs its
rows of the packed codes, the packed columns ``[c0 // 2, ceil(c1 / 2))`` (two values per byte: an odd ``c0`` / ``c1``
reads the neighbouring value of its byte and trims it after unpacking) and the scale box ``[r0, r1) x [c0 // g,
ceil(c1 / g))``. The math is the fp32 reference's (:mod:`.reference`), element by element, so a box equals the
same box of the whole weight's dequantization bit for bit.
"""

from __future__ import annotations

import torch

from hybrid_model.hf.quant.formats import cdiv, scale_to_float
from hybrid_model.hf.quant.reference import e2m1_value, unpack_fp4_codes


def fp8_box_source(
    rows: tuple[int, int], cols: tuple[int, int], block: tuple[int, int]
) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int]]:
    """``(code rows, code cols, scale rows, scale cols)`` an FP8 box ``rows x cols`` is read from."""
    (r0, r1), (c0, c1), (bm, bn) = rows, cols, block
    return (r0, r1), (c0, c1), (r0 // bm, cdiv(r1, bm)), (c0 // bn, cdiv(c1, bn))


def fp4_box_source(
    rows: tuple[int, int], cols: tuple[int, int], group: int
) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int]]:
    """``(code rows, packed code cols, scale rows, scale cols)`` an FP4 box ``rows x cols`` (logical columns) is
    read from."""
    (r0, r1), (c0, c1) = rows, cols
    return (r0, r1), (c0 // 2, cdiv(c1, 2)), (r0, r1), (c0 // group, cdiv(c1, group))


def dequantize_fp8_box(
    q: torch.Tensor,
    scale: torch.Tensor,
    origin: tuple[int, int],
    block: tuple[int, int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """FP8 codes ``q [m, n]`` of the box at ``origin`` ``(r0, c0)`` and its scale box (:func:`fp8_box_source`)
    -> ``[m, n]`` in ``dtype`` (fp32 math)."""
    (m, n), (r0, c0), (bm, bn) = q.shape, origin, block
    if tuple(scale.shape) != (cdiv(r0 % bm + m, bm), cdiv(c0 % bn + n, bn)):
        raise ValueError(
            f"FP8 box {(m, n)} at {origin} with block {block} needs a "
            f"{(cdiv(r0 % bm + m, bm), cdiv(c0 % bn + n, bn))} scale box, got {tuple(scale.shape)}"
        )
    s = scale_to_float(scale).repeat_interleave(bm, 0)[r0 % bm : r0 % bm + m]
    s = s.repeat_interleave(bn, 1)[:, c0 % bn : c0 % bn + n]  # [m, n]
    return (q.float() * s).to(dtype)


def dequantize_fp4_box(
    packed: torch.Tensor,
    scale: torch.Tensor,
    origin: tuple[int, int],
    cols: int,
    group: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """FP4 packed codes ``[m, k]`` read for the box of ``cols`` logical columns at ``origin`` ``(r0, c0)``
    (:func:`fp4_box_source`) and its scale box -> ``[m, cols]`` in ``dtype`` (fp32 math)."""
    m, c0 = packed.shape[0], origin[1]
    lo = c0 % 2  # the value before c0 in its byte
    if 2 * packed.shape[1] < lo + cols or tuple(scale.shape) != (m, cdiv(c0 % group + cols, group)):
        raise ValueError(
            f"FP4 box of {cols} columns at {origin} (group {group}) needs {cdiv(lo + cols, 2)} packed columns and "
            f"a {(m, cdiv(c0 % group + cols, group))} scale box, got {tuple(packed.shape)} and {tuple(scale.shape)}"
        )
    v = e2m1_value(unpack_fp4_codes(packed))[:, lo : lo + cols]  # [m, cols]
    s = scale_to_float(scale).repeat_interleave(group, 1)[:, c0 % group : c0 % group + cols]  # [m, cols]
    return (v * s).to(dtype)
