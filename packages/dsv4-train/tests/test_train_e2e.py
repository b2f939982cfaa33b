"""End-to-end CPU training: loss falls, same seed -> same metrics, save at k + resume == uninterrupted run. Every
run of the module one after the other in one fresh process (the process start and the imports paid once)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

_RUNNER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from dsv4_train.config import TrainConfig
    from dsv4_train.trainer import train

    if __name__ == "__main__":
        keys = ("lm_loss", "mtp_loss", "grad_norm", "lr")
        for run in json.loads(sys.argv[1]):
            latest = run.pop("latest", None)
            if latest is not None:  # resume from this step's checkpoint (not the newest one)
                (Path(run["out"]) / "checkpoints" / "latest").write_text(latest)
            ms = train(TrainConfig.from_flat(progress=False, **run))
            print("METRICS " + json.dumps([{k: m.get(k) for k in keys} for m in ms]), flush=True)
    """
)


#: the module's base config (each run's overrides apply on top)
E2E_BASE = dict(seq_len=64, global_batch_size=4, micro_batch_size=2, warmup_steps=2, lr=3e-3)


def _train_runs(tmp_path, *runs: dict, base: dict = E2E_BASE) -> list[list[dict]]:
    """Training runs one after the other in one fresh process (megatron's global state starts clean; each Trainer
    builds and destroys its own parallel state, so the process start and imports are paid once): per run, per step
    lm/MTP loss, grad norm and lr. A run's ``latest`` key first points ``out/checkpoints/latest`` at that
    checkpoint."""
    script = tmp_path / "run_train.py"
    script.write_text(_RUNNER)
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps([base | run for run in runs])],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("METRICS ")]
    assert len(lines) == len(runs), proc.stdout[-2000:]
    return [json.loads(x[len("METRICS ") :]) for x in lines]


_RESUME = dict(steps=8, warmup_steps=5, dense_steps=4)
_FUSED = dict(steps=6, warmup_steps=2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The runs of every test below, one after the other in one fresh process (:func:`_train_runs`): ``{name:
    per-step metrics}`` and ``{name}-dir``: the run directories."""
    tmp = tmp_path_factory.mktemp("e2e")
    dirs = {"loss": tmp / "loss", "full": tmp / "full", "resume": tmp / "resume", "fused": tmp / "fused"}
    named = {
        "loss": dict(steps=30, out=str(dirs["loss"])),
        # save at step 3, resume from step 3 (not the latest, 8)
        "full": dict(out=str(dirs["full"]), save_final=False, **_RESUME),
        "saved": dict(out=str(dirs["resume"]), save_interval=3, **_RESUME),
        "tail": dict(out=str(dirs["resume"]), resume=True, latest="iter_0000003", **_RESUME),
        # --optimizer-impl fused, then its step-3 checkpoint resumed under fused and under unfused
        "fused-full": dict(out=str(dirs["fused"]), save_interval=3, optimizer_impl="fused", **_FUSED),
        "fused-tail": dict(
            out=str(dirs["fused"]), resume=True, optimizer_impl="fused", latest="iter_0000003", **_FUSED
        ),
        "fused-other": dict(
            out=str(dirs["fused"]), resume=True, optimizer_impl="unfused", latest="iter_0000003", **_FUSED
        ),
    }
    metrics = _train_runs(tmp, *named.values())
    return dict(zip(named, metrics, strict=True)) | {f"{k}-dir": v for k, v in dirs.items()}


def test_loss_falls_and_outputs_written(runs):
    out = runs["loss-dir"]
    losses = [m["lm_loss"] for m in runs["loss"]]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.3, losses
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
    for key in (
        "lm_loss",
        "mtp_loss",
        "indexer_loss",
        "balance_loss",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "mfu",
    ):
        assert key in rows[-1], key
    # MTP loss weight: the preset's 0.3 through the warm-up (2 steps) and the peak step, 0.1 once the LR decays
    assert [r["mtp_weight"] for r in rows[:4]] == [0.3, 0.3, 0.3, 0.1] and rows[-1]["mtp_weight"] == 0.1
    assert (out / "loss.png").stat().st_size > 0
    assert any((out / "tb").iterdir())
    # a finished run leaves its final checkpoint
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_0000030"


def test_exact_resume(runs):
    """Save at step 3, resume: steps 4..8 (lm + MTP loss, grad norm, lr) are bit-identical to an uninterrupted run.

    Exercises the Adam state restore (moments and the per-param ``step`` of megatron's distributed optimizer, fixed
    by dsv4_primitives' ``get_megatron_optimizer_keep_fp32``), the cosine LR scheduler mid-warm-up, the data
    position and the dense -> sparse CSA switch after the resume point.
    """
    full, saved, tail = runs["full"], runs["saved"], runs["tail"]
    assert not (runs["full-dir"] / "checkpoints").exists()  # --no-save-final: no checkpoint written
    assert saved == full  # same seed -> identical runs; saving does not perturb training
    assert len(tail) == 5
    assert tail == full[3:]
    rows = [json.loads(x) for x in (runs["resume-dir"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))  # rows after the resume point are rewritten


def test_fused_optimizer_exact_resume_and_cross_impl_resume(runs):
    """``--optimizer-impl fused`` (torch's fused AdamW kernel; on CPU here) resumes bit-identically, and a checkpoint
    it wrote resumes under megatron's own optimizer (``unfused``): same format, Adam state and step restored, so
    the losses stay within the fused/unfused rounding difference (dsv4_train.optimizer)."""
    full, tail, other = runs["fused-full"], runs["fused-tail"], runs["fused-other"]
    assert tail == full[3:]
    assert len(other) == 3
    for a, b in zip(other, full[3:], strict=True):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-3 * abs(b["lm_loss"]), (a, b)
        assert a["lr"] == b["lr"]
