"""TP4 checkpoints from the CLI (issue 31): ``dsv4 convert HF OUT --tp 4`` then ``dsv4 train --init-from OUT --tp 4``
(4 gloo processes) trains like one process ``--init-from`` the TP1 conversion of the same HF checkpoint; a ``--tp 4``
run saved at step 2 and resumed with ``--tp 4 --resume`` equals the uninterrupted ``--tp 4`` run bit for bit; a
one-process bf16 checkpoint resumed at ``--tp 4 --bf16`` continues it within the bf16 bound, and a ``--tp 4 --bf16``
checkpoint resumed by one process continues the TP4 run within the bf16 bound (TP4 -> TP1), optimizer state included.

The source: an HF DeepSeek-V4 directory written by the project's HF export from a random ``tiny`` model with 4
output-projection groups (``o_groups=4``: ``tiny``'s 2 groups refuse ``--tp 4``; test_train_tp4.py), its default
layer pattern (the HF model: DSv4 attention W C H, hash-routed and learned experts, mHC, one MTP depth). The runs
name that model as users do: ``--preset tiny`` and a ``--config`` file with ``model_overrides {"o_groups": 4}``
(``--init-from`` refuses a checkpoint of another model). 3 steps of 2 sequences of 64 tokens, fp32 unless named.

Runs, shared by the tests: one process ``--init-from`` the TP1 conversion, fp32 and bf16 (the bf16 one saves at
step 2, ``--ckpt-format fully_reshardable``); then in one set of 4 spawned gloo workers
(:func:`cli_runs.train_in_workers`: the CLI's ``main`` as ``torchrun`` would run it) one ``--tp 4 --init-from`` the
TP4 conversion ``--resume auto`` command line (the user's rerun after a stop: it starts fresh from ``--init-from``
where ``--out`` has no checkpoint and resumes where it has one): fp32 in a fresh ``--out``, saving at step 2; fp32
in an ``--out`` holding that step-2 checkpoint (TP4 -> TP4); bf16 in an ``--out`` holding the one-process bf16
step-2 checkpoint (TP1 -> TP4); bf16 in a fresh ``--out``, saving at step 2 (the uninterrupted TP4 bf16 run).
Then one process resumes that TP4 bf16 step-2 checkpoint (TP4 -> TP1, the same ``--resume auto`` command line
without ``--tp``, ``--init-from`` the TP1 conversion). A resumed run logs step 3 only.

Bounds:

* TP4 from the TP4 conversion vs one process from the TP1 conversion, fp32: both start from the same weights
  (hybrid-model's test_hf_megatron_tp4.py: the TP4 conversion reads back bitwise as the TP1 one), so only the TP
  summation orders differ: ``cli_runs.FP32_REL`` (``2e-5`` relative, derived in test_train_tp4.py) for every step.
* TP4 -> TP4 resume: the same layout on the same machine, so step 3 and the final checkpoint (weights, fp32 main
  params, Adam moments: ``fully_reshardable`` writes them per parameter) equal the uninterrupted run's bit for bit.
* TP1 -> TP4 resume, bf16: the resumed run starts from the one-process step-2 state (bf16 weights, fp32 main
  params and moments, resharded exactly) and trains step 3, whose forward differs from the one process's only in
  TP-reordered bf16 sums: ``cli_runs.assert_bf16_parity`` against the one-process bf16 step 3 (within twice that
  step's bf16-vs-fp32 deviation of the one process, with a ``2·u_bf16`` relative floor for the fp32 statistics).
  Step 3's metrics come from the forward and backward before step 3's update, so they see the resumed bf16
  weights only; the optimizer state (fp32 main params, Adam moments and step) is checked on the final checkpoints.
  Both runs take one torch AdamW step (CPU: the single-tensor path, ``dsv4_train.optimizer``) from the same
  step-2 state ``(P2, m2, v2)`` with their own clipped gradients ``g``: ``m3 = b1·m2 + (1 - b1)·g``, ``v3 =
  b2·v2 + (1 - b2)·g²``, ``P3 = (1 - lr·wd)·P2 - lr·U(m3, v3)`` with ``U = (m3 / bc1) / (√v3 / √bc2 + eps)``,
  ``bc_i = 1 - b_i**3``, ``lr`` the scheduler's rate for step 3. Without knowing ``g``: (a) ``g' = (m3' - b1·m2) /
  (1 - b1)`` from the saved ``m2`` predicts ``v3' = b2·v2 + (1 - b2)·g'²`` within ``1e-6`` relative per tensor (a
  few fp32 roundings, amplified at most 10x by the division; measured 1.7e-7; moments that are not the saved ones
  miss it by O(1)); (b) ``P3' - P3 = -lr·(U(m3', v3') - U(m3, v3))`` elementwise within ``2·ulp(P3) +
  16·2**-24·lr·(|U'| + |U|)`` (the decayed ``P2`` cancels when both runs hold the same one; measured: 0.6 of the
  bound; main params re-derived from the bf16 weights miss it 400x, a wrong Adam step count changes ``bc_i``).
* TP4 -> TP1 resume, bf16: the mirror image. The one process resumes the TP4 step-2 state (resharded exactly into
  whole tensors) and trains step 3, whose forward differs from the uninterrupted TP4 run's step 3 only in the bf16
  sums TP4 splits: within ``2·δ_m`` of it, ``δ_m`` the uninterrupted TP4 bf16 run's largest deviation from its
  fp32 twin (the TP4 fp32 run) over steps 1-3, with the ``2·u_bf16`` floor for the fp32 statistics
  (``cli_runs.assert_bf16_parity``: step 1's deviation is one bf16 forward's rounding from identical weights, the
  size of what step 3's reordering adds). Its trajectory (steps 1-2 of the TP4 run it continued, then its step 3)
  is a 3-step bf16 run like any other, so it is also within ``cli_runs.assert_bf16_parity``'s bound of the
  one-process bf16 run. The optimizer state: (a) and (b) as above, from the TP4 step-2 checkpoint, against the
  uninterrupted TP4 run's final checkpoint. Measured (CPU), step 3 against the TP4 run: LM 1.2e-4 (bound 4.3e-4),
  MTP 6.7e-5 (4.0e-4), grad norm 4.1e-4 (1.1e-2), indexer 3.2e-4 (1.9e-3), balance 1.8e-9 (7.9e-7); against one
  process: LM 2.5e-4 (6.8e-4), MTP 1.4e-4 (2.7e-4), grad norm 8.7e-4 (1.0e-2), indexer 1.3e-4 (1.4e-3).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from cli_runs import PARITY_KEYS, assert_bf16_parity, assert_fp32_parity, train_in_workers
from tp_resume_runs import SAVED_STEP, assert_adam_step_continues, checkpoint_tensors, final_checkpoint
from warm_workers import run_warm

from dsv4_testkit.megatron_cpu import megatron_cpu_context
from dsv4_train.cli import main
from hybrid_model.hf.convert import export_hf_checkpoint
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

TP = 4
#: the model TP4 splits, given as users give it (module docstring; test_train_tp4.py's)
MODEL = {"model": {"model_overrides": {"o_groups": TP}}}
_ARGS = [
    "--preset", "tiny", "--seed", "11", "--steps", "3", "--seq-len", "64", "--global-batch-size", "2",
    "--micro-batch-size", "1", "--no-progress",
]  # fmt: skip
_SAVING = ["--save-interval", str(SAVED_STEP), "--ckpt-format", "fully_reshardable"]


def _hf_source(path: Path) -> Path:
    """An HF DeepSeek-V4 directory of a random ``tiny`` model with ``o_groups=4`` (module docstring)."""
    with megatron_cpu_context():
        torch.manual_seed(0)
        model = build_model(get_preset("tiny").replace(**MODEL["model"]["model_overrides"])).eval()
        export_hf_checkpoint(model, path, max_shard_bytes=1 << 40)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """``{name: metrics rows}`` of the runs (module docstring), ``{name}-dir``: their run directories, and
    ``meg-tp4``: the TP4 conversion."""
    tmp = tmp_path_factory.mktemp("tp4-ckpt")
    hf = _hf_source(tmp / "hf")
    tp1, tp4 = tmp / "meg-tp1", tmp / "meg-tp4"
    with megatron_cpu_context():  # megatron's state for the converts in this process, torn down after them
        assert main(["convert", str(hf), str(tp1)]) == 0
        assert main(["convert", str(hf), str(tp4), "--tp", str(TP)]) == 0
    config = tmp / "tp4-model.json"
    config.write_text(json.dumps(MODEL))
    args = [*_ARGS, "--config", str(config)]
    out: dict = {"tmp": tmp, "meg-tp4": tp4} | {
        f"{n}-dir": tmp / n for n in ("one", "one-bf16", "tp4", "tp4-resumed", "tp4-bf16", "tp4-to-tp1-bf16")
    }
    one = [
        (
            "one",
            [*args, "--no-bf16", "--init-from", str(tp1), "--no-save-final", "--out", str(out["one-dir"])],
        ),
        ("one-bf16", [*args, "--bf16", "--init-from", str(tp1), *_SAVING, "--out", str(out["one-bf16-dir"])]),
    ]
    out |= run_warm(train_in_workers, 1, one, timeout=1800)[0]
    at_tp4 = [*args, "--tp", str(TP), "--init-from", str(tp4), "--resume", "auto", *_SAVING]
    out["tp1-to-tp4-bf16-dir"] = tmp / "tp1-to-tp4-bf16"
    tp4_runs = [
        ("tp4", [*at_tp4, "--no-bf16", "--out", str(out["tp4-dir"])]),
        ("tp4-resumed", [*at_tp4, "--no-bf16", "--out", str(out["tp4-resumed-dir"])]),
        ("tp1-to-tp4-bf16", [*at_tp4, "--bf16", "--out", str(out["tp1-to-tp4-bf16-dir"])]),
        ("tp4-bf16", [*at_tp4, "--bf16", "--out", str(out["tp4-bf16-dir"])]),
    ]
    resumes = {"tp4-resumed": str(out["tp4-dir"]), "tp1-to-tp4-bf16": str(out["one-bf16-dir"])}
    per_rank = run_warm(train_in_workers, TP, tp4_runs, resumes, timeout=2400)
    assert all(r == per_rank[0] for r in per_rank)  # every rank read the same metrics.jsonl
    out |= per_rank[0]
    # TP4 -> TP1: the one-process command line of the "one-bf16" run, resuming the TP4 bf16 step-2 checkpoint
    back = [*args, "--bf16", "--init-from", str(tp1), "--resume", "auto", *_SAVING]
    to_tp1 = [("tp4-to-tp1-bf16", [*back, "--out", str(out["tp4-to-tp1-bf16-dir"])])]
    resumed = {"tp4-to-tp1-bf16": str(out["tp4-bf16-dir"])}
    return out | run_warm(train_in_workers, 1, to_tp1, resumed, timeout=1800)[0]


def test_tp4_conversion_trains_at_tp4_like_one_process_from_the_tp1_conversion(runs):
    """``--tp 4 --init-from`` the TP4 conversion: steps 1-3 within ``2e-5`` relative of one process ``--init-from``
    the TP1 conversion (module docstring)."""
    one, tp4 = runs["one"], runs["tp4"]
    assert [m["step"] for m in one] == [m["step"] for m in tp4] == [1, 2, 3]
    assert [m["lr"] for m in one] == [m["lr"] for m in tp4]
    assert_fp32_parity(tp4, one)
    layout = json.loads((runs["meg-tp4"] / "dsv4_model_config.json").read_text())
    assert layout["layout"]["tp"] == TP and layout["model_config"]["o_groups"] == TP


def test_tp4_resume_at_tp4_is_bitwise(runs):
    """``--tp 4 --resume`` of the ``--tp 4`` step-2 checkpoint: step 3 and the final checkpoint (weights, fp32 main
    params, Adam moments) equal the uninterrupted ``--tp 4`` run's bit for bit."""
    (got,) = runs["tp4-resumed"]
    ref = runs["tp4"][SAVED_STEP]
    for key in ("step", "lr", *PARITY_KEYS):
        assert got[key] == ref[key], (key, got[key], ref[key])
    scratch = runs["tmp"] / "scratch.pt"
    a = checkpoint_tensors(final_checkpoint(runs["tp4-dir"]), scratch, model_only=False)
    b = checkpoint_tensors(final_checkpoint(runs["tp4-resumed-dir"]), scratch, model_only=False)
    assert sorted(a) == sorted(b) and any(k.startswith("chained") for k in a)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_bf16_tp1_checkpoint_resumes_at_tp4_within_the_bf16_bound(runs):
    """A one-process bf16 step-2 checkpoint resumed by ``--tp 4 --bf16``: step 3 within the bf16 bound of the one
    process's step 3 (module docstring)."""
    (got,) = runs["tp1-to-tp4-bf16"]
    one_bf16, one_fp32 = runs["one-bf16"][SAVED_STEP], runs["one"][SAVED_STEP]
    assert got["step"] == one_bf16["step"] == SAVED_STEP + 1 and got["lr"] == one_bf16["lr"]
    assert_bf16_parity([got], [one_bf16], [one_fp32])


