"""The quantized formats of the released DeepSeek-V4 checkpoints (``config.json`` ``quantization_config``).

* FP8 weights: ``float8_e4m3fn`` (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; largest finite 448), one
  scale per ``weight_block_size`` block (``[128, 128]``) of the ``[out, in]`` weight; the scale grid is
  ``[ceil(out / 128), ceil(in / 128)]``, the last block row / column covers the remainder (edge blocks).
* FP4 routed-expert weights (``expert_dtype: "fp4"``): e2m1 codes (1 sign, 2 exponent bits with bias 1, 1 mantissa
  bit; values 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte along the input dim, the element at even column ``2j`` in
  the low nibble and ``2j + 1`` in the high nibble; stored as ``int8`` (or ``uint8`` / ``float4_e2m1fn_x2``) of
  shape ``[out, in / 2]``, one scale per 32 consecutive input columns of a row: scale grid ``[out, ceil(in / 32)]``.
* Scales (``scale_fmt``): ``"ue8m0"`` = a power of two stored as its biased exponent byte (``float8_e8m0fnu``, or
  ``uint8``): ``2 ** (byte - 127)``; ``"float"`` = ``float32``. Stored beside the weight as ``NAME.scale`` (the
  release) or ``NAME.weight_scale_inv`` (transformers' spelling); the weight is ``q * scale``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
#: e2m1 magnitudes by code (the sign is bit 3)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: smallest block amax the quantizers use (all-zero blocks get the scale of this amax)
AMAX_FLOOR = 1e-4
SCALE_FMTS = ("ue8m0", "float")
EXPERT_DTYPES = ("fp4", "fp8")
#: stored dtypes an FP4 weight may have (two codes per byte)
FP4_STORAGE = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)
#: stored dtypes of a scale per ``scale_fmt``
SCALE_STORAGE = {"ue8m0": (torch.float8_e8m0fnu, torch.uint8), "float": (torch.float32,)}


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's quantization: FP8 block shape, FP4 group size, scale storage, routed-expert format."""

    fp8_block: tuple[int, int] = (128, 128)
    fp4_block: int = 32
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp4"

    def __post_init__(self) -> None:
        if len(self.fp8_block) != 2 or min(self.fp8_block) < 1:
            raise ValueError(f"weight_block_size must be two positive ints, got {self.fp8_block!r}")
        if self.fp4_block < 2 or self.fp4_block % 2:
            raise ValueError(f"the FP4 group size must be a positive even int, got {self.fp4_block}")
        if self.scale_fmt not in SCALE_FMTS:
            raise ValueError(f"scale_fmt must be one of {SCALE_FMTS}, got {self.scale_fmt!r}")
        if self.expert_dtype not in EXPERT_DTYPES:
            raise ValueError(f"expert_dtype must be one of {EXPERT_DTYPES}, got {self.expert_dtype!r}")

    @classmethod
    def from_hf(cls, q: Any, *, where: str = "config.json") -> QuantConfig:
        """From a ``quantization_config`` object (``quant_method: "fp8"``, dynamic activations)."""
        if not isinstance(q, dict):
            raise ValueError(f"{where}: quantization_config must be an object, got {q!r}")
        if q.get("quant_method", "fp8") != "fp8":
            raise ValueError(
                f"{where}: quantization_config.quant_method={q.get('quant_method')!r}; only the released "
                "'fp8' format (FP8 block scales + FP4 experts) is read"
            )
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"{where}: activation_scheme={q.get('activation_scheme')!r} (only 'dynamic')")
        block = q.get("weight_block_size", [128, 128])
        if not (
            isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) for b in block)
        ):
            raise ValueError(f"{where}: weight_block_size must be [rows, cols], got {block!r}")
        try:
            return cls(
                fp8_block=(int(block[0]), int(block[1])),
                scale_fmt=q.get("scale_fmt", "float") or "float",
                expert_dtype=q.get("expert_dtype", "fp8") or "fp8",
            )
        except ValueError as e:
            raise ValueError(f"{where}: quantization_config: {e}") from e

    def to_hf(self) -> dict[str, Any]:
        """The ``quantization_config`` object of this format."""
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(self.fp8_block),
            "scale_fmt": self.scale_fmt,
            "expert_dtype": self.expert_dtype,
        }


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """Scale grid of an FP8 ``[out, in]`` weight (edge blocks included)."""
    return cdiv(shape[0], block[0]), cdiv(shape[1], block[1])


def fp4_scale_shape(packed_shape: tuple[int, ...], group: int) -> tuple[int, int]:
    """Scale grid of an FP4 weight stored ``[out, in / 2]``."""
    return packed_shape[0], cdiv(2 * packed_shape[1], group)


def scale_to_float(s: torch.Tensor) -> torch.Tensor:
    """Any stored scale (``float8_e8m0fnu``, ``uint8`` exponent bytes, float) as ``float32``."""
    if s.dtype == torch.uint8:
        return torch.ldexp(torch.ones(s.shape, dtype=torch.float32, device=s.device), s.to(torch.int32) - 127)
    if s.dtype == torch.float8_e8m0fnu:
        return scale_to_float(s.view(torch.uint8))
    return s.float()


def scale_from_float(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``float32`` scales stored as ``dtype`` (powers of two for the ue8m0 dtypes)."""
    if dtype in (torch.uint8, torch.float8_e8m0fnu):
        exp = torch.frexp(s.float()).exponent - 1  # s = 2 ** exp exactly for a power of two
        b = (exp + 127).clamp(0, 254).to(torch.uint8)
        return b if dtype == torch.uint8 else b.view(torch.float8_e8m0fnu)
    return s.to(dtype)
