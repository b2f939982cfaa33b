"""Benchmark: fused output head + cross entropy (``linear_cross_entropy``, vocab-chunked, logits recomputed in the
backward) vs the unfused head (``hidden @ W.T`` materialising bf16 ``[T, V]`` logits, then a cross entropy) on the
DSv4 head shape (H200, bf16, vocabulary 129280, hidden 4096).

Run on the GPU box with our sources on PYTHONPATH (no uv, no network):

    python3 packages/dsv4-primitives/benchmarks/bench_linear_cross_entropy.py --out /tmp/out

Cases: hidden ``[T, 4096]`` bf16 (``T`` from ``--tokens``, default 4096, 16384, 65536), head weight
``[129280, 4096]`` bf16, integer targets ``[T]``, fp32 incoming per-token loss gradient. Implementations:

  ours fused linear CE   ``linear_cross_entropy(h, W, y)`` (default vocab chunk: 2**28 / T weight rows)
  unfused + fused CE     ``vocab_parallel_cross_entropy(h @ W.T, y, inplace_backward=True)`` (the model's path
                         before the fused head: bf16 logits and their gradient in place)
  unfused + megatron CE  megatron-core 0.19.2 ``vocab_parallel_cross_entropy`` on ``h @ W.T`` (fp32 logits copy)

Timing: ``triton.testing.do_bench`` (median, p10, p90) of forward + backward (``torch.autograd.grad`` w.r.t.
``h`` and ``W``). TFLOP/s counts the three head GEMMs of the unfused path (``3 * 2 T V d``; ours runs a fourth, the
recomputed logits). Peak extra memory: peak CUDA allocation of one call beyond what was allocated before it (inputs
exist already; the returned gradients are counted). A case that runs out of memory is recorded as ``"OOM"``.
Correctness is checked first (``T = --check-tokens``): loss, ``dh`` and ``dW`` against the fp32 reference within 2x
the unfused bf16 path's error plus a small atol; the script exits non-zero if a check fails. Prints one table;
writes JSON to --out and to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from _bench_utils import RESULTS_DIR, write_results
from _bench_utils import bench as _bench
from _bench_utils import peak_extra_mib as _peak_extra_mib

VOCAB = 129280
HIDDEN = 4096


def _init_group():
    import socket

    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist.group.WORLD


def _impls(group):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as megatron_ce

    from dsv4_primitives import linear_cross_entropy, vocab_parallel_cross_entropy

    def ours(h, w, y):
        return linear_cross_entropy(h, w, y, backend="triton")

    def unfused_fused_ce(h, w, y):
        logits = h @ w.t()  # [T, V] bf16
        return vocab_parallel_cross_entropy(logits, y, inplace_backward=True, backend="triton")

    def unfused_megatron(h, w, y):
        return megatron_ce((h @ w.t())[:, None], y[:, None], 0.0, group)[:, 0]

    return {
        "ours fused linear CE": ours,
        "unfused + fused CE": unfused_fused_ce,
        "unfused + megatron CE": unfused_megatron,
    }


def _inputs(tokens: int, device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(tokens, HIDDEN, device=device, generator=gen).bfloat16()
    w = (torch.randn(VOCAB, HIDDEN, device=device, generator=gen) * HIDDEN**-0.5).bfloat16()
    y = torch.randint(0, VOCAB, (tokens,), device=device, generator=gen)
    g = torch.rand(tokens, device=device, generator=gen) / tokens
    return h, w, y, g


def _grads(fn, h, w, y, g):
    h = h.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    loss = fn(h, w, y)
    dh, dw = torch.autograd.grad(loss, (h, w), g.to(loss.dtype))
    return loss.detach(), dh, dw


def _max_err(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def correctness(tokens: int, device, group, failures: list[str]) -> list[dict]:
    """Ours and the unfused path vs the fp32 reference; ours must stay within 2x the unfused error + atol."""
    from dsv4_primitives import linear_cross_entropy_ref

    impls = _impls(group)
    h, w, y, g = _inputs(tokens, device, 0)
    ref = _grads(linear_cross_entropy_ref, h.float(), w.float(), y, g)
    base = _grads(impls["unfused + fused CE"], h, w, y, g)
    ours = _grads(impls["ours fused linear CE"], h, w, y, g)
    checks = []
    for i, name in enumerate(("loss", "dh", "dW")):
        scale = max(1.0, float(ref[i].abs().max()))
        atol = (1e-5 if name == "loss" else 1e-3) * scale
        bound = 2 * _max_err(base[i], ref[i]) + atol
        err = _max_err(ours[i], ref[i])
        ok = bool(torch.isfinite(ours[i]).all()) and err <= bound
        if not ok:
            failures.append(f"{name}: max_err={err:.3e} > bound {bound:.3e}")
        checks.append(
            {"name": name, "max_err": err, "unfused_err": _max_err(base[i], ref[i]), "bound": bound, "ok": ok}
        )
    return checks


def run(out_dir: Path, token_list: list[int], check_tokens: int, device: str = "cuda") -> int:
    device = torch.device(device)
    group = _init_group()
    failures: list[str] = []
    checks = correctness(check_tokens, device, group, failures)
    for c in checks:
        print(
            f"check {c['name']:<5} max_err={c['max_err']:.3e} unfused_err={c['unfused_err']:.3e} "
            f"(bound {c['bound']:.3e}) {'ok' if c['ok'] else 'FAIL'}"
        )
    if failures:
        print("CORRECTNESS FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1

    impls = _impls(group)
    rows = []
    for tokens in token_list:
        h, w, y, g = _inputs(tokens, device, 1)
        h.requires_grad_(True)
        w.requires_grad_(True)
        flops = 3 * 2 * tokens * VOCAB * HIDDEN
        base_ms = None
        for name, fn in impls.items():

            def call(fn=fn, h=h, w=w, y=y, g=g):
                torch.autograd.grad(fn(h, w, y), (h, w), g)

            row = {"tokens": tokens, "vocab": VOCAB, "hidden": HIDDEN, "impl": name}
            try:
                call()  # warm-up (compile)
                med, p10, p90 = _bench(call)
                peak = _peak_extra_mib(call)
            except torch.OutOfMemoryError:
                row.update(median_ms="OOM", peak_extra_MiB="OOM")
                rows.append(row)
                torch.cuda.empty_cache()
                continue
            if name == "unfused + fused CE":
                base_ms = med
            row.update(
                median_ms=med,
                p10_ms=p10,
                p90_ms=p90,
                TFLOPs=flops / (med * 1e-3) / 1e12,
                peak_extra_MiB=peak,
            )
            rows.append(row)
            torch.cuda.empty_cache()
        for row in rows:
            if row["tokens"] == tokens and base_ms is not None and isinstance(row["median_ms"], float):
                row["speedup_vs_unfused_fused_ce"] = base_ms / row["median_ms"]
        del h, w, y, g, call
        torch.cuda.empty_cache()

    header = f"{'T':>7} {'impl':<23} {'median ms':>10} {'p10':>9} {'p90':>9} {'TFLOP/s':>8} {'peak MiB':>10} {'speedup':>8}"
    print()
    print(header)
    print("-" * len(header))
    for r in rows:
        if r["median_ms"] == "OOM":
            print(f"{r['tokens']:>7} {r['impl']:<23} {'OOM':>10}")
            continue
        print(
            f"{r['tokens']:>7} {r['impl']:<23} {r['median_ms']:>10.3f} {r['p10_ms']:>9.3f} {r['p90_ms']:>9.3f} "
            f"{r['TFLOPs']:>8.1f} {r['peak_extra_MiB']:>10.0f} {r.get('speedup_vs_unfused_fused_ce', float('nan')):>7.2f}x"
        )
    write_results(
        "bench_linear_cross_entropy",
        out_dir,
        device,
        {"vocab": VOCAB, "hidden": HIDDEN, "tokens": token_list, "checks": checks, "rows": rows},
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for the JSON result")
    ap.add_argument(
        "--tokens", type=int, nargs="+", default=[4096, 16384, 65536], help="rows T of hidden [T, d]"
    )
    ap.add_argument("--check-tokens", type=int, default=1024, help="rows of the correctness gate")
    args = ap.parse_args()
    if min(args.tokens) < 1 or args.check_tokens < 1:
        raise ValueError("--tokens and --check-tokens must be positive")
    if not torch.cuda.is_available():
        print("bench_linear_cross_entropy: no CUDA device; nothing to measure (run on the GPU box)")
        return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    try:
        return run(args.out, args.tokens, args.check_tokens)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
