"""``+`` (MLA) and ``D`` (DSA) patterns trained by ``dsv4 train``: from the CLI, and under ``--pp 2`` (fp32, equal
to PP = 1). The layers themselves are tested in hybrid-model's ``test_latent_attention.py``."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from parallel_runs import METRIC_KEYS, merge_rank_grads, train_layouts
from warm_workers import run_warm

from dsv4_train.cli import main
from hybrid_model.presets import get_preset

#: upstream's functional pattern 'WEC-|H-C-/W-' with MLA and DSA mixed in (as in hybrid-model's test)
FUNCTIONAL = "WE+-|HDC-/D-"
_BASE = ["--seq-len", "32", "--global-batch-size", "2", "--micro-batch-size", "2", "--warmup-steps", "0"]
_BASE += ["--log-interval", "1", "--lr", "1e-2"]


def _tiny(pattern):
    return get_preset("tiny").with_pattern(pattern)


def test_cli_trains_a_pattern_with_mla_and_dsa(tmp_path):
    run = tmp_path / "run"
    assert main(["train", *_BASE, "--pattern", "W+D-E", "--steps", "5", "--out", str(run)]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["lm_loss"] for r in rows if "lm_loss" in r]
    assert len(losses) == 5 and all(x == x for x in losses), losses
    assert min(losses[-2:]) < losses[0], losses
    assert all(r.get("indexer_loss") is not None for r in rows if "lm_loss" in r)  # D's indexer KL, logged


def _overrides(pattern: str) -> dict:
    """``model_overrides`` that turn the tiny preset into ``pattern`` (the fields ``with_pattern`` derives)."""
    base, cfg = get_preset("tiny"), _tiny(pattern)
    return {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if getattr(cfg, f.name) != getattr(base, f.name)
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_pp2_matches_pp1_in_fp32(tmp_path):
    """The functional pattern with '+' and 'D' split by its '|' over two pipeline stages: every step's losses and
    the first step's gradients equal the PP = 1 run of the same global batch (DP = 2 in the same two gloo
    processes, itself equal to the single process: test_parallel_matrix) within fp32 reduction-order rounding."""
    base = dict(seq_len=16, global_batch_size=4, micro_batch_size=1, warmup_steps=0, lr=3e-3, steps=2)
    pp1 = base | dict(out=str(tmp_path / "pp1"), model_overrides=_overrides(FUNCTIONAL.replace("|", "")))
    pp2 = base | dict(
        out=str(tmp_path / "pp2"),
        pp=2,
        model_overrides=_overrides(FUNCTIONAL),
        init_from=str(tmp_path / "pp1" / "checkpoints" / "iter_0000000"),
    )
    ranks = run_warm(train_layouts, 2, [("pp1", pp1), ("pp2", pp2)], True, timeout=900)
    got = {name: [r[name]["metrics"] for r in ranks] for name in ("pp1", "pp2")}
    for name, metrics in got.items():
        assert all(m == metrics[0] for m in metrics), name
    ref, pp = got["pp1"][0], got["pp2"][0]
    for step, (g, r) in enumerate(zip(pp, ref, strict=True), start=1):
        for key in METRIC_KEYS:
            if r[key] is None:
                assert g[key] is None, (step, key)
                continue
            assert g[key] == pytest.approx(r[key], rel=2e-5, abs=1e-7), (step, key, g[key], r[key])
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"] and ref[0]["indexer_loss"] is not None
    g_ref, g_pp = (merge_rank_grads([r[name]["grads"] for r in ranks]) for name in ("pp1", "pp2"))
    assert set(g_ref) == set(g_pp)
    for name, g in g_ref.items():
        err = float((g_pp[name] - g).abs().max())
        assert err <= 2e-5 * float(g.abs().max()) + 1e-9, (name, err)
