"""Frequency tables: oracle R3 (YaRN ratio vector), the lo == hi edge case, table caching."""

import math
from types import SimpleNamespace

import pytest
import torch

from dsv4_primitives import RopeConfig, YarnConfig, rope_cos_sin, rope_inv_freq, yarn_ramp_bounds
from dsv4_primitives.rope.frequencies import _TABLES

V4_YARN = YarnConfig(factor=16, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1)
R3_RATIO = (
    [1.0] * 16 + [0.90625, 0.8125, 0.71875, 0.625, 0.53125, 0.4375, 0.34375, 0.25, 0.15625] + [0.0625] * 7
)


def test_r3_yarn_ratio_vector_exact():
    plain = rope_inv_freq(RopeConfig(64, 160000.0)).double()
    yarn = rope_inv_freq(RopeConfig(64, 160000.0, V4_YARN)).double()
    assert yarn_ramp_bounds(64, 160000.0, V4_YARN) == (15.0, 25.0)
    ratio = (yarn / plain).tolist()
    assert len(ratio) == 32
    for got, want in zip(ratio, R3_RATIO, strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=0)


def test_plain_inv_freq_swa_layers():
    inv = rope_inv_freq(RopeConfig(64, 10000.0)).double()
    want = torch.tensor([10000.0 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)
    torch.testing.assert_close(inv, want, rtol=1e-7, atol=0)


@pytest.mark.parametrize(
    ("rope_dim", "orig", "lo"),
    [(4, 6, 0), (8, 6, 0), (4, 10**9, 3), (8, 5 * 10**9, 7)],  # both bounds clamp to 0, or both to r-1
)
def test_yarn_lo_equals_hi_edge_case(rope_dim, orig, lo):
    yarn = YarnConfig(factor=4.0, original_max_position_embeddings=orig)
    got_lo, got_hi = yarn_ramp_bounds(rope_dim, 10000.0, yarn)
    assert got_lo == lo and got_hi == pytest.approx(lo + 0.001)
    plain = rope_inv_freq(RopeConfig(rope_dim, 10000.0)).double()
    scaled = rope_inv_freq(RopeConfig(rope_dim, 10000.0, yarn)).double()
    ratio = scaled / plain
    for i, q in enumerate(ratio.tolist()):  # pair lo and below unchanged, pairs > lo fully scaled
        assert q == pytest.approx(1.0 if i <= lo else 0.25, rel=1e-6)


class _HFLikeConfig(SimpleNamespace):
    def standardize_rope_params(self):
        pass


@pytest.mark.parametrize(
    ("rope_dim", "base", "factor", "orig"),
    [
        (64, 160000.0, 16, 65536),
        (8, 160000.0, 4, 32),  # the tiny CPU config of spec §9.4
        (8, 10000.0, 4, 6),  # lo == hi == 0
        (4, 10000.0, 4, 10**9),  # lo == hi == r - 1
        (4, 10000.0, 4, 10**12),  # lo > hi (lo is only clamped from below, hi from above, as in HF)
    ],
)
def test_yarn_matches_hf_transformers(rope_dim, base, factor, orig):
    from transformers import modeling_rope_utils as rope_utils

    cfg = _HFLikeConfig(
        head_dim=rope_dim,
        hidden_size=rope_dim,
        num_attention_heads=1,
        max_position_embeddings=orig * factor,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": base,
            "factor": factor,
            "original_max_position_embeddings": orig,
            "beta_fast": 32,
            "beta_slow": 1,
            "attention_factor": 1.0,
        },
    )
    hf_inv, attention_factor = rope_utils._compute_yarn_parameters(cfg, device="cpu")
    assert attention_factor == 1.0
    ours = rope_inv_freq(RopeConfig(rope_dim, base, YarnConfig(factor, orig)))
    torch.testing.assert_close(ours, hf_inv.float(), rtol=2e-6, atol=0)


def test_cos_sin_values_and_cache_keys():
    _TABLES.clear()  # other tests may have cached tables of this config already
    cfg = RopeConfig(8, 10000.0)
    cos5, sin5 = rope_cos_sin(cfg, 5)
    cos7, _ = rope_cos_sin(cfg, 7)
    assert cos5.shape == (5, 4) and cos5.dtype == torch.float32
    assert cos5.data_ptr() == cos7.data_ptr()  # both lengths round up to one cached table of 8 rows
    ang = torch.arange(5, dtype=torch.float64)[:, None] * rope_inv_freq(cfg).double()
    torch.testing.assert_close(sin5, ang.sin().float(), rtol=0, atol=0)
    n_before = len(_TABLES)
    cos64, _ = rope_cos_sin(cfg, 5, dtype=torch.float64)
    assert cos64.dtype == torch.float64 and cos64.data_ptr() != cos5.data_ptr()
    rope_cos_sin(cfg, 9)  # a longer length is a new (16-row) table
    assert len(_TABLES) == n_before + 2
    rope_cos_sin(cfg, 16, device="cpu")
    assert len(_TABLES) == n_before + 2
    assert rope_cos_sin(cfg, 0)[0].shape == (0, 4)


def test_cos_sin_precision_at_large_position():
    cfg = RopeConfig(64, 10000.0)
    n = 1 << 20
    cos, sin = rope_cos_sin(cfg, n)
    ang = (n - 1) * 1.0  # theta_0 = 1
    assert cos[-1, 0].item() == pytest.approx(math.cos(ang), abs=1e-7)
    assert sin[-1, 0].item() == pytest.approx(math.sin(ang), abs=1e-7)
    _TABLES.clear()


def test_bad_configs_raise_value_error():
    with pytest.raises(ValueError, match="rope_dim"):
        RopeConfig(7)
    with pytest.raises(ValueError, match="beta_fast"):
        YarnConfig(beta_fast=1, beta_slow=2)
    with pytest.raises(ValueError, match="length"):
        rope_cos_sin(RopeConfig(8), -1)
