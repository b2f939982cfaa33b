"""Benchmark of the routed experts at decode sizes on one GPU: the routed-expert kernels vs the grouped GEMM path.

One MoE layer's routed experts (issue 37) at flash-smoke's shapes (``hybrid_model.presets.flash_smoke``: hidden
4096, expert width 2048, 16 experts, top-6; bf16 weights, fp32 routing weights), for ``--tokens`` decode batches
(default 1, 8, 32 tokens = 6, 48, 192 expert-sorted rows; each token picks 6 distinct experts uniformly at random,
seeded), two paths on the same inputs:

- ``grouped``: ``hash_moe.grouped_swiglu_experts`` with the counts on the device, today's decode path
  (``torch._grouped_mm`` padded to the static worst case: every expert's weights are read, fused Triton SwiGLU);
- ``routed``: ``hash_moe.routed_swiglu_experts`` (only the experts with rows are read).

Each is timed eager and as a CUDA-graph replay (as in the graph decode step), CUDA events, L2 not flushed (one
layer's weights are 805 MB, far past L2). Columns: median ms, the experts with rows, the weight bytes those need
(``active · (2F·H + H·F) · 2``) and GB/s of them at the measured time (so the grouped path's GB/s is the useful
rate, not its raw traffic), and the routed path's speed-up. Correctness first: both paths vs the fp32 loop reference;
the routed error must be within 2x the grouped path's error + 1e-2 · max|ref| (the exit status is 1 otherwise).

``bench_routed_decode.json`` is rewritten after every row (``"complete": false`` until the end) in ``--out DIR`` and
``packages/hash-moe/benchmarks/results/`` (GPU runs). About 10 s on an H100.

Run on the GPU box (plain python3, sources on PYTHONPATH):
``python3 packages/hash-moe/benchmarks/bench_routed_decode.py --out DIR``
CPU smoke test of the script (tiny shapes, Triton interpreter, no graphs):
``python3 packages/hash-moe/benchmarks/bench_routed_decode.py --device cpu --hidden 40 --ffn 24 --out /tmp/brd``
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from _bench_utils import T_START, Results, add_run_args, max_err, start_device
from _bench_utils import bench as _bench

DEVICE = "cuda"
# flash-smoke (hybrid_model.presets.flash_smoke: DSv4ModelConfig's hidden_size / moe_intermediate_size defaults)
HIDDEN, FFN, EXPERTS, TOPK, LIMIT = 4096, 2048, 16, 6, 10.0


def make_layer(args, seed: int = 0):
    """bf16 ``gate_up [G, 2F, H]`` and ``down [G, H, F]`` (std 1/sqrt of the input width)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    gate_up = (
        torch.randn(args.experts, 2 * args.ffn, args.hidden, device=DEVICE, generator=g) / args.hidden**0.5
    )
    down = torch.randn(args.experts, args.hidden, args.ffn, device=DEVICE, generator=g) / args.ffn**0.5
    return gate_up.bfloat16(), down.bfloat16()


