"""fp32 references of the released checkpoints' block-scaled FP8 and FP4 weights (formats: :mod:`.formats`).

Dequantization (``s`` = the scale as float32, :func:`~.formats.scale_to_float`):

    FP8  W[i, j] = e4m3(Q[i, j]) * s[i // bm, j // bn]                 # Q [M, N], s [ceil(M/bm), ceil(N/bn)]
    FP4  W[i, k] = e2m1(code(P[i, k // 2], k % 2)) * s[i, k // g]     # P [M, K/2], s [M, ceil(K/g)]
         code(b, 0) = b & 0xF (low nibble), code(b, 1) = b >> 4

Quantization (the same rule for every block ``B``; ``qmax`` = 448 for FP8, 6 for FP4):

    a = max(max|W_B|, 1e-4)
    s = 2 ** ceil(log2(a / qmax))    (scale_fmt "ue8m0")      s = a / qmax    (scale_fmt "float")
    Q_B = round_to_nearest_even(clamp(W_B / s, -qmax, qmax))  in e4m3 / e2m1

A block whose largest value rounds down to ``qmax / 2`` (e.g. 3.2 -> 3 in e2m1) has the same values as that block
encoded with half the scale, so no rule on the values alone can give back the original bytes. Quantizing with a
``scale_hint`` (the original checkpoint's scales) keeps a hinted scale wherever it still fits the block:

    s = hint   if a == 0 or qmax / 2 <= max|W_B| / hint <= qmax * (1 + 2**-20)        else the rule above

so a weight dequantized from a released checkpoint (ue8m0: the products ``code * 2**k`` are exact in bf16 and fp32;
float scales: through fp32) quantizes back to the released codes and scales byte for byte; blocks changed by
training get a fresh scale when the hint no longer fits.
"""

from __future__ import annotations

import torch

from hybrid_model.hf.quant.formats import AMAX_FLOOR, E2M1_VALUES, FP4_MAX, FP8_MAX, cdiv, scale_to_float

#: rounding boundaries between consecutive e2m1 magnitudes (a value on a boundary goes to the even code)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _expand_blocks(s: torch.Tensor, rows: int, cols: int, bm: int, bn: int) -> torch.Tensor:
    """``s [ceil(rows/bm), ceil(cols/bn)]`` repeated over its blocks and cut to ``[rows, cols]``."""
    return s.repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]


def _check_2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D [out, in] weight, got shape {tuple(t.shape)}")


