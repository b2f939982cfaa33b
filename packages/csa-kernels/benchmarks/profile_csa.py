#!/usr/bin/env python3
"""Hardware-counter profile of the fused kernels at the issue's shapes (one launch each, under Nsight Compute).

Run on the GPU box from the repository root (ncu reads the counters on the Firecracker machines)::

    PYTHONPATH=packages/dsv4-primitives/src:packages/csa-kernels/src \\
    ncu --clock-control none --profile-from-start off --set full --import-source no \\
        --export /tmp/csa.ncu-rep python3 packages/csa-kernels/benchmarks/profile_csa.py
    ncu --import /tmp/csa.ncu-rep --csv --page raw > raw.csv
    python3 packages/csa-kernels/benchmarks/profile_csa.py --summarize raw.csv   # the markdown table

Every op is called once outside the capture range (compilation, autotuning-free warm-up) and once inside it
(``cudaProfilerStart`` / ``Stop``), so each kernel appears once per op in the report. The ``--summarize`` mode needs
no GPU: it reads ncu's raw CSV and prints, per kernel, duration, the speed-of-light percentages, tensor-pipe use,
L2 hit rate, achieved occupancy, registers and the three largest warp-stall reasons.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from dsv4_primitives.varlen import SeqBoundaries

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _ops():
    """(name, callable) pairs of one launch sequence each at the benchmark's shapes."""
    import torch
    from bench_csa import _indexer_inputs, attn_inputs

    from csa_kernels.ops.compressor.autograd import compressor_pool_triton
    from csa_kernels.ops.indexer.triton import indexer_topk_triton
    from csa_kernels.ops.indexer_loss.autograd import indexer_loss_triton
    from csa_kernels.ops.sparse_attn import triton as K

    scale = 512**-0.5
    q, kv, sink, idx = attn_inputs(4096, 64, 512, 128, 4, 512, False)
    idx_c, cnt = K.compact_indices(idx)
    o, lse = K.sparse_attn_fwd(q, kv, sink, idx_c, cnt, scale)
    do = torch.randn_like(q)
    swa = attn_inputs(4096, 64, 512, 128, 0, 0, False)
    swa_idx, swa_cnt = K.compact_indices(swa[3])
    qi, ki, wi, bounds = _indexer_inputs(8192, 64, 128, 4)
    comp = idx[:, 128:].contiguous()
    scores = torch.randn(4096, 512, device="cuda")
    kv4 = torch.randn(8192, 1024, device="cuda").to(torch.bfloat16).requires_grad_()
    sc4 = torch.randn(8192, 1024, device="cuda").to(torch.bfloat16).requires_grad_()
    ape4 = torch.randn(4, 1024, device="cuda").requires_grad_()
    cu4 = SeqBoundaries.from_host([0, 7192, 8189, 8192], "cuda")

    def compressor():
        pooled, _ = compressor_pool_triton(kv4, sc4, ape4, 4, True, cu4)
        pooled.backward(torch.ones_like(pooled))

    return [
        ("attn_fwd flash S4096", lambda: K.sparse_attn_fwd(q, kv, sink, idx_c, cnt, scale)),
        ("attn_bwd flash S4096", lambda: K.sparse_attn_bwd(q, kv, sink, idx_c, cnt, scale, o, lse, do)),
        ("attn_fwd swa S4096", lambda: K.sparse_attn_fwd(swa[0], swa[1], swa[2], swa_idx, swa_cnt, scale)),
        ("indexer_topk S8192", lambda: indexer_topk_triton(qi, ki, wi, 4, 512, bounds)),
        ("indexer_loss flash S4096", lambda: indexer_loss_triton(q, kv, sink, lse, comp, scores, scale)),
        ("compressor r4 fwd+bwd T8192", compressor),
    ]


def run(only: str | None = None) -> None:
    import torch

    ops = [(n, f) for n, f in _ops() if only is None or only in n]
    for _, fn in ops:  # warm-up: compile every kernel outside the capture range
        fn()
    torch.cuda.synchronize()
    for name, fn in ops:
        torch.cuda.nvtx.range_push(name)
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        torch.cuda.nvtx.range_pop()
        print("profiled", name, flush=True)


# ncu raw-page metric names (Nsight Compute 2025.x, sm_90)
_COLS = {
    "duration us": "gpu__time_duration.sum",
    "SM %": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "mem %": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "DRAM %": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "L2 hit %": "lts__t_sector_hit_rate.pct",
    "tensor %": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "occupancy %": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "regs": "launch__registers_per_thread",
    "smem KiB": "launch__shared_mem_per_block",
    "issue %": "sm__inst_issued.avg.pct_of_peak_sustained_elapsed",
}
_STALL_PREFIX = "smsp__average_warps_issue_stalled_"
_STALL_SUFFIX = "_per_issue_active.ratio"


def _num(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def summarize(path: str, all_kernels: bool = False) -> None:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, units, body = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    stall_cols = [
        n
        for n in header
        if n.startswith(_STALL_PREFIX) and n.endswith(_STALL_SUFFIX) and "not_issued" not in n
    ]
    print("| kernel | " + " | ".join(_COLS) + " | top warp stalls (cycles per issued instruction) |")
    print("|" + "---|" * (len(_COLS) + 2))
    for r in body:
        name = r[col["Kernel Name"]] if "Kernel Name" in col else r[4]
        if not name.startswith("_") and not all_kernels:
            continue  # PyTorch's own small kernels (index compaction, casts, torch.topk) unless --all
        cells = []
        for key, metric in _COLS.items():
            i = col.get(metric)
            v = _num(r[i]) if i is not None else None
            if v is None:
                cells.append("n/a")
                continue
            unit = units[i]
            if key == "duration us":
                v = v / 1000 if unit in ("nsecond", "ns") else v * 1000 if unit in ("msecond", "ms") else v
            if key == "smem KiB":
                v = v / 1024 if unit in ("byte", "") else v * 1000 / 1024 if unit == "Kbyte" else v
            cells.append(f"{v:.0f}" if key in ("regs",) else f"{v:.1f}")
        stalls = sorted(
            (
                (n[len(_STALL_PREFIX) : -len(_STALL_SUFFIX)], _num(r[col[n]]) or 0.0)
                for n in stall_cols
                if "selected" not in n  # "selected" is the issue cycle itself, not a stall
            ),
            key=lambda x: -x[1],
        )[:3]
        st = ", ".join(f"{n} {v:.1f}" for n, v in stalls)
        print(f"| `{name[:40]}` | " + " | ".join(cells) + f" | {st} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--summarize", metavar="RAW_CSV", help="print the table from ncu's --page raw CSV (no GPU)"
    )
    ap.add_argument("--all", action="store_true", help="with --summarize: PyTorch's kernels too")
    ap.add_argument("--only", help="profile only the ops whose name contains this string (e.g. compressor)")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize, args.all)
    else:
        run(args.only)


if __name__ == "__main__":
    main()
