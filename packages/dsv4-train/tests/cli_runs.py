"""``dsv4 train`` from the CLI in the tests, as users run it: one process or ``torchrun``, the metrics of every step.

Every run gets ``OMP_NUM_THREADS=1`` (torchrun's default per process; the single process too: the CPU GEMMs'
blocking, and so their rounding, depends on the thread count)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ONE_PROCESS = [sys.executable, "-m", "dsv4_train"]


def torchrun(nproc: int) -> list[str]:
    """The launcher of ``nproc`` gloo processes of ``dsv4_train`` on this host."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        "-m", "dsv4_train",
    ]  # fmt: skip


def train_metrics(cmd: list[str], out: Path, *args: str) -> list[dict]:
    """The ``metrics.jsonl`` rows of ``cmd train *args --out out`` (it must exit 0)."""
    proc = subprocess.run(
        [*cmd, "train", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
