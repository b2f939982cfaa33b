"""Benchmark the fused mHC kernels against eager PyTorch and torch.compile (H200; CUDA only).

    PYTHONPATH=packages/mhc/src:packages/dsv4-primitives/src python3 packages/mhc/benchmarks/bench_mhc.py --out /tmp/mhc

Shapes (performance-anchors.md §5 (e)): T = 16384 tokens, n = 4 streams, d = 4096, 20 Sinkhorn iterations, streams in
bf16 (``--dtype``), parameters fp32. Ops, forward and backward:

- ``pre``:   coefficients (RMS + 24-wide projection + gates + Sinkhorn) fused with the collapse ``Σ pre_i X_i``
- ``post``:  ``X' = post ⊗ F + combᵀ X``
- ``coeff``: coefficients alone (RMS + projection + Sinkhorn; ours is the same fused kernel without the collapse)
- ``sinkhorn``: the 4x4 Sinkhorn alone on [T, 4, 4] logits (baselines only: ours is fused into ``pre``/``coeff``)

Bandwidth = minimum bytes (every input read once, every output written once) / time, and % of the measured
4.27 TB/s device-to-device copy of the H200. Correctness is checked against the fp32 reference first.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

HBM = 4.27e12  # measured H200 copy bandwidth, bytes/s
RESULTS = Path(__file__).parent / "results"


def _bench(fn, warmup=5, rep=30) -> float:
    """Median milliseconds of ``fn()`` (CUDA events)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def _grad_timer(fwd, inputs):
    """A callable timing one backward of ``fwd(*inputs)`` (the graph is built once and reused)."""
    outs = fwd(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    outs = [o for o in outs if o.requires_grad]
    grads = [torch.randn_like(o) for o in outs]
    diff = [t for t in inputs if t.requires_grad]
    return lambda: torch.autograd.grad(outs, diff, grads, retain_graph=True)


def _leaf(t, grad=True):
    return t.detach().clone().requires_grad_(grad)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--out", type=Path, default=None, help="directory for the JSON result (also written to results/)"
    )
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_mhc: CUDA is not available; this benchmark runs on the GPU box only.")
        return 0

    from mhc import (
        mhc_coefficients,
        mhc_coefficients_ref,
        mhc_post,
        mhc_post_ref,
        mhc_pre,
        mhc_pre_ref,
        sinkhorn_ref,
    )

    dev = "cuda"
    T, n, d, it = args.tokens, args.streams, args.hidden, args.iters
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    es = torch.tensor([], dtype=dt).element_size()
    m = (2 + n) * n
    torch.manual_seed(0)
    x = torch.randn(T, n, d, device=dev, dtype=dt)
    fn = torch.randn(m, n * d, device=dev) * 0.02
    scale = torch.tensor([0.5, 0.5, 1.0], device=dev)
    base = torch.randn(m, device=dev) * 0.1
    f = torch.randn(T, d, device=dev, dtype=dt)
    post = 2 * torch.rand(T, n, device=dev)
    comb = torch.softmax(torch.randn(T, n, n, device=dev), dim=-2)
    logits = torch.randn(T, n, n, device=dev)

    ours_pre = lambda x, fn, s, b: mhc_pre(x, fn, s, b, sinkhorn_iters=it, backend="triton")
    ref_pre = lambda x, fn, s, b: mhc_pre_ref(x, fn, s, b, sinkhorn_iters=it)
    ours_coeff = lambda x, fn, s, b: mhc_coefficients(x, fn, s, b, sinkhorn_iters=it, backend="triton")
    ref_coeff = lambda x, fn, s, b: mhc_coefficients_ref(x, fn, s, b, sinkhorn_iters=it)
    ours_post = lambda f, x, p, c: mhc_post(f, x, p, c, backend="triton")
    ref_sk = lambda z: sinkhorn_ref(z, it, 1e-6)

    # ---- correctness first (vs the fp32 reference on the same inputs)
    checks = {}
    with torch.no_grad():
        xs = x[:2048]
        a, b_ = ours_pre(xs, fn, scale, base), ref_pre(xs.float(), fn, scale, base)
        checks["pre.x_in"] = (a[0].float() - b_[0]).abs().max().item() / max(b_[0].abs().max().item(), 1e-9)
        checks["pre.comb"] = (a[2] - b_[2]).abs().max().item()
        o = ours_post(f[:2048], xs, post[:2048], comb[:2048])
        r = mhc_post_ref(f[:2048].float(), xs.float(), post[:2048], comb[:2048])
        checks["post"] = (o.float() - r).abs().max().item() / max(r.abs().max().item(), 1e-9)
    bad = {k: v for k, v in checks.items() if not v < 2e-2}
    print("correctness (max rel err vs fp32 reference):", {k: f"{v:.2e}" for k, v in checks.items()})
    if bad:
        print(f"bench_mhc: correctness check FAILED: {bad}")
        return 1

    def compiled(fn_):
        return torch.compile(fn_, dynamic=False) if not args.no_compile else None

    x_b = T * n * d * es  # bytes of the streams
    h_b = T * d * es  # bytes of one hidden state
    coef_b = T * (2 * n + n * n) * 4
    cases = {
        # name: (impls {label: fn}, input builder, fwd bytes, bwd bytes)
        "pre": (
            {"ours": ours_pre, "eager": ref_pre, "compile": compiled(ref_pre)},
            lambda: [_leaf(x), _leaf(fn), _leaf(scale), _leaf(base)],
            x_b + h_b + coef_b,  # read X, write x_in (+ post/comb)
            2 * x_b + h_b + coef_b,  # read X and dx_in (+ dpost/dcomb), write dX
        ),
        "post": (
            {"ours": ours_post, "eager": mhc_post_ref, "compile": compiled(mhc_post_ref)},
            lambda: [_leaf(f), _leaf(x), _leaf(post), _leaf(comb)],
            2 * x_b + h_b + coef_b,  # read X, F, post, comb; write X'
            3 * x_b + 2 * h_b + 2 * coef_b,  # read dX', X, F; write dX, dF, dpost, dcomb
        ),
        "coeff": (
            {"ours": ours_coeff, "eager": ref_coeff, "compile": compiled(ref_coeff)},
            lambda: [_leaf(x), _leaf(fn), _leaf(scale), _leaf(base)],
            x_b + coef_b,
            2 * x_b + coef_b,  # read X (twice is not minimal: once), write dX
        ),
        "sinkhorn": (
            {"eager": ref_sk, "compile": compiled(ref_sk)},
            lambda: [_leaf(logits)],
            2 * T * n * n * 4,
            3 * T * n * n * 4,
        ),
    }
    rows = []
    for name, (impls, make, fwd_b, bwd_b) in cases.items():
        for label, impl in impls.items():
            if impl is None:
                continue
            try:
                inp = make()
                with torch.no_grad():
                    t_f = _bench(lambda impl=impl, inp=inp: impl(*inp))
                t_b = _bench(_grad_timer(impl, inp))
            except Exception as e:  # a baseline failing (e.g. compile OOM) must not hide the others
                print(f"  {name}/{label}: failed: {type(e).__name__}: {e}")
                continue
            for phase, t, nbytes in (("fwd", t_f, fwd_b), ("bwd", t_b, bwd_b)):
                gbs = nbytes / (t * 1e-3) / 1e9
                rows.append(
                    dict(
                        op=name,
                        impl=label,
                        phase=phase,
                        ms=t,
                        gb_s=gbs,
                        pct_hbm=100 * gbs * 1e9 / HBM,
                        bytes=nbytes,
                    )
                )
            torch.cuda.empty_cache()

    print(
        f"\nmHC  T={T} n={n} d={d} iters={it} streams={args.dtype}  (GB/s of minimum bytes; % of 4.27 TB/s)"
    )
    print(f"{'op':<9}{'phase':<6}" + "".join(f"{lbl:>24}" for lbl in ("ours", "eager", "compile")))
    for name in cases:
        for phase in ("fwd", "bwd"):
            cells = []
            for lbl in ("ours", "eager", "compile"):
                r = next(
                    (r for r in rows if r["op"] == name and r["impl"] == lbl and r["phase"] == phase), None
                )
                cells.append(
                    f"{r['ms']:8.3f} ms {r['gb_s']:6.0f} {r['pct_hbm']:4.0f}%" if r else f"{'-':>24}"
                )
            print(f"{name:<9}{phase:<6}" + "".join(f"{c:>24}" for c in cells))

    result = dict(
        bench="mhc",
        shape=dict(tokens=T, streams=n, hidden=d, sinkhorn_iters=it, stream_dtype=args.dtype),
        hbm_bytes_per_s=HBM,
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        python=platform.python_version(),
        time=time.strftime("%Y-%m-%dT%H:%M:%S"),
        correctness=checks,
        rows=rows,
    )
    for out_dir in [RESULTS] + ([args.out] if args.out else []):
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "bench_mhc.json").write_text(json.dumps(result, indent=2))
    print(
        f"\nwrote {RESULTS / 'bench_mhc.json'}" + (f" and {args.out / 'bench_mhc.json'}" if args.out else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
