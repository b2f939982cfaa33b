"""Benchmark the fused mHC kernels against eager PyTorch and torch.compile (H200; CUDA only).

    PYTHONPATH=packages/mhc/src:packages/dsv4-primitives/src python3 packages/mhc/benchmarks/bench_mhc.py --out /tmp/mhc

Shapes (performance-anchors.md §5 (e)): T = 16384 tokens, n = 4 streams, d = 4096, 20 Sinkhorn iterations, streams in
bf16 (``--dtype``), parameters fp32. Ops, forward and backward:

- ``pre``:   coefficients (RMS + 24-wide projection + gates + Sinkhorn) fused with the collapse ``Σ pre_i X_i``
- ``post``:  ``X' = post ⊗ F + combᵀ X``
- ``coeff``: coefficients alone (RMS + projection + Sinkhorn; ours is the same fused kernel without the collapse)
- ``sinkhorn``: the 4x4 Sinkhorn alone on [T, 4, 4] logits (baselines only: ours is fused into ``pre``/``coeff``)

``pre`` and ``coeff`` (ours) are measured under every coefficient dot precision (``MHC_DOT_PRECISION``:
bf16split, tf32x3, tf32, ieee; see ``mhc/ops/precision.py``) side by side, each after its own accuracy check:
max relative error of mix / pre / post / comb / x_in and of the gradients dX / dfn / dscale / dbase vs the float64
reference on the same inputs (the fp32 eager reference is printed as the yardstick).

Bandwidth = minimum bytes (every input read once, every output written once) / time, and % of the measured
4.27 TB/s device-to-device copy of the H200. Correctness is checked against the fp32 reference first.
"""

from __future__ import annotations

