"""``dsv4 train --init-from`` of a checkpoint holding another model than the run builds (issue 29: the advice of a
refused resume led there, and the load failed with a 19,441-character line blaming corruption): one line naming the
fields that differ and the model flags that build the checkpoint's model; those flags are checked to build it, and
through the CLI they train. A run that fails this way leaves no empty ``--out`` behind."""

from __future__ import annotations

import json
import shlex

from dsv4_train.cli import build_parser, main, train_config_from_args
from dsv4_train.config import TrainConfig
from dsv4_train.init_model import RUN_CONFIG_FILE, mismatch_message, model_differences, one_stage
from dsv4_train.model_config import model_config_for
from hybrid_model.hf.convert import MODEL_CONFIG_FILE
from hybrid_model.presets import get_preset


def _train_checkpoint(tmp_path, **flat) -> tuple:
    ck = tmp_path / "run" / "checkpoints" / "iter_0000002"
    ck.mkdir(parents=True)
    saved = TrainConfig.from_flat(**flat)
    (ck / RUN_CONFIG_FILE).write_text(json.dumps(saved.to_dict()))
    return ck, saved


def _suggested(msg: str) -> list[str]:
    """The model flags a mismatch message suggests (``--preset ...`` up to ' (in place' or ' and without')."""
    text = msg.split("build the checkpoint's model with ")[1].split(";")[0]
    text = text.split(" (in place of")[0].split(" and without")[0]
    return shlex.split(text)


def _model_of_flags(flags: list[str]):
    return one_stage(model_config_for(train_config_from_args(build_parser().parse_args(["train", *flags]))))


def test_pattern_mismatch_names_the_patterns_and_the_flags_that_build_the_checkpoints_model(tmp_path):
    ck, saved = _train_checkpoint(tmp_path)  # the default tiny model
    run = TrainConfig.from_flat(model_overrides={"hybrid_layer_pattern": "W-C-/W-"})
    msg = mismatch_message(str(ck), ck, run)
    assert msg is not None and "\n" not in msg and len(msg) < 500, msg
    assert "layer pattern 'W-C-/W-' (checkpoint: 'WECEHECEHECE/WE')" in msg
    assert "num_layers" not in msg  # the pattern's own fields are reported as the pattern
    assert "--preset tiny and without --pattern / --no-mhc / --model-overrides" in msg
    assert _model_of_flags(_suggested(msg)) == one_stage(model_config_for(saved))


def test_overrides_of_the_checkpoints_run_are_suggested_and_build_its_model(tmp_path):
    ck, saved = _train_checkpoint(
        tmp_path, model_overrides={"hybrid_layer_pattern": "W-|C-/W-", "enable_mhc_connections": False}, pp=2
    )
    run = TrainConfig.from_flat()  # one stage, mHC on, the preset's pattern
    msg = mismatch_message(str(ck.parent.parent), ck, run)
    assert f"--init-from {ck.parent.parent} ({ck}) holds another model" in msg, msg
    assert "enable_mhc_connections True (checkpoint: False)" in msg
    flags = _suggested(msg)  # the cut removed: this run has one stage
    assert flags[:2] == ["--preset", "tiny"] and json.loads(flags[3])["hybrid_layer_pattern"] == "W-C-/W-"
    assert _model_of_flags(flags) == one_stage(model_config_for(saved))


def test_a_convert_output_gets_overrides_on_this_runs_preset(tmp_path):
    ck = tmp_path / "converted"
    ck.mkdir()
    model = get_preset("tiny").with_pattern("WE/W").replace(hidden_size=96)
    (ck / MODEL_CONFIG_FILE).write_text(json.dumps({"model_config": model.to_dict()}))
    msg = mismatch_message(str(ck), ck, TrainConfig.from_flat())
    assert "hidden_size" in msg and "(checkpoint: 96)" in msg, msg
    assert _model_of_flags(_suggested(msg)) == one_stage(model)


def test_same_model_other_pipeline_layout_is_no_mismatch(tmp_path):
    ck, _ = _train_checkpoint(tmp_path, model_overrides={"hybrid_layer_pattern": "W-|C-/W-"}, pp=2)
    run = TrainConfig.from_flat(model_overrides={"hybrid_layer_pattern": "W-C-/W-"})
    assert mismatch_message(str(ck), ck, run) is None
    assert model_differences(model_config_for(run), get_preset("tiny").with_pattern("W-|C-/W-")) == []


def test_cli_init_from_another_model_is_one_line_and_its_advice_trains(tmp_path, capsys):
    """Through ``dsv4 train``: rc 2, one line, no empty --out (nor its new parents) left; the suggested flags train."""
    argv = [
        "train",
        "--seq-len",
        "32",
        "--global-batch-size",
        "1",
        "--micro-batch-size",
        "1",
        "--no-progress",
    ]
    argv += ["--steps", "1", "--data", "mock:docs=50"]
    src = tmp_path / "src"
    assert main([*argv, "--pattern", "W-", "--out", str(src)]) == 0
    capsys.readouterr()
    new = tmp_path / "new" / "a"
    assert main([*argv, "--pattern", "WE", "--init-from", str(src), "--out", str(new)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds another model than this run builds" in err, err
    assert "layer pattern 'WE' (checkpoint: 'W-')" in err
    assert not (tmp_path / "new").exists()
    flags = _suggested(err)
    assert main([*argv, *flags, "--init-from", str(src), "--out", str(new)]) == 0
