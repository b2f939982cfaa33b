"""Benchmark: the fused output head + cross entropy (``linear_cross_entropy``, both modes) side by side with the
unfused head, liger-kernel and cut-cross-entropy, in one process, on the DSv4 head shape (bf16, V = 129280,
d = 4096, mean loss, forward + backward).

Run on the GPU box with our sources on PYTHONPATH (no uv, no network); the peers are benchmark-only wheels,
imported only when installed (``pip install --no-deps liger_kernel-0.8.5-*.whl cut_cross_entropy-25.1.1-*.whl``):

    python3 packages/dsv4-primitives/benchmarks/bench_linear_cross_entropy.py --out /tmp/out

Implementations (each computes ``mean_t loss_t`` of ``h [T, d]``, ``W [V, d]``, targets ``y [T]``, and the
gradients of ``h`` and ``W``):

  unfused torch CE        ``F.cross_entropy((h @ W.T).float(), y)``: bf16 logits, an fp32 copy (the issue's
                          "unfused head", ``shared/anchors/fused_ce_peers.py``)
  unfused + fused CE      ``vocab_parallel_cross_entropy(h @ W.T, y, inplace_backward=True).mean()`` (the model's
                          path without the fused head: bf16 logits, their gradient written in place)
  ours grad_in_forward    ``linear_cross_entropy(h, W, y).mean()`` (the default under autograd: 3 head GEMMs)
  ours recompute          ``linear_cross_entropy(h, W, y, mode="recompute").mean()`` (4 head GEMMs)
  liger-kernel            ``LigerFusedLinearCrossEntropyLoss()(W, h, y)`` (if installed)
  cut-cross-entropy       ``cut_cross_entropy.linear_cross_entropy(h, W, y)`` (if installed)

Timing: ``triton.testing.do_bench`` (median, p10, p90) of one forward + ``torch.autograd.grad`` w.r.t. ``h`` and
``W``. TFLOP/s counts three head GEMMs (``3 * 2 T V d``) for every implementation. Peak: the largest CUDA
allocation of one call beyond what was allocated before it (the inputs; the returned gradients are counted), in
GiB, as the anchor script measures it. A case that runs out of memory is recorded as ``"OOM"``, a peer that raises
as its error. Correctness first (``T = --check-tokens``): loss, ``dh`` and ``dW`` of every implementation against
the fp32 reference; ours must stay within 2x the unfused bf16 path's error plus a small atol (the script exits
non-zero otherwise); the peers' errors are printed. Prints one table per T; writes JSON to --out and results/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _bench_utils import RESULTS_DIR, write_results
from _bench_utils import bench as _bench

VOCAB = 129280
HIDDEN = 4096
GIB = 2**30


def _peers() -> tuple[dict, dict]:
    """``(impls, skipped)``: the peer implementations that import, and why the others did not."""
    impls, skipped = {}, {}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        impls["liger-kernel"] = lambda h, w, y: liger(w, h, y)
    except ImportError as e:
        skipped["liger-kernel"] = f"not installed ({e})"
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        impls["cut-cross-entropy"] = lambda h, w, y: cce(h, w, y)
    except ImportError as e:
        skipped["cut-cross-entropy"] = f"not installed ({e})"
    return impls, skipped


def _impls() -> tuple[dict, dict]:
    from dsv4_primitives import linear_cross_entropy, vocab_parallel_cross_entropy

    ours = {
        "unfused torch CE": lambda h, w, y: F.cross_entropy((h @ w.t()).float(), y),
        "unfused + fused CE": lambda h, w, y: vocab_parallel_cross_entropy(
            h @ w.t(), y, inplace_backward=True
        ).mean(),
        "ours grad_in_forward": lambda h, w, y: linear_cross_entropy(h, w, y).mean(),
        "ours recompute": lambda h, w, y: linear_cross_entropy(h, w, y, mode="recompute").mean(),
    }
    peers, skipped = _peers()
    return {**ours, **peers}, skipped


def _inputs(tokens: int, device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(tokens, HIDDEN, device=device, generator=gen).bfloat16()
    w = (torch.randn(VOCAB, HIDDEN, device=device, generator=gen) * HIDDEN**-0.5).bfloat16()
    y = torch.randint(0, VOCAB, (tokens,), device=device, generator=gen)
    return h, w, y


def _grads(fn, h, w, y):
    h = h.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    loss = fn(h, w, y)
    dh, dw = torch.autograd.grad(loss, (h, w))
    return loss.detach().float(), dh, dw


def _max_err(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def correctness(impls: dict, tokens: int, device, failures: list[str]) -> list[dict]:
    """Every implementation vs the fp32 reference; ours within 2x the unfused bf16 error + atol."""
    from dsv4_primitives import linear_cross_entropy_ref

    h, w, y = _inputs(tokens, device, 0)
    ref = _grads(lambda a, b, c: linear_cross_entropy_ref(a, b, c).mean(), h.float(), w.float(), y)
    base = _grads(impls["unfused + fused CE"], h, w, y)
    checks = []
    for impl, fn in impls.items():
        try:
            got = _grads(fn, h, w, y)
        except Exception as e:  # a peer that fails is itself a data point
            checks.append({"impl": impl, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        for i, name in enumerate(("loss", "dh", "dW")):
            scale = max(1.0, float(ref[i].abs().max()))
            bound = 2 * _max_err(base[i], ref[i]) + (1e-5 if name == "loss" else 1e-3) * scale
            err = _max_err(got[i], ref[i])
            ok = bool(torch.isfinite(got[i]).all()) and err <= bound
            if impl.startswith("ours") and not ok:
                failures.append(f"{impl} {name}: max_err={err:.3e} > bound {bound:.3e}")
            checks.append({"impl": impl, "name": name, "max_err": err, "bound": bound, "ok": ok})
        del got
        torch.cuda.empty_cache()
    return checks


def _measure(fn, h, w, y) -> dict:
    def call():
        torch.autograd.grad(fn(h, w, y), (h, w))

    call()  # warm-up (compile, autotune)
    med, p10, p90 = _bench(call)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / GIB
    return {"median_ms": med, "p10_ms": p10, "p90_ms": p90, "peak_GiB": peak}


def run(out_dir: Path, token_list: list[int], check_tokens: int) -> int:
    device = torch.device("cuda")
    impls, skipped = _impls()
    for name, why in skipped.items():
        print(f"skip {name}: {why}")
    failures: list[str] = []
    checks = correctness(impls, check_tokens, device, failures)
    for c in checks:
        if "error" in c:
            print(f"check {c['impl']:<22} ERROR {c['error']}")
        else:
            print(
                f"check {c['impl']:<22} {c['name']:<5} max_err={c['max_err']:.3e} (ours' bound {c['bound']:.3e})"
                f"{'' if c['ok'] else ' over'}"
            )
    if failures:
        print("CORRECTNESS FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    rows = []
    for tokens in token_list:
        h, w, y = _inputs(tokens, device, 1)
        h.requires_grad_(True)
        w.requires_grad_(True)
        flops = 3 * 2 * tokens * VOCAB * HIDDEN
        for name, fn in impls.items():
            row = {"tokens": tokens, "impl": name}
            try:
                row.update(_measure(fn, h, w, y))
                row["TFLOPs"] = flops / (row["median_ms"] * 1e-3) / 1e12
            except torch.OutOfMemoryError:
                row["median_ms"] = "OOM"
            except Exception as e:  # a peer that fails is itself a data point
                row["median_ms"] = f"{type(e).__name__}: {str(e)[:120]}"
            rows.append(row)
            torch.cuda.empty_cache()
        del h, w, y
        torch.cuda.empty_cache()
    _print_table(rows)
    write_results(
        "bench_linear_cross_entropy",
        out_dir,
        device,
        {
            "vocab": VOCAB,
            "hidden": HIDDEN,
            "tokens": token_list,
            "skipped": skipped,
            "checks": checks,
            "rows": rows,
        },
    )
    return 0


def _print_table(rows: list[dict]) -> None:
    header = f"{'T':>6} {'impl':<22} {'median ms':>10} {'p10':>9} {'p90':>9} {'TFLOP/s':>8} {'peak GiB':>9} {'vs best peer':>12}"
    print()
    print(header)
    print("-" * len(header))
    for tokens in sorted({r["tokens"] for r in rows}):
        mine = [r for r in rows if r["tokens"] == tokens]
        peers = [
            r["median_ms"]
            for r in mine
            if isinstance(r["median_ms"], float)
            and r["impl"] in ("unfused torch CE", "liger-kernel", "cut-cross-entropy")
        ]
        best = min(peers) if peers else None
        for r in mine:
            if not isinstance(r["median_ms"], float):
                print(f"{tokens:>6} {r['impl']:<22} {r['median_ms']}")
                continue
            ratio = f"{best / r['median_ms']:.2f}x" if best else "-"
            print(
                f"{tokens:>6} {r['impl']:<22} {r['median_ms']:>10.2f} {r['p10_ms']:>9.2f} {r['p90_ms']:>9.2f} "
                f"{r['TFLOPs']:>8.1f} {r['peak_GiB']:>9.2f} {ratio:>12}"
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for the JSON result")
    ap.add_argument(
        "--tokens", type=int, nargs="+", default=[4096, 16384, 32768, 65536], help="rows T of hidden [T, d]"
    )
    ap.add_argument("--check-tokens", type=int, default=1024, help="rows of the correctness gate")
    args = ap.parse_args()
    if min(args.tokens) < 1 or args.check_tokens < 1:
        raise ValueError("--tokens and --check-tokens must be positive")
    if not torch.cuda.is_available():
        print("bench_linear_cross_entropy: no CUDA device; nothing to measure (run on the GPU box)")
        return 0
    return run(args.out, args.tokens, args.check_tokens)


if __name__ == "__main__":
    sys.exit(main())