import argparse
import json
import os
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

    # ---- correctness first: every precision mode (and the fp32 eager reference) vs float64
    from mhc.ops.autograd import coefficients_fwd
    from mhc.ops.precision import DEFAULT, ENV, MODES

    ts = min(T, 2048)
    xs = x[:ts]
    gen = torch.Generator(device=dev).manual_seed(1)
    dys = [  # exact in bf16 so every implementation sees the same output grads
        torch.randn(ts, d, device=dev, generator=gen).to(dt).float(),
        torch.randn(ts, n, device=dev, generator=gen).to(dt).float(),
        torch.randn(ts, n, n, device=dev, generator=gen).to(dt).float(),
    ]

    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()

    def pre_with_grads(f_, dtype_x, dtype_p):
        ins = [
            _leaf(xs.to(dtype_x)),
            _leaf(fn.to(dtype_p)),
            _leaf(scale.to(dtype_p)),
            _leaf(base.to(dtype_p)),
        ]
        outs = f_(*ins)
        loss = sum((o.double() * g.double()).sum() for o, g in zip(outs, dys))
        grads = torch.autograd.grad(loss, ins)
        return [o.detach() for o in outs], grads

    f64 = torch.float64
    truth_out, truth_g = pre_with_grads(ref_pre, f64, f64)
    xd = xs.double().reshape(ts, -1)
    truth_mix = (xd @ fn.double().T) * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    truth_pre = mhc_coefficients_ref(
        xs.double(), fn.double(), scale.double(), base.double(), sinkhorn_iters=it
    )[0]

    def check(label, outs, grads, mix, pre):
        c = {"mix": rel(mix, truth_mix), "pre": rel(pre, truth_pre)}
        for k_, a, b in zip(("x_in", "post", "comb"), outs, truth_out):
            c[k_] = rel(a, b)
        for k_, a, b in zip(("dX", "dfn", "dscale", "dbase"), grads, truth_g):
            c[k_] = rel(a, b)
        checks[label] = c

    checks = {}
    ref_outs, ref_g = pre_with_grads(ref_pre, dt, torch.float32)  # the fp32 reference (streams in dt)
    with torch.no_grad():
        xr = xs.float().reshape(ts, -1)
        ref_mix = (xr @ fn.T) * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6)
        ref_pre_c = mhc_coefficients_ref(xs.float(), fn, scale, base, sinkhorn_iters=it)[0]
    check("fp32-ref", ref_outs, ref_g, ref_mix, ref_pre_c)
    modes_ok = []
    for mode in MODES:
        os.environ[ENV] = mode
        try:
            outs, grads = pre_with_grads(ours_pre, dt, torch.float32)
            with torch.no_grad():
                pre_k, *_, mix_k, _ = coefficients_fwd(xs, fn, scale, base, it, 1e-6, 1e-6, True, False, dt)
            check(mode, outs, grads, mix_k, pre_k)
            if mode == "tf32" or all(v < 2e-2 for v in checks[mode].values()):
                modes_ok.append(mode)
        except Exception as e:  # one mode failing to compile must not hide the others
            print(f"  precision {mode}: failed: {type(e).__name__}: {e}")
    os.environ[ENV] = DEFAULT
    cols = list(next(iter(checks.values())))
    print("correctness: max rel err vs float64 reference (outputs | grads of mhc_pre)")
    print(f"{'impl':<10}" + "".join(f"{c_:>9}" for c_ in cols))
    for label, c in checks.items():
        print(f"{label:<10}" + "".join(f"{c[c_]:9.1e}" for c_ in cols))
    with torch.no_grad():
        o = ours_post(f[:ts], xs, post[:ts], comb[:ts])
        r = mhc_post_ref(f[:ts].float(), xs.float(), post[:ts], comb[:ts])
        checks["post"] = {"out": rel(o.float(), r)}
    print(f"post: {checks['post']['out']:.1e}")
    if DEFAULT not in modes_ok or checks["post"]["out"] > 2e-2:
        print(f"bench_mhc: correctness check FAILED for the default ({DEFAULT}) or post")
        return 1

    def compiled(fn_):
        return torch.compile(fn_, dynamic=False) if not args.no_compile else None

    x_b = T * n * d * es  # bytes of the streams
    h_b = T * d * es  # bytes of one hidden state
    coef_b = T * (2 * n + n * n) * 4
    cases = {
        # name: (impls {label: fn}, input builder, fwd bytes, bwd bytes)
        "pre": (
            {**{m_: ours_pre for m_ in modes_ok}, "eager": ref_pre, "compile": compiled(ref_pre)},
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
            {**{m_: ours_coeff for m_ in modes_ok}, "eager": ref_coeff, "compile": compiled(ref_coeff)},
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
            if label in MODES:
                os.environ[ENV] = label
            try:
                inp = make()
                with torch.no_grad():
                    t_f = _bench(lambda impl=impl, inp=inp: impl(*inp))
                t_b = _bench(_grad_timer(impl, inp))
            except Exception as e:  # a baseline failing (e.g. compile OOM) must not hide the others
                print(f"  {name}/{label}: failed: {type(e).__name__}: {e}")
                continue
            finally:
                os.environ[ENV] = DEFAULT
            for phase, t, nbytes in (("fwd", t_f, fwd_b), ("bwd", t_b, bwd_b)):
                gbs = nbytes / (t * 1e-3) / 1e9
                rows.append(
                    dict(
                        op=name,
                        impl="ours" if label in MODES else label,
                        precision=label if label in MODES else None,
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
    labels = [m_ for m_ in MODES if m_ in modes_ok] + ["ours", "eager", "compile"]
    print(f"ours = default precision ({DEFAULT}) for pre/coeff; post has no GEMM")
    print(f"{'op':<9}{'phase':<6}" + "".join(f"{lbl:>24}" for lbl in labels))
    for name in cases:
        for phase in ("fwd", "bwd"):
            cells = []
            for lbl in labels:
                if lbl == "ours" and name in ("pre", "coeff"):
                    pick = lambda r: r["precision"] == DEFAULT
                elif lbl in MODES:
                    pick = lambda r, lbl=lbl: r["precision"] == lbl
                else:
                    pick = lambda r, lbl=lbl: r["impl"] == lbl and r["precision"] is None
                r = next((r for r in rows if r["op"] == name and r["phase"] == phase and pick(r)), None)
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
        default_precision=DEFAULT,
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
