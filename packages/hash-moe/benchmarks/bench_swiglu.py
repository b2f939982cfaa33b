"""Benchmark of the clamped SwiGLU activation (§7.3, P5) on one GPU: fused Triton kernels vs the PyTorch path.

One run, one table: ``clamped_swiglu(gate_up [M, 2F], limit, probs [M])`` in bf16 (fp32 probs, as megatron's
permuted routing weights), forward and forward+backward (gradients of ``gate_up`` and ``probs``), at ``--rows``
(default 4096 tokens x top-6 = 24576) and each ``--ffn`` width (default 2048 and 3072), for
``backend="triton"`` (the fused kernels, default on CUDA) and ``backend="reference"`` (the unfused fp32 PyTorch ops).
Columns: median ms and GB/s of the compulsory traffic (forward: read ``gate_up`` + ``probs``, write ``h``;
backward: read ``gate_up`` + ``probs`` + ``dh``, write ``d gate_up`` + ``d probs``) and its share of the HBM
bandwidth (4.8 TB/s on an H200).

Correctness is checked first (both backends vs the fp64 reference, outputs and both gradients, project tolerance
rule: error <= 2 x the bf16 PyTorch reference's error + atol). Rows are printed as they are measured and
``bench_swiglu.json`` is rewritten after every row (``"complete": false`` until the end) in ``--out DIR`` and
``packages/hash-moe/benchmarks/results/`` (GPU runs). Each measurement is capped at about ``--max-s`` seconds of
timed calls; the whole run takes a few seconds on an H200.

Run on the GPU box (plain python3, sources on PYTHONPATH):
``python3 packages/hash-moe/benchmarks/bench_swiglu.py --out DIR``
CPU smoke test of the script (tiny shapes, Triton interpreter):
``python3 packages/hash-moe/benchmarks/bench_swiglu.py --device cpu --rows 37 --ffn 8,24 --out /tmp/bench_swiglu``
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from _bench_utils import T_START, Results, add_run_args, max_err, start_device
from _bench_utils import bench as _bench

DEVICE = "cuda"


def bench(fn, warmup: int = 5, rep: int = 50, max_s: float = 0.3) -> tuple[float, int]:
    """``(median milliseconds, timed calls)`` of ``fn`` on ``DEVICE`` (see ``_bench_utils.bench``)."""
    return _bench(fn, DEVICE, warmup, rep, max_s)


def make_inputs(rows: int, ffn: int, seed: int = 0):
    """bf16 ``gate_up [M, 2F]`` (std 4: the limit 10 clamps a few values), fp32 ``probs [M]``, bf16 ``dh [M, F]``."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = (torch.randn(rows, 2 * ffn, device=DEVICE, generator=g) * 4).bfloat16()
    p = torch.rand(rows, device=DEVICE, generator=g)
    dh = torch.randn(rows, ffn, device=DEVICE, generator=g).bfloat16()
    return x, p, dh


def run(x, p, dh, limit, backend, dtype=None):
    """``(h, d gate_up, d probs)``; ``backend="ref"`` is the autograd-traced reference in ``dtype``."""
    from hash_moe import clamped_swiglu, clamped_swiglu_ref

    dtype = dtype or x.dtype
    xl = x.detach().to(dtype).requires_grad_()
    pl = p.detach().to(dtype if backend == "ref" else p.dtype).requires_grad_()
    if backend == "ref":
        a, b = xl.chunk(2, dim=-1)
        h = clamped_swiglu_ref(a, b, limit) * pl.unsqueeze(-1)
    else:
        h = clamped_swiglu(xl, limit, pl, backend=backend)
    dx, dp = torch.autograd.grad(h, (xl, pl), dh.to(h.dtype))
    return h.detach(), dx, dp


