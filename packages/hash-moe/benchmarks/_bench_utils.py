"""Timing and result-file helpers shared by this package's benchmark scripts (imported from the script's folder)."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

T_START = time.perf_counter()
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _wall(fn, device: str) -> float:
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def bench(fn, device: str, warmup: int, rep: int, max_s: float) -> tuple[float, int]:
    """``(median milliseconds, timed calls)`` of ``fn`` (CUDA events, L2 not flushed; wall clock on CPU).

    One untimed call (compilation, allocation), then warm-up and timed calls cut to about ``max_s`` seconds of
    timed work from the second call's wall time: at most ``rep`` and at least 3 timed calls.
    """
    fn()
    est = max(_wall(fn, device), 1e-6)
    for _ in range(min(max(warmup - 2, 0), int(0.25 * max_s / est))):
        fn()
    n = max(3, min(rep, int(max_s / est)))
    times = []
    if device != "cuda":
        for _ in range(n):
            times.append(_wall(fn, device) * 1e3)
        return sorted(times)[n // 2], n
    torch.cuda.synchronize()
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[n // 2], n


def add_run_args(ap, *, rep: int = 50, max_s: float = 0.3) -> None:
    """The timing and device options every benchmark script of this package takes."""
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rep", type=int, default=rep, help="most timed calls per measurement")
    ap.add_argument(
        "--max-s", type=float, default=max_s, help="about this many seconds of timed calls per measurement"
    )
    ap.add_argument("--device", default="cuda", help="'cpu' only to smoke-test this script with tiny shapes")


def start_device(bench_name: str, device: str) -> tuple[str, float] | None:
    """``device_and_hbm(device)``, or None (said on stdout) when CUDA is asked for but absent. CPU smoke runs use
    the Triton interpreter (set before any kernel module is imported)."""
    if device == "cuda" and not torch.cuda.is_available():
        print(f"{bench_name}: CUDA is not available; nothing measured")
        return None
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return device_and_hbm(device)


def device_and_hbm(device: str) -> tuple[str, float]:
    """``(device name, HBM bytes/s)``: the GPU's name and its HBM peak (H200's 4.8 TB/s if unknown); CPU name."""
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    return name, next((v for k, v in HBM_BYTES_PER_S.items() if k in name), 4.8e12)


class Results:
    """The JSON record ``<name>.json`` (the run's header + ``fields``), rewritten (atomically) after each added row
    to ``out`` and, for GPU runs, to the package's ``benchmarks/results/``."""

    def __init__(self, name: str, device: str, device_name: str, args, out: Path, **fields) -> None:
        self.name = name
        self.record = {
            "benchmark": name,
            "device": device_name,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "args": {k: str(v) for k, v in vars(args).items()},
            **fields,
        }
        self.dirs = [out] + ([RESULTS_DIR] if device == "cuda" else [])
        for d in self.dirs:
            d.mkdir(parents=True, exist_ok=True)
        self.save()

    def add(self, section: str, row: dict) -> None:
        row["t_s"] = round(time.perf_counter() - T_START, 2)
        self.record.setdefault(section, []).append(row)
        self.save()

    def save(self) -> None:
        self.record["elapsed_s"] = round(time.perf_counter() - T_START, 2)
        text = json.dumps(self.record, indent=2)
        for d in self.dirs:
            tmp = d / f"{self.name}.json.tmp"
            tmp.write_text(text)
            tmp.replace(d / f"{self.name}.json")


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
