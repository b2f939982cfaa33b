"""mHC kernels at the flash-smoke shapes: tuned launches vs the 0.1.0 (legacy) launches vs eager (H200; CUDA only).

    PYTHONPATH=packages/mhc/src:packages/dsv4-primitives/src python3 packages/mhc/benchmarks/bench_mhc_kernels.py \
        --out /tmp/mhc_kernels

Shapes: T = 4096 and 8192 tokens (``--tokens``), n = 4 streams, d = 4096, 20 Sinkhorn iterations; streams in fp32
(the model's default ``MHCConfig.stream_dtype``) and bf16 (``--dtypes``); ``x_in``, ``h`` and the sub-layer output
``F`` in bf16; parameters fp32; default dot precision (``MHC_DOT_PRECISION``, bf16split). Ops, forward and
backward (the backward gets random grads for every output, as in the model):

- ``pre``:   ``mhc_pre`` (coefficients + Sinkhorn + collapse)   - ``coeff``: ``mhc_coefficients`` alone
- ``head``:  ``hyper_head``                                       - ``post``:  ``mhc_post``

Each op runs under ``MHC_KERNELS=tuned`` (split-K forward, stream-aligned backward, ...) and ``MHC_KERNELS=legacy``
(the 0.1.0 launches), after a correctness check of both against the float64 reference (max relative error; the
run fails if either is off). Table: median ms (CUDA events), GB/s of the minimum bytes (every tensor read or
written once) and % of the measured 4.27 TB/s H200 copy bandwidth (performance-anchors.md §0), speedup of tuned
over legacy and over eager. A per-kernel breakdown (torch.profiler, one fwd+bwd) names the kernels as the model
profile does, and ``--sweep`` times a few split-K / backward tile configs (``MHC_COEFF_SPLITK_CFG``,
``MHC_COEFF_BWD_STREAMS_CFG``, ``MHC_POST_BWD_CFG``) for retuning the defaults in ``mhc/ops/launch.py``.
JSON: ``--out`` and ``benchmarks/results/bench_mhc_kernels.json``.
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

HBM = 4.27e12  # measured H200 device-to-device copy, bytes/s (performance-anchors.md §0)
RESULTS = Path(__file__).parent / "results"
SETS = ("tuned", "legacy")
SWEEP = {
    # env var: configs (pre forward for the split-K kernel, pre backward for the dX/dfn kernel, post backward)
    "MHC_COEFF_SPLITK_CFG": ["64,64,0,4,3", "64,32,0,4,4", "64,64,0,4,4", "64,64,4,4,3", "64,32,32,4,4"],
    "MHC_COEFF_BWD_STREAMS_CFG": ["64,64,4,3", "64,64,4,2", "64,64,8,3"],
    "MHC_POST_BWD_CFG": ["4,128,0,4", "8,128,0,4", "4,128,1,4", "2,256,0,4"],
}


def _bench(fn) -> float:
    """Median ms: CUDA events (triton.testing.do_bench); wall clock in the CPU dry run."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _grad_timer(fwd, inputs):
    outs = fwd(*inputs)
    outs = [o for o in (outs if isinstance(outs, tuple) else (outs,)) if o.requires_grad]
    grads = [torch.randn_like(o) for o in outs]
    diff = [t for t in inputs if t.requires_grad]
    return lambda: torch.autograd.grad(outs, diff, grads, retain_graph=True)


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


