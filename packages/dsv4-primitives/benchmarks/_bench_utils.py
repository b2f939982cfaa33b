"""Timing, memory and error helpers shared by this package's benchmark scripts (imported from the script's folder)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

HBM_CEILING_GBS = 4270.0  # measured device-to-device copy, read+write counted (performance-anchors.md §0)
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def bench(fn, grad_to_none=None) -> tuple[float, float, float]:
    """``(median, p10, p90)`` milliseconds of ``fn`` through ``triton.testing.do_bench`` (CUDA events)."""
    import triton.testing

    out = triton.testing.do_bench(
        fn, warmup=25, rep=200, grad_to_none=grad_to_none, quantiles=[0.5, 0.1, 0.9]
    )
    if isinstance(out, (list, tuple)):
        return float(out[0]), float(out[1]), float(out[2])
    return float(out), float(out), float(out)


def peak_extra_mib(fn) -> float:
    """Peak CUDA memory allocated by one call of ``fn`` beyond what was allocated before, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-30))


def write_results(name: str, out_dir: Path, device: torch.device, fields: dict) -> None:
    """Write ``{name}.json`` to ``out_dir`` and to ``results/``: the run header (benchmark, time, device, torch,
    python, triton versions) followed by ``fields``."""
    payload = {
        "benchmark": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        **fields,
    }
    try:
        import triton

        payload["triton"] = triton.__version__
    except ImportError:
        pass
    for d in (out_dir, RESULTS_DIR):
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{name}.json").write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {out_dir / (name + '.json')} and {RESULTS_DIR / (name + '.json')}")
