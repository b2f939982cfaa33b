"""Config-time rules of ``dsv4 train --vpp`` and ``--ckpt-format`` (no processes: the checks need no parallel state).
The runs themselves are the PP2xVPP2 cell of ``test_parallel_matrix.py``."""

import pytest

from dsv4_train.config import TrainConfig
from dsv4_train.model_config import model_config_for
from dsv4_train.setup import check_run
from dsv4_train.virtual_pipeline import check_vpp_microbatches


def test_vpp_sets_pp_times_vpp_segments_with_the_hash_layers_in_the_first():
    cfg = model_config_for(TrainConfig.from_flat(pp=2, vpp=2))
    segments = cfg.parsed_pattern.segments
    assert len(segments) == 4
    assert [len(s) for s in segments] == [4, 4, 2, 2]  # tiny's 6 blocks (attention + MoE symbols) as 2/2/1/1
    assert (
        len(model_config_for(TrainConfig.from_flat(pp=2)).parsed_pattern.segments) == 2
    )  # --vpp 1: as before


def test_vpp_refusals_name_the_fix():
    with pytest.raises(ValueError, match="--vpp 2 needs pipeline stages to interleave: set --pp >= 2"):
        TrainConfig.from_flat(vpp=2)
    with pytest.raises(ValueError, match=r"pipeline_stages must be in \[1, 6\]"):
        check_run(
            TrainConfig.from_flat(pp=2, vpp=4)
        )  # 8 segments of 6 blocks (the model decides: at run start)
    with pytest.raises(ValueError, match="needs 4 pipeline segments, but the model's pattern has 2"):
        check_run(TrainConfig.from_flat(pp=2, vpp=2, model_overrides={"pipeline_stages": 2}))
    with pytest.raises(ValueError, match="first"):  # the 2 hash layers would span segments 0 and 1
        check_run(TrainConfig.from_flat(pp=2, vpp=2, model_overrides={"pipeline_stages": [1, 2, 2, 1]}))
    with pytest.raises(ValueError, match="--vpp must be >= 1"):
        TrainConfig.from_flat(vpp=0)


def test_vpp_microbatch_groups():
    check_vpp_microbatches(4, 2)
    check_vpp_microbatches(2, 2)
    for n in (1, 3, 5):
        with pytest.raises(ValueError, match="multiple of --pp 2 micro-batches per step"):
            check_vpp_microbatches(n, 2)


def test_ckpt_format_choices():
    assert TrainConfig.from_flat().checkpoint.ckpt_format == "dp_reshardable"
    TrainConfig.from_flat(ckpt_format="fully_reshardable")
    with pytest.raises(ValueError, match="--ckpt-format must be one of"):
        TrainConfig.from_flat(ckpt_format="fully_sharded_model_space")


def test_vpp_refusal_with_cp_and_evaluation_under_cp_or_vpp():
    """Combinations no parity test covers yet are refused at config time with the reason (README matrix); the
    evaluation runs under --cp and --vpp (parity: test_train_eval_parallel.py)."""
    with pytest.raises(ValueError, match="--vpp 2 with --cp 2 is not supported"):
        TrainConfig.from_flat(pp=2, vpp=2, cp=2, seq_len=64)
    assert TrainConfig.from_flat(cp=2, seq_len=64, eval_interval=1).eval.eval_interval == 1
    assert TrainConfig.from_flat(pp=2, vpp=2, eval_interval=1).eval.eval_interval == 1
