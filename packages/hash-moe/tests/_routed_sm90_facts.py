"""sm_90 compile facts of the routed-expert kernels (run as a script by ``test_routed_experts_sm90_compile.py``).

Runs in its own process without ``TRITON_INTERPRET``: under the interpreter ``triton.jit`` kernels are interpreted
functions, and compiling their source for sm_90 fails inside the code generator on the kernels' ``range`` loops.
Prints one JSON object: case id -> ``{regs, stack, smem, mma, block_m, stages}``.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hash_moe.kernels import routed_experts_triton as kernels
from hash_moe.routed_experts import BLOCK_K, BLOCK_N, NUM_WARPS, launch_config

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
HIDDEN, FFN, EXPERTS = 4096, 2048, 16
# (dtype, rows M of the launch): bf16 decode (16 rows per block), many rows per expert (64); fp32's largest block
CASES = [("bf16", 6), ("bf16", 1024), ("fp32", 1024)]
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def compile_sm90(kernel, consts: dict, ptrs: dict, ints: dict, stages: int, out_dir: Path) -> dict:
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "limit":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    c = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS, "num_stages": stages}
    )
    cubin = out_dir / "routed.cubin"
    cubin.write_bytes(c.asm["cubin"])

    def dump(flag: str) -> str:
        return subprocess.run(
            [str(BIN / "cuobjdump"), flag, str(cubin)], capture_output=True, text=True, check=True
        ).stdout

    regs, stack = map(int, re.search(r"REG:(\d+) STACK:(\d+)", dump("--dump-resource-usage")).groups())
    return {
        "regs": regs,
        "stack": stack,
        "smem": c.metadata.shared,
        "mma": len(re.findall(r"\bHG?MMA", dump("--dump-sass"))),
    }


def case_facts(kernel: str, dtype: str, m: int, out_dir: Path) -> dict:
    block_m, stages = launch_config(TORCH_DTYPES[dtype], m, EXPERTS)
    consts = {
        "G_BLOCK": triton.next_power_of_2(EXPERTS),
        "BLOCK_M": block_m,
        "BLOCK_N": BLOCK_N,
        "BLOCK_K": BLOCK_K,
        "IEEE": dtype == "fp32",
        "UPCAST": False,
    }
    index = {"counts_ptr": "*i64"}  # megatron's tokens_per_expert
    if kernel == "mm":  # fc2: [M, F] x [G, H, F]
        ptrs = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", **index}
        ints = {
            "n_experts": EXPERTS,
            "n_out": HIDDEN,
            "n_in": FFN,
            "stride_x": FFN,
            "stride_we": HIDDEN * FFN,
            "stride_wn": FFN,
        }
        facts = compile_sm90(
            kernels._routed_mm_kernel, consts, ptrs, {**ints, "stride_out": HIDDEN}, stages, out_dir
        )
    else:  # fc1 + SwiGLU: [M, H] x [G, 2F, H]
        consts |= {"ROUND_BF16_BY_BITS": False, "HAS_LIMIT": True, "HAS_PROBS": True}
        ptrs = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "p_ptr": "*fp32", "h_ptr": f"*{dtype}", **index}
        ints = {
            "n_experts": EXPERTS,
            "n_ffn": FFN,
            "n_in": HIDDEN,
            "stride_x": HIDDEN,
            "stride_we": 2 * FFN * HIDDEN,
            "stride_wn": HIDDEN,
        }
        facts = compile_sm90(
            kernels._routed_gate_up_kernel, consts, ptrs, {**ints, "stride_h": FFN}, stages, out_dir
        )
    return {**facts, "block_m": block_m, "stages": stages}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    facts = {
        f"{kernel}-{dtype}-m{m}": case_facts(kernel, dtype, m, out)
        for kernel in ("mm", "gate_up")
        for dtype, m in CASES
    }
    print(json.dumps(facts))
