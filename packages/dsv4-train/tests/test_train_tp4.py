"""``--tp 4`` from the CLI (issue 31): ``dsv4 train --tp 4`` on 4 gloo processes (the CLI's ``main`` as ``torchrun``
would run it, below; CPU, sequence parallelism, micro-batches of one sequence) trains like one process from the same ``--seed``, and a TP1
checkpoint (``--ckpt-format fully_reshardable``) resumes at TP4 like the one-process continuation.

The model: the ``tiny`` preset has ``o_groups=2`` (DSv4 attention's grouped output projection, whole groups per TP
rank), so ``--tp 4`` is refused on it; a ``--config`` file with ``model_overrides {"o_groups": 4}`` (4 groups of
one head each) is the whole change TP4 needs (hybrid-model's ``tensor_parallel_sizes``: the vocabulary 512, the
shared experts' and '-' MLP's intermediate size 32 split over 4 already; the shared KV head, the compressors and
the indexer are replicated). Pattern ``WEC-HE/WE``: DSv4 attention W C H with its heads split, hash-routed (the
first two) and learned 'E', megatron's '-' MLP, mHC, one MTP depth, as the TP2 test. 3 steps of 2 sequences of 64
tokens (16 rows per TP rank).

Five runs, shared by the tests: one process fp32, saving at step 2 (``fully_reshardable``) and at the end, and one
process bf16 (one after the other in one process); then ``--tp 4`` fp32, ``--tp 4 --resume`` of the one-process
step-2 checkpoint (TP1 -> TP4) and ``--tp 4`` bf16 one after the other in one set of 4 spawned gloo processes
(:func:`cli_runs.train_in_workers`: the CLI's ``main`` with those flags, as ``torchrun`` would run it, without paying
the process start and imports per run; ``test_train_tensor_parallel_combos.py`` checks that a ``torchrun`` launch
gives the same metrics bit for bit). One thread per process.

Bounds (fp32): TP4 changes the summation order of the row-parallel products (``linear_proj``, ``linear_fc2``, the
shared expert's ``linear_down``, DSv4 attention's ``wo_b``: four partial sums of ``k/4`` terms, added by the
reduce-scatter), of the vocab-parallel softmax statistics (four vocabulary shards), of the indexer loss's per-rank
partials and of the replicated parameters' gradients (four sequence shards summed by the TP all-reduce). Each is
still an fp32 sum of the same ``k`` terms, bracketed otherwise: any bracketing of a sum of ``k`` terms is within
``(k-1)·u·Σ|x_i|`` of the exact sum (``u = 2**-24``), whatever the number of partial sums, so the TP2 rule holds
unchanged: for ``k <= 512`` terms of one sign ``512·u ≈ 3e-5`` relative worst case, rounding errors of random
sign add up to about ``√k·u``; the losses and the grad norm are compared at ``2e-5`` relative (``cli_runs.
FP32_REL``, as the TP2 test and the parallel matrix; measured: the LM / MTP / balance / indexer losses within 2e-7
relative, the grad norm within 2.3e-7, at all 3 steps). bf16: ``cli_runs.assert_bf16_parity`` (within twice the
single process's own bf16-vs-fp32 deviation per metric, derived in ``test_train_tensor_context_parallel.py``).

Resume (TP1 -> TP4): the resumed run loads the single process's step-2 weights, fp32 main params and Adam moments,
resharded over 4 TP ranks, and trains step 3: step 3 is compared with the single process's step 3 (the run it
continues) and with the uninterrupted TP4 run's (the layout it runs at) within ``2e-5`` relative, its final weights
with the single process's within ``lr·1e-2`` absolute (the derivation of ``test_train_tp_resume.py``: one Adam
step moves a weight by about ``lr`` at most, fp32 gradient rounding changes the normalized update noticeably only
where the gradient is near zero; a wrong slice of a weight or a moment moves weights by ``O(lr)``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from cli_runs import PARITY_KEYS, assert_bf16_parity, assert_fp32_parity, train_in_workers
from tp_resume_runs import SAVED_STEP, checkpoint_tensors, final_checkpoint, resume_dir
from warm_workers import run_warm

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

#: the model TP4 splits: the tiny preset with 4 output-projection groups (module docstring), given as users give it
MODEL = {"model": {"model_overrides": {"o_groups": 4}}}
_ARGS = [
    "--preset", "tiny", "--pattern", "WEC-HE/WE", "--seed", "11", "--steps", "3", "--seq-len", "64",
    "--global-batch-size", "2", "--micro-batch-size", "1", "--no-progress",
]  # fmt: skip
_TP4 = ["--tp", "4"]
_LR = 3e-3  # the tiny preset's default --lr
_FP32_WEIGHT_ATOL = _LR * 1e-2


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """``{name: metrics rows}`` of the five runs (module docstring) and ``{name}-dir``: their run directories."""
    tmp = tmp_path_factory.mktemp("tp4")
    config = tmp / "tp4-model.json"
    config.write_text(json.dumps(MODEL))
    args = [*_ARGS, "--config", str(config)]
    fp32, bf16, no_save = ["--no-bf16"], ["--bf16"], ["--no-save-final"]
    saving = ["--save-interval", str(SAVED_STEP), "--ckpt-format", "fully_reshardable"]
    out: dict = {"tmp": tmp, "one-dir": tmp / "one"}
    one = [
        ("one", [*args, *fp32, *saving, "--out", str(out["one-dir"])]),
        ("one-bf16", [*args, *bf16, *no_save, "--out", str(tmp / "one-bf16")]),
    ]
    out |= run_warm(train_in_workers, 1, one, timeout=1800)[0]
    out["tp1-to-tp4-dir"] = resume_dir(out["one-dir"], tmp / "tp1-to-tp4")
    resume = ["--ckpt-format", "fully_reshardable", "--resume", "--out", str(out["tp1-to-tp4-dir"])]
    tp4 = [
        ("tp4", [*args, *fp32, *_TP4, *no_save, "--out", str(tmp / "tp4")]),
        ("tp1-to-tp4", [*args, *fp32, *_TP4, *resume]),
        ("tp4-bf16", [*args, *bf16, *_TP4, *no_save, "--out", str(tmp / "tp4-bf16")]),
    ]
    per_rank = run_warm(train_in_workers, 4, tp4, timeout=2400)
    assert all(r == per_rank[0] for r in per_rank)  # every rank read the same metrics.jsonl
    return out | per_rank[0]


def _same_steps(got: list[dict], one: list[dict], steps: list[int]) -> None:
    assert [m["step"] for m in one] == [m["step"] for m in got] == steps
    for g, r in zip(got, one, strict=True):
        assert g["lr"] == r["lr"]
        assert all(g[key] is not None and r[key] is not None for key in PARITY_KEYS)


def test_tp4_from_the_cli_trains_like_one_process_fp32(runs):
    """Steps 1-3 of ``--tp 4`` within ``2e-5`` relative of one process (module docstring)."""
    _same_steps(runs["tp4"], runs["one"], [1, 2, 3])
    assert_fp32_parity(runs["tp4"], runs["one"])


def test_tp4_from_the_cli_trains_like_one_process_bf16(runs):
    """Steps 1-3 of ``--tp 4 --bf16`` within the bf16 bound of one bf16 process (module docstring)."""
    _same_steps(runs["tp4-bf16"], runs["one-bf16"], [1, 2, 3])
    assert_bf16_parity(runs["tp4-bf16"], runs["one-bf16"], runs["one"])


def test_tp1_checkpoint_resumes_at_tp4_like_the_one_process_continuation(runs):
    """A TP1 ``fully_reshardable`` step-2 checkpoint resumed by ``--tp 4``: step 3 within ``2e-5`` of the single
    process's and the uninterrupted TP4 run's, final weights within ``lr·1e-2`` of the single process's."""
    (got,) = runs["tp1-to-tp4"]
    assert got["step"] == SAVED_STEP + 1
    for ref in (runs["one"][SAVED_STEP], runs["tp4"][SAVED_STEP]):
        _same_steps([got], [ref], [SAVED_STEP + 1])
        assert_fp32_parity([got], [ref])
    scratch = runs["tmp"] / "scratch.pt"
    a = checkpoint_tensors(final_checkpoint(runs["one-dir"]), scratch, model_only=True)
    b = checkpoint_tensors(final_checkpoint(runs["tp1-to-tp4-dir"]), scratch, model_only=True)
    assert sorted(a) == sorted(b) and a
    worst = {k: float(((a[k] - b[k]).abs() - _FP32_WEIGHT_ATOL).max()) for k in a}
    assert [k for k, w in worst.items() if w > 0] == [], sorted(worst.items(), key=lambda kv: -kv[1])[:5]
