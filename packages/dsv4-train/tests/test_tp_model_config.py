"""Giving ``dsv4 train --tp N`` a model that TP ``N`` splits (issue 31): a ``--tp`` the model's sizes do not divide
is refused in one line and rc 2 before any process group or ``--out`` exists, naming the size, the ``--tp`` values
that fit and the ``model_overrides`` that make it fit; a ``--config`` file's ``model_overrides`` stay when
``--pattern`` / ``--no-mhc`` / ``--model-overrides`` add keys (they merge key by key, the flags winning per key)."""

from __future__ import annotations

import json

from dsv4_train.cli import main
from dsv4_train.config import TrainConfig
from dsv4_train.model_config import model_config_for


def test_tp4_on_tiny_is_one_line_naming_o_groups_and_the_override(capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--tp", "4", "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("dsv4 train: error: --tp 4: o_groups=2 is not divisible by 4 ("), err
    assert "--tp 1, 2 fit this model" in err and 'model_overrides {"o_groups": 4} in the --config file' in err
    assert not out.exists()


def test_config_file_model_overrides_merge_with_the_model_flags(capsys, tmp_path):
    config = tmp_path / "tp4.json"
    config.write_text(json.dumps({"model": {"model_overrides": {"o_groups": 4, "num_hash_layers": 2}}}))
    flag = {"hybrid_layer_pattern": "WEC-HE/WE", "num_hash_layers": 1}
    tc = TrainConfig.from_file(config, model_overrides=flag)
    assert tc.model.model_overrides == {
        "o_groups": 4,
        "num_hash_layers": 1,
        "hybrid_layer_pattern": "WEC-HE/WE",
    }
    assert model_config_for(tc.replace(tp=4)).o_groups == 4
    # through the CLI: --config FILE --pattern P keeps the file's 4 output groups
    argv = ["train", "--config", str(config), "--pattern", "WEC-HE/WE", "--print-config"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["model"]["model_overrides"] == {
        "o_groups": 4,
        "num_hash_layers": 2,
        "hybrid_layer_pattern": "WEC-HE/WE",
    }