def correctness(ffn: int, args) -> list[dict]:
    """Both backends vs the fp64 reference (bf16 reference as the yardstick) on 1/4 of the rows."""
    x, p, dh = make_inputs(max(1, args.rows // 4), ffn, seed=1)
    ref64 = run(x, p, dh, args.limit, "ref", torch.float64)
    ref_bf = run(x, p, dh, args.limit, "ref", torch.bfloat16)
    rows = []
    for backend in ("triton", "reference"):
        got = run(x, p, dh, args.limit, backend)
        for name, out, r, s in zip(("h", "dgate_up", "dprobs"), got, ref64, ref_bf):
            err, base = max_err(out, r), max_err(s, r)
            scale = max(1.0, r.abs().max().item()) if r.numel() else 1.0
            ok = err <= 2 * base + 1e-3 * scale
            print(
                f"  check F={ffn} {backend:<6} {name:<9} err {err:.3e}  bf16-ref err {base:.3e}  "
                f"{'ok' if ok else 'FAIL'}"
            )
            rows.append(
                {"ffn": ffn, "backend": backend, "name": name, "err": err, "bf16_err": base, "ok": ok}
            )
    return rows


def traffic_bytes(rows: int, ffn: int) -> dict[str, int]:
    """Compulsory HBM traffic of the bf16 activation with fp32 probs."""
    gate_up, h, probs = rows * 2 * ffn * 2, rows * ffn * 2, rows * 4
    fwd = gate_up + probs + h
    bwd = gate_up + probs + h + gate_up + probs  # read gate_up, probs, dh; write d gate_up, d probs
    return {"fwd": fwd, "fwd_bwd": fwd + bwd}


def bench_width(ffn: int, args, hbm: float, emit) -> None:
    from hash_moe import clamped_swiglu

    x, p, dh = make_inputs(args.rows, ffn)
    nbytes = traffic_bytes(args.rows, ffn)
    for mode in ("fwd", "fwd_bwd"):
        for backend in ("triton", "reference"):
            xl, pl = (
                x.detach().requires_grad_(mode == "fwd_bwd"),
                p.detach().requires_grad_(mode == "fwd_bwd"),
            )

            def fn(xl=xl, pl=pl, backend=backend, mode=mode):
                h = clamped_swiglu(xl, args.limit, pl, backend=backend)
                if mode == "fwd_bwd":
                    torch.autograd.grad(h, (xl, pl), dh)

            ms, n = bench(fn, args.warmup, args.rep, args.max_s)
            emit(
                {
                    "rows": args.rows,
                    "ffn": ffn,
                    "mode": mode,
                    "backend": backend,
                    "ms": ms,
                    "reps": n,
                    "bytes": nbytes[mode],
                    "gbps": nbytes[mode] / ms / 1e6,
                    "pct_hbm": nbytes[mode] / ms / 1e-3 / hbm,
                }
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(".gpu-out"))
    ap.add_argument("--rows", type=int, default=4096 * 6, help="token-expert rows M (tokens x top-k)")
    ap.add_argument("--ffn", type=str, default="2048,3072", help="expert widths F")
    ap.add_argument("--limit", type=float, default=10.0, help="SwiGLU clamp")
    add_run_args(ap)
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    started = start_device("bench_swiglu", DEVICE)
    if started is None:
        return 0
    name, hbm = started
    widths = [int(f) for f in args.ffn.split(",")]
    print(f"bench_swiglu on {name}: M = {args.rows} rows, F = {widths}, bf16, limit {args.limit}", flush=True)
    results = Results(
        "bench_swiglu", DEVICE, name, args, args.out, hbm_bytes_per_s=hbm, complete=False, checks=[], rows=[]
    )
    record = results.record
    for f in widths:
        for c in correctness(f, args):
            results.add("checks", c)
    ok = all(c["ok"] for c in record["checks"])
    print(f"  (checks {'passed' if ok else 'FAILED'} at {time.perf_counter() - T_START:.1f} s)", flush=True)

    print(f"\n| M | F | pass | backend | ms | GB/s | % of {hbm / 1e12:.2f} TB/s | speed-up |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    pending: dict[tuple, dict] = {}

    def emit(row: dict) -> None:
        results.add("rows", row)
        key = (row["ffn"], row["mode"])
        speedup = ""
        if row["backend"] == "reference" and key in pending:
            speedup = f"triton {row['ms'] / pending[key]['ms']:.2f}x"
        pending[key] = row
        print(
            f"| {row['rows']} | {row['ffn']} | {row['mode'].replace('_', '+')} | {row['backend']} | {row['ms']:.3f} "
            f"| {row['gbps']:.0f} | {100 * row['pct_hbm']:.0f}% | {speedup} |",
            flush=True,
        )

    for f in widths:
        bench_width(f, args, hbm, emit)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    record["complete"] = True
    results.save()
    print(
        f"\nbench_swiglu done in {time.perf_counter() - T_START:.1f} s; JSON in {', '.join(map(str, results.dirs))}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
