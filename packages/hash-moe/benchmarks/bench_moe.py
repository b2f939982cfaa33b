"""Benchmark of the DSv4 routed-expert path on one GPU (H200 targets from issue 7).

One run, one table:

- expert MLP (grouped GEMM + fp32 clamped SwiGLU + routing-weight multiply), forward and forward+backward, for
  ``--experts`` local experts (default 8/64/256) at ``--tokens x --topk`` rows (default 4096 x 6 = 24576), against
  (a) the per-expert loop (``torch.split``, one matmul per expert) and (b) the dense MLP of equal FLOPs (the same
  rows through one expert's shapes): TFLOP/s and % of dense;
- routing (sqrt-softplus scores + selection-bias top-6 + normalised, scaled weights), fused Triton kernel vs the
  PyTorch ops, in GB/s, at ``--tokens`` and at ``--bw-tokens`` (65536: the bandwidth regime);
- permute / unpermute of the tokens (megatron-core's ``moe_utils`` ops used by the dispatchers) in GB/s.

Correctness is checked first (grouped vs loop, bf16 vs an fp32 reference, project tolerance rule). Each table row
is printed as soon as it is measured and ``bench_moe.json`` is rewritten after every row (``"complete": false``
until the end), in ``--out DIR`` and ``packages/hash-moe/benchmarks/results/`` (GPU runs), so a cut run keeps its
numbers. Every measurement is capped at about ``--max-s`` seconds of timed calls (``--rep`` at most, 3 at least);
the whole run takes well under a minute on an H200.

Run on the GPU box (plain python3, sources on PYTHONPATH):  ``python3 packages/hash-moe/benchmarks/bench_moe.py --out DIR``
CPU smoke test of the script (tiny shapes, Triton interpreter):
``python3 packages/hash-moe/benchmarks/bench_moe.py --device cpu --tokens 64 --hidden 64 --ffn 32 --experts 2,4
--num-experts-total 8 --bw-tokens 256 --out /tmp/bench_moe``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from _bench_utils import T_START, Results, add_run_args, max_err, start_device
from _bench_utils import bench as _bench

TARGETS = {"mlp_ge512": 0.85, "mlp_96_128": 0.60, "bandwidth": 0.70}


DEVICE = "cuda"


def bench(fn, warmup: int = 5, rep: int = 20, max_s: float = 0.5) -> tuple[float, int]:
    """``(median milliseconds, timed calls)`` of ``fn`` on ``DEVICE`` (see ``_bench_utils.bench``)."""
    return _bench(fn, DEVICE, warmup, rep, max_s)


def check(name: str, out: torch.Tensor, ref32: torch.Tensor, same: torch.Tensor, atol: float = 1e-3) -> dict:
    """Project rule: err(out) <= 2 * err(same-dtype reference) + atol * max|ref|."""
    err, base = max_err(out, ref32), max_err(same, ref32)
    scale = max(1.0, ref32.abs().max().item()) if ref32.numel() else 1.0
    ok = err <= 2 * base + atol * scale
    print(f"  check {name:<22} err {err:.3e}  same-dtype err {base:.3e}  {'ok' if ok else 'FAIL'}")
    return {"name": name, "err": err, "same_dtype_err": base, "ok": ok}


def make_expert_inputs(
    rows: int, experts: int, hidden: int, ffn: int, seed: int = 0, dtype: torch.dtype = torch.float32
):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    kw = dict(device=DEVICE, generator=g, dtype=dtype)
    x = torch.randn(rows, hidden, **kw)
    gu = torch.randn(experts, 2 * ffn, hidden, **kw).mul_(hidden**-0.5)
    dn = torch.randn(experts, hidden, ffn, **kw).mul_(ffn**-0.5)
    p = torch.rand(rows, **kw)
    base, extra = divmod(rows, experts)
    counts = torch.tensor([base + (e < extra) for e in range(experts)], dtype=torch.int64)  # balanced, on CPU
    return x, gu, dn, p, counts


def correctness(experts: int, args) -> list[dict]:
    """Grouped (bf16) vs loop (bf16) vs fp32 loop, forward and backward, on 1/8 of the rows and 1/4 of the width."""
    from hash_moe import grouped_swiglu_experts

    rows = max(experts, args.tokens * args.topk // 8)
    x, gu, dn, p, counts = make_expert_inputs(rows, experts, args.hidden, max(8, args.ffn // 4), seed=1)
    g = torch.randn(rows, args.hidden, device=DEVICE)
    results = {}
    for tag, dtype, backend in (
        ("fast", torch.bfloat16, "auto"),
        ("same", torch.bfloat16, "loop"),
        ("ref", torch.float32, "loop"),
    ):
        leaves = [t.to(dtype).requires_grad_() for t in (x, gu, dn, p)]
        out = grouped_swiglu_experts(
            leaves[0], counts, leaves[1], leaves[2], limit=args.limit, probs=leaves[3], backend=backend
        )
        grads = torch.autograd.grad((out.float() * g).sum(), leaves)
        results[tag] = (out, *grads)
        del leaves
    names = ("out", "dx", "dgate_up", "ddown", "dprobs")
    return [
        check(f"E{experts} {n}", f, r, s)
        for n, f, s, r in zip(names, results["fast"], results["same"], results["ref"])
    ]


def bench_experts(experts: int, args, emit) -> dict:
    """Grouped vs per-expert loop vs dense of equal FLOPs, forward and forward+backward; ``emit(row, mode)`` per mode.

    The backward uses ``torch.autograd.grad`` (no ``.grad`` accumulation: at 256 experts the weight gradients are
    13 GB, and accumulating them would add an extra pass to every timed call).
    """
    from hash_moe import grouped_swiglu_experts

    rows = args.tokens * args.topk
    x, gu, dn, p, counts = make_expert_inputs(rows, experts, args.hidden, args.ffn, dtype=torch.bfloat16)
    flops_fwd = 6.0 * rows * args.hidden * args.ffn
    res = {"experts": experts, "rows": rows, "rows_per_expert": rows / experts}
    dout = torch.ones(rows, args.hidden, device=DEVICE, dtype=torch.bfloat16)

    def mlp(weights, group_counts, backend, grad):
        leaves = [t.detach().requires_grad_(grad) for t in (x, *weights, p)]

        def fn():
            out = grouped_swiglu_experts(
                leaves[0],
                group_counts,
                leaves[1],
                leaves[2],
                limit=args.limit,
                probs=leaves[3],
                backend=backend,
            )
            if grad:
                torch.autograd.grad(out, leaves, dout)

        return fn

    # dense MLP of equal FLOPs: all rows through one expert's weights
    dense_w, dense_counts = (gu[:1].contiguous(), dn[:1].contiguous()), torch.tensor([rows])
    for mode, grad, flops in (("fwd", False, flops_fwd), ("fwd_bwd", True, 3 * flops_fwd)):
        for name, fn in (
            ("grouped", mlp((gu, dn), counts, "auto", grad)),
            ("loop", mlp((gu, dn), counts, "loop", grad)),
            ("dense", mlp(dense_w, dense_counts, "loop", grad)),
        ):
            ms, n = bench(fn, args.warmup, args.rep, args.max_s)
            res[f"{name}_{mode}_ms"] = ms
            res[f"{name}_{mode}_reps"] = n
            res[f"{name}_{mode}_tflops"] = flops / ms / 1e9
        res[f"grouped_{mode}_pct_dense"] = res[f"grouped_{mode}_tflops"] / res[f"dense_{mode}_tflops"]
        res[f"loop_{mode}_pct_dense"] = res[f"loop_{mode}_tflops"] / res[f"dense_{mode}_tflops"]
        emit(res, mode)
    return res


def memory_row(op: str, ms: float, reps: int, nbytes: int, hbm: float, ok: bool) -> dict:
    return {
        "op": op,
        "ms": ms,
        "reps": reps,
        "bytes": nbytes,
        "gbps": nbytes / ms / 1e6,
        "pct_hbm": nbytes / ms / 1e-3 / hbm,
        "ok": ok,
    }


def bench_routing(args, hbm: float, emit) -> None:
    """Routing at the issue's token count and at ``--bw-tokens`` (where launch latency no longer dominates)."""
    from hash_moe import RouterConfig, topk_route

    cfg = RouterConfig(num_experts=args.num_experts_total, topk=args.topk, routed_scaling_factor=1.5)
    for tokens in (args.tokens, args.bw_tokens):
        logits = torch.randn(tokens, cfg.num_experts, device=DEVICE)
        bias = torch.randn(cfg.num_experts, device=DEVICE) * 1e-2
        fused = topk_route(logits, cfg, selection_bias=bias, backend="triton")
        ref = topk_route(logits.double(), cfg, selection_bias=bias, backend="reference")
        ok = (
            bool((fused.experts == ref.experts).float().mean() > 0.999)
            and max_err(fused.weights, ref.weights) < 1e-4
        )
        print(f"  check routing T={tokens} triton vs torch {'ok' if ok else 'FAIL'}")
        # logits read, bias read, scores + weights + expert ids written
        nbytes = logits.numel() * 4 * 2 + bias.numel() * 4 + tokens * args.topk * (4 + 8)
        for backend in ("triton", "reference"):
            ms, n = bench(
                lambda b=backend, z=logits, sb=bias: topk_route(z, cfg, selection_bias=sb, backend=b),
                args.warmup,
                args.rep,
                args.max_s,
            )
            emit(memory_row(f"routing {backend} T={tokens}", ms, n, nbytes, hbm, ok))


