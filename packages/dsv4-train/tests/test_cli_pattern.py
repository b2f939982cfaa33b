"""``--pattern`` and ``--no-mhc`` from the ``dsv4`` CLI: upstream's functional pattern trains under PP2, MTP depth 2
logs one loss per depth, mHC off trains, and pattern errors point at the offending character."""

import json
import os
import subprocess
import sys

import pytest

from dsv4_train.cli import main

_BASE = ["--seq-len", "32", "--global-batch-size", "2", "--micro-batch-size", "2", "--warmup-steps", "0"]
_BASE += ["--log-interval", "1", "--lr", "1e-2"]


def _metrics(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _decreasing_ish(losses):
    assert all(x == x and abs(x) < 1e3 for x in losses), losses  # finite
    assert min(losses[-2:]) < losses[0], losses


@pytest.mark.slow
def test_upstream_functional_pattern_trains_under_pp2(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "dsv4_train"]
    cmd += ["train", *_BASE, "--pp", "2", "--pattern", "WEC-|H-C-/W-", "--steps", "5", "--out", str(run)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    _decreasing_ish([r["lm_loss"] for r in rows])
    assert all(r["mtp_loss"] is not None for r in rows) and "mtp_loss_1" not in rows[0]


@pytest.mark.slow
def test_mtp_depth_2_without_mhc_logs_each_depth(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="2")
    cmd = [sys.executable, "-m", "dsv4_train", "train", *_BASE, "--no-mhc", "--pattern", "WEC-H-/W-/W-"]
    proc = subprocess.run(
        [*cmd, "--steps", "4", "--out", str(run)], capture_output=True, text=True, timeout=900, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _metrics(run)
    _decreasing_ish([r["lm_loss"] for r in rows])
    for r in rows:
        assert r["mtp_loss"] == pytest.approx((r["mtp_loss_1"] + r["mtp_loss_2"]) / 2, rel=1e-6)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("dsv4 train: step ")]
    assert len(lines) == 4 and all("mtp_loss_1 " in x and "mtp_loss_2 " in x for x in lines)
    # resuming with mHC on (the override dropped) is refused: the switch is fixed by the run directory
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv4_train",
            "train",
            *_BASE,
            "--pattern",
            "WEC-H-/W-/W-",
            "--steps",
            "4",
        ]
        + ["--out", str(run), "--resume", "auto"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert again.returncode == 2 and "enable_mhc_connections" in again.stderr, again.stderr[-3000:]
    assert "--steps" not in again.stderr.split("cannot change in a resumed run:")[1]  # only the model differs


@pytest.mark.parametrize("cmd", ["inspect", "flops", "train"])
def test_pattern_errors_point_at_the_character(cmd, capsys):
    assert main([cmd, "--pattern", "WEC-|H-X-/W-"]) == 2
    err = capsys.readouterr().err
    assert f"dsv4 {cmd}: error: invalid hybrid layer pattern at position 8: 'X' is not a layer symbol" in err
    assert "\n  WEC-|H-X-/W-\n         ^\n" in err
    assert (
        "valid symbols: W window, C CSA, H HCA, E MoE, - dense MLP, * attention, + MLA, D DSA, G GDN, M Mamba"
        in err
    )


def test_train_pattern_cuts_must_match_pp(capsys, tmp_path):
    assert main(["train", "--pattern", "WEC-|H-C-/W-", "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    assert not (tmp_path / "run").exists()  # refused before anything was created
    assert "has 2 pipeline stage(s) ('|' cuts) but --pp is 1" in capsys.readouterr().err


def test_inspect_and_flops_follow_the_pattern(capsys):
    assert main(["inspect", "--pattern", "WEC-|H-C-/W-", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pattern"] == "WEC-|H-C-/W-"
    assert [x["symbol"] for x in report["layers"]] == list("WEC-H-C-W-")
    assert [x["stage"] for x in report["layers"]] == [0, 0, 0, 0, 1, 1, 1, 1, -1, -1]
    assert [x["router"] for x in report["layers"]][:2] == ["", "hash"]
    assert main(["flops", "--pattern", "*-*E", "--seq-len", "64", "--json"]) == 0
    flops = json.loads(capsys.readouterr().out)
    assert flops["components"]["mlp"] > 0 and flops["components"]["attention.causal_core"] > 0
    assert main(["inspect", "--no-mhc", "--json"]) == 0
    assert "mhc" not in json.loads(capsys.readouterr().out)["params"]["components"]