class _Env:
    """Set environment variables for a block (the mhc host code reads them per call)."""

    def __init__(self, **kv):
        self.kv, self.old = kv, {}

    def __enter__(self):
        for k, v in self.kv.items():
            self.old[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _kernel_breakdown(step) -> dict[str, float]:
    """Device microseconds per kernel name for one call of ``step`` (torch.profiler); {} if unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile

        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        step()
        sync()
        acts = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
        with profile(activities=acts) as prof:
            step()
            sync()
        out: dict[str, float] = {}
        for ev in prof.key_averages():
            us = getattr(ev, "self_device_time_total", 0.0) or getattr(ev, "self_cuda_time_total", 0.0)
            if us > 0:
                out[ev.key[:60]] = out.get(ev.key[:60], 0.0) + us
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))
    except Exception as e:  # the breakdown is informative only
        print(f"  (profiler breakdown unavailable: {type(e).__name__}: {e})")
        return {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="directory for the JSON result (also results/)")
    ap.add_argument("--tokens", default="4096,8192")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtypes", default="fp32,bf16", help="stream dtypes, comma-separated (fp32, bf16)")
    ap.add_argument("--sweep", action="store_true", help="also time alternative launch configs")
    ap.add_argument(
        "--dry-run-cpu", action="store_true", help="check the script on CPU (TRITON_INTERPRET=1, tiny shapes)"
    )
    args = ap.parse_args()
    if args.dry_run_cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("bench_mhc_kernels: CUDA is not available; this benchmark runs on the GPU box only.")
        return 0

    from mhc import (
        hyper_head,
        hyper_head_ref,
        mhc_coefficients,
        mhc_coefficients_ref,
        mhc_post,
        mhc_post_ref,
        mhc_pre,
        mhc_pre_ref,
    )

    dev, n, d, it = ("cpu" if args.dry_run_cpu else "cuda"), args.streams, args.hidden, args.iters
    m = (2 + n) * n
    bf = torch.bfloat16
    ops = {
        "pre": (
            lambda x, fn, s, b: mhc_pre(x, fn, s, b, sinkhorn_iters=it, out_dtype=bf, backend="triton"),
            lambda x, fn, s, b: mhc_pre_ref(x, fn, s, b, sinkhorn_iters=it, out_dtype=bf),
        ),
        "coeff": (
            lambda x, fn, s, b: mhc_coefficients(x, fn, s, b, sinkhorn_iters=it, backend="triton"),
            lambda x, fn, s, b: mhc_coefficients_ref(x, fn, s, b, sinkhorn_iters=it),
        ),
        "head": (
            lambda x, fn, s, b: hyper_head(x, fn, s, b, out_dtype=bf, backend="triton"),
            lambda x, fn, s, b: hyper_head_ref(x, fn, s, b).to(bf),
        ),
        "post": (
            lambda f, x, p, c: mhc_post(f, x, p, c, backend="triton"),
            lambda f, x, p, c: mhc_post_ref(f, x, p, c).to(x.dtype),
        ),
    }
    truths = {  # float64 truth: the references without the bf16 output casts
        "pre": lambda x, fn, s, b: mhc_pre_ref(x, fn, s, b, sinkhorn_iters=it),
        "coeff": ops["coeff"][1],
        "head": hyper_head_ref,
        "post": mhc_post_ref,
    }
    rows, checks, kernels, sweep_rows = [], {}, {}, []
    failed = False
    for dname in args.dtypes.split(","):
        dt = {"fp32": torch.float32, "bf16": bf}[dname]
        es = torch.tensor([], dtype=dt).element_size()
        for T in (int(v) for v in args.tokens.split(",")):
            inputs = _inputs(T, n, d, m, dt, dev)
            xb, hb, cb = T * n * d * es, T * d * 2, T * (2 * n + n * n) * 4
            nbytes = {  # minimum bytes (fwd, bwd)
                "pre": (xb + hb + cb, 2 * xb + hb + cb),  # X -> x_in; X, dx_in (+dpost, dcomb) -> dX
                "coeff": (xb + cb, 2 * xb + cb),
                "head": (xb + hb, 2 * xb + hb),
                "post": (2 * xb + hb + cb, 3 * xb + 2 * hb + 2 * cb),  # X, F -> X'; dX', X, F -> dX, dF
            }
            tag = f"{dname}-T{T}"
            # ---- correctness: both kernel sets vs float64 (and vs each other), forward and every gradient
            for op, (ours, _) in ops.items():
                ins = inputs[op]()

                def fwd_bwd(fun, ins_, g_seed=3):
                    gg = torch.Generator(device=dev).manual_seed(g_seed)
                    outs = fun(*ins_)
                    outs = outs if isinstance(outs, tuple) else (outs,)
                    loss = sum(
                        (o.double() * torch.randn(o.shape, device=dev, generator=gg).to(bf).double()).sum()
                        for o in outs
                    )
                    grads = torch.autograd.grad(loss, ins_)
                    return [o.detach() for o in outs], [gr.detach() for gr in grads]

                truth = fwd_bwd(truths[op], [_leaf(v.detach().double()) for v in ins])
                res = {}
                for ks in SETS:
                    with _Env(MHC_KERNELS=ks):
                        outs, grads = fwd_bwd(ours, [_leaf(v.detach()) for v in ins])
                    errs = [_rel(a, b) for a, b in zip(outs + grads, truth[0] + truth[1])]
                    res[ks] = (outs + grads, errs)
                    # bf16-stored tensors at bf16 rounding, fp32 ones tighter (output grads are exact in bf16: the
                    # same for every implementation)
                    lim = [2e-2 if v.dtype == bf else 1e-3 for v in outs + grads]
                    ok = all(e <= lm for e, lm in zip(errs, lim))
                    checks[f"{tag}/{op}/{ks}"] = dict(max_rel_err=max(errs), errs=errs, ok=ok)
                    if not ok:
                        print(f"  {tag} {op} {ks}: rel errors {[f'{e:.1e}' for e in errs]} limits {lim}")
                    failed |= not ok
                diff = max(_rel(a, b) for a, b in zip(res["tuned"][0], res["legacy"][0]))
                checks[f"{tag}/{op}/tuned-vs-legacy"] = dict(max_rel_diff=diff)
                print(
                    f"check {tag:<11} {op:<6} max rel err vs fp64: tuned {max(res['tuned'][1]):.1e} "
                    f"legacy {max(res['legacy'][1]):.1e}  tuned-vs-legacy {diff:.1e}"
                )
            if failed:
                print("bench_mhc_kernels: correctness check FAILED (see above); no timings")
                break
            # ---- timings
            for op, (ours, ref) in ops.items():
                fb, bb = nbytes[op]
                impls = [(ks, ours) for ks in SETS] + [("eager", ref)]
                for label, fun in impls:
                    env = {"MHC_KERNELS": label} if label in SETS else {}
                    try:
                        with _Env(**env):
                            ins = inputs[op]()
                            with torch.no_grad():
                                t_f = _bench(lambda fun=fun, ins=ins: fun(*ins))
                            step_b = _grad_timer(fun, ins)
                            t_b = _bench(step_b)
                            if label in SETS:
                                kernels[f"{tag}/{op}/{label}"] = _kernel_breakdown(
                                    lambda fun=fun, ins=ins: torch.autograd.grad(
                                        [o.float().sum() for o in _tuple(fun(*ins)) if o.requires_grad],
                                        [v for v in ins if v.requires_grad],
                                    )
                                )
                    except Exception as e:  # one impl failing (e.g. eager OOM) must not hide the others
                        print(f"  {tag}/{op}/{label}: failed: {type(e).__name__}: {e}")
                        continue
                    for phase, t, nb in (("fwd", t_f, fb), ("bwd", t_b, bb)):
                        gbs = nb / (t * 1e-3) / 1e9
                        rows.append(
                            dict(
                                streams=dname,
                                tokens=T,
                                op=op,
                                impl=label,
                                phase=phase,
                                ms=t,
                                gb_s=gbs,
                                pct_hbm=100 * gbs * 1e9 / HBM,
                                bytes=nb,
                            )
                        )
                    torch.cuda.empty_cache()
            if args.sweep:
                for var, cfgs in SWEEP.items():
                    op = "post" if var == "MHC_POST_BWD_CFG" else "pre"
                    phase = "fwd" if var == "MHC_COEFF_SPLITK_CFG" else "bwd"
                    for cfg in cfgs:
                        try:
                            with _Env(MHC_KERNELS="tuned", **{var: cfg}):
                                ins = inputs[op]()
                                fun = ops[op][0]
                                if phase == "fwd":
                                    with torch.no_grad():
                                        t = _bench(lambda fun=fun, ins=ins: fun(*ins))
                                else:
                                    t = _bench(_grad_timer(fun, ins))
                        except Exception as e:
                            print(f"  sweep {tag} {var}={cfg}: failed: {type(e).__name__}: {e}")
                            continue
                        sweep_rows.append(
                            dict(streams=dname, tokens=T, var=var, cfg=cfg, op=op, phase=phase, ms=t)
                        )
            del inputs
            torch.cuda.empty_cache()
        if failed:
            break

    _print_tables(rows, kernels, sweep_rows, n, d, it)
    result = dict(
        bench="mhc_kernels",
        shape=dict(tokens=args.tokens, streams=n, hidden=d, sinkhorn_iters=it, stream_dtypes=args.dtypes),
        hbm_bytes_per_s=HBM,
        device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)",
        torch=torch.__version__,
        python=platform.python_version(),
        time=time.strftime("%Y-%m-%dT%H:%M:%S"),
        precision=os.environ.get("MHC_DOT_PRECISION", "bf16split"),
        correctness=checks,
        rows=rows,
        kernels_us=kernels,
        sweep=sweep_rows,
    )
    for out_dir in ([] if args.dry_run_cpu else [RESULTS]) + ([args.out] if args.out else []):
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "bench_mhc_kernels.json").write_text(json.dumps(result, indent=2))
    dirs = ([] if args.dry_run_cpu else [str(RESULTS)]) + ([str(args.out)] if args.out else [])
    print(f"\nwrote bench_mhc_kernels.json to {', '.join(dirs) or 'nowhere'}")
    return 1 if failed else 0


def _inputs(T, n, d, m, dt, dev):
    """Builders of fresh leaf inputs per op (x in the stream dtype; F in bf16; parameters fp32)."""
    torch.manual_seed(0)
    x = torch.randn(T, n, d, device=dev).to(dt)
    fn = torch.randn(m, n * d, device=dev) * 0.02
    scale = torch.tensor([0.5, 0.5, 1.0], device=dev)
    base = torch.randn(m, device=dev) * 0.1
    hfn, hscale, hbase = fn[:n].clone(), scale[:1].clone(), base[:n].clone()
    f = torch.randn(T, d, device=dev).to(torch.bfloat16)
    post = 2 * torch.rand(T, n, device=dev)
    comb = torch.softmax(torch.randn(T, n, n, device=dev), dim=-2)
    sets = {
        "pre": (x, fn, scale, base),
        "coeff": (x, fn, scale, base),
        "head": (x, hfn, hscale, hbase),
        "post": (f, x, post, comb),
    }
    return {op: (lambda ts=ts: [_leaf(t) for t in ts]) for op, ts in sets.items()}


def _tuple(o):
    return o if isinstance(o, tuple) else (o,)


def _print_tables(rows, kernels, sweep_rows, n, d, it):
    if not rows:
        return
    print(
        f"\nmHC kernels  n={n} d={d} iters={it}  ms | GB/s of minimum bytes | % of 4.27 TB/s; speedup of tuned"
    )
    head = f"{'streams':<8}{'T':>6} {'op':<6}{'phase':<6}"
    head += "".join(f"{s:>24}" for s in (*SETS, "eager")) + f"{'vs legacy':>11}{'vs eager':>10}"
    print(head)
    keys = list(dict.fromkeys((r["streams"], r["tokens"], r["op"], r["phase"]) for r in rows))
    for key in keys:
        cell = {r["impl"]: r for r in rows if (r["streams"], r["tokens"], r["op"], r["phase"]) == key}
        txt = "".join(
            f"{c['ms']:8.3f} {c['gb_s']:6.0f} {c['pct_hbm']:5.1f}%" if (c := cell.get(s)) else f"{'-':>24}"
            for s in (*SETS, "eager")
        )
        tu = cell.get("tuned")
        sp = [f"{cell[s]['ms'] / tu['ms']:.2f}x" if tu and s in cell else "-" for s in ("legacy", "eager")]
        print(f"{key[0]:<8}{key[1]:>6} {key[2]:<6}{key[3]:<6}{txt}{sp[0]:>11}{sp[1]:>10}")
    if kernels:
        print("\nper-kernel device time, one fwd+bwd (us), kernels >= 1 us")
        for name, ks in kernels.items():
            print(f"  {name}: " + ", ".join(f"{k} {v:.0f}" for k, v in ks.items() if v >= 1.0))
    if sweep_rows:
        print("\nlaunch-config sweep (tuned set; ms)")
        for r in sweep_rows:
            print(
                f"  {r['streams']:<5}T={r['tokens']:<6}{r['var']}={r['cfg']:<14} {r['op']} {r['phase']}: {r['ms']:.3f}"
            )


if __name__ == "__main__":
    sys.exit(main())