def bench_permute(args, hbm: float, emit) -> None:
    try:
        from megatron.core.transformer.moe.moe_utils import permute, unpermute
    except Exception as exc:  # megatron-core missing on the box: say so in the table
        emit({"op": "permute", "skipped": f"megatron-core not importable: {exc}"})
        return
    e, k, t, h = args.num_experts_total, args.topk, args.tokens, args.hidden
    tokens = torch.randn(t, h, device=DEVICE, dtype=torch.bfloat16)
    idx = torch.rand(t, e, device=DEVICE).topk(k, dim=-1).indices
    routing_map = torch.zeros(t, e, dtype=torch.bool, device=DEVICE).scatter_(1, idx, True)
    probs = torch.zeros(t, e, device=DEVICE).scatter_(1, idx, 1.0 / k)
    permuted, _, sorted_idx, _, _ = permute(tokens, routing_map, num_out_tokens=t * k)
    back = unpermute(permuted, sorted_idx, tokens.shape, probs=probs, routing_map=routing_map)
    ok = max_err(back, tokens) <= 1e-2 * tokens.abs().max().item()
    print(f"  check permute/unpermute roundtrip {'ok' if ok else 'FAIL'}")
    moved = t * k * h * 2
    ms, n = bench(
        lambda: permute(tokens, routing_map, num_out_tokens=t * k), args.warmup, args.rep, args.max_s
    )
    emit(memory_row("permute", ms, n, 2 * moved, hbm, ok))
    ms, n = bench(
        lambda: unpermute(permuted, sorted_idx, tokens.shape, probs=probs, routing_map=routing_map),
        args.warmup,
        args.rep,
        args.max_s,
    )
    emit(memory_row("unpermute", ms, n, moved + t * h * 2, hbm, ok))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(".gpu-out"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--experts", type=str, default="8,64,256", help="local expert counts")
    ap.add_argument("--num-experts-total", type=int, default=256, help="experts seen by the router")
    ap.add_argument("--bw-tokens", type=int, default=65536, help="token count of the bandwidth-regime rows")
    ap.add_argument("--limit", type=float, default=10.0, help="SwiGLU clamp")
    add_run_args(ap, rep=20, max_s=0.5)
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    started = start_device("bench_moe", DEVICE)
    if started is None:
        return 0
    name, hbm = started
    experts = [int(e) for e in args.experts.split(",")]
    print(
        f"bench_moe on {name}: tokens {args.tokens} x top-{args.topk}, hidden {args.hidden}, ffn {args.ffn}",
        flush=True,
    )
    results = Results(
        "bench_moe",
        DEVICE,
        name,
        args,
        args.out,
        hbm_bytes_per_s=hbm,
        targets=TARGETS,
        complete=False,
        checks=[],
        expert_mlp=[],
        memory_bound=[],
    )
    record = results.record

    for e in experts:
        for c in correctness(e, args):
            results.add("checks", c)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print(f"  (checks done at {time.perf_counter() - T_START:.1f} s)", flush=True)

    print(
        "\n| experts | rows/expert | mode | grouped TFLOP/s | loop TFLOP/s | dense TFLOP/s | grouped % dense "
        "| loop % dense | target |"
    )
    print("|---|---|---|---|---|---|---|---|---|", flush=True)

    def emit_mlp(r: dict, mode: str) -> None:
        rpe = r["rows_per_expert"]
        target = TARGETS["mlp_ge512"] if rpe >= 512 else TARGETS["mlp_96_128"] if rpe >= 96 else None
        g, lo, d = (r[f"{n}_{mode}_tflops"] for n in ("grouped", "loop", "dense"))
        pct = r[f"grouped_{mode}_pct_dense"]
        verdict = "-" if target is None else f">= {target:.0%} {'met' if pct >= target else 'MISSED'}"
        print(
            f"| {r['experts']} | {rpe:.0f} | {mode} | {g:.4g} | {lo:.4g} | {d:.4g} | {pct:.0%} | "
            f"{r[f'loop_{mode}_pct_dense']:.0%} | {verdict} |",
            flush=True,
        )
        if mode == "fwd":
            results.add("expert_mlp", r)  # the same dict gets the fwd_bwd numbers next
        else:
            results.save()

    for e in experts:
        bench_experts(e, args, emit_mlp)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    print("\n| op | ms | GB/s | % HBM | target |")
    print("|---|---|---|---|---|", flush=True)

    def emit_memory(m: dict) -> None:
        if "skipped" in m:
            print(f"| {m['op']} | - | - | - | skipped: {m['skipped']} |", flush=True)
        else:
            met = "met" if m["pct_hbm"] >= TARGETS["bandwidth"] else "MISSED"
            print(
                f"| {m['op']} | {m['ms']:.4g} | {m['gbps']:.4g} | {m['pct_hbm']:.0%} | >= 70% {met} |",
                flush=True,
            )
        results.add("memory_bound", m)

    bench_routing(args, hbm, emit_memory)
    bench_permute(args, hbm, emit_memory)

    all_ok = all(c["ok"] for c in record["checks"]) and all(m.get("ok", True) for m in record["memory_bound"])
    record["correct"], record["complete"] = all_ok, True
    results.save()
    print(
        f"\nwrote bench_moe.json to {', '.join(map(str, results.dirs))}; correct={all_ok}; "
        f"{time.perf_counter() - T_START:.1f} s"
    )
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
