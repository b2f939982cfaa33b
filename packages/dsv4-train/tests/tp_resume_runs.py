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
