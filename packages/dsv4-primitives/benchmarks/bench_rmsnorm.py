"""Benchmark: fused Triton RMSNorm (forward and forward+backward) vs the eager paths (H200, bf16, DSv4 shapes).

Run on the GPU box with our sources on PYTHONPATH (no uv, no network):

    python3 packages/dsv4-primitives/benchmarks/bench_rmsnorm.py --out /tmp/out

Cases (``T = --tokens``, default 4096):
  q_head   [T*64, 512]  weightless per-head query norm (the [T, 64, 512] q of every attention layer)
  hidden   [T, 4096]    weighted (fp32 weight): attn_norm / ffn_norm of the hidden state
  q_latent [T, 1024]    weighted: q_norm of the query latent
  kv       [T, 512]     weighted: kv_norm / compressor norm
  d7168    [T, 7168]    weighted: a wider hidden size (non-power-of-two row)
Implementations: ours (``rms_norm(backend="triton")``, fp32 weight), the fp32 reference ``rms_norm_ref`` run eagerly
on the bf16 tensor (what the model ran before: ~6 elementwise fp32 passes), and
``torch.nn.functional.rms_norm`` (PyTorch's own op; given the weight cast to bf16, since it does not take an fp32
weight with a bf16 input without promoting its output to fp32).

Memory-bound op: GB/s counts the compulsory bytes (forward: read x + write y; forward+backward: also read x and dy
and write dx; the weight and dweight are counted too), compared with the ~4.8 TB/s H200 HBM peak and the measured
4.27 TB/s copy ceiling (performance-anchors.md §0). Correctness is checked first against the reference in fp32 (y, dx,
dw: rel. L2 <= 1e-2, cos >= 0.9999, and max error <= 2x the eager bf16 reference's + 1e-3 * max|ref|); the script
exits non-zero if a check fails. Prints one table; writes JSON to --out and to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from _bench_utils import HBM_CEILING_GBS, RESULTS_DIR, write_results
from _bench_utils import bench as _bench
from _bench_utils import cosine as _cos
from _bench_utils import peak_extra_mib as _peak_extra_mib
from _bench_utils import rel_l2 as _rel_l2

HBM_PEAK_GBS = 4800.0  # H200 HBM3e peak
EPS = 1e-6


def _cases(tokens: int) -> list[tuple[str, tuple[int, int], bool]]:
    return [
        ("q_head", (tokens * 64, 512), False),
        ("hidden", (tokens, 4096), True),
        ("q_latent", (tokens, 1024), True),
        ("kv", (tokens, 512), True),
        ("d7168", (tokens, 7168), True),
    ]


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def _check(name: str, got: torch.Tensor, ref: torch.Tensor, eager: torch.Tensor, failures: list[str]) -> dict:
    rel, cos, err = _rel_l2(got, ref), _cos(got, ref), _max_err(got, ref)
    bound = 2.0 * _max_err(eager, ref) + 1e-3 * max(1.0, float(ref.detach().abs().max()))
    finite = bool(torch.isfinite(got).all())
    ok = finite and rel <= 1e-2 and cos >= 0.9999 and err <= bound
    if not ok:
        failures.append(
            f"{name}: rel_l2={rel:.2e} cos={cos:.6f} max_err={err:.2e} (bound {bound:.2e}) finite={finite}"
        )
    return {"name": name, "rel_l2": rel, "cos": cos, "max_err": err, "bound": bound, "ok": ok}


def _fwd_bwd(fn, x: torch.Tensor, w: torch.Tensor | None, gy: torch.Tensor):
    xl = x.clone().requires_grad_(True)
    wl = w.clone().requires_grad_(True) if w is not None else None
    y = fn(xl, wl)
    grads = torch.autograd.grad(y, [xl] + ([wl] if wl is not None else []), gy)
    return y.detach(), grads[0], (grads[1] if wl is not None else None)


def correctness(tokens: int, device, failures: list[str]) -> list[dict]:
    """Ours and the eager bf16 reference vs the fp32 reference, at the benchmark widths with ``tokens`` rows."""
    from dsv4_primitives import rms_norm, rms_norm_ref

    torch.manual_seed(0)
    checks = []
    for name, (_, d), weighted in _cases(tokens):
        rows = tokens * 64 if name == "q_head" else tokens
        x = (2 * torch.randn(rows, d, device=device)).bfloat16()
        w = (1 + 0.3 * torch.randn(d, device=device)) if weighted else None  # fp32 keep-in-fp32 weight
        gy = torch.randn(rows, d, device=device).bfloat16()
        ours = _fwd_bwd(lambda a, b: rms_norm(a, b, EPS, backend="triton"), x, w, gy)
        ref = _fwd_bwd(lambda a, b: rms_norm_ref(a, b, EPS), x.float(), w, gy.float())
        eager = _fwd_bwd(
            lambda a, b: rms_norm_ref(a, b, EPS), x, w, gy
        )  # the eager path the model ran, bf16 x
        for label, o, r, e in zip(("y", "dx", "dw"), ours, ref, eager, strict=True):
            if o is not None:
                checks.append(_check(f"{name} {label}", o, r, e, failures))
    return checks


def run(out_dir: Path, tokens: int, check_tokens: int, device: str = "cuda") -> int:
    import torch.nn.functional as F

    from dsv4_primitives import rms_norm, rms_norm_ref

    device = torch.device(device)
    failures: list[str] = []
    checks = correctness(check_tokens, device, failures)
    for c in checks:
        print(
            f"check {c['name']:<12} rel_l2={c['rel_l2']:.2e} cos={c['cos']:.7f} max_err={c['max_err']:.2e} "
            f"(bound {c['bound']:.2e}) {'ok' if c['ok'] else 'FAIL'}"
        )
    if failures:
        print("CORRECTNESS FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1

    rows = []
    torch.manual_seed(1)
    for case, shape, weighted in _cases(tokens):
        d = shape[-1]
        x = torch.randn(shape, device=device).bfloat16()
        w = (1 + 0.3 * torch.randn(d, device=device)) if weighted else None
        w16 = w.bfloat16() if w is not None else None
        gy = torch.randn_like(x)
        numel = x.numel()
        w_bytes = 4 * d if weighted else 0
        fwd_bytes = 2 * numel * 2 + w_bytes  # read x, write y (bf16), read w
        fb_bytes = fwd_bytes + 3 * numel * 2 + 2 * w_bytes  # + read x, dy, write dx; read w, write dw
        impls = {
            "ours triton": (lambda a, b: rms_norm(a, b, EPS, backend="triton"), w),
            "eager fp32 reference": (lambda a, b: rms_norm_ref(a, b, EPS), w),
            "F.rms_norm (bf16 w)": (lambda a, b, d=d: F.rms_norm(a, (d,), b, EPS), w16),
        }
        xl = x.clone().requires_grad_(True)
        for mode, nbytes in (("fwd", fwd_bytes), ("fwd+bwd", fb_bytes)):
            results = {}
            for impl, (fn, wt) in impls.items():
                if mode == "fwd":
                    call, leaves = (lambda fn=fn, wt=wt, x=x: fn(x, wt)), None
                else:
                    wl = wt.clone().requires_grad_(True) if wt is not None else None
                    leaves = [xl] + ([wl] if wl is not None else [])

                    def call(fn=fn, wl=wl, xl=xl, gy=gy):
                        fn(xl, wl).backward(gy)

                call()  # warm-up (compile)
                med, p10, p90 = _bench(call, leaves)
                results[impl] = (med, p10, p90, _peak_extra_mib(call))
            base_ms = results["eager fp32 reference"][0]
            for impl, (med, p10, p90, peak) in results.items():
                gbs = nbytes / (med * 1e-3) / 1e9
                rows.append(
                    {
                        "case": case,
                        "shape": list(shape),
                        "weighted": weighted,
                        "mode": mode,
                        "impl": impl,
                        "median_ms": med,
                        "p10_ms": p10,
                        "p90_ms": p90,
                        "bytes": nbytes,
                        "GB_per_s": gbs,
                        "pct_of_4800_GBps_peak": 100.0 * gbs / HBM_PEAK_GBS,
                        "pct_of_4270_GBps_copy": 100.0 * gbs / HBM_CEILING_GBS,
                        "speedup_vs_eager_ref": base_ms / med,
                        "peak_extra_MiB": peak,
                    }
                )

    header = (
        f"{'case':<9} {'shape':<12} {'mode':<8} {'impl':<21} {'median ms':>10} {'p10':>8} {'p90':>8} "
        f"{'GB/s':>7} {'% 4.8TB/s':>9} {'% 4.27':>7} {'vs eager':>9} {'peak MiB':>9}"
    )
    print()
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['case']:<9} {'x'.join(map(str, r['shape'])):<12} {r['mode']:<8} {r['impl']:<21} "
            f"{r['median_ms']:>10.4f} {r['p10_ms']:>8.4f} {r['p90_ms']:>8.4f} {r['GB_per_s']:>7.0f} "
            f"{r['pct_of_4800_GBps_peak']:>8.1f}% {r['pct_of_4270_GBps_copy']:>6.1f}% "
            f"{r['speedup_vs_eager_ref']:>8.2f}x {r['peak_extra_MiB']:>9.1f}"
        )
    write_results(
        "bench_rmsnorm",
        out_dir,
        device,
        {
            "hbm_peak_GBps": HBM_PEAK_GBS,
            "hbm_copy_ceiling_GBps": HBM_CEILING_GBS,
            "tokens": tokens,
            "eps": EPS,
            "checks": checks,
            "rows": rows,
        },
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for the JSON result")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens T (rows; the q_head case has T*64 rows)")
    ap.add_argument("--check-tokens", type=int, default=1000, help="tokens of the correctness gate")
    args = ap.parse_args()
    if args.tokens < 1 or args.check_tokens < 1:
        raise ValueError("--tokens and --check-tokens must be positive")
    if not torch.cuda.is_available():
        print("bench_rmsnorm: no CUDA device; nothing to measure (run on the GPU box)")
        return 0
    return run(args.out, args.tokens, args.check_tokens)


if __name__ == "__main__":
    sys.exit(main())
