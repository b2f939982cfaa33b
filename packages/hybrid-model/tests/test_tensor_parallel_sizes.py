"""The config-level TP size check (:mod:`hybrid_model.tensor_parallel_sizes`): it refuses a ``--tp`` in one line
naming the size, the ``--tp`` values that fit and the ``model_overrides`` that make it fit, and it accepts exactly
the TP sizes the model's own split accepts (the converter's check on the meta model, which reads every TP-split
parameter's partition axis: :func:`hybrid_model.hf.megatron_tp.check_tensor_split`) on DSv4 attention and ``E``.
That split judges tensor sizes, not heads, and the converter reads no ``*`` / ``-`` layer (it passes 4 ``*`` heads
at TP 8), so for those the check's own refusals are tested."""

import pytest

from hybrid_model.hf.megatron_plan import meta_checkpoint_entries
from hybrid_model.presets import get_preset
from hybrid_model.tensor_parallel_sizes import check_tensor_parallel_sizes, fitting_overrides, split_sizes


def _model_splits(cfg, tp: int) -> bool:
    """Whether the meta model of ``cfg`` splits over ``tp`` ranks (the converter's check)."""
    try:
        meta_checkpoint_entries(cfg, tp)
    except ValueError:
        return False
    return True


def _config_splits(cfg, tp: int) -> bool:
    try:
        check_tensor_parallel_sizes(cfg, tp)
    except ValueError:
        return False
    return True


def test_tiny_at_tp4_names_o_groups_the_sizes_that_fit_and_the_override():
    with pytest.raises(ValueError) as e:
        check_tensor_parallel_sizes(get_preset("tiny"), 4)
    assert str(e.value) == (
        "--tp 4: o_groups=2 is not divisible by 4 (each TP rank holds whole groups of DSv4 attention's grouped "
        "output projection, and their heads); --tp 1, 2 fit this model, or give it sizes TP 4 splits: "
        'model_overrides {"o_groups": 4} in the --config file (or --model-overrides \'{"o_groups": 4}\')'
    )


def test_the_sizes_follow_the_pattern():
    tiny = get_preset("tiny")  # W C H + E with a shared expert: no '*', no '-'
    assert sorted(split_sizes(tiny)) == ["moe_intermediate_size", "o_groups", "vocab_size"]
    star = tiny.with_pattern("*E*E")
    assert sorted(split_sizes(star)) == ["moe_intermediate_size", "num_attention_heads", "vocab_size"]
    assert sorted(split_sizes(star.replace(n_shared_experts=0))) == ["num_attention_heads", "vocab_size"]
    assert "moe_intermediate_size" in split_sizes(tiny.replace(n_shared_experts=0).with_pattern("W-C-"))


def test_star_heads_and_mlp_width_refuse_a_tp_that_does_not_divide_them():
    tiny = get_preset("tiny")  # 4 heads, moe_intermediate_size 32
    with pytest.raises(
        ValueError, match=r"^--tp 8: num_attention_heads=4 is not divisible by 8 \(megatron's '\*'"
    ):
        check_tensor_parallel_sizes(tiny.with_pattern("*E*E"), 8)
    mlp = tiny.replace(moe_intermediate_size=36, n_shared_experts=0, o_groups=4).with_pattern("W-C-")
    check_tensor_parallel_sizes(mlp, 4)
    with pytest.raises(
        ValueError, match=r"^--tp 8: moe_intermediate_size=36 is not divisible by 8 \(megatron's '-'"
    ):
        check_tensor_parallel_sizes(mlp.replace(o_groups=8, num_attention_heads=8), 8)


@pytest.mark.parametrize(
    "changes",
    [{}, {"o_groups": 4}, {"num_attention_heads": 8, "o_groups": 8, "moe_intermediate_size": 36}],
    ids=["tiny", "o_groups4", "shared_expert36"],
)
def test_the_config_check_accepts_what_the_model_splits(megatron_cpu, changes):
    cfg = get_preset("tiny").replace(**changes)
    for tp in (2, 4, 8):
        assert _config_splits(cfg, tp) == _model_splits(cfg, tp), (changes, tp)


@pytest.mark.parametrize("tp", [3, 4, 8])
def test_the_suggested_overrides_make_tp_fit(megatron_cpu, tp):
    tiny = get_preset("tiny")
    cfg = tiny.replace(**fitting_overrides(tiny, tp))
    check_tensor_parallel_sizes(cfg, tp)
    assert _model_splits(cfg, tp)
    assert fitting_overrides(cfg, tp) == {}
