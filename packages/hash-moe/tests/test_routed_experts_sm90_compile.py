"""sm_90 compile facts of the routed-expert kernels at the launch configurations the CUDA launcher picks (no GPU).

Both kernels (:mod:`hash_moe.kernels.routed_experts_triton`) are compiled for Hopper (``GPUTarget("cuda", 90, 32)``)
with the constexprs of :func:`hash_moe.routed_experts.launch_config` (bf16 at 16 and 64 rows per block, fp32 at its
largest block), at flash-smoke's widths (H 4096, F 2048), in one subprocess without the Triton interpreter
(``_routed_sm90_facts.py``), with a fresh Triton cache (a cache hit would skip the code generator). Checked: it
compiles, bf16 products run on the tensor cores (``HMMA`` / ``HGMMA``), no register spills, shared memory within
one SM's 227 KiB.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
pytestmark = pytest.mark.skipif(
    not (BIN / "cuobjdump").exists() or not (BIN / "ptxas").exists(),
    reason="Triton's NVIDIA backend tools (ptxas, cuobjdump) are not installed",
)
SMEM_PER_SM = 227 * 1024
CASES = [f"{k}-{c}" for k in ("mm", "gate_up") for c in ("bf16-m6", "bf16-m1024", "fp32-m1024")]


@pytest.fixture(scope="module")
def facts(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("routed-sm90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(out / "triton-cache")
    script = Path(__file__).parent / "_routed_sm90_facts.py"
    run = subprocess.run(
        [sys.executable, str(script), str(out)], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_sm90_compiles_without_spills(facts, case):
    f = facts[case]
    assert f["stack"] == 0, f"{case}: {f}"  # no spills
    assert 0 < f["smem"] <= SMEM_PER_SM, f"{case}: {f}"  # pipelined through shared memory, fits one SM
    assert (f["mma"] > 0) == ("bf16" in case), (
        f"{case}: {f}"
    )  # bf16 on the tensor cores, fp32 IEEE on FMA units
