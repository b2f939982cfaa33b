"""``dsv4 train --cp 2`` on CPU (gloo) trains the tiny preset like ``--cp 1`` on the same global batch.

Runs (every run starts from the single-process reference's initial weights: the ``--cp 2`` ``[B, S]`` runs build
them from ``--seed`` as users do (layout-independent initialisation, checked bitwise), the others read the
reference's step-0 checkpoint through ``init_from``):

* 1 process: the references ``--cp 1`` for packed THD and ``[B, S]`` batches, fp32 and bf16 (4 documents of up to
  256 tokens per global batch, 2 steps; ``[B, S]``: micro-batches of 2 rows), and for each batch format the fp32
  twin of the bf16 run (fp32 on the bf16 runs' schedule, below), from which the bf16 bounds are derived.
* 2 processes: ``--cp 2`` (DP 1) for the same four runs. Each CP rank holds 128 contiguous rows of every pack
  (documents cross the rank boundary; ``[B, S]`` micro-batches run as a THD pack of 2 documents of 256 tokens).
  The fp32 packed run also saves its step-1 and step-2 checkpoints.
* 4 processes, one world for every case: ``--cp 2 --pp 2`` and ``--cp 2 --ep 2`` (packed, fp32 and bf16),
  ``--cp 2`` with DP 2 (``[B, S]``, fp32: each DP replica one micro-batch of 2 rows, split over its 2 CP ranks), and
  the resume of the ``--cp 2`` step-1 checkpoint at ``--cp 1`` (DP 4) and at ``--cp 4`` (64 rows per rank), each
  saving its step-2 checkpoint.

Schedules (megatron's linear warm-up starts at rate 0): the fp32 runs pass ``warmup_steps=0``, so step 1 updates
at the full rate and step 2 runs the weights the first step's reduced gradients produced through AdamW: step 2's
metrics check those gradients (CP, DP x CP reductions, the pipeline's backward, the distributed optimizer's
shards) through the optimizer too. The bf16 runs keep ``warmup_steps=1`` (step 1's rate is 0, so their step 2 runs
the initial weights on the second batch) and their bounds come from the fp32 twin of that schedule: after a
full-rate first AdamW step (an update of about ``lr·sign(g)`` per element) bf16 rounding flips the sign of small
gradients, and a layout's deviation from one process is no longer of the size of the one-process bf16 run's own
(test_train_tp_cp_pp_dp.py measured it 1.4 times that for the indexer loss, beyond ``2·δ``).

What is compared: every metric of both steps (LM, MTP, balance and indexer losses, grad norm, LR; each the global
value, identical on every rank) and the first step's reduced gradient of every parameter.

fp32: to ``2e-5`` relative (the parallel matrix's bound: fp32 sums in another order — the CP attention's gathers and
halo rows, the loss partials summed over CP, DDP's reduction over DP x CP).

bf16 (the bound of ``test_parallel_matrix``, re-derived for CP):

* losses: a CP run makes the same bf16 roundings as the single-process run, of the same magnitudes, in another
  order (each rank's rows, the gathered compressed entries), so its deviation from the fp32 run is of the size of the
  single-process bf16 run's own deviation ``δ = max_step |L_bf16 - L_fp32|`` (``L_fp32``: the fp32 twin, the same
  schedule, so the same weights at both steps); by the triangle inequality ``|L_cp - L_ref| <= 2·δ``
  (``test_parallel_matrix._bf16_loss_bound``).
* gradients, two effects added: (1) per micro-batch a weight gradient is one bf16 GEMM output over all rows at
  CP=1, and two bf16 GEMM outputs over half the rows each (summed in fp32 by the DP x CP reduction) at CP=2: at most
  two bf16 roundings of at most ``max|g_ref|`` per micro-batch, accumulated over at most ``M = 4`` micro-batches in
  fp32: ``2·M·u·max|g_ref|`` with ``u = 2**-8``; (2) unlike DP/PP, CP changes the forward arithmetic (each rank's
  rows, the gathered compressed entries), so the bf16 activations the gradients are made of round differently. Some
  gradients are sums over all tokens of terms that nearly cancel (mHC's ``base`` / ``scale``: ``max|g|`` ~ 5e-7), so
  this is not bounded relative to ``max|g_ref|``. As for the losses, we bound it by bf16 rounding itself: the
  single-process bf16 gradient deviates from the fp32 twin's by ``δ_g = max|g_bf16 - g_fp32|`` (per tensor,
  measured; the first step's gradients precede any update, so they are the same under either schedule);
  a CP bf16 run makes the same roundings in another order, so by the triangle inequality it stays within ``2·δ_g``.
  Bound per tensor: ``max|g - g_ref| <= 2·δ_g + 2·M·u·max|g_ref|``.
* CP2 x PP2 and CP2 x EP2: the same loss bound ``2·δ``. PP adds no rounding to the forward (the mHC streams cross
  stages in fp32); EP's grouped expert GEMMs see another set of rows and round them in another order, which is
  again the same bf16 roundings of the same magnitudes, so the triangle-inequality argument holds unchanged.
  Gradients: the CP bound plus the one bf16 rounding per micro-batch that PP and EP add in ``test_parallel_matrix``
  (PP: the word embedding's main-head and MTP contributions summed in fp32 across stages instead of in bf16 on one
  stage; EP: a rounding per expert GEMM output over another row grouping): ``2·δ_g + (2 + 1)·M·u·max|g_ref|``.

Resume (fp32): the checkpoint is CP-agnostic (weights, ``dp_reshardable`` optimizer state: fp32 main params and
Adam moments in flat buffers whose checkpoint form drops the padding to a DP multiple, so the same elements at
every DP x CP size; scheduler, data position); only the layout of step 2 differs. Step 1 updated at the full rate,
so the saved state differs from the initial one.

* The step-2 metrics of the ``--cp 1`` and ``--cp 4`` resumes equal the uninterrupted ``--cp 2`` run's to the fp32
  bound above. They come from the forward and backward before step 2's update, so they check the resumed weights
  (and, through the grad norm, step 2's reduced gradients), not the optimizer state.
* The optimizer state, from the step-2 checkpoints: both runs take step 2's AdamW update from the same saved
  step-1 state ``(P1, m1, v1)`` with their own gradients ``g``. Without knowing ``g``, (a) ``g' = (m2' - b1·m1) /
  (1 - b1)`` from the saved ``m1`` predicts the resumed ``v2' = b2·v1 + (1 - b2)·g'²`` within ``1e-6`` relative
  per flat buffer, and (b) the resumed main params satisfy ``P2' - P2 = -lr·(U(m2', v2') - U(m2, v2))``
  elementwise within ``2·ulp(P2) + 16·2**-24·lr·(|U'| + |U|)`` (``U`` AdamW's normalized update with step 2's bias
  corrections, ``P2`` the uninterrupted run's; the derivation of test_train_tp4_ckpt.py,
  :func:`tp_resume_runs.assert_adam_step_continues`): moments that are not the saved ones miss (a) by O(1), main
  params that are not the saved ones miss (b) by far more than its ulp-sized bound, a wrong Adam step count
  changes ``U``'s bias corrections. The flat buffers' alignment gaps are left out: megatron writes them from
  ``torch.empty`` (arbitrary values, NaN included, different in every checkpoint;
  :func:`tp_resume_runs.bucket_masks` finds the parameters' elements as the fp32 weights' copies in the main
  params).
* The final weights within ``lr·1e-2`` of the uninterrupted run's (test_train_tp4.py's derivation: from the same
  state, one Adam step moves a weight by about ``lr`` at most and fp32 gradient reordering changes the normalized
  update noticeably only where the gradient is near zero).

Measured (CPU): fp32, every cell's step 2 (after the full-rate step 1) within 3.1e-7 relative of one process
(step 1: 1.6e-7); bf16, the LM / MTP losses within 4.2e-7 of the one-process bf16 run (``2·δ`` = 1.9e-4), the
gradients at most 0.37 of their bound. Resumes: step-2 metrics within 7e-8 relative; (a) 7.3e-8 (bound 1e-6); (b)
0.50 of its bound; final weights within 1.5e-6 (bound 3e-5). Tampered resumes (scratch runs) that still pass the
step-2 metrics (within 4.7e-7): the loaded Adam moments halved miss (a) by 0.41 (4e5 times its bound) and the
weights by 5.2e-4 (17 times); the loaded main params scaled by ``1 + 2**-20`` miss (b) 8.5 times.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from parallel_runs import METRIC_KEYS, merge_rank_grads, train_layouts
from test_parallel_matrix import _BF16_U, _bf16_loss_bound
from tp_resume_runs import assert_adam_step_continues, checkpoint_tensors, final_checkpoint
from warm_workers import run_warm

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

_LR = 3e-3
_BASE = dict(seq_len=256, global_batch_size=4, lr=_LR, steps=2)
FORMATS = {"packed": dict(packed=True), "bs": dict(micro_batch_size=2)}
DTYPES = ("fp32", "bf16")
# fp32: step 1 at the full rate; bf16: megatron's warm-up from rate 0 (step 1 does not move the weights)
_WARMUP = {"fp32": 0, "bf16": 1}
# the one-process fp32 twins of the bf16 runs (their schedule), from which the bf16 bounds are derived
TWIN = "twin"
# the resumed runs' final weights against the uninterrupted run's (module docstring)
_FP32_WEIGHT_ATOL = _LR * 1e-2
_MICRO_BATCHES = 4  # at most 4 micro-batches per step (4 documents)
_FP32_REL = 2e-5
# 4-process cells (packed, fp32 and bf16): (name, layout)
CELLS4 = {"cp2xpp2": dict(cp=2, pp=2), "cp2xep2": dict(cp=2, ep=2)}
# bf16 roundings per micro-batch that PP / EP add to a gradient (module docstring)
_EXTRA_ROUNDINGS4 = 1
# resumes of the --cp 2 step-1 checkpoint in the 4-process world: (name, CP size; DP is the rest)
RESUMES = {"resume-cp1": 1, "resume-cp4": 4}


def _kw(fmt: str, dt: str, out: Path, **extra) -> dict:
    """``dt``: ``fp32``, ``bf16`` or :data:`TWIN` (fp32 on the bf16 runs' schedule)."""
    warmup = _WARMUP["bf16" if dt == TWIN else dt]
    return dict(_BASE, bf16=dt == "bf16", warmup_steps=warmup, out=str(out)) | FORMATS[fmt] | extra


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run, computed once for the module: ``{"ref": {...}, "cp2": {...}, "world4": [...]}``."""
    tmp = tmp_path_factory.mktemp("cp")
    names = [(f, d) for f in FORMATS for d in DTYPES]
    ref_runs = [(f"{f}-{d}", _kw(f, d, tmp / f"ref-{f}-{d}")) for f, d in names]
    ref_runs += [(f"{f}-{TWIN}", _kw(f, TWIN, tmp / f"ref-{f}-{TWIN}")) for f in FORMATS]
    (ref,) = run_warm(train_layouts, 1, ref_runs, True, timeout=900)
    init = {key: str(tmp / f"ref-{key}" / "checkpoints" / "iter_0000000") for key in ref}
    for key in ref:
        ref[key]["grads"] = merge_rank_grads([ref[key]["grads"]])
        ref[key]["initial"] = merge_rank_grads([ref[key]["initial"]])
    cp2_runs = [
        (
            f"{f}-{d}",
            _kw(f, d, tmp / f"cp2-{f}-{d}", cp=2, **({} if f == "bs" else {"init_from": init[f"{f}-{d}"]}))
            | (dict(save_interval=1) if (f, d) == ("packed", "fp32") else {}),
        )
        for f, d in names
    ]
    cp2 = run_warm(train_layouts, 2, cp2_runs, timeout=1800)
    world4_runs = [
        (f"{name}-{d}", _kw("packed", d, tmp / f"{name}-{d}", init_from=init[f"packed-{d}"]) | layout)
        for name, layout in CELLS4.items()
        for d in DTYPES
    ]
    world4_runs.append(("cp2xdp2", _kw("bs", "fp32", tmp / "cp2xdp2", cp=2, init_from=init["bs-fp32"])))
    for name, cp in RESUMES.items():
        # the CP=2 step-1 checkpoint as the newest one of a fresh run directory, resumed at CP=1 (DP=4) / CP=4
        dst = tmp / name / "checkpoints"
        shutil.copytree(tmp / "cp2-packed-fp32" / "checkpoints" / "iter_0000001", dst / "iter_0000001")
        (dst / "latest").write_text("iter_0000001")
        world4_runs.append((name, _kw("packed", "fp32", tmp / name, resume=True, cp=cp, save_final=True)))
    world4 = run_warm(train_layouts, 4, world4_runs, timeout=1800)
    return {"ref": ref, "cp2": cp2, "world4": world4, "tmp": tmp}


def _check_fp32(got_ranks: list[dict], ref: dict, cell: str) -> None:
    metrics = [r["metrics"] for r in got_ranks]
    assert all(m == metrics[0] for m in metrics), "every metric is the global value on every rank"
    got = metrics[0]
    assert len(got) == len(ref["metrics"]) == _BASE["steps"]
    for step, (g, r) in enumerate(zip(got, ref["metrics"], strict=True), start=1):
        for key in METRIC_KEYS:
            assert r[key] is not None, key
            assert g[key] == pytest.approx(r[key], rel=_FP32_REL, abs=1e-7), (cell, step, key, g[key], r[key])
    grads = merge_rank_grads([r["grads"] for r in got_ranks])
    assert set(grads) == set(ref["grads"])
    for name, g_ref in ref["grads"].items():
        err = float((grads[name] - g_ref).abs().max())
        assert err <= _FP32_REL * float(g_ref.abs().max()) + 1e-9, (cell, name, err)


def _check_bf16(
    got_ranks: list[dict], ref: dict, ref_fp32: dict, cell: str, extra_roundings: int = 0
) -> None:
    """Losses within ``2·δ``, gradients within ``2·δ_g + (2 + extra_roundings)·M·u·max|g_ref|`` (module
    docstring); ``ref_fp32``: the one-process fp32 twin of ``ref`` (same schedule)."""
    metrics = [r["metrics"] for r in got_ranks]
    assert all(m == metrics[0] for m in metrics), "every metric is the global value on every rank"
    bound = _bf16_loss_bound({"fp32": ref_fp32, "bf16": ref})
    for step, (g, r) in enumerate(zip(metrics[0], ref["metrics"], strict=True), start=1):
        for key in ("lm_loss", "mtp_loss"):
            assert abs(g[key] - r[key]) <= bound, (cell, step, key, g[key], r[key], bound)
        assert g["lr"] == r["lr"]
    grads = merge_rank_grads([r["grads"] for r in got_ranks])
    assert set(grads) == set(ref["grads"])
    roundings = 2 + extra_roundings
    for name, g_ref in ref["grads"].items():
        err = float((grads[name] - g_ref).abs().max())
        delta = float((g_ref - ref_fp32["grads"][name]).abs().max())  # single-process bf16 vs fp32
        bound = 2 * delta + roundings * _MICRO_BATCHES * _BF16_U * float(g_ref.abs().max())
        assert err <= bound, (cell, name, err, bound)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_cp2_matches_cp1(runs, fmt, dtype):
    ref = runs["ref"][f"{fmt}-{dtype}"]
    per_rank = [r[f"{fmt}-{dtype}"] for r in runs["cp2"]]
    if fmt == "bs":  # built from --seed: the single-process model, bit for bit
        initial = merge_rank_grads([r["initial"] for r in per_rank])
        assert [n for n, p in ref["initial"].items() if not torch.equal(initial[n], p)] == []
    if dtype == "fp32":
        _check_fp32(per_rank, ref, f"cp2-{fmt}")
    else:
        _check_bf16(per_rank, ref, runs["ref"][f"{fmt}-{TWIN}"], f"cp2-{fmt}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", list(CELLS4))
def test_cp2_with_pp2_or_ep2_matches_cp1(runs, cell, dtype):
    per_rank = [r[f"{cell}-{dtype}"] for r in runs["world4"]]
    ref = runs["ref"][f"packed-{dtype}"]
    if dtype == "fp32":
        _check_fp32(per_rank, ref, cell)
    else:
        _check_bf16(per_rank, ref, runs["ref"][f"packed-{TWIN}"], cell, _EXTRA_ROUNDINGS4)


def test_cp2_with_dp2_matches_cp1(runs):
    _check_fp32([r["cp2xdp2"] for r in runs["world4"]], runs["ref"]["bs-fp32"], "cp2xdp2")


@pytest.mark.parametrize("resume", list(RESUMES))
def test_resume_cp2_checkpoint_at_another_cp_gives_the_same_next_step_loss(runs, resume):
    full = runs["cp2"][-1]["packed-fp32"]["metrics"]
    got = runs["world4"][-1][resume]["metrics"]
    assert [m["step"] for m in full] == [1, 2] and [m["step"] for m in got] == [2]
    for key in ("lm_loss", "mtp_loss", "balance_loss", "indexer_loss"):
        g, f = got[0][key], full[1][key]
        assert g == pytest.approx(f, rel=_FP32_REL), (resume, key, g, f)
    assert got[0]["lr"] == full[1]["lr"]


@pytest.mark.parametrize("resume", list(RESUMES))
def test_resume_cp2_checkpoint_at_another_cp_continues_the_optimizer_state(runs, resume):
    """The ``--cp 1`` / ``--cp 4`` resume's final checkpoint (after step 2): its fp32 main params and Adam moments
    follow from the saved ``--cp 2`` step-1 state by step 2's AdamW update, compared with the uninterrupted
    ``--cp 2`` run's final state; its weights within ``lr·1e-2`` of that run's (module docstring)."""
    full_dir, scratch = runs["tmp"] / "cp2-packed-fp32", runs["tmp"] / "scratch.pt"
    saved = full_dir / "checkpoints" / "iter_0000001"
    ref, got = final_checkpoint(full_dir), final_checkpoint(runs["tmp"] / resume)
    assert ref.name == got.name == "iter_0000002"
    lr = runs["cp2"][-1]["packed-fp32"]["metrics"][1]["lr"]  # the rate of step 2's update
    assert lr > 0
    assert_adam_step_continues(saved, ref, got, lr, 2, scratch)
    a = checkpoint_tensors(ref, scratch, model_only=True)
    b = checkpoint_tensors(got, scratch, model_only=True)
    assert sorted(a) == sorted(b) and a
    errs = {k: float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point()}
    worst = sorted(errs.items(), key=lambda kv: -kv[1])[:5]
    assert [k for k, e in errs.items() if e > _FP32_WEIGHT_ATOL] == [], worst
