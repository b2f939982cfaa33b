"""Benchmark: fused Triton partial interleaved RoPE vs the eager references (H200, bf16, DSv4-Flash shapes).

Run on the GPU box with our sources on PYTHONPATH (no uv, no network):

    python3 packages/dsv4-primitives/benchmarks/bench_rope.py --out /tmp/out

Cases (head 512 = [448 nope | 64 rope], YaRN base 160000, THD positions from cu_seqlens):
  q       [T, 64, 512]  forward rotation, out of place and in place, and fwd+bwd (autograd)
  kv      [T', 512]     forward rotation (single shared kv head), out of place and in place
  o_inv   [T, 64, 512]  inverse rotation of the attention output (out of place, as DSv4 requires)
Implementations: ours (``apply_rope(backend="triton")``: out of place one fused pass that copies the nope channels
and rotates the rope channels), "ours copy_+in-place" (the previous out-of-place strategy, kept as a row to justify
the choice: ``x.clone()`` then the in-place kernel on the rope channels), the same API on the eager backend
(``backend="reference"``), and the fp32 reference ``apply_rope_ref`` run eagerly on the bf16 tensor.

``--sweep`` also times the kernel's launch geometry (``RopeKernelConfig``: bytes per program x warps) on the q
(in place, out of place) and kv (in place) cases and prints a second table (in the JSON under ``"sweep"``).

Memory-bound op: GB/s counts the bytes the op must move (out of place: read x + write y; in place: read + write the
64 rope channels; fwd+bwd: also read dy + write dx), compared with the measured 4.27 TB/s H200 copy ceiling
(performance-anchors.md §0). Correctness is checked first (bf16 vs fp32 reference: rel. L2 <= 1e-2, cos >= 0.9999,
nope channels bit-identical); the script exits non-zero if a check fails. Prints one table; writes JSON to --out
and to benchmarks/results/.
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
        if not torch.equal(x, xl.detach()):
            failures.append(f"{name}: out-of-place call modified its input")
    return checks


SWEEP = [(16384, 4), (8192, 4), (32768, 4), (16384, 8), (32768, 8), (65536, 8)]


def sweep(cfg, tokens: int, kv_tokens: int, device, failures: list[str]) -> list[dict]:
    """Time ``apply_rope`` under each ``RopeKernelConfig`` of :data:`SWEEP` (q in/out of place, kv in place).

    A geometry whose result is not bit-identical to the default's is reported in ``failures`` and not timed.
    """
    from dsv4_primitives import apply_rope
    from dsv4_primitives.rope import apply as rope_apply

    default = rope_apply.KERNEL_CONFIG
    out = []
    cases = [
        ("q", (tokens, 64, 512), False, 2 * tokens * 64 * 512 * 2),
        ("q", (tokens, 64, 512), True, 2 * tokens * 64 * 64 * 2),
        ("kv", (kv_tokens, 512), True, 2 * kv_tokens * 64 * 2),
    ]
    try:
        for case, shape, inplace, nbytes in cases:
            pos, maxp = _thd_positions(shape[0], device)
            x = torch.randn(shape, device=device).bfloat16()
            want = apply_rope(x, pos, cfg, backend="triton", max_position=maxp)
            seen = set()
            for bpp, warps in SWEEP:
                rope_apply.KERNEL_CONFIG = rope_apply.RopeKernelConfig(
                    bytes_per_program=bpp, min_programs=default.min_programs, num_warps=warps
                )
                heads = shape[1] if len(shape) == 3 else 1
                _, consts, _ = rope_apply.launch_params(shape[0], heads, 512, 64, 2, not inplace, True)
                tile = (consts["BLOCK_P"], consts["BLOCK_H"], warps)
                if tile in seen:  # the launcher's layout caps can map several configs to one tile
                    continue
                seen.add(tile)
                xi = x.clone()
                got = apply_rope(
                    xi if inplace else x, pos, cfg, inplace=inplace, backend="triton", max_position=maxp
                )
                if not torch.equal(got, want):
                    failures.append(f"sweep {case} {bpp} B x {warps} warps: result differs from the default")
                    continue
                fn = lambda x=x, xi=xi, pos=pos, mp=maxp, ip=inplace: apply_rope(
                    xi if ip else x, pos, cfg, inplace=ip, backend="triton", max_position=mp
                )
                med, p10, p90 = _bench(fn)
                gbs = nbytes / (med * 1e-3) / 1e9
                out.append(
                    {
                        "case": case,
                        "shape": list(shape),
                        "mode": "in-place" if inplace else "out-of-place",
                        "bytes_per_program": bpp,
                        "num_warps": warps,
                        "tile_positions_heads": [tile[0], tile[1]],
                        "default": (bpp, warps) == (default.bytes_per_program, default.num_warps),
                        "median_ms": med,
                        "p10_ms": p10,
                        "p90_ms": p90,
                        "GB_per_s": gbs,
                        "pct_of_4270_GBps": 100.0 * gbs / HBM_CEILING_GBS,
                    }
                )
    finally:
        rope_apply.KERNEL_CONFIG = default
    return out


def run(
    out_dir: Path,
    tokens: int,
    kv_tokens: int,
    device: str = "cuda",
    check_tokens: int = 3000,
    do_sweep: bool = False,
) -> int:
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
            "ours copy_+in-place": lambda x=x, pos=pos, inv=inverse, mp=maxp: apply_rope(
                x.clone(), pos, cfg, inverse=inv, inplace=True, backend="triton", max_position=mp
            ),
            "eager torch backend": lambda x=x, pos=pos, inv=inverse, mp=maxp: apply_rope(
                x, pos, cfg, inverse=inv, backend="reference", max_position=mp
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
                            xi, pos, cfg, inplace=True, backend="reference", max_position=mp
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
                        "eager torch backend": lambda: fb("reference"),
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
    sweep_rows = sweep(cfg, tokens, kv_tokens, device, failures) if do_sweep else []
    if sweep_rows:
        hdr = f"{'case':<6} {'mode':<13} {'bytes/prog':>10} {'warps':>5} {'tile PxH':>9} {'median ms':>10} {'p10':>8} {'GB/s':>8} {'% 4.27TB/s':>10}"
        print("\nlaunch-geometry sweep (RopeKernelConfig; * = default)\n" + hdr + "\n" + "-" * len(hdr))
        for r in sweep_rows:
            print(
                f"{r['case']:<6} {r['mode']:<13} {r['bytes_per_program']:>10} {r['num_warps']:>5} "
                f"{'x'.join(map(str, r['tile_positions_heads'])):>9} "
                f"{r['median_ms']:>10.4f} {r['p10_ms']:>8.4f} {r['GB_per_s']:>8.0f} {r['pct_of_4270_GBps']:>9.1f}%"
                + (" *" if r["default"] else "")
            )
    write_results(
        "bench_rope",
        out_dir,
        device,
        {
            "hbm_ceiling_GBps": HBM_CEILING_GBS,
            "rope": {"rope_dim": 64, "base": 160000.0, "yarn": True, "head_dim": 512},
            "checks": checks,
            "rows": rows,
            "sweep": sweep_rows,
            "sweep_failures": failures,
        },
    )
    if failures:
        print("SWEEP CHECK FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for the JSON result")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens T of the q / output cases")
    ap.add_argument("--kv-tokens", type=int, default=65536, help="tokens of the kv case")
    ap.add_argument("--sweep", action="store_true", help="also time the kernel's launch geometries")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_rope: no CUDA device; nothing to measure (run on the GPU box)")
        return 0
    if args.tokens < 1 or args.kv_tokens < 1:
        raise ValueError("--tokens and --kv-tokens must be positive")
    return run(args.out, args.tokens, args.kv_tokens, do_sweep=args.sweep)


if __name__ == "__main__":
    sys.exit(main())
