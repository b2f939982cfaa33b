"""C/H/W symbols, compress-ratio forms and pattern generation (upstream D4)."""

import re

import pytest

from hybrid_model.model_flags import apply_model_overrides
from hybrid_model.presets import get_preset
from hybrid_model.symbols import (
    compress_ratios_from_pattern,
    hash_layer_numbers,
    layer_infos,
    normalize_compress_ratios,
    parse_pattern,
    pattern_from_compress_ratios,
    register_dsv4_symbols,
)

FLASH = [0, 0] + [4, 128] * 20 + [4] + [0]


def test_pattern_from_compress_ratios_flash():
    p = pattern_from_compress_ratios(FLASH, 43)
    assert p.startswith("WEWECEHECE") and p.endswith("CE/WE")
    parsed = parse_pattern(p)
    assert parsed.main.count("W") == 2 and parsed.main.count("C") == 21 and parsed.main.count("H") == 20
    assert parsed.mtp_pattern == "WE" and parsed.mtp_num_depths == 1
    assert compress_ratios_from_pattern(p) == FLASH


def test_pattern_pipeline_cuts():
    p = pattern_from_compress_ratios([0, 4, 8, 4, 8, 4, 0], 6, hca_ratio=8, pipeline_stages=2)
    assert p == "WECEHE|CEHECE/WE"
    p = pattern_from_compress_ratios([0, 4, 8, 4, 8, 4, 0], 6, hca_ratio=8, pipeline_stages=(4, 2))
    assert p == "WECEHECE|HECE/WE"
    with pytest.raises(ValueError, match="sum to 6"):
        pattern_from_compress_ratios([0, 4, 8, 4, 8, 4, 0], 6, hca_ratio=8, pipeline_stages=(4, 1))


def test_compact_and_full_forms_agree():
    pat = "WECE|HE/WE"
    full = normalize_compress_ratios(pat, hca_ratio=128)
    assert full == [0, 0, 4, 0, 128, 0, 0, 0]
    assert normalize_compress_ratios(pat, [0, 4, 128, 0]) == full
    assert normalize_compress_ratios(pat, full) == full


@pytest.mark.parametrize(
    ("ratios", "msg"),
    [
        ([0, 128, 128, 0], "does not match symbol 'C'"),
        ([0, 4, 128], "needs 4 .compact"),
        ([0, 1, 4, 0, 128, 0, 0, 0], "non-C/H/W symbols must carry 0"),
        ([4, 4, 128, 0], "does not match symbol 'W'"),
    ],
)
def test_bad_ratios_rejected(ratios, msg):
    with pytest.raises(ValueError, match=msg):
        normalize_compress_ratios("WECE|HE/WE", ratios)


@pytest.mark.parametrize(
    "pattern, position, reason",
    [
        ("*ECE", 2, "standard attention '*' mixed with the MLA family"),
        ("WXE", 1, "'X' is not a layer symbol"),
        ("WE/WE/CE", 6, "differs from the first depth"),
        ("WE/W|E", 4, "'|' inside an MTP depth"),
        ("WE||CE", 3, "empty pipeline stage"),
        ("WE/", 2, "empty MTP depth"),
        ("/WE", 0, "has no layers"),
    ],
)
def test_bad_patterns_point_at_the_character(pattern, position, reason):
    from hybrid_model.symbols import PatternError

    with pytest.raises(PatternError, match=re.escape(reason)) as info:
        parse_pattern(pattern)
    err = info.value
    assert isinstance(err, ValueError) and err.position == position
    lines = str(err).splitlines()
    assert lines[0].startswith(f"invalid hybrid layer pattern at position {position + 1}:")
    assert lines[1] == f"  {pattern}" and lines[2] == "  " + " " * position + "^"
    assert "valid symbols: W window, C CSA, H HCA, E MoE, - dense MLP, * attention" in lines[3]


def test_pattern_from_bad_ratio():
    with pytest.raises(ValueError, match="neither 0"):
        pattern_from_compress_ratios([0, 16], 2)


def test_hash_layers_count_moe_layers_and_first_stage():
    # first 3 MoE layers: positions 2, 4, 6 (not the first three symbols)
    assert hash_layer_numbers("WEWECEHE|CE", 3) == [2, 4, 6]
    with pytest.raises(ValueError, match="first pipeline stage"):
        hash_layer_numbers("WE|WECE", 2)
    with pytest.raises(ValueError, match="only 2 main MoE"):
        hash_layer_numbers("WECE/WE", 3)


def test_a_pattern_builds_one_model_under_every_pipeline_cut():
    """``with_pattern`` caps the hash layers at the pattern's main ``E`` count, never at the first stage's: a cut
    that cannot hold them is refused, and ``--model-overrides`` can lower them before the pattern is applied."""
    tiny = get_preset("tiny")  # num_hash_layers = 2
    assert tiny.with_pattern("WEC-HE/WE").num_hash_layers == 2
    assert tiny.with_pattern("WEC-E|HE/WE").num_hash_layers == 2
    # one main E: a property of the pattern, not a cut
    assert tiny.with_pattern("WEC-/WE").num_hash_layers == 1
    with pytest.raises(ValueError, match="first pipeline stage"):
        tiny.with_pattern("WEC-|HE/WE")
    lowered = apply_model_overrides(tiny, {"hybrid_layer_pattern": "WEC-|HE/WE", "num_hash_layers": 1}, pp=2)
    assert lowered.num_hash_layers == 1 and lowered.hash_layer_numbers == [2]


def test_layer_infos():
    infos = layer_infos("WECE|HE/WE", num_hash_layers=1, hca_ratio=128)
    assert [i.kind for i in infos] == ["window", "moe", "csa", "moe", "hca", "moe", "window", "moe"]
    assert [i.router for i in infos if i.symbol == "E"] == ["hash", "learned", "learned", "learned"]
    assert [i.stage for i in infos] == [0, 0, 0, 0, 1, 1, -1, -1]
    assert infos[-1].mtp_depth == 1 and infos[4].compress_ratio == 128


def test_megatron_accepts_dsv4_symbols_after_registration():
    from megatron.core.models.hybrid.hybrid_layer_allocation import (
        Symbols,
        get_hybrid_layer_counts,
        parse_hybrid_pattern,
    )

    register_dsv4_symbols()
    register_dsv4_symbols()  # idempotent
    assert {"C", "H", "W"} <= Symbols.VALID_LAYERS
    parsed = parse_hybrid_pattern("WECE|HE/WE")
    assert parsed.mtp_pattern == "WE"
    counts = get_hybrid_layer_counts("WECE|HE/WE")
    assert counts["W"] == 2 and counts["C"] == 1 and counts["H"] == 1 and counts["E"] == 4
