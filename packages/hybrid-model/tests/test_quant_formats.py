"""Released FP8 / FP4 formats: the references against decoders written from the bit fields, the Triton kernels
(interpreter on CPU, bf16 on GPU) against the references on odd shapes with partial edge blocks, and quantization
back reproducing the codes and scales (with hints) byte for byte."""

import pytest
import torch

from dsv4_testkit import assert_close_to_ref, interpreting
from hybrid_model.hf.quant import (
    dequantize_fp4,
    dequantize_fp4_ref,
    dequantize_fp8,
    dequantize_fp8_ref,
    quantize_fp4_ref,
    quantize_fp8_ref,
    scale_from_float,
    unpack_fp4_codes,
)

needs_triton = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1"
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _e4m3_by_hand(b: int) -> float:
    sign, e, m = b >> 7, (b >> 3) & 15, b & 7
    if e == 15 and m == 7:
        return float("nan")
    v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if sign else v


def _e2m1_by_hand(c: int) -> float:
    sign, e, m = c >> 3, (c >> 1) & 3, c & 1
    v = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return -v if sign else v


def test_fp8_codes_match_a_bit_field_decoder():
    b = torch.arange(256, dtype=torch.uint8)
    ones = torch.ones(1, 1, dtype=torch.float32)
    got = dequantize_fp8_ref(b.view(torch.float8_e4m3fn).view(16, 16), ones, (16, 16)).flatten()
    want = torch.tensor([_e4m3_by_hand(i) for i in range(256)])
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok], want[ok]) and torch.equal(torch.signbit(got[ok]), torch.signbit(want[ok]))


def test_fp4_codes_match_a_bit_field_decoder_low_nibble_first():
    b = torch.arange(256, dtype=torch.uint8).view(1, 256)
    got = dequantize_fp4_ref(b.view(torch.int8), torch.ones(1, 16), 32).flatten()
    want = torch.tensor([_e2m1_by_hand(c) for i in range(256) for c in (i & 15, i >> 4)])
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    assert unpack_fp4_codes(torch.tensor([[0x21]], dtype=torch.uint8)).tolist() == [[1, 2]]


def _fp8_case(m, n, block, fmt, seed=0):
    w = torch.randn(m, n, generator=torch.Generator().manual_seed(seed)) * 3
    w[: block[0], : block[1]] = 0  # an all-zero block
    q, s = quantize_fp8_ref(w, block, fmt)
    return w, q, scale_from_float(s, torch.float8_e8m0fnu if fmt == "ue8m0" else torch.float32)


@needs_triton
@pytest.mark.parametrize(
    ("m", "n", "block"), [(130, 200, (128, 128)), (37, 50, (16, 24)), (5, 7, (128, 128))]
)
@pytest.mark.parametrize("fmt", ["ue8m0", "float"])
def test_fp8_kernel_matches_reference(m, n, block, fmt):
    _, q, s = _fp8_case(m, n, block, fmt)
    ref = dequantize_fp8_ref(q, s, block)
    out = dequantize_fp8(q.to(DEV), s.to(DEV), block, torch.float32, backend="triton")
    assert torch.equal(out.cpu(), ref)


@needs_triton
@pytest.mark.parametrize(
    ("m", "k", "group"), [(5, 70, 32), (33, 64, 32), (3, 18, 32), (4, 600, 32), (7, 266, 16)]
)
def test_fp4_kernel_matches_reference(m, k, group):
    w = torch.randn(m, k, generator=torch.Generator().manual_seed(1)) * 2
    p, s = quantize_fp4_ref(w, group)
    s = scale_from_float(s, torch.float8_e8m0fnu)
    ref = dequantize_fp4_ref(p, s, group)
    out = dequantize_fp4(p.view(torch.int8).to(DEV), s.to(DEV), group, torch.float32, backend="triton")
    assert torch.equal(out.cpu(), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_kernels_bf16_on_gpu(kind):
    if kind == "fp8":
        _, q, s = _fp8_case(4099, 7168, (128, 128), "ue8m0")
        ref = dequantize_fp8_ref(q, s)
        out = dequantize_fp8(q.cuda(), s.cuda(), dtype=torch.bfloat16)
    else:
        p, s = quantize_fp4_ref(torch.randn(2048, 7168), 32)
        s = scale_from_float(s, torch.float8_e8m0fnu)
        ref = dequantize_fp4_ref(p, s, 32)
        out = dequantize_fp4(p.view(torch.int8).cuda(), s.cuda(), 32, torch.bfloat16)
    assert_close_to_ref(kind, out.float().cpu(), ref, ref.bfloat16().float())


def test_quantization_error_is_within_half_a_step():
    w, q, s = _fp8_case(37, 50, (16, 24), "ue8m0")
    d = dequantize_fp8_ref(q, s, (16, 24))
    step = torch.repeat_interleave(torch.repeat_interleave(s.float(), 16, 0)[:37], 24, 1)[:, :50]
    assert ((d - w).abs() <= step * 16 + 1e-6).all()  # e4m3 spacing is <= 32 codes at the top binade
    assert (d[:16, :24] == 0).all()


# float32 scales times codes are not exact in bf16: float-scale checkpoints round-trip through fp32 only
@pytest.mark.parametrize(
    ("fmt", "via"), [("ue8m0", torch.bfloat16), ("ue8m0", torch.float32), ("float", torch.float32)]
)
def test_dequantize_then_quantize_with_hints_gives_the_same_bytes(fmt, via):
    _, q, s = _fp8_case(37, 50, (16, 24), fmt)
    q2, s2 = quantize_fp8_ref(dequantize_fp8_ref(q, s, (16, 24)).to(via), (16, 24), fmt, scale_hint=s)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(scale_from_float(s2, s.dtype).view(torch.uint8), s.view(torch.uint8))
    w = torch.randn(9, 70, generator=torch.Generator().manual_seed(3))
    p, s4 = quantize_fp4_ref(w, 32, fmt)
    s4 = scale_from_float(s4, s.dtype)
    p2, s42 = quantize_fp4_ref(dequantize_fp4_ref(p, s4, 32).to(via), 32, fmt, scale_hint=s4)
    assert torch.equal(p2, p) and torch.equal(
        scale_from_float(s42, s.dtype).view(torch.uint8), s4.view(torch.uint8)
    )
