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


# the model's floating-point buffers (in the checkpoint's model state, not in the optimizer's): the MoE routers'
# expert-bias correction, updated outside the optimizer
_BUFFERS = ("e_score_correction_bias",)


def bucket_masks(path: Path, scratch: Path, state: dict) -> dict[str, torch.Tensor]:
    """``{bucket: bool mask}`` of the elements of each ``dp_reshardable`` flat bucket of ``state`` (the checkpoint
    ``path``'s :func:`optimizer_state`) that hold a parameter's state. megatron writes the gaps between parameters
    (alignment padding) from ``torch.empty``: uninitialised memory, arbitrary values (NaN and ``1e38`` measured),
    different in every checkpoint, so they are left out. A parameter's elements are found as its weights' exact copy
    in the bucket's fp32 main params (fp32 runs only: there the main params are the weights); a weight stored
    stacked (experts ``[G, ...]``) is found slice by slice. Every weight must be found (buffers aside)."""
    buckets = {
        n: state["param", n].float() for k, n in state if k == "param" and ".optimizer.distributed." in n
    }
    masks = {n: torch.zeros(b.numel(), dtype=torch.bool) for n, b in buckets.items()}
    if not buckets:
        return masks

    def place(v: torch.Tensor) -> bool:
        j = int(v.abs().argmax())  # anchor: the largest element, rarely repeated
        found = False
        for n, flat in buckets.items():
            for c in (flat == v[j]).nonzero().flatten().tolist():
                start = c - j
                if (
                    start >= 0
                    and start + v.numel() <= flat.numel()
                    and torch.equal(flat[start : start + v.numel()], v)
                ):
                    masks[n][start : start + v.numel()] = True
                    found = True
        return found

    weights = checkpoint_tensors(path, scratch, model_only=True)
    missing = []
    for key, w in weights.items():
        if not w.is_floating_point() or key.endswith(_BUFFERS) or place(w.float().flatten()):
            continue
        if w.dim() < 2 or not all(place(w[i].float().flatten()) for i in range(w.shape[0])):
            missing.append(key)
    assert missing == [], missing
    return masks


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
    for name, mask in bucket_masks(saved, scratch, before).items():  # dp_reshardable: without the padding
        for state in (before, ref_state, got_state):
            for kind in ("param", "exp_avg", "exp_avg_sq"):
                state[kind, name] = state[kind, name][mask]
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
    # ``not r <= bound``: a NaN fails too
    assert [n for n, r in moments.items() if not r <= 1e-6] == [], moments
    assert [n for n, r in params.items() if not r <= 1] == [], params
