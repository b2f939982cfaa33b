"""Config validation, presets and analytic parameter counts (spec §9.3)."""

import pytest

from hybrid_model.config import DSv4ModelConfig
from hybrid_model.params import analytic_param_counts
from hybrid_model.presets import PRESETS, get_preset


def test_presets_build_and_patterns():
    assert get_preset("tiny").layer_pattern == "WECEHECEHECE/WE"
    assert get_preset("flash-smoke").layer_pattern == "WECEHECE/WE"
    assert get_preset("flash-smoke").hash_layer_numbers == [2]
    assert get_preset("v4-flash").hash_layer_numbers == [2, 4, 6]
    pro = get_preset("v4-pro").layer_pattern
    assert pro.startswith("HEHECE") and pro.count("C") == 30 and pro.count("H") == 31
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("nope")


@pytest.mark.parametrize(
    ("name", "main", "mtp", "act", "attn", "expert"),
    [("v4-flash", 284.33, 6.61, 13.80, 5.09, 25.17e-3), ("v4-pro", 1573.0, 25.84, 49.78, 19.47, 66.06e-3)],
)
def test_analytic_counts_match_spec(name, main, mtp, act, attn, expert):
    p = analytic_param_counts(get_preset(name))
    assert abs(p.main / 1e9 - main) < 0.01
    assert abs(p.mtp / 1e9 - mtp) < 0.01
    assert abs(p.activated / 1e9 - act) < 0.01
    assert abs(p.attention / 1e9 - attn) < 0.01
    assert abs(p.one_expert / 1e9 - expert) < 1e-5
    assert sum(p.components.values()) == p.total


def test_config_validation_messages():
    with pytest.raises(ValueError, match="need num_layers"):
        DSv4ModelConfig(compress_ratios=(0, 4))
    with pytest.raises(ValueError, match="MTP block is window-only"):
        get_preset("tiny").replace(compress_ratios=(0, 4, 8, 4, 8, 4, 4))
    with pytest.raises(ValueError, match="first pipeline stage"):
        get_preset("tiny").replace(pipeline_stages=(1, 5))
    with pytest.raises(ValueError, match="disagrees"):
        get_preset("tiny").replace(hybrid_layer_pattern="WECEHECEHECE/CE")
    with pytest.raises(ValueError, match="divisible by o_groups"):
        get_preset("tiny").replace(o_groups=3)


def test_compress_ratios_are_checked_against_attention_kinds_at_config_time():
    """A ratio dsv4-attention has no layer kind for fails when the config is made, not when the spec is built."""
    with pytest.raises(
        ValueError,
        match=r"csa_compress_ratio=8: dsv4-attention's CSA layers compress 4 .*set csa_compress_ratio=4",
    ):
        DSv4ModelConfig(csa_compress_ratio=8)
    with pytest.raises(ValueError, match=r"hca_compress_ratio=64: .*LayerKind.HCA"):
        get_preset("tiny").replace(hca_compress_ratio=64)


def test_pattern_is_parsed_once_and_kinds_travel():
    from dsv4_attention import LayerKind

    cfg = get_preset("tiny")
    assert cfg.parsed_pattern is cfg.parsed_pattern  # cached on the (frozen) config
    assert cfg.parsed_pattern.pattern == cfg.layer_pattern == "WECEHECEHECE/WE"
    kinds = [li.attention_kind for li in cfg.layers() if li.attention_kind is not None]
    assert [k.symbol for k in kinds] == list("WCHCHCW")
    assert kinds[1] is LayerKind.CSA and kinds[1].has_indexer and kinds[2].compress_ratio == 128
    assert cfg.replace(num_layers=4).parsed_pattern.pattern == "WECEHECE/WE"  # a replaced config parses anew


def test_round_trip_dict():
    for f in PRESETS.values():
        c = f()
        assert DSv4ModelConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="unknown DSv4ModelConfig keys"):
        DSv4ModelConfig.from_dict({"hidden": 3})
