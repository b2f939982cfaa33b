#!/usr/bin/env python3

"""Index scores at given entries (the gradient path of the sparse indexer loss) on one GPU: correctness gates
first, then one side-by-side table, JSON to --out and results/.

Run on the GPU box (no uv, no network), from the repository root:

    PYTHONPATH=packages/dsv4-primitives/src:packages/csa-kernels/src python3 \\
        packages/csa-kernels/benchmarks/bench_scores_at.py --out /tmp/bench

Shape: the flash-smoke indexer (T = 4096 tokens in one document, HI = 64 index heads, DI = 128, ratio 4 so
Tc = 1024 entries, top-k K = 512), bf16 inputs, indices from the real top-k (``-1`` trailing for early tokens).
Rows:
- ``topk-grad``: what ``indexer_topk`` adds to a training step. Ours attaches the fused backward to the selection
  pass's values (no forward work); ``eager-ref`` is the 0.1.x path (``vals + (live - live.detach())`` with ``live``
  the chunked fp32 reference ``indexer_scores_at_ref``), forward + backward.
- ``scores_at``: the public op ``indexer_scores_at``, forward and forward + backward, fused vs the reference.
- ``sweep``: backward launch configs ``(BLOCK_H, BLOCK_J, warps, stages)``, each checked against the default.
Useful FLOPs over valid slots: forward ``2·HI·DI·pairs``, backward ``6·HI·DI·pairs`` (score recomputation, ``dq``,
``dk``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import bench_csa as B
import torch
import triton

from dsv4_primitives.varlen import SeqBoundaries


def _inputs(T, HI, DI, ratio, topk, seed=0, device="cuda", dtype=torch.bfloat16):
    from csa_kernels.ops.indexer.triton import indexer_topk_triton

    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(T, HI, DI, device=device, generator=gen).to(dtype)
    k = torch.randn(T // ratio, DI, device=device, generator=gen).to(dtype)
    w = (torch.randn(T, HI, device=device, generator=gen) * (HI * DI) ** -0.5).to(dtype)
    idx, vals = indexer_topk_triton(q, k, w, ratio, topk, SeqBoundaries.from_host([0, T], device))
    g = torch.randn(T, topk, device=device, generator=gen)
    return q, k, w, idx, vals, g


def _grads(fn, q, k, w, idx, g, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, w)]
    s = fn(*leaves, idx)
    s.backward(g)
    return [s.detach()] + [x.grad for x in leaves]


def gates(q, k, w, idx, vals, g) -> bool:
    """Fused op (bf16) vs the fp32 reference: score, dq, dk, dw; top-k path: same values, same gradients."""
    from csa_kernels.ops.indexer import indexer_topk
    from csa_kernels.ops.indexer.reference import indexer_scores_at_ref
    from csa_kernels.ops.indexer.scores_at_autograd import indexer_scores_at_triton

    print("correctness gate: scores at entries (bf16 kernel vs fp32 reference)", flush=True)
    valid = idx >= 0
    got = _grads(indexer_scores_at_triton, q, k, w, idx, g, q.dtype)
    ref = _grads(indexer_scores_at_ref, q, k, w, idx, g, torch.float32)
    ok = bool(torch.equal(torch.isneginf(got[0]), ~valid))
    for name, a, r in zip(("score", "dq", "dk", "dw"), got, ref):
        if name == "score":
            a, r = a[valid], r[valid]
        ok &= B.gate(f"scores_at {name}", a, r)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, w)]
    bounds = SeqBoundaries.from_host([0, q.shape[0]], q.device)
    sel, v = indexer_topk(*leaves, 4, idx.shape[1], bounds, backend="triton")
    same = bool(torch.equal(sel, idx) and torch.equal(v.detach(), vals))
    (torch.where(valid, v, 0.0) * g).sum().backward()
    ref_leaves = [x.detach().float().requires_grad_() for x in (q, k, w)]
    (torch.where(valid, indexer_scores_at_ref(*ref_leaves, idx), 0.0) * g).sum().backward()
    for name, a, r in zip(("dq", "dk", "dw"), leaves, ref_leaves):
        ok &= B.gate(f"topk-grad {name}", a.grad, r.grad)
    B.GATES.append(dict(name="topk-grad forward = selection values", ok=same))
    print(f"  gate topk-grad forward values = selection pass: {'OK' if same else 'FAIL'}", flush=True)
    return ok and same


def bench(q, k, w, idx, vals, g, eager: bool, sweep: bool) -> None:
    from csa_kernels.ops.indexer import scores_at_triton as K
    from csa_kernels.ops.indexer.reference import indexer_scores_at_ref
    from csa_kernels.ops.indexer.scores_at_autograd import attach_scores_at_grad, indexer_scores_at_triton

    T, HI, DI = q.shape
    pairs = int((idx >= 0).sum())
    fl_f, fl_b = 2.0 * HI * DI * pairs, 6.0 * HI * DI * pairs
    shape = f"T{T} HI{HI} K{idx.shape[1]}"
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, w)]

    def ours_topk_grad():
        v = attach_scores_at_grad(vals, *leaves, idx)
        v.backward(g)
        return v

    def eager_topk_grad():
        live = torch.where(idx >= 0, indexer_scores_at_ref(*leaves, idx), 0.0)
        v = vals + (live - live.detach())
        v.backward(g)
        return v

    def ours_f():
        with torch.no_grad():
            return indexer_scores_at_triton(q, k, w, idx)

    def ours_fb():
        s = indexer_scores_at_triton(*leaves, idx)
        s.backward(g)
        return s

    def eager_f():
        with torch.no_grad():
            return indexer_scores_at_ref(q, k, w, idx)

    def eager_fb():
        s = indexer_scores_at_ref(*leaves, idx)
        s.backward(g)
        return s

    cases = [
        ("topk-grad", "bwd", ours_topk_grad, eager_topk_grad, fl_b, fl_f + fl_b),
        ("scores_at", "fwd", ours_f, eager_f, fl_f, fl_f),
        ("scores_at", "fwd+bwd", ours_fb, eager_fb, fl_f + fl_b, fl_f + fl_b),
    ]
    for section, mode, ours, ref, fl, fl_ref in cases:
        grad = leaves if mode != "fwd" else None
        o = B.record(section, shape, "ours", mode, B.timeit(ours, grad), fl, B.peak_extra_gib(ours))
        if eager:
            e = B.record(
                section,
                shape,
                "eager-ref",
                mode if section != "topk-grad" else "fwd+bwd",
                B.timeit(ref, grad, rep=60),
                fl_ref,
                B.peak_extra_gib(ref),
                "fp32 chunked reference",
            )
            o["speedup_vs_eager"] = e["ms"] / o["ms"]
    if not sweep:
        return
    base = K.scores_at_bwd(q, k, w, idx, g)
    for cfg in [(64, 64, 8, 2), (64, 64, 8, 1), (64, 64, 8, 3), (64, 32, 8, 2), (64, 32, 8, 3), (64, 16, 4, 3),
                (64, 128, 8, 2)]:  # fmt: skip
        K.BWD_CONFIG_OVERRIDE = cfg
        try:
            got = K.scores_at_bwd(q, k, w, idx, g)
            same = all(B.rel_l2(a, b) <= 1e-2 for a, b in zip(got, base))
            ms = B.timeit(lambda: K.scores_at_bwd(q, k, w, idx, g))
            B.record(
                "sweep", shape, f"bwd{cfg}", "bwd", ms, fl_b, 0.0, "same grads" if same else "WRONG grads"
            )
        except Exception as exc:  # a config that does not compile must not hide the others
            print("  sweep bwd", cfg, "failed:", str(exc)[:200], flush=True)
    K.BWD_CONFIG_OVERRIDE = None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="directory for the JSON result")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--no-eager", action="store_true", help="skip the eager reference rows")
    ap.add_argument("--no-sweep", action="store_true", help="skip the backward launch-config sweep")
    ap.add_argument("--tag", default="h200")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_scores_at: no CUDA device; nothing to measure (exit 0)")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    inputs = _inputs(args.tokens, 64, 128, 4, 512)
    failed = [] if gates(*inputs) else ["scores_at gate"]
    bench(*inputs, eager=not args.no_eager, sweep=not args.no_sweep)
    result = dict(
        timestamp=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        peak_tflops=B.PEAK / 1e12,
        gates=B.GATES,
        rows=B.ROWS,
        failed=failed,
    )
    name = f"bench_scores_at_{args.tag}.json"
    for d in (args.out, B.RESULTS_DIR):
        try:
            d.mkdir(parents=True, exist_ok=True)
            (d / name).write_text(json.dumps(result, indent=1))
        except OSError as exc:
            print(f"could not write {d / name}: {exc}")
    B.print_table()
    print("FAILED: " + ", ".join(failed) if failed else "all correctness gates passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
