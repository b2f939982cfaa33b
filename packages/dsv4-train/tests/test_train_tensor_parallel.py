"""``--tp`` from the CLI (issue 31): ``torchrun --nproc-per-node 2 -m dsv4_train train --tp 2`` (gloo, CPU, sequence
parallelism) on a pattern of megatron's attention ``*``, DSv4 MoE ``E`` (hash-routed and learned), mHC and one MTP
depth starts from the single process's model and batches: its first step is the single process's first step.
DSv4 attention (the tiny preset's ``W C H``) refuses TP with its symbol record's reason, before any work.

Both runs use one thread per process (the single process is given ``OMP_NUM_THREADS=1`` too: the CPU GEMMs'
blocking, and so their rounding, depends on the thread count).

Bounds (fp32): TP changes the summation order of the row-parallel products (``linear_proj``, ``linear_fc2``, the
shared expert's ``linear_down``: two partial sums of ``k/2`` terms added by the reduce-scatter), of the vocab-parallel
softmax statistics and of the replicated parameters' gradients (two sequence shards summed by the TP all-reduce).
Each is an fp32 sum of ``k <= 512`` terms in another order: within ``k·u`` relative (``u = 2**-24``, ``512·u ≈
3e-5``) of its value; the losses and the grad norm are compared at ``2e-5`` relative as the parallel matrix does
(measured: the LM and MTP losses bitwise, the grad norm within ``3e-7``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsv4_train.cli import main
from hybrid_model.mixers.record import Layout
from hybrid_model.mixers.registry import REGISTRY

_ARGS = [
    "--preset", "tiny", "--pattern", "*E*E/*E", "--seed", "11", "--no-bf16", "--steps", "1", "--seq-len", "64",
    "--global-batch-size", "4", "--micro-batch-size", "1", "--no-progress", "--no-save-final",
]  # fmt: skip
_REL = 2e-5


def _first_step(cmd: list[str], out, env, *layout: str) -> dict:
    proc = subprocess.run(
        [*cmd, "train", *_ARGS, *layout, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_from_the_cli_starts_like_one_process(tmp_path):
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    one = _first_step([sys.executable, "-m", "dsv4_train"], tmp_path / "one", env)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    tp = _first_step([*torchrun, "-m", "dsv4_train"], tmp_path / "tp", env, "--tp", "2")
    assert one["step"] == tp["step"] == 1
    for key in ("lm_loss", "mtp_loss", "grad_norm", "balance_loss"):
        assert tp[key] == pytest.approx(one[key], rel=_REL), (key, tp[key], one[key])


def test_dsv4_attention_refuses_tp_with_its_record_reason(tmp_path, capsys):
    """The tiny preset's pattern holds ``W C H``: ``--tp 2`` stops before any work (rc 2, one line)."""
    rc = main(["train", "--preset", "tiny", "--tp", "2", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == [f"dsv4 train: error: --tp 2: {REGISTRY['C'].message(Layout.TP)}"]
    assert not (tmp_path / "run").exists()
