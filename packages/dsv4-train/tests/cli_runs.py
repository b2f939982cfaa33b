"""``dsv4 train`` from the CLI in the tests, as users run it: one process or ``torchrun``, the metrics of every step.

Every run gets ``OMP_NUM_THREADS=1`` (torchrun's default per process; the single process too: the CPU GEMMs'
blocking, and so their rounding, depends on the thread count).

:func:`train_in_workers` runs several ``dsv4 train`` command lines one after the other in one set of gloo workers
(``warm_workers.run_warm`` or ``dsv4_testkit.run_distributed``, one thread each): the CLI's ``main`` itself, minus
the process launch, so the process start and the imports (most of a tiny run's time) are paid once per world size
instead of once per run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from tp_resume_runs import resume_dir

from dsv4_train.cli import main

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


def train_in_workers(
    rank: int, world: int, runs: list[tuple[str, list[str]]], resumes: dict[str, str] | None = None
) -> dict[str, list[dict]]:
    """``{name: metrics.jsonl rows}`` of ``dsv4 train *flags`` for each ``(name, flags)`` (the flags name their
    ``--out``), run in turn by ``dsv4_train.cli.main`` in this gloo worker (each run builds and destroys its own
    megatron state); every rank reads the rows once all ranks finished the run. ``resumes``: ``{name: run
    directory}`` of the runs that ``--resume`` an earlier run of the list: rank 0 first copies that directory's
    step-``SAVED_STEP`` checkpoint into the run's ``--out`` (:func:`tp_resume_runs.resume_dir`)."""
    results = {}
    for name, flags in runs:
        out = Path(flags[flags.index("--out") + 1])
        if name in (resumes or {}):
            if rank == 0:
                resume_dir(Path(resumes[name]), out)
            dist.barrier()
        assert main(["train", *flags]) == 0, (name, flags)
        dist.barrier()
        results[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return results


#: the metrics a parallel run is compared on against one process (test_train_tensor_context_parallel.py's docstring
#: derives the bounds): fp32 within ``FP32_REL``; bf16 within twice the one-process bf16-vs-fp32 deviation, with a
#: ``2·u_bf16`` relative floor for the fp32 statistics
PARITY_KEYS = ("lm_loss", "mtp_loss", "grad_norm", "balance_loss", "indexer_loss")
FP32_REL = 2e-5
BF16_U = 2.0**-8
FP32_STATISTICS = ("balance_loss", "indexer_loss")


def assert_same_steps(got: list[dict], one: list[dict]) -> None:
    """Both runs logged steps 1 and 2 with the same learning rates and a value for every ``PARITY_KEYS``."""
    assert [m["step"] for m in one] == [m["step"] for m in got] == [1, 2]
    for g, r in zip(got, one, strict=True):
        assert g["lr"] == r["lr"]
        for key in PARITY_KEYS:
            assert r[key] is not None and g[key] is not None, key


def assert_fp32_parity(got: list[dict], one: list[dict]) -> None:
    """Every step's ``PARITY_KEYS`` of the parallel fp32 run within ``FP32_REL`` of one process. Of several steps,
    one before the last must have updated the weights (a positive ``lr``), so that the later steps check the
    reduced gradients through the optimizer: megatron's warm-up starts at rate 0, so a 2-step run needs
    ``--warmup-steps 0``."""
    if len(one) > 1:
        assert any(r["lr"] > 0 for r in one[:-1]), (
            "no step before the last updated the weights (lr 0 in warm-up): the later steps would only repeat the "
            "forward and backward of the initial weights; run the fp32 parity runs with --warmup-steps 0"
        )
    for step, (g, r) in enumerate(zip(got, one, strict=True), start=1):
        for key in PARITY_KEYS:
            assert g[key] == pytest.approx(r[key], rel=FP32_REL, abs=1e-9), (step, key, g[key], r[key])


def assert_bf16_parity(got: list[dict], one: list[dict], one_fp32: list[dict]) -> None:
    """Every step's ``PARITY_KEYS`` of the parallel bf16 run within the bf16 bound of one process's bf16 run
    (``one``), derived from that run's deviation from its fp32 twin (``one_fp32``)."""
    for key in PARITY_KEYS:
        delta = max(
            abs(b[key] - f[key]) for b, f in zip(one, one_fp32, strict=True)
        )  # one-process bf16 vs fp32
        for step, (g, r) in enumerate(zip(got, one, strict=True), start=1):
            bound = 2 * delta
            if key in FP32_STATISTICS:
                bound = max(bound, 2 * BF16_U * abs(r[key]))
            assert abs(g[key] - r[key]) <= bound, (step, key, g[key], r[key], bound)
