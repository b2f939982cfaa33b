"""``dsv4 train`` runs of the TP checkpoint tests, from the CLI as users run them: one process, or ``torchrun
--nproc-per-node 2`` for ``--tp 2`` (gloo, CPU, one thread per process), and the tensors of a checkpoint read back
under their global (TP=1) names."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

# DSv4 attention W C H with its heads split, hash-routed (the first two) and learned 'E', mHC, one MTP depth:
# symbols ``dsv4 generate`` decodes (megatron's '-' under TP: test_train_tensor_parallel.py)
ARGS = [
    "--preset", "tiny", "--pattern", "WECEHE/WE", "--seed", "11", "--steps", "3", "--seq-len", "64",
    "--global-batch-size", "2", "--micro-batch-size", "1", "--save-interval", "2", "--no-progress",
]  # fmt: skip
SAVED_STEP = 2  # the checkpoint a resumed run starts from; the run ends at step 3 (the final checkpoint)
METRICS = ("lm_loss", "mtp_loss", "grad_norm", "balance_loss", "indexer_loss")
_ENV = os.environ | {
    "OMP_NUM_THREADS": "1"
}  # the CPU GEMMs' blocking (and rounding) depends on the thread count
_MODEL_PARTS = ("embedding", "decoder", "mtp", "output_layer")


def command(tp: int) -> list[str]:
    launcher = [sys.executable]
    if tp > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp)]
    return [*launcher, "-m", "dsv4_train", "train"]


def flags(out: Path, *, tp: int, dtype: str, fmt: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The ``dsv4 train`` flags of one run (after ``train``)."""
    precision = "--no-bf16" if dtype == "fp32" else "--bf16"
    return [*ARGS, precision, "--tp", str(tp), "--ckpt-format", fmt, *extra, "--out", str(out)]


def train(
    out: Path, *, tp: int, dtype: str, fmt: str, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*command(tp), *flags(out, tp=tp, dtype=dtype, fmt=fmt, extra=extra)],
        capture_output=True,
        text=True,
        timeout=900,
        env=_ENV,
    )


def checked(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def metrics(run: Path) -> dict[int, dict]:
    """``{step: metrics}`` of a run directory."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m for m in rows}


def resume_dir(saved_run: Path, out: Path) -> Path:
    """A fresh run directory whose newest checkpoint is ``saved_run``'s step-:data:`SAVED_STEP` one."""
    name = f"iter_{SAVED_STEP:07d}"
    shutil.copytree(saved_run / "checkpoints" / name, out / "checkpoints" / name)
    (out / "checkpoints" / "latest").write_text(name)
    return out


def final_checkpoint(run: Path) -> Path:
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


def checkpoint_tensors(path: Path, scratch: Path, *, model_only: bool) -> dict[str, torch.Tensor]:
    """Every tensor of the dist checkpoint ``path`` as one global tensor under its checkpoint key (the TP=1 name:
    TP shards are stored as slices of it); ``model_only``: the model's weights and buffers only."""
    scratch.parent.mkdir(parents=True, exist_ok=True)
    dcp_to_torch_save(str(path), str(scratch))
    flat = torch.load(scratch, weights_only=False)
    scratch.unlink()
    return {
        k: v
        for k, v in flat.items()
        if isinstance(v, torch.Tensor) and (not model_only or k.split(".")[0] in _MODEL_PARTS)
    }


#: the AdamW constants of every dsv4 train run (``dsv4_train.setup``'s ``OptimizerConfig``)
ADAM_BETA1, ADAM_BETA2, ADAM_EPS = 0.9, 0.95, 1e-8
_U32 = 2.0**-24  # fp32 unit roundoff


def optimizer_state(path: Path, scratch: Path) -> dict[tuple[str, str], torch.Tensor]:
    """``{(kind, name): fp64 tensor}`` of a checkpoint's optimizer state (``kind``: ``param`` = the fp32 main
    param, ``exp_avg``, ``exp_avg_sq``), whatever chained optimizer holds it: ``name`` is the parameter's
    (``fully_reshardable``: ``chained_<i>.optimizer.state.<kind>.<name>``) or the flat bucket's key
    (``dp_reshardable``: ``chained_<i>.optimizer.distributed.<bucket>.<kind>``, the bucket without its padding to a
    DP multiple, so the same elements at every DP size)."""
    state = {}
    for key, value in checkpoint_tensors(path, scratch, model_only=False).items():
        if not key.startswith("chained_"):
            continue
        if ".optimizer.state." in key:
            _, _, _, kind, name = key.split(".", 4)
        else:
            name, kind = key.rsplit(".", 1)
        assert (kind, name) not in state, key
        state[kind, name] = value.double()
    return state


def assert_adam_step_continues(
    saved: Path, ref: Path, got: Path, lr: float, step: int, scratch: Path
) -> None:
    """The run whose final checkpoint is ``got``, resumed from the checkpoint ``saved`` (step ``step - 1``), took
    step ``step``'s AdamW update from that saved state: its final moments and fp32 main params follow from the
    saved ``(P, m, v)`` compared with the final checkpoint ``ref`` of a run that continued the same state (the
    derivation: test_train_tp4_ckpt.py's module docstring, (a) and (b)). ``lr``: the rate of step ``step``."""
    before = optimizer_state(saved, scratch)
    ref_state = optimizer_state(ref, scratch)
    got_state = optimizer_state(got, scratch)
    assert sorted(before) == sorted(ref_state) == sorted(got_state) and before
    bc1, bc2 = 1 - ADAM_BETA1**step, 1 - ADAM_BETA2**step

    def update(state: dict, name: str) -> torch.Tensor:
        return (state["exp_avg", name] / bc1) / (state["exp_avg_sq", name].sqrt() / bc2**0.5 + ADAM_EPS)

    moments, params = {}, {}
    for name in sorted({name for _, name in before}):
        m_prev, v_prev = before["exp_avg", name], before["exp_avg_sq", name]
        grad = (got_state["exp_avg", name] - ADAM_BETA1 * m_prev) / (1 - ADAM_BETA1)
        v_next = ADAM_BETA2 * v_prev + (1 - ADAM_BETA2) * grad**2
        moments[name] = float(
            (got_state["exp_avg_sq", name] - v_next).norm() / v_next.norm().clamp_min(1e-300)
        )
        p_ref = ref_state["param", name]
        ulp = (
            torch.nextafter(p_ref.float().abs(), torch.tensor(float("inf"))) - p_ref.float().abs()
        ).double()
        u_got, u_ref = update(got_state, name), update(ref_state, name)
        bound = 2 * ulp + 16 * _U32 * lr * (u_got.abs() + u_ref.abs())
        miss = (got_state["param", name] - p_ref + lr * (u_got - u_ref)).abs() / bound
        params[name] = float(miss.max())
    worst = sorted(moments.items(), key=lambda kv: -kv[1])[:5]
    assert [n for n, r in moments.items() if r > 1e-6] == [], worst
    worst = sorted(params.items(), key=lambda kv: -kv[1])[:5]
    assert [n for n, r in params.items() if r > 1] == [], worst
