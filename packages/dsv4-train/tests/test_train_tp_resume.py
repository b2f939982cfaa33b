"""TP checkpoints from the CLI: ``dsv4 train --tp 2`` (gloo, CPU) saved at step 2 and resumed with ``--resume``, at
the same TP size (both ``--ckpt-format`` values) and at another one (``fully_reshardable``: TP2 -> TP1 and TP1 ->
TP2), fp32 and bf16.

The runs: the CLI's ``main`` with each run's flags, one run after the other in four sets of spawned gloo workers
(:func:`cli_runs.train_in_workers`, one thread per process), so the process start and the imports are paid per set
instead of per run; a resumed run is always in a later set than the run that saved its checkpoint (a fresh process).
``torchrun --nproc-per-node 2`` itself launches the TP2 run initialised from a TP2 checkpoint, the single process
the refused TP change (``test_train_tensor_parallel_combos.py`` checks that a ``torchrun`` launch gives the spawned
run's metrics bit for bit).

Every run trains 3 steps of 2 sequences (pattern ``WECEHE/WE``: DSv4 attention W C H with its heads split,
hash-routed and learned 'E', mHC, one MTP depth) and saves at step 2 and at the end; a resumed run loads the step-2
checkpoint (model, optimizer, LR schedule, data position, RNG) and trains step 3.

* Same TP size: step 3 of the resumed run and its final checkpoint are bitwise those of the uninterrupted run, in
  fp32 and in bf16, in both formats (same processes, same arithmetic): the weights, which took the step-3 update
  from the restored Adam moments, and with ``fully_reshardable`` the fp32 main params and moments themselves
  (``dp_reshardable`` writes flat buffers whose padding is uninitialised memory).
* Another TP size (``fully_reshardable``): the resumed run starts from the saving run's step-2 weights and
  optimizer state, resharded; only the TP summation orders change (row-parallel products, vocab-parallel softmax
  statistics, the TP all-reduce of the sequence-parallel gradients: see ``test_train_tensor_parallel.py``). Its
  step 3 is compared with the uninterrupted runs of both layouts, its final weights with those of the run that
  saved the checkpoint:

  - fp32: the step-3 losses and grad norm within ``2e-5`` relative (the TP test's bound: fp32 sums of ``k <= 512``
    terms in another order, ``512·2**-24 ≈ 3e-5``; measured: within 1.5e-7). The final weights within ``lr·1e-2``
    absolute: one Adam step from the restored moments moves each weight by about ``lr`` at most; the two step-3
    gradients differ by fp32 rounding, which changes the normalized update ``m̂/(√v̂+ε)`` noticeably only where the
    gradient is near zero (measured: max |Δw| ≈ 1.4e-5 = 5e-3·lr, lr = 3e-3). A wrong slice of a weight or of a
    moment moves weights by ``O(lr)`` or more.
  - bf16: the forward runs on the same bf16 weights, each TP-reordered sum rounded to bf16 (unit roundoff
    ``u = 2**-8``) where the other layout rounds the full sum: the losses are bounded by one bf16 rounding of
    themselves, ``|ΔL| <= u·|L|``, and the grad norm by ``u`` relative. The balance and indexer losses are not
    compared in bf16: they follow discrete top-k selections (experts, the indexer's keys) that a bf16 perturbation
    of a near-tie flips (measured: the indexer loss 0.8% off, two bf16 roundings; the parallel matrix compares the
    LM and MTP losses in bf16 for the same reason). The final weights are compared in fp32 only: the bf16 step-3
    gradients differ by bf16 roundings, and Adam's normalized update of a near-zero gradient element then changes
    by ``O(lr)`` (measured: up to 1.2·lr beyond one bf16 ulp), so a bf16 bound loose enough would not tell a wrong
    moment slice (also ``O(lr)``) apart; the bf16 losses of step 3 check the resharded weights.

``--ckpt-format dp_reshardable`` refuses a TP change before loading (its flat optimizer buffers depend on the TP
shard sizes). A TP2 checkpoint initialises a TP1 run (``--init-from``), loads into ``dsv4 generate``'s
single-process model exactly, and ``dsv4 inspect`` reports it like a TP1 checkpoint (fp32 runs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from cli_runs import train_in_workers
from tp_resume_runs import (
    METRICS,
    SAVED_STEP,
    checked,
    checkpoint_tensors,
    final_checkpoint,
    flags,
    metrics,
    resume_dir,
    train,
)
from warm_workers import run_warm

from dsv4_train.cli import main
from dsv4_train.convert_cli import run_model_config
from dsv4_train.inspect_checkpoint import checkpoint_report
from hybrid_model.generation import generate
from hybrid_model.hf import load_megatron_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FORMATS = ("dp_reshardable", "fully_reshardable")
DTYPES = ("fp32", "bf16")
# with --init-from: the first step from a checkpoint's weights
_INIT_FROM = ("--steps", "1", "--no-save-final")
_FP32_REL = 2e-5
_LR = 3e-3  # the tiny preset's default --lr
_FP32_WEIGHT_ATOL = _LR * 1e-2
_BF16_U = 2.0**-8
# compared in bf16 (module docstring: the balance and indexer losses follow discrete top-k selections)
_BF16_KEYS = ("lm_loss", "mtp_loss", "grad_norm")
# loading a checkpoint into another layout does not depend on the precision: these use the fp32 runs only
_FP32_ONLY = pytest.mark.parametrize("runs", ["fp32"], indirect=True)


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory):
    """``{dtype: {name: run directory}}`` (module docstring: every run from the CLI's ``main``), in four sets of
    gloo workers, each run's resumes in a later set than the run that saved it (a fresh process, as after a stop):

    1. one process: the TP1 runs (``fully_reshardable``);
    2. two processes: the uninterrupted TP2 runs in both formats, then TP1 -> TP2 (``tp1-to-tp2``);
    3. one process: TP2 -> TP1 (``tp2-to-tp1``) and the fp32 TP1 run initialised from a TP2 checkpoint;
    4. two processes: each TP2 run's step-2 checkpoint resumed at TP2 (``tp2-FORMAT-resumed``).
    """
    tmp = tmp_path_factory.mktemp("tp-resume")
    out = {dtype: {"dtype": dtype, "tmp": tmp / dtype} for dtype in DTYPES}
    sets: list[tuple[int, list, dict]] = [(1, [], {}), (2, [], {}), (1, [], {}), (2, [], {})]

    def add(
        worker_set: int, dtype: str, name: str, *, tp: int, fmt: str, extra=(), resumes: str | None = None
    ):
        run = out[dtype][name] = out[dtype]["tmp"] / name
        key = f"{dtype}/{name}"
        sets[worker_set][1].append((key, flags(run, tp=tp, dtype=dtype, fmt=fmt, extra=extra)))
        if resumes is not None:
            sets[worker_set][2][key] = str(out[dtype][resumes])

    reshardable = "fully_reshardable"
    for dtype in DTYPES:
        add(0, dtype, "tp1", tp=1, fmt=reshardable)
        for fmt in FORMATS:
            add(1, dtype, f"tp2-{fmt}", tp=2, fmt=fmt)
        add(1, dtype, "tp1-to-tp2", tp=2, fmt=reshardable, extra=("--resume",), resumes="tp1")
        add(2, dtype, "tp2-to-tp1", tp=1, fmt=reshardable, extra=("--resume",), resumes=f"tp2-{reshardable}")
        for fmt in FORMATS:
            add(3, dtype, f"tp2-{fmt}-resumed", tp=2, fmt=fmt, extra=("--resume",), resumes=f"tp2-{fmt}")
    src = out["fp32"]["tp2-dp_reshardable"] / "checkpoints" / f"iter_{SAVED_STEP:07d}"
    init = ("--init-from", str(src), *_INIT_FROM)
    add(2, "fp32", "init-tp1", tp=1, fmt="dp_reshardable", extra=init)
    for world, runs_of_set, resumes in sets:
        per_rank = run_warm(train_in_workers, world, runs_of_set, resumes, timeout=1800)
        assert all(r == per_rank[0] for r in per_rank)  # every rank read the same metrics.jsonl
    return out


@pytest.fixture(scope="module", params=DTYPES)
def runs(request, all_runs):
    """``{name: run directory}`` of one dtype: uninterrupted TP2 runs in both formats and a TP1 run
    (``fully_reshardable``), each one's step-2 checkpoint resumed at its own TP size (``tp2-FORMAT-resumed``) and,
    for ``fully_reshardable``, at the other one (``tp2-to-tp1``, ``tp1-to-tp2``); ``dtype`` and ``tmp``."""
    return all_runs[request.param]


@pytest.mark.parametrize("fmt", FORMATS)
def test_same_tp_resume_is_bitwise(runs, fmt):
    full, resumed = runs[f"tp2-{fmt}"], runs[f"tp2-{fmt}-resumed"]
    got, ref = metrics(resumed), metrics(full)
    assert sorted(got) == [SAVED_STEP + 1] and sorted(ref) == [1, 2, 3]
    for key in (*METRICS, "lr"):
        assert got[3][key] == ref[3][key], (fmt, key, got[3][key], ref[3][key])
    if fmt == "fully_reshardable":  # the format changes what is written, not the training
        other = metrics(runs["tp2-dp_reshardable"])
        assert all(other[s][k] == ref[s][k] for s in ref for k in METRICS)
    # fully_reshardable: the optimizer state too (per parameter); dp_reshardable writes flat buffers whose padding
    # is uninitialised memory: its weights only, which took the step-3 update from the restored moments
    whole = fmt == "fully_reshardable"
    scratch = runs["tmp"] / "scratch.pt"
    a = checkpoint_tensors(final_checkpoint(full), scratch, model_only=not whole)
    b = checkpoint_tensors(final_checkpoint(resumed), scratch, model_only=not whole)
    assert sorted(a) == sorted(b)
    assert any(k.startswith("chained") for k in a) == whole
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.parametrize("direction", ("tp2-to-tp1", "tp1-to-tp2"))
def test_resume_at_another_tp_size_continues_the_saved_run(runs, direction):
    tp2 = runs["tp2-fully_reshardable"]
    saved_by, runs_at = (tp2, runs["tp1"]) if direction == "tp2-to-tp1" else (runs["tp1"], tp2)
    got = metrics(runs[direction])
    assert sorted(got) == [SAVED_STEP + 1]
    bf16 = runs["dtype"] == "bf16"
    rel = _BF16_U if bf16 else _FP32_REL
    keys = _BF16_KEYS if bf16 else METRICS
    # the run it continues (same step-2 state) and the uninterrupted run of the layout it now runs at
    for ref in (metrics(saved_by), metrics(runs_at)):
        assert got[3]["lr"] == ref[3]["lr"]
        for key in keys:
            assert abs(got[3][key] - ref[3][key]) <= rel * abs(ref[3][key]), (direction, key, got[3], ref[3])
    if bf16:
        return  # final weights: fp32 only (module docstring)
    scratch = runs["tmp"] / "scratch.pt"
    a = checkpoint_tensors(final_checkpoint(saved_by), scratch, model_only=True)
    b = checkpoint_tensors(final_checkpoint(runs[direction]), scratch, model_only=True)
    assert sorted(a) == sorted(b)
    worst = {k: float(((a[k] - b[k]).abs() - _FP32_WEIGHT_ATOL).max()) for k in a}
    assert [k for k, w in worst.items() if w > 0] == [], sorted(worst.items(), key=lambda kv: -kv[1])[:5]


@_FP32_ONLY
def test_dp_reshardable_refuses_another_tp_size(runs):
    """Before loading: rc 2 and one line naming the layouts and the way out."""
    out = resume_dir(runs["tp2-dp_reshardable"], runs["tmp"] / "refused")
    proc = train(out, tp=1, dtype="fp32", fmt="dp_reshardable", extra=("--resume",))
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [line for line in proc.stderr.splitlines() if line.startswith("dsv4 train: error:")]
    assert len(err) == 1 and "(PP, TP, EP) = (1, 2, 1)" in err[0] and "fully_reshardable" in err[0], err
    log = out / "metrics.jsonl"
    assert not log.exists() or not log.read_text().strip()  # no step was trained


@_FP32_ONLY
def test_init_from_a_tp2_checkpoint_at_tp1(runs):
    """``--init-from`` a TP2 checkpoint: the first step at TP1 equals the first step at TP2 from the same weights
    (the TP bound)."""
    src = runs["tmp"] / "tp2-dp_reshardable" / "checkpoints" / f"iter_{SAVED_STEP:07d}"
    out = runs["tmp"] / "init-tp2"  # torchrun --nproc-per-node 2; the TP1 run is one of the fixture's
    extra = ("--init-from", str(src), *_INIT_FROM)
    checked(train(out, tp=2, dtype=runs["dtype"], fmt="dp_reshardable", extra=extra))
    first = {1: metrics(runs["init-tp1"])[1], 2: metrics(out)[1]}
    assert sorted(metrics(out)) == sorted(metrics(runs["init-tp1"])) == [1]
    for key in METRICS:
        assert abs(first[1][key] - first[2][key]) <= _FP32_REL * abs(first[2][key]), (key, first)


@_FP32_ONLY
def test_generate_and_inspect_read_a_tp2_checkpoint(runs, megatron_cpu, capsys):
    """``dsv4 generate``'s loader puts every tensor of a TP2 run's checkpoint into the single-process model
    unchanged, and ``dsv4 generate`` from the run directory gives that model's tokens; ``dsv4 inspect`` reports a
    TP2 checkpoint like a TP1 one."""
    run = runs["tp2-fully_reshardable"]
    path = final_checkpoint(run)
    model = load_megatron_checkpoint(run, model_config=run_model_config(path))
    saved = checkpoint_tensors(path, runs["tmp"] / "scratch.pt", model_only=True)
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert sorted(state) == sorted(saved)
    assert [k for k in saved if not torch.equal(state[k], saved[k].to(state[k].dtype))] == []
    capsys.readouterr()
    argv = ["generate", "--checkpoint", str(run), "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["ids"] == generate(model, [[5, 6, 7]], 4)
    # inspect reads a dist checkpoint's file list and model config only: the same report but for the files
    tp2, tp1 = checkpoint_report(path), checkpoint_report(final_checkpoint(runs["tp1"]))
    same = ("format", "model")
    assert "PP/TP/EP/DP" in tp2["format"] and {k: tp2[k] for k in same} == {k: tp1[k] for k in same}
