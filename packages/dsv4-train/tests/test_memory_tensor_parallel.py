"""``dsv4 memory --tp 2`` against a gloo TP=2 ``dsv4 train`` step of the tiny preset (one ``[1, 128]`` micro-batch,
bf16, CPU): on each rank the static bytes (parameters: the TP-split ones halved, the routers' fp32 biases; fp32
main params and Adam moments: the dense ones sharded over DP x CP = 1, the routed experts over the expert-data-
parallel group = the 2 TP ranks) EXACTLY, the gradient buffers up to megatron's 64-element alignment padding, and
the bytes saved for backward by one forward (no recompute and full recompute) against the activation term on the
CPU reference path within the TP=1 test's tolerance (``test_memory_model.ACTIVATION_TOLERANCE``, 15%: the
reference path's eager terms are approximate; both ranks measured). Then the TP communication section."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from memory_runs import memory_config, tp_rank_memory
from test_memory_model import ACTIVATION_TOLERANCE, FULL
from warm_workers import run_warm

from dsv4_train.cli import main
from dsv4_train.memory_comm import tp_comm_per_step
from dsv4_train.memory_model import GIB, estimate_memory

SEQ, TP = 128, 2


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_static_and_activations_match_a_tp2_step(tmp_path, capsys):
    runs = [{}, FULL]
    ranks = run_warm(tp_rank_memory, TP, str(tmp_path / "run"), SEQ, runs, timeout=900)
    assert main(["memory", "--preset", "tiny", "--tp", "2", "--seq-len", str(SEQ), "--micro-batch-size", "1",
                 "--global-batch-size", "1", "--json"]) == 0  # fmt: skip
    static = json.loads(capsys.readouterr().out)["static"]
    for got in (r[0] for r in ranks):
        assert static["parameters"] * GIB == got["params"]
        assert static["fp32 main params (sharded)"] * GIB == got["main"]
        assert static["Adam moments (sharded)"] * GIB == got["adam"]
        grads = static["gradient buffers (fp32 main_grad)"] * GIB
        assert 0 <= got["grads"] - grads < 64 * 4 * got["n_params"]
    for settings, per_rank in zip(runs, zip(*ranks, strict=True), strict=True):
        tc = memory_config(tmp_path / "model", SEQ, tp=TP, **settings)
        model = sum(estimate_memory(tc, dp=1, path="reference").activations.values())
        for r in per_rank:
            assert abs(model / r["saved"] - 1) <= ACTIVATION_TOLERANCE, (
                f"TP2 {settings or 'no recompute'}: model {model / SEQ:.0f} B/token, saved {r['saved'] / SEQ:.0f}"
            )


def test_tp_comm_section(tmp_path, capsys):
    """``--tp 2`` prints the per-step TP bytes of one rank; the layers' bytes scale with the micro-batches, the
    replicated-gradient all-reduce (once per step) does not; ``--tp 1`` has none; TP with EP is modelled like any
    layout the trainer runs."""
    one = tp_comm_per_step(memory_config(tmp_path, 64, tp=2), dp=1)
    four = tp_comm_per_step(memory_config(tmp_path, 64, tp=2, global_batch_size=4), dp=1)
    grads = "replicated-gradient all-reduce (fp32)"
    assert four[grads] == one[grads] > 0
    for key in one.keys() - {grads}:
        assert four[key] == 4 * one[key] > 0, key
    assert tp_comm_per_step(memory_config(tmp_path, 64), dp=1) == {}
    assert (
        main(["memory", "--preset", "tiny", "--tp", "2", "--seq-len", "64", "--micro-batch-size", "1"]) == 0
    )
    out = capsys.readouterr().out
    assert "DP1 TP2 PP1 CP1 EP1 (2 GPUs)" in out and "TP communication per step" in out
    assert (
        main(["memory", "--preset", "tiny", "--tp", "2", "--seq-len", "65", "--micro-batch-size", "1"]) == 2
    )
    assert "multiple of --cp x --tp" in capsys.readouterr().err
    # TP x EP (the trainer runs it since the TP x EP parity test)
    tp_ep = [
        "memory",
        "--preset",
        "tiny",
        "--tp",
        "2",
        "--ep",
        "2",
        "--seq-len",
        "64",
        "--micro-batch-size",
        "1",
    ]
    assert main([*tp_ep, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world"] == 2 and report["layout"] == "DP1 TP2 PP1 CP1 EP2"
    assert sum(report["tp_comm_bytes"].values()) > 0