def make_batch(tokens: int, args, seed: int):
    """Expert-sorted rows of ``tokens`` tokens: ``x [M, H]`` bf16, device ``counts [G]``, fp32 ``probs [M]``."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(args.experts, generator=g)[: args.topk] for _ in range(tokens)])
    counts = torch.bincount(experts.flatten(), minlength=args.experts)  # [G]
    m = tokens * args.topk
    x = torch.randn(m, args.hidden, generator=g).bfloat16().to(DEVICE)
    probs = (torch.rand(m, generator=g) / args.topk).to(DEVICE)
    return x, counts.to(DEVICE), probs


def paths():
    from hash_moe import grouped_swiglu_experts, routed_swiglu_experts

    def grouped(x, counts, gate_up, down, probs, limit):
        return grouped_swiglu_experts(x, counts, gate_up, down, limit=limit, probs=probs)

    def routed(x, counts, gate_up, down, probs, limit):
        return routed_swiglu_experts(x, counts, gate_up, down, limit=limit, probs=probs)

    return {"grouped": grouped, "routed": routed}


def correctness(tokens: int, layer, args) -> dict:
    from hash_moe import grouped_swiglu_experts

    x, counts, probs = make_batch(tokens, args, seed=tokens)
    gate_up, down = layer
    with torch.no_grad():
        got = {name: fn(x, counts, gate_up, down, probs, args.limit) for name, fn in paths().items()}
        ref = grouped_swiglu_experts(
            x.float(),
            counts.tolist(),
            gate_up.float(),
            down.float(),
            limit=args.limit,
            probs=probs,
            backend="loop",
            activation_backend="reference",
        )
    err = {name: max_err(out, ref) for name, out in got.items()}
    atol = 1e-2 * ref.abs().max().item()
    ok = err["routed"] <= 2 * err["grouped"] + atol
    return {
        "tokens": tokens,
        "routed_err": err["routed"],
        "grouped_err": err["grouped"],
        "atol": atol,
        "ok": ok,
    }


def timed(fn, graphed: bool, args) -> tuple[float, int]:
    """``(median ms, timed calls)`` of ``fn`` eager, or of its CUDA-graph replay (captured after a warm call)."""
    if not graphed:
        return _bench(fn, DEVICE, args.warmup, args.rep, args.max_s)
    fn()  # compile / allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _bench(graph.replay, DEVICE, args.warmup, args.rep, args.max_s)


def bench_tokens(tokens: int, layer, args, emit) -> None:
    x, counts, probs = make_batch(tokens, args, seed=tokens)
    gate_up, down = layer
    active = int((counts > 0).sum())
    per_expert = (2 * args.ffn * args.hidden + args.hidden * args.ffn) * gate_up.element_size()
    modes = ["eager"] + (["graph"] if DEVICE == "cuda" and not args.no_graph else [])
    for mode in modes:
        for name, path in paths().items():

            def fn(path=path):
                with torch.no_grad():
                    path(x, counts, gate_up, down, probs, args.limit)

            try:
                ms, n = timed(fn, mode == "graph", args)
            except Exception as exc:  # a path that cannot be captured is reported, not fatal
                print(f"  {name} {mode} at {tokens} tokens failed: {type(exc).__name__}: {exc}", flush=True)
                emit({"tokens": tokens, "mode": mode, "path": name, "error": f"{type(exc).__name__}: {exc}"})
                continue
            emit(
                {
                    "tokens": tokens,
                    "rows": tokens * args.topk,
                    "mode": mode,
                    "path": name,
                    "active_experts": active,
                    "ms": ms,
                    "reps": n,
                    "needed_bytes": active * per_expert,
                    "all_bytes": args.experts * per_expert,
                    "gbps_needed": active * per_expert / ms / 1e6,
                }
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(".gpu-out"))
    ap.add_argument("--tokens", type=str, default="1,8,32", help="decode batch sizes (tokens per step)")
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--ffn", type=int, default=FFN, help="routed expert width F")
    ap.add_argument("--experts", type=int, default=EXPERTS)
    ap.add_argument("--topk", type=int, default=TOPK)
    ap.add_argument("--limit", type=float, default=LIMIT, help="SwiGLU clamp")
    ap.add_argument("--no-graph", action="store_true", help="time eager calls only")
    add_run_args(ap)
    args = ap.parse_args(argv)
    if not 1 <= args.topk <= args.experts:
        raise SystemExit(f"--topk must lie in [1, --experts={args.experts}], got {args.topk}")
    global DEVICE
    DEVICE = args.device
    started = start_device("bench_routed_decode", DEVICE)
    if started is None:
        return 0
    name, hbm = started
    batches = [int(t) for t in args.tokens.split(",")]
    print(
        f"bench_routed_decode on {name}: H = {args.hidden}, F = {args.ffn}, {args.experts} experts, top-{args.topk}, "
        f"bf16, tokens {batches}",
        flush=True,
    )
    results = Results(
        "bench_routed_decode",
        DEVICE,
        name,
        args,
        args.out,
        hbm_bytes_per_s=hbm,
        complete=False,
        checks=[],
        rows=[],
    )
    layer = make_layer(args)
    for t in batches:
        results.add("checks", correctness(t, layer, args))
    checks = results.record["checks"]
    ok = all(c["ok"] for c in checks)
    for c in checks:
        print(
            f"  check {c['tokens']} tokens: routed err {c['routed_err']:.3e}, grouped err {c['grouped_err']:.3e} "
            f"({'ok' if c['ok'] else 'FAILED'})",
            flush=True,
        )
    print(
        f"\n| tokens | rows | mode | path | active experts | ms | GB/s of needed weights | % of "
        f"{hbm / 1e12:.2f} TB/s | routed speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    grouped_ms: dict[tuple, float] = {}

    def emit(row: dict) -> None:
        results.add("rows", row)
        if "error" in row:
            return
        key = (row["tokens"], row["mode"])
        speedup = ""
        if row["path"] == "grouped":
            grouped_ms[key] = row["ms"]
        elif key in grouped_ms:
            speedup = f"{grouped_ms[key] / row['ms']:.2f}x"
        print(
            f"| {row['tokens']} | {row['rows']} | {row['mode']} | {row['path']} | {row['active_experts']} "
            f"| {row['ms']:.3f} | {row['gbps_needed']:.0f} | {100 * row['gbps_needed'] * 1e9 / hbm:.0f}% "
            f"| {speedup} |",
            flush=True,
        )

    for t in batches:
        bench_tokens(t, layer, args, emit)
    results.record["complete"] = True
    results.save()
    print(
        f"\nbench_routed_decode done in {time.perf_counter() - T_START:.1f} s; JSON in "
        f"{', '.join(map(str, results.dirs))}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
