"""Reading only the box of a source tensor that one rank's piece needs (``dsv4 convert --tp N``; issue 32).

Under ``--tp N`` a TP-split tensor is written as ``N`` pieces, one into each TP rank's file
(:mod:`hybrid_model.hf.megatron_plan`). Each piece reads only its own box of the source tensor
(:meth:`~hybrid_model.hf.safetensors_io.SafetensorsFile.read_box`), so a ``--tp N`` conversion reads every source
byte once, as ``--tp 1`` does, instead of ``N`` times:

* a cut along dim 0 (column-parallel linears, vocab-parallel embedding / head, attention heads) is rows ``[r0, r1)``:
  one contiguous byte range, one read;
* a cut along dim 1 (row-parallel linears) is columns ``[c0, c1)`` of every row: one read per row of just those
  bytes (reading whole rows and dropping columns would read ``N`` times the bytes again; the per-row reads cost one
  system call each, a few milliseconds for the widest V4 tensors);
* an FP8 weight reads its code box and the scale box covering it (scale rows ``[r0 // bm, ceil(r1 / bm))``,
  columns alike, the partial edge blocks included), an FP4 weight its rows, its packed columns rounded out to whole
  bytes and its scale groups (:mod:`hybrid_model.hf.quant.boxes`); the box is dequantized with the fp32 reference
  math, element by element the same as the whole tensor's, so the written checkpoint is bitwise what reading the
  whole tensor and cutting it writes (tested against that);
* an uncut piece (``--tp 1``, replicated tensors, routed experts) reads its whole tensor, as before.

Why per-piece boxes rather than reading each source tensor once and writing all ``N`` ranks' slices from that read:
the conversion's job is one rank file (its resumability: ``.dsv4-convert-progress.json`` lists finished rank files,
and ``workers`` rank files are written at once), so one read feeding ``N`` files would need ``N`` files open per job
and a progress record per tensor across files. With boxes the design stays as it was, each source byte is read once
and the memory bound per worker shrinks to the largest *piece* (its stored box + scale box, the fp32 box and a cast
copy: about ``12 bytes x elements`` of the largest piece; whole tensors for uncut pieces).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid_model.hf.quant.boxes import (
    dequantize_fp4_box,
    dequantize_fp8_box,
    fp4_box_source,
    fp8_box_source,
)
from hybrid_model.hf.quant.formats import QuantConfig
from hybrid_model.hf.released import Quantized, Stored, dequantize_stored, logical_shape
from hybrid_model.hf.safetensors_io import SafetensorsFile


@dataclass(frozen=True)
class SourceBox:
    """Rows ``[r0, r1)`` and columns ``[c0, c1)`` (``None``: all; logical columns for FP4) of a source tensor."""

    rows: tuple[int, int]
    cols: tuple[int, int] | None = None


def source_box(start: tuple[int, ...], shape: tuple[int, ...], whole: tuple[int, ...]) -> SourceBox | None:
    """The box ``[start, start + shape)`` of a source tensor of logical shape ``whole`` (the piece in the source's
    own coordinates), or ``None`` when the whole tensor is read: the piece is all of it, or it is cut along a
    dim past 1 (read whole, then cut)."""
    if len(start) != len(whole) or tuple(shape) == tuple(whole):
        return None
    cut = [i for i, (s, n, w) in enumerate(zip(start, shape, whole)) if s or n != w]
    if any(i > 1 for i in cut):
        return None
    rows = (start[0], start[0] + shape[0])
    return SourceBox(rows, (start[1], start[1] + shape[1]) if 1 in cut else None)


def _box_bytes(s: Stored, rows: tuple[int, int], cols: tuple[int, int] | None) -> int:
    n = (rows[1] - rows[0]) * s.dtype.itemsize
    if len(s.shape) > 1:
        n *= (cols[1] - cols[0]) if cols is not None else s.shape[1]
    for d in s.shape[2:]:
        n *= d
    return n


def _quant_sources(
    stored: dict[str, Stored], name: str, pair: Quantized, quant: QuantConfig, box: SourceBox
) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int]]:
    whole = logical_shape(stored[name], pair.kind)
    cols = box.cols if box.cols is not None else (0, whole[1])
    if pair.kind == "fp8":
        return fp8_box_source(box.rows, cols, quant.fp8_block)
    return fp4_box_source(box.rows, cols, quant.fp4_block)


def box_read_bytes(
    stored: dict[str, Stored],
    name: str,
    pair: Quantized | None,
    quant: QuantConfig | None,
    box: SourceBox | None,
) -> int:
    """The bytes :func:`read_source_box` reads for ``box`` of ``name`` (``None``: all of it), its scale's included."""
    s = stored[name]
    if box is None:
        rows = (0, s.shape[0]) if s.shape else (0, 1)
        return _box_bytes(s, rows, None) + (
            0 if pair is None else box_read_bytes(stored, pair.scale, None, None, None)
        )
    if pair is None:
        return _box_bytes(s, box.rows, box.cols)
    qr, qc, sr, sc = _quant_sources(stored, name, pair, quant, box)
    return _box_bytes(s, qr, qc) + _box_bytes(stored[pair.scale], sr, sc)


def read_source_box(
    files: dict[Path, SafetensorsFile],
    stored: dict[str, Stored],
    name: str,
    pair: Quantized | None,
    quant: QuantConfig | None,
    box: SourceBox | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``box`` of stored tensor ``name`` (``None``: all of it), dequantized to ``dtype`` when it has a scale (on the
    CPU), else as stored; reads only the box's bytes (and its scale box)."""
    if box is None:
        return dequantize_stored(files, stored, name, pair, quant, dtype, device="cpu")
    f = files[stored[name].file]
    if pair is None:
        return f.read_box(name, box.rows, box.cols)
    qr, qc, sr, sc = _quant_sources(stored, name, pair, quant, box)
    q = f.read_box(name, qr, qc)
    scale = files[stored[pair.scale].file].read_box(pair.scale, sr, sc)
    c0 = box.cols[0] if box.cols is not None else 0
    if pair.kind == "fp8":
        return dequantize_fp8_box(q, scale, (box.rows[0], c0), quant.fp8_block, dtype)
    cols = box.cols[1] - c0 if box.cols is not None else logical_shape(stored[name], "fp4")[1]
    return dequantize_fp4_box(q, scale, (box.rows[0], c0), cols, quant.fp4_block, dtype)
