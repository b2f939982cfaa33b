"""``dsv4 train`` user errors found by the bad-input probe (issue 29) end in one line and rc 2, before any process
group or --out exists: pattern symbols whose optional packages are missing, and a --pp x --vpp larger than the
model."""

from __future__ import annotations

import pytest

from dsv4_train.cli import main
from hybrid_model.mixers.record import Dependency


@pytest.mark.parametrize("pattern, names", [("M-", "mamba-ssm"), ("WG", "hybrid-model[gdn]")])
def test_unavailable_pattern_symbols_are_one_line_and_rc_2(pattern, names, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(Dependency, "installed", lambda self: False)  # whatever this machine has installed
    out = tmp_path / "run"
    assert main(["train", "--pattern", pattern, "--steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"dsv4 train: error: --pattern {pattern}: "), err
    assert names in err and "or use a pattern without" in err
    assert not out.exists()


def test_pp_times_vpp_over_the_layers_names_the_flags_and_the_fix(capsys, tmp_path):
    assert main(["train", "--pp", "2", "--vpp", "8", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(
        "dsv4 train: error: --pp 2 --vpp 8 with --preset tiny"
    ), err
    assert "16 pipeline segments" in err and "has 6 layers: lower --pp / --vpp" in err
