"""CPU dry run of ``benchmarks/bench_offload_step.py`` (tiny preset, one timed step per row; times meaningless):
the offloaded rows run under :func:`offload_sim.simulated_device` (CPU tensors play the GPU), so the script's whole
path runs: the real step, the four rows, the parts, the full training steps (forward and backward on the plain CPU
path, the pipelined and the deferred offloaded step), the table and the JSON."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
TESTS = Path(__file__).parent
BENCH = TESTS.parent / "benchmarks" / "bench_offload_step.py"

_RUNNER = textwrap.dedent(
    """
    import contextlib, importlib.util, sys
    import torch.overrides
    sys.path.insert(0, sys.argv[1])
    sys.path.insert(0, sys.argv[2].rsplit("/", 1)[0])  # the benchmarks folder (bench_optimizer_step's timing)
    from offload_sim import simulated_device
    spec = importlib.util.spec_from_file_location("bench_offload_step", sys.argv[2])
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)


    @contextlib.contextmanager
    def without_simulated_device():  # the model's forward picks its kernels by is_cuda: the plain CPU path
        with torch.overrides._pop_mode_temporarily():
            yield

    bench.main(sys.argv[3:], offload_context=simulated_device, forward_context=without_simulated_device)
    """
)


def test_bench_offload_step_dry_run(tmp_path):
    script = tmp_path / "run_bench.py"
    script.write_text(_RUNNER)
    out = tmp_path / "out"
    argv = ["--out", str(out), "--preset", "tiny", "--seq-len", "64", "--iters", "1", "--full-steps", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run(
        [sys.executable, str(script), str(TESTS), str(BENCH), *argv],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads((out / "bench_offload_step.json").read_text())
    assert list(r["step_ms"]) == [
        "no offload (peer)",
        "offload: megatron (today)",
        "offload: megatron overlap",
        "offload: pipelined",
    ]
    assert all(v > 0 for v in r["step_ms"].values())
    assert r["offloaded_elements"] == r["params"] > 0  # F = 1: every trained element
    for row in ("offload: megatron (today)", "offload: pipelined"):
        parts = r["parts"][row]
        n = parts["offloaded_elements"]
        assert n == r["params"], row
        assert parts["d2h grads"]["bytes"] == parts["h2d params"]["bytes"] == 4 * n
        assert parts["cpu adamw"]["bytes"] == 28 * n
    assert "offload: pipelined" in proc.stdout and "d2h grads" in proc.stdout
    # the full training steps (forward, backward, step): without the optimizer, pipelined, deferred
    full = r["full_step_ms"]
    assert list(full) == ["fwd+bwd (no optimizer)", "pipelined", "deferred"] and all(
        v > 0 for v in full.values()
    )
    assert r["exposed_optimizer_ms"] == {
        k: full[k] - full["fwd+bwd (no optimizer)"] for k in ("pipelined", "deferred")
    }
    assert "full step, deferred" in proc.stdout
