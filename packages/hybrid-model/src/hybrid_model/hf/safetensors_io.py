"""Tensor-at-a-time safetensors reading and writing with bounded memory.

A safetensors file is ``u64 little-endian header length N`` + ``N`` bytes of JSON (``name -> {dtype, shape,
data_offsets [begin, end)}`` relative to the data section, plus ``__metadata__``) + the data section. The reader
parses and validates the header (every failure names the file: truncated, corrupt, offsets outside the file) and
reads one tensor's bytes, or one box of its rows / columns (:meth:`SafetensorsFile.read_box`), with plain
``preadv`` calls into the result's buffer (no mmap: resident memory is the tensor read, nothing else);
the writer writes the header from the planned names/dtypes/shapes first and then each tensor as it is produced, so
a whole file is never held in memory. ``F4`` (``float4_e2m1fn_x2``) shapes count FP4 elements in the header (two
per stored byte), as the ``safetensors`` library writes them.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

_REFETCH = "re-download or re-export the checkpoint"
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
}
CODES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


class SafetensorsFile:
    """The header of one safetensors file; :meth:`read` loads one tensor (CPU)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        bad = f"{self.path}: not a readable safetensors file"
        try:
            size = self.path.stat().st_size
            with self.path.open("rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError(f"{bad} (truncated: {size} bytes); {_REFETCH}")
                (n,) = struct.unpack("<Q", head)
                if n > _MAX_HEADER or 8 + n > size:
                    raise ValueError(
                        f"{bad} (header length {n} does not fit the {size}-byte file); {_REFETCH}"
                    )
                raw = f.read(n)
        except OSError as e:
            raise ValueError(f"{bad} ({e.strerror or e}); check the file's permissions") from e
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{bad} (corrupt header: {e}); {_REFETCH}") from e
        if not isinstance(header, dict):
            raise ValueError(f"{bad} (the header is not a JSON object); {_REFETCH}")
        self.metadata: dict[str, Any] = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                dtype = DTYPES[e["dtype"]]
                shape = tuple(int(d) for d in e["shape"])
                begin, end = (int(x) for x in e["data_offsets"])
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(
                    f"{bad} (tensor {name!r} has an invalid or unknown entry {e!r}); {_REFETCH}"
                ) from err
            if dtype == torch.float4_e2m1fn_x2:
                shape = (*shape[:-1], shape[-1] // 2)  # the header counts FP4 elements
            if end - begin != _nbytes(dtype, shape) or begin < 0 or self.data_start + end > size:
                raise ValueError(
                    f"{bad} (tensor {name!r}: bytes [{begin}, {end}) do not match {e['dtype']} {list(shape)} or lie "
                    f"past the end of the {size}-byte file: truncated or corrupt); {_REFETCH}"
                )
            self.entries[name] = (dtype, shape, begin, end)

    def nbytes(self, name: str) -> int:
        _, _, b, e = self.entries[name]
        return e - b

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` (a fresh CPU tensor)."""
        return self.read_box(name, None)

    def read_box(
        self, name: str, rows: tuple[int, int] | None, cols: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Rows ``[r0, r1)`` (dim 0) and columns ``[c0, c1)`` (dim 1; ``None``: all) of tensor ``name``, a fresh
        contiguous CPU tensor; ``rows`` ``None``: the whole tensor. Rows are one contiguous byte range (one read); a
        column range is read row by row (one read of ``(c1 - c0) x trailing dims`` per row), so only the box's bytes
        are read. ``F4`` columns count stored bytes (two FP4 values each)."""
        dtype, shape, begin, _ = self.entries[name]
        if rows is None:
            rows = (0, shape[0]) if shape else (0, 1)
        r0, r1 = rows
        d0 = shape[0] if shape else 1
        d1 = shape[1] if len(shape) > 1 else 1
        c0, c1 = cols if cols is not None else (0, d1)
        if not (0 <= r0 <= r1 <= d0 and 0 <= c0 <= c1 <= d1) or (cols is not None and len(shape) < 2):
            raise ValueError(
                f"{self.path}: box rows {rows} cols {cols} lies outside tensor {name!r} of shape {list(shape)}"
            )
        box = (*((r1 - r0,) if shape else ()), *((c1 - c0,) if len(shape) > 1 else ()), *shape[2:])
        inner = _nbytes(dtype, tuple(shape[2:]))  # bytes of one [.., .., *trailing] element of dims 0 and 1
        row, width = d1 * inner, (c1 - c0) * inner
        buf = bytearray(width * (r1 - r0))
        view = memoryview(buf)
        start = self.data_start + begin + r0 * row + c0 * inner
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if width == row or r1 - r0 <= 1:  # whole rows (or one row): one contiguous range
                got = _read_at(fd, start, view)
            else:
                got = sum(
                    _read_at(fd, start + i * row, view[i * width : (i + 1) * width]) for i in range(r1 - r0)
                )
        finally:
            os.close(fd)
        if got != len(buf):
            raise ValueError(f"{self.path}: tensor {name!r} is cut short (truncated file); {_REFETCH}")
        if not buf:
            return torch.empty(box, dtype=dtype)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(box)


def _read_at(fd: int, offset: int, view: memoryview) -> int:
    """Fill ``view`` with the file's bytes from ``offset`` on; returns the bytes read (fewer only at the end of the
    file). Every tensor read goes through here (tests count the bytes read by wrapping it)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


class SafetensorsWriter:
    """Write a safetensors file whose tensors (``name -> (dtype, shape)``, data in the dict's order) are known
    before their data: the header goes first, then :meth:`write` each tensor in that order; :meth:`close` checks
    all were written."""

    def __init__(self, path: str | Path, plan: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata=None):
        self.path = Path(path)
        self.order = list(plan)
        self.plan = plan
        header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
        off = 0
        for name in self.order:
            dtype, shape = plan[name]
            n = _nbytes(dtype, shape)
            hshape = list(shape) if dtype != torch.float4_e2m1fn_x2 else [*shape[:-1], 2 * shape[-1]]
            header[name] = {"dtype": CODES[dtype], "shape": hshape, "data_offsets": [off, off + n]}
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.f = self.path.open("wb")
        self.f.write(struct.pack("<Q", len(raw)) + raw)
        self.next = 0

    def write(self, name: str, t: torch.Tensor) -> int:
        """Write tensor ``name`` (must be the next in sorted order, with its planned dtype and shape); returns its
        byte count."""
        want = self.order[self.next] if self.next < len(self.order) else None
        dtype, shape = self.plan.get(name, (None, None))
        if name != want or t.dtype != dtype or tuple(t.shape) != tuple(shape):
            raise AssertionError(f"{self.path}: wrote {name!r} {t.dtype} {tuple(t.shape)}, expected {want!r}")
        data = t.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy()
        self.f.write(memoryview(data))
        self.next += 1
        return data.nbytes

    def close(self) -> None:
        self.f.close()
        if self.next != len(self.order):
            raise AssertionError(
                f"{self.path}: {len(self.order) - self.next} planned tensor(s) were not written"
            )