def test_bf16_tp1_to_tp4_resume_continues_the_saved_optimizer_state(runs):
    """The ``--tp 4 --bf16`` run resumed from the one-process bf16 step-2 checkpoint continues its fp32 main
    params, Adam moments and step: its step-3 moments and main params follow from the saved step-2 state by the
    AdamW update, compared with the one-process continuation (module docstring: (a) and (b))."""
    lr = runs["one-bf16"][SAVED_STEP]["lr"]  # the rate step 3's update used (its metrics row)
    saved = runs["one-bf16-dir"] / "checkpoints" / f"iter_{SAVED_STEP:07d}"
    ref, got = final_checkpoint(runs["one-bf16-dir"]), final_checkpoint(runs["tp1-to-tp4-bf16-dir"])
    assert_adam_step_continues(saved, ref, got, lr, SAVED_STEP + 1, runs["tmp"] / "scratch.pt")


def test_bf16_tp4_checkpoint_resumes_in_one_process_within_the_bf16_bound(runs):
    """A ``--tp 4 --bf16`` step-2 checkpoint resumed by one process: step 3 within the bf16 bound of the
    uninterrupted TP4 run's step 3, the whole trajectory within that of the one-process bf16 run (module
    docstring)."""
    (got,) = runs["tp4-to-tp1-bf16"]
    tp4_bf16 = runs["tp4-bf16"]
    assert [m["step"] for m in tp4_bf16] == [1, 2, 3] and got["step"] == SAVED_STEP + 1
    assert got["lr"] == tp4_bf16[SAVED_STEP]["lr"] == runs["one-bf16"][SAVED_STEP]["lr"]
    trajectory = [*tp4_bf16[:SAVED_STEP], got]  # the steps the resumed run's weights went through
    assert_bf16_parity(trajectory, tp4_bf16, runs["tp4"])
    assert_bf16_parity(trajectory, runs["one-bf16"], runs["one"])


def test_bf16_tp4_to_tp1_resume_continues_the_saved_optimizer_state(runs):
    """The one process resumed from the ``--tp 4 --bf16`` step-2 checkpoint continues its fp32 main params, Adam
    moments and step, compared with the uninterrupted TP4 run (module docstring: (a) and (b))."""
    lr = runs["tp4-bf16"][SAVED_STEP]["lr"]
    saved = runs["tp4-bf16-dir"] / "checkpoints" / f"iter_{SAVED_STEP:07d}"
    ref, got = final_checkpoint(runs["tp4-bf16-dir"]), final_checkpoint(runs["tp4-to-tp1-bf16-dir"])
    assert_adam_step_continues(saved, ref, got, lr, SAVED_STEP + 1, runs["tmp"] / "scratch.pt")
