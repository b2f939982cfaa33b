"""``--tp`` from the CLI (issue 31): ``torchrun --nproc-per-node 2 -m dsv4_train train --tp 2`` (gloo, CPU, sequence
parallelism, micro-batches of one sequence) on a pattern of DSv4 attention ``W C H`` (its heads split by
dsv4-attention's TP core), megatron's MLP ``-``, DSv4 MoE ``E`` (hash-routed and learned), mHC and one MTP depth
starts from the single process's model and batches: its first step is the single process's first step (LM / MTP /
balance / indexer losses and the grad norm). Megatron's ``*`` under TP (one attention family per model, so another
pattern) is covered at the model level (hybrid-model ``tests/test_tensor_parallel.py``, ``*E-E/*E``). ``--tp`` with
micro-batches of more than one sequence is refused with the support table's reason, before any work.

Both runs use one thread per process (the single process is given ``OMP_NUM_THREADS=1`` too: the CPU GEMMs'
blocking, and so their rounding, depends on the thread count).

Bounds (fp32): TP changes the summation order of the row-parallel products (``linear_proj``, ``linear_fc2``, the
shared expert's ``linear_down``, DSv4 attention's ``wo_b``: two partial sums of ``k/2`` terms added by the
reduce-scatter), of the vocab-parallel softmax statistics, of the indexer loss's per-rank partials and of the
replicated parameters' gradients (two sequence shards summed by the TP all-reduce). Each is an fp32 sum of ``k <=
512`` terms in another order: within ``k·u`` relative (``u = 2**-24``, ``512·u ≈ 3e-5``) of its value; the losses
and the grad norm are compared at ``2e-5`` relative as the parallel matrix does (measured with this pattern: the LM
loss within 2e-8, the grad norm within 4e-7, the indexer loss within 1e-7 relative).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsv4_train.cli import main
from dsv4_train.config import TrainConfig
from dsv4_train.support import RELATIONS

_ARGS = [
    "--preset", "tiny", "--pattern", "WEC-HE/WE", "--seed", "11", "--no-bf16", "--steps", "1", "--seq-len", "64",
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
    for key in ("lm_loss", "mtp_loss", "grad_norm", "balance_loss", "indexer_loss"):
        assert tp[key] == pytest.approx(one[key], rel=_REL), (key, tp[key], one[key])


def test_tp_refuses_micro_batches_of_several_sequences(tmp_path, capsys):
    """DSv4 attention's TP layout covers ``[S, 1]`` micro-batches: ``--tp 2`` with the default micro-batch of 4
    sequences stops before any work (rc 2, one line: the support table's reason)."""
    rc = main(["train", "--preset", "tiny", "--tp", "2", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    rel = next(r for r in RELATIONS if r.features == ("tp", "micro_batch"))
    assert rc == 2
    assert err == [
        f"dsv4 train: error: {rel.reason.format(**{**TrainConfig.from_flat().flat(), 'tp': 2}, dp=1)}"
    ]
    assert not (tmp_path / "run").exists()