def dequantize_fp8_ref(
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """FP8 ``q [M, N]`` (``float8_e4m3fn``) with block scales ``[ceil(M/bm), ceil(N/bn)]`` -> ``[M, N]``
    (computed in fp32, returned as ``dtype``)."""
    _check_2d("FP8 weight", q)
    m, n = q.shape
    want = (cdiv(m, block[0]), cdiv(n, block[1]))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"FP8 weight {tuple(q.shape)} with block {block} needs a {want} scale, got {tuple(scale.shape)}"
        )
    s = _expand_blocks(scale_to_float(scale), m, n, *block)  # [M, N]
    return (q.float() * s).to(dtype)


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K/2]`` bytes -> ``[..., K]`` e2m1 codes (uint8 0..15), low nibble first."""
    b = packed.contiguous().view(torch.uint8)
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)


def pack_fp4_codes(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` e2m1 codes -> ``[..., K/2]`` uint8 bytes (element ``2j`` in the low nibble)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packs two codes per byte: the last dim must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def e2m1_value(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes -> float32 values (table lookup)."""
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def dequantize_fp4_ref(
    packed: torch.Tensor, scale: torch.Tensor, group: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """FP4 ``packed [M, K/2]`` with group scales ``[M, ceil(K/group)]`` -> ``[M, K]`` (fp32 math, ``dtype`` out)."""
    _check_2d("FP4 weight", packed)
    m, k = packed.shape[0], 2 * packed.shape[1]
    if tuple(scale.shape) != (m, cdiv(k, group)):
        raise ValueError(
            f"FP4 weight [{m}, {k}] (stored {tuple(packed.shape)}) with group {group} needs a "
            f"{(m, cdiv(k, group))} scale, got {tuple(scale.shape)}"
        )
    s = scale_to_float(scale).repeat_interleave(group, 1)[:, :k]  # [M, K]
    return (e2m1_value(unpack_fp4_codes(packed)) * s).to(dtype)


def block_scale(amax: torch.Tensor, qmax: float, scale_fmt: str) -> torch.Tensor:
    """The scale of blocks with largest magnitude ``amax`` (module docstring), float32."""
    r = amax.float().clamp_min(AMAX_FLOOR) / qmax
    if scale_fmt == "float":
        return r
    mant, exp = torch.frexp(r)  # r = mant * 2**exp, mant in [0.5, 1)
    up = torch.where(mant == 0.5, exp - 1, exp)  # ceil(log2 r), exact
    return torch.ldexp(torch.ones_like(r), up)


def hinted_scale(amax: torch.Tensor, qmax: float, scale_fmt: str, hint: torch.Tensor | None) -> torch.Tensor:
    """:func:`block_scale`, or the hint where it still fits the block (module docstring)."""
    s = block_scale(amax, qmax, scale_fmt)
    if hint is None:
        return s
    if tuple(hint.shape) != tuple(amax.shape):
        raise ValueError(f"scale_hint has shape {tuple(hint.shape)}, the blocks form {tuple(amax.shape)}")
    h = scale_to_float(hint).to(amax.device)
    r = amax.float() / h
    fits = (h > 0) & torch.isfinite(h) & ((amax == 0) | ((r >= qmax / 2) & (r <= qmax * (1 + 2**-20))))
    return torch.where(fits, h, s)


def quantize_fp8_ref(
    w: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    scale_fmt: str = "ue8m0",
    scale_hint: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [M, N]`` -> ``(q float8_e4m3fn [M, N], scale float32 [ceil(M/bm), ceil(N/bn)])``."""
    _check_2d("weight", w)
    m, n = w.shape
    bm, bn = block
    gm, gn = cdiv(m, bm), cdiv(n, bn)
    x = w.float()
    pad = torch.zeros(gm * bm, gn * bn, dtype=torch.float32, device=w.device)
    pad[:m, :n] = x.abs()
    amax = pad.view(gm, bm, gn, bn).amax(dim=(1, 3))  # [gm, gn]
    s = hinted_scale(amax, FP8_MAX, scale_fmt, scale_hint)
    q = (x / _expand_blocks(s, m, n, bm, bn)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s


def e2m1_code(x: torch.Tensor) -> torch.Tensor:
    """float32 values (already scaled) -> the nearest e2m1 codes (ties to the even code; saturates at 6)."""
    mid = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    a = x.abs()
    idx = torch.bucketize(a, mid)  # mid[idx-1] < a <= mid[idx]
    on_mid = (idx < len(_E2M1_MIDPOINTS)) & (a == mid[idx.clamp(max=len(_E2M1_MIDPOINTS) - 1)])
    idx = torch.where(on_mid & (idx % 2 == 1), idx + 1, idx)
    return (idx | torch.signbit(x).long() << 3).to(torch.uint8)


def quantize_fp4_ref(
    w: torch.Tensor, group: int = 32, scale_fmt: str = "ue8m0", scale_hint: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [M, K]`` -> ``(packed uint8 [M, K/2], scale float32 [M, ceil(K/group)])``."""
    _check_2d("weight", w)
    m, k = w.shape
    if k % 2:
        raise ValueError(f"FP4 packs two values per byte along the input dim: {k} is odd")
    g = cdiv(k, group)
    x = w.float()
    pad = torch.zeros(m, g * group, dtype=torch.float32, device=w.device)
    pad[:, :k] = x.abs()
    s = hinted_scale(pad.view(m, g, group).amax(-1), FP4_MAX, scale_fmt, scale_hint)  # [M, g]
    codes = e2m1_code((x / s.repeat_interleave(group, 1)[:, :k]).clamp(-FP4_MAX, FP4_MAX))
    return pack_fp4_codes(codes), s
