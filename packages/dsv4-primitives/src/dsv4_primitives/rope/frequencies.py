"""Rotary frequency tables: plain (window-only layers) and YaRN without mscale (compressed layers).

Spec: dsv4-architecture.md §2.3. For pair ``i`` of a rotary width ``r`` (``i = 0 .. r/2-1``):

    theta_i = base^(-2i/r)

YaRN (as in the DeepSeek reference, **no** attention temperature / mscale):

    f(n)   = r * ln(orig / (2*pi*n)) / (2 * ln(base))
    lo     = max(floor(f(beta_fast)), 0);   hi = min(ceil(f(beta_slow)), r-1)    (as in HF / the reference)
    hi     = lo + 0.001 if lo == hi
    ramp_i = clip((i - lo) / (hi - lo), 0, 1)
    theta_i <- theta_i / factor * ramp_i + theta_i * (1 - ramp_i)

For V4 (r=64, base 160000, factor 16, orig 65536, beta_fast 32, beta_slow 1): lo=15, hi=25 (oracle R3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class YarnConfig:
    """YaRN context-extension parameters (DSv4 compressed layers). ``mscale`` is deliberately absent."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise ValueError(f"YarnConfig.factor must be >= 1, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError("YarnConfig.original_max_position_embeddings must be positive")
        if not self.beta_fast > self.beta_slow > 0:
            raise ValueError(
                f"YarnConfig needs beta_fast > beta_slow > 0, got {self.beta_fast}, {self.beta_slow}"
            )


@dataclass(frozen=True)
class RopeConfig:
    """Per-layer rotary configuration.

    Attributes:
        rope_dim: rotary width ``r`` (the **last** ``r`` channels of a head are rotated), even.
        base: ``theta`` base (10000 for window-only layers, 160000 for CSA/HCA layers).
        yarn: YaRN parameters or ``None`` for plain RoPE.
    """

    rope_dim: int = 64
    base: float = 10000.0
    yarn: YarnConfig | None = None

    def __post_init__(self) -> None:
        if self.rope_dim <= 0 or self.rope_dim % 2:
            raise ValueError(f"RopeConfig.rope_dim must be a positive even number, got {self.rope_dim}")
        if self.base <= 1.0:
            raise ValueError(f"RopeConfig.base must be > 1, got {self.base}")


def _yarn_correction_dim(n: float, rope_dim: int, base: float, orig: int) -> float:
    return rope_dim * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(base))


def yarn_ramp_bounds(rope_dim: int, base: float, yarn: YarnConfig) -> tuple[float, float]:
    """``(lo, hi)`` of the YaRN ramp: ``lo >= 0``, ``hi <= r-1``, and ``hi = lo + 0.001`` when they coincide.

    As in HF and the DeepSeek reference, ``lo`` is only clamped from below and ``hi`` only from above, so for
    extreme settings ``lo > hi`` is possible (the ramp then decreases; the formula is kept as is for parity).
    """
    lo = math.floor(
        _yarn_correction_dim(yarn.beta_fast, rope_dim, base, yarn.original_max_position_embeddings)
    )
    hi = math.ceil(
        _yarn_correction_dim(yarn.beta_slow, rope_dim, base, yarn.original_max_position_embeddings)
    )
    lo, hi = max(lo, 0), min(hi, rope_dim - 1)
    if lo == hi:
        hi = lo + 0.001
    return float(lo), float(hi)


def rope_inv_freq(cfg: RopeConfig, device=None) -> torch.Tensor:
    """Inverse frequencies ``theta_i`` as float64 then fp32, shape ``[r/2]``."""
    r = cfg.rope_dim
    i = torch.arange(0, r, 2, dtype=torch.float64) / r
    inv = 1.0 / (cfg.base**i)
    if cfg.yarn is not None:
        lo, hi = yarn_ramp_bounds(r, cfg.base, cfg.yarn)
        ramp = ((torch.arange(r // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0.0, 1.0)
        inv = inv / cfg.yarn.factor * ramp + inv * (1.0 - ramp)
    return inv.to(device=device, dtype=torch.float32)


_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _canonical_device(device) -> torch.device:
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def rope_cos_sin(
    cfg: RopeConfig, length: int, device=None, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached ``cos, sin`` tables of shape ``[length, r/2]`` for positions ``0 .. length-1``.

    Cached per ``(cfg, device, dtype, length)``; lengths are rounded up to a power of two so a growing sequence
    length does not fill the cache (the returned tensors are contiguous row-prefixes of the cached table). Angles
    are computed in float64 (``pos * theta`` loses precision in fp32 at 1M), then cast to ``dtype`` (fp32 by
    default; the fused kernel always uses fp32 tables).
    """
    if length < 0:
        raise ValueError(f"rope_cos_sin length must be >= 0, got {length}")
    if not dtype.is_floating_point:
        raise ValueError(f"rope_cos_sin dtype must be floating point, got {dtype}")
    device = _canonical_device(device)
    n = 1 << max(int(length) - 1, 0).bit_length()
    key = (cfg, device, dtype, n)
    tab = _TABLES.get(key)
    if tab is None:
        # normal tensors even when first built under torch.inference_mode(): a cached inference tensor could never
        # be saved for backward by a later training step
        with torch.inference_mode(False):
            pos = torch.arange(n, dtype=torch.float64)
            ang = torch.outer(pos, rope_inv_freq(cfg).double())
            tab = (ang.cos().to(device=device, dtype=dtype), ang.sin().to(device=device, dtype=dtype))
        _TABLES[key] = tab
    return tab[0][:length], tab[1][:length]


def clear_rope_cache() -> None:
    """Drop every cached ``cos``/``sin`` table (frees their memory)."""
    _TABLES.clear()
