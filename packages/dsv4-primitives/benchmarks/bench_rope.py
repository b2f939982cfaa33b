"""Benchmark: fused Triton partial interleaved RoPE vs the eager references (H200, bf16, DSv4-Flash shapes).

Run on the GPU box with our sources on PYTHONPATH (no uv, no network):

    python3 packages/dsv4-primitives/benchmarks/bench_rope.py --out /tmp/out

Cases (head 512 = [448 nope | 64 rope], YaRN base 160000, THD positions from cu_seqlens):
  q       [T, 64, 512]  forward rotation, out of place and in place, and fwd+bwd (autograd)
  kv      [T', 512]     forward rotation (single shared kv head), out of place and in place
  o_inv   [T, 64, 512]  inverse rotation of the attention output (out of place, as DSv4 requires)
Implementations: ours (``apply_rope(backend="triton")``), the same API on the eager backend
(``backend="torch"``), and the fp32 reference ``apply_rope_ref`` run eagerly on the bf16 tensor.

Memory-bound op: GB/s counts the bytes the op must move (out of place: read x + write y; in place: read + write the
64 rope channels; fwd+bwd: also read dy + write dx), compared with the measured 4.27 TB/s H200 copy ceiling
(performance-anchors.md §0). Correctness is checked first (bf16 vs fp32 reference: rel. L2 <= 1e-2, cos >= 0.9999,
nope channels bit-identical); the script exits non-zero if a check fails. Prints one table; writes JSON to --out
and to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from _bench_utils import HBM_CEILING_GBS, RESULTS_DIR
from _bench_utils import bench as _bench
from _bench_utils import cosine as _cos
from _bench_utils import peak_extra_mib as _peak_extra_mib
from _bench_utils import rel_l2 as _rel_l2


def _check(name: str, got: torch.Tensor, ref: torch.Tensor, failures: list[str]) -> dict:
    rel, cos = _rel_l2(got, ref), _cos(got, ref)
    finite = bool(torch.isfinite(got).all())
    ok = finite and rel <= 1e-2 and cos >= 0.9999
    if not ok:
        failures.append(f"{name}: rel_l2={rel:.2e} cos={cos:.6f} finite={finite}")
    return {"name": name, "rel_l2": rel, "cos": cos, "ok": ok}


def _thd_positions(total: int, device):
    from dsv4_primitives import positions_from_cu_seqlens

    # documents of uneven lengths (packed THD), restarting positions at each document start
    lens, t, i = [], 0, 0
    while t < total:
        n = min(total - t, [4096, 1000, 2500, 8192, 617][i % 5])
        lens.append(n)
        t, i = t + n, i + 1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device, dtype=torch.int32)
    return positions_from_cu_seqlens(cu), max(lens)


def correctness(cfg, device, failures: list[str], n_tok: int = 3000) -> list[dict]:
    from dsv4_primitives import apply_rope, apply_rope_ref

    torch.manual_seed(0)
    checks = []
    pos, maxp = _thd_positions(n_tok, device)
    shapes = [("q", (n_tok, 64, 512), False), ("kv", (n_tok, 512), False), ("o_inv", (n_tok, 64, 512), True)]
    for name, shape, inverse in shapes:
        x = torch.randn(shape, device=device).bfloat16()
        gy = torch.randn(shape, device=device).bfloat16()
        xr = x.float().requires_grad_(True)
        yr = apply_rope_ref(xr, pos, cfg, inverse=inverse)
        (gxr,) = torch.autograd.grad(yr, xr, gy.float())
        xl = x.clone().requires_grad_(True)
        y = apply_rope(xl, pos, cfg, inverse=inverse, backend="triton", max_position=maxp)
        (gx,) = torch.autograd.grad(y, xl, gy)
        checks.append(_check(f"{name} y", y, yr, failures))
        checks.append(_check(f"{name} dx", gx, gxr, failures))
        if not torch.equal(y[..., :448], x[..., :448]):
            failures.append(f"{name}: nope channels changed")
        xi = x.clone()
        apply_rope(xi, pos, cfg, inverse=inverse, inplace=True, backend="triton", max_position=maxp)
        if not torch.equal(xi, y.detach()):
            failures.append(f"{name}: in-place result differs from out-of-place")
    return checks


def run(out_dir: Path, tokens: int, kv_tokens: int, device: str = "cuda", check_tokens: int = 3000) -> int:
    from dsv4_primitives import RopeConfig, YarnConfig, apply_rope, apply_rope_ref

    device = torch.device(device)
    cfg = RopeConfig(64, 160000.0, YarnConfig())
    failures: list[str] = []
    checks = correctness(cfg, device, failures, check_tokens)
    for c in checks:
        print(
            f"check {c['name']:<10} rel_l2={c['rel_l2']:.2e} cos={c['cos']:.7f} {'ok' if c['ok'] else 'FAIL'}"
        )
    if failures:
        print("CORRECTNESS FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1

    rows = []
    torch.manual_seed(1)
    cases = [
        ("q", (tokens, 64, 512), False),
        ("kv", (kv_tokens, 512), False),
        ("o_inv", (tokens, 64, 512), True),
    ]
    for case, shape, inverse in cases:
        n_tok = shape[0]
        pos, maxp = _thd_positions(n_tok, device)
        x = torch.randn(shape, device=device).bfloat16()
        numel = x.numel()
        heads = numel // (n_tok * 512)
        full_bytes = 2 * numel * 2  # read x + write y (bf16)
        rope_bytes = 2 * n_tok * heads * 64 * 2  # read + write the rope channels only
        impls = {
            "ours triton": lambda x=x, pos=pos, inv=inverse, mp=maxp: apply_rope(
                x, pos, cfg, inverse=inv, backend="triton", max_position=mp
            ),
            "eager torch backend": lambda x=x, pos=pos, inv=inverse, mp=maxp: apply_rope(
                x, pos, cfg, inverse=inv, backend="torch", max_position=mp
            ),
            "eager fp32 reference": lambda x=x, pos=pos, inv=inverse: apply_rope_ref(
                x, pos, cfg, inverse=inv
            ),
        }
        modes = [("fwd out-of-place", impls, full_bytes)]
        if not inverse:  # DSv4 de-rotates the retained attention output out of place only
            xi = x.clone()
            modes.append(
                (
                    "fwd in-place",
                    {
                        "ours triton": lambda xi=xi, pos=pos, mp=maxp: apply_rope(
                            xi, pos, cfg, inplace=True, backend="triton", max_position=mp
                        ),
                        "eager torch backend": lambda xi=xi, pos=pos, mp=maxp: apply_rope(
                            xi, pos, cfg, inplace=True, backend="torch", max_position=mp
                        ),
                    },
                    rope_bytes,
                )
            )
        if case == "q":
            xl = x.clone().requires_grad_(True)
            gy = torch.randn_like(x)

            def fb(backend, xl=xl, gy=gy, pos=pos, mp=maxp):
                y = apply_rope(xl, pos, cfg, backend=backend, max_position=mp)
                y.backward(gy)

            def fb_ref(xl=xl, gy=gy, pos=pos):
                apply_rope_ref(xl, pos, cfg).backward(gy)

            modes.append(
                (
                    "fwd+bwd",
                    {
                        "ours triton": lambda: fb("triton"),
                        "eager torch backend": lambda: fb("torch"),
                        "eager fp32 reference": fb_ref,
                    },
                    2 * full_bytes,
                    [xl],
                )
            )
        for mode in modes:
            mode_name, fns, nbytes = mode[0], mode[1], mode[2]
            grad_to_none = mode[3] if len(mode) > 3 else None
            base_ms = None
            results = {}
            for impl, fn in fns.items():
                fn()  # warm-up (compile, table cache)
                med, p10, p90 = _bench(fn, grad_to_none)
                peak = _peak_extra_mib(fn)
                results[impl] = (med, p10, p90, peak)
            base_ms = results.get("eager fp32 reference", results["eager torch backend"])[0]
            for impl, (med, p10, p90, peak) in results.items():
                gbs = nbytes / (med * 1e-3) / 1e9
                rows.append(
                    {
                        "case": case,
                        "shape": list(shape),
                        "mode": mode_name,
                        "impl": impl,
                        "median_ms": med,
                        "p10_ms": p10,
                        "p90_ms": p90,
                        "bytes": nbytes,
                        "GB_per_s": gbs,
                        "pct_of_4270_GBps": 100.0 * gbs / HBM_CEILING_GBS,
                        "speedup_vs_eager": base_ms / med,
                        "peak_extra_MiB": peak,
                    }
                )

    header = (
        f"{'case':<6} {'shape':<16} {'mode':<17} {'impl':<21} {'median ms':>10} {'p10':>8} {'p90':>8} "
        f"{'GB/s':>8} {'% 4.27TB/s':>10} {'vs eager':>9} {'peak MiB':>9}"
    )
    print()
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['case']:<6} {'x'.join(map(str, r['shape'])):<16} {r['mode']:<17} {r['impl']:<21} "
            f"{r['median_ms']:>10.4f} {r['p10_ms']:>8.4f} {r['p90_ms']:>8.4f} {r['GB_per_s']:>8.0f} "
            f"{r['pct_of_4270_GBps']:>9.1f}% {r['speedup_vs_eager']:>8.2f}x {r['peak_extra_MiB']:>9.1f}"
        )
    payload = {
        "benchmark": "bench_rope",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "hbm_ceiling_GBps": HBM_CEILING_GBS,
        "rope": {"rope_dim": 64, "base": 160000.0, "yarn": True, "head_dim": 512},
        "checks": checks,
        "rows": rows,
    }
    try:
        import triton

        payload["triton"] = triton.__version__
    except ImportError:
        pass
    for d in (out_dir, RESULTS_DIR):
        d.mkdir(parents=True, exist_ok=True)
        (d / "bench_rope.json").write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {out_dir / 'bench_rope.json'} and {RESULTS_DIR / 'bench_rope.json'}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for the JSON result")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens T of the q / output cases")
    ap.add_argument("--kv-tokens", type=int, default=65536, help="tokens of the kv case")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_rope: no CUDA device; nothing to measure (run on the GPU box)")
        return 0
    if args.tokens < 1 or args.kv_tokens < 1:
        raise ValueError("--tokens and --kv-tokens must be positive")
    return run(args.out, args.tokens, args.kv_tokens)


if __name__ == "__main__":
    sys.exit(main())
