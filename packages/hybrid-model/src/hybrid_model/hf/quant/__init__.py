"""The released DeepSeek-V4 quantized weight formats: FP8 block-scaled (e4m3, 128x128 scales) and FP4 routed
experts (e2m1, two per byte, one scale per 32 inputs); fp32 references, Triton dequantization kernels,
quantization back for export (:mod:`.formats` documents the layouts)."""

from hybrid_model.hf.quant.formats import QuantConfig, scale_from_float, scale_to_float
from hybrid_model.hf.quant.ops import dequantize_fp4, dequantize_fp8
from hybrid_model.hf.quant.reference import (
    dequantize_fp4_ref,
    dequantize_fp8_ref,
    pack_fp4_codes,
    quantize_fp4_ref,
    quantize_fp8_ref,
    unpack_fp4_codes,
)

__all__ = [
    "QuantConfig",
    "dequantize_fp4",
    "dequantize_fp4_ref",
    "dequantize_fp8",
    "dequantize_fp8_ref",
    "pack_fp4_codes",
    "quantize_fp4_ref",
    "quantize_fp8_ref",
    "scale_from_float",
    "scale_to_float",
    "unpack_fp4_codes",
]
