"""Benchmark: fused vocab-parallel cross entropy (forward and forward+backward) vs megatron-core's unfused
``tensor_parallel.vocab_parallel_cross_entropy`` and ``torch.nn.functional.cross_entropy`` on fp32-upcast logits
(H200, bf16 logits, DSv4 vocabulary 129280).

Run on the GPU box with our sources on PYTHONPATH (no uv, no network):

    python3 packages/dsv4-primitives/benchmarks/bench_cross_entropy.py --out /tmp/out

Cases: logits ``[T, 1, 129280]`` bf16 (``T`` from ``--tokens``, default 4096 and 8192: one output head of a
flash-smoke step), integer targets ``[T, 1]``, fp32 incoming loss gradient ``[T, 1]``. Implementations:

  ours triton          ``vocab_parallel_cross_entropy(backend="triton")``: gradient in a new bf16 tensor
  ours triton inplace  the same with ``inplace_backward=True`` (gradient written into the logits buffer)
  megatron unfused     megatron-core 0.19.2 ``vocab_parallel_cross_entropy`` (world-size-1 NCCL group): fp32 copy
                       of the logits, ~8 elementwise passes over it, fp32 gradient cast back to bf16 by autograd
  F.cross_entropy fp32 ``F.cross_entropy(logits.float(), target, reduction="none")``

Timing: ``triton.testing.do_bench`` (median, p10, p90) of ``loss = f(logits)`` (fwd, under ``no_grad``) and of
``torch.autograd.grad(loss, logits, g)`` (fwd+bwd) on a non-leaf ``logits`` made once (the in-place variant overwrites
it with gradients every call; its kernels are data-independent). GB/s counts the compulsory bytes: forward reads the
logits once, forward+backward reads them twice and writes the gradient once (``3 * T * V * 2`` bytes). Peak extra
memory: peak CUDA allocation of one call beyond what was allocated before it (the logits exist already; the
returned gradient is counted). Correctness is checked first against the fp32 reference (``T = --check-tokens``,
labels smoothing 0 and 0.1, both output modes) and against megatron; the script exits non-zero if a check fails.
Prints one table; writes JSON to --out and to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from _bench_utils import HBM_CEILING_GBS, RESULTS_DIR, write_results
from _bench_utils import bench as _bench
from _bench_utils import cosine as _cos
from _bench_utils import peak_extra_mib as _peak_extra_mib
from _bench_utils import rel_l2 as _rel_l2

HBM_PEAK_GBS = 4800.0  # H200 HBM3e peak
VOCAB = 129280


def _init_group():
    import torch.distributed as dist

    if not dist.is_initialized():
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist.group.WORLD


def _impls(group):
    import torch.nn.functional as F
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as megatron_ce

    from dsv4_primitives import vocab_parallel_cross_entropy

    def ours(x, t, ls=0.0):
        return vocab_parallel_cross_entropy(x, t, tp_group=group, label_smoothing=ls, backend="triton")

    def ours_inplace(x, t, ls=0.0):
        return vocab_parallel_cross_entropy(
            x, t, tp_group=group, label_smoothing=ls, backend="triton", inplace_backward=True
        )

    def megatron(x, t, ls=0.0):
        return megatron_ce(x, t, ls, group)

    def torch_ce(x, t, ls=0.0):
        return F.cross_entropy(x.float().view(-1, x.shape[-1]), t.view(-1), reduction="none").view(t.shape)

    return {
        "ours triton": ours,
        "ours triton inplace": ours_inplace,
        "megatron unfused": megatron,
        "F.cross_entropy fp32": torch_ce,
    }


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def _loss_grad(fn, x: torch.Tensor, t: torch.Tensor, g: torch.Tensor, ls: float):
    leaf = x.detach().clone().requires_grad_(True)
    logits = leaf * 1  # non-leaf, like the output layer's result
    loss = fn(logits, t, ls)
    (gx,) = torch.autograd.grad(loss, logits, g)
    return loss.detach(), gx


def correctness(tokens: int, device, group, failures: list[str]) -> list[dict]:
    """Ours vs the fp32 reference (bound: 2x the bf16 rounding of the reference gradient + atol) and megatron."""
    from dsv4_primitives import vocab_parallel_cross_entropy_ref

    impls = _impls(group)
    torch.manual_seed(0)
    x = (4 * torch.randn(tokens, 1, VOCAB, device=device)).bfloat16()
    t = torch.randint(0, VOCAB, (tokens, 1), device=device)
    g = torch.rand(tokens, 1, device=device)
    checks = []

    def record(name, got, ref, bound):
        rel, cos, err = _rel_l2(got, ref), _cos(got, ref), _max_err(got, ref)
        finite = bool(torch.isfinite(got).all())
        ok = finite and err <= bound and rel <= 1e-2 and cos >= 0.9999
        if not ok:
            failures.append(f"{name}: rel_l2={rel:.2e} cos={cos:.6f} max_err={err:.2e} (bound {bound:.2e})")
        checks.append({"name": name, "rel_l2": rel, "cos": cos, "max_err": err, "bound": bound, "ok": ok})

    for ls in (0.0, 0.1):
        ref_loss, ref_grad = _loss_grad(
            lambda a, b, c: vocab_parallel_cross_entropy_ref(a, b, label_smoothing=c), x.float(), t, g, ls
        )
        grad_bound = 2 * _max_err(ref_grad.bfloat16(), ref_grad) + 1e-3
        meg_loss, meg_grad = _loss_grad(impls["megatron unfused"], x, t, g, ls)
        for name in ("ours triton", "ours triton inplace"):
            loss, grad = _loss_grad(impls[name], x, t, g, ls)
            record(f"{name} ls={ls} loss", loss, ref_loss, 1e-5 * max(1.0, float(ref_loss.abs().max())))
            record(f"{name} ls={ls} grad", grad, ref_grad, grad_bound)
            record(f"{name} ls={ls} loss vs megatron", loss, meg_loss, 1e-4)
            record(f"{name} ls={ls} grad vs megatron", grad, meg_grad, 2**-7)  # |grad| < 1: 2 bf16 ulps
    return checks


def run(out_dir: Path, token_list: list[int], check_tokens: int, device: str = "cuda") -> int:
    device = torch.device(device)
    group = _init_group()
    failures: list[str] = []
    checks = correctness(check_tokens, device, group, failures)
    for c in checks:
        print(
            f"check {c['name']:<40} rel_l2={c['rel_l2']:.2e} cos={c['cos']:.7f} max_err={c['max_err']:.2e} "
            f"(bound {c['bound']:.2e}) {'ok' if c['ok'] else 'FAIL'}"
        )
    if failures:
        print("CORRECTNESS FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1

    impls = _impls(group)
    rows = []
    for tokens in token_list:
        torch.manual_seed(1)
        base = (4 * torch.randn(tokens, 1, VOCAB, device=device)).bfloat16()
        t = torch.randint(0, VOCAB, (tokens, 1), device=device)
        g = torch.rand(tokens, 1, device=device)
        nbytes_logits = base.numel() * base.element_size()
        for mode, nbytes in (("fwd", nbytes_logits), ("fwd+bwd", 3 * nbytes_logits)):
            results = {}
            for name, fn in impls.items():
                if mode == "fwd" and name == "ours triton inplace":
                    continue  # same forward as "ours triton"
                leaf = base.clone().requires_grad_(True)
                logits = leaf * 1  # non-leaf, made once

                if mode == "fwd":

                    def call(fn=fn, logits=logits, t=t):
                        with torch.no_grad():
                            fn(logits, t)
                else:

                    def call(fn=fn, logits=logits, t=t, g=g):
                        torch.autograd.grad(fn(logits, t), logits, g)

                call()  # warm-up (compile)
                med, p10, p90 = _bench(call)
                results[name] = (med, p10, p90, _peak_extra_mib(call))
                del leaf, logits
            base_ms = results["megatron unfused"][0]
            for name, (med, p10, p90, peak) in results.items():
                gbs = nbytes / (med * 1e-3) / 1e9
                rows.append(
                    {
                        "shape": [tokens, 1, VOCAB],
                        "mode": mode,
                        "impl": name,
                        "median_ms": med,
                        "p10_ms": p10,
                        "p90_ms": p90,
                        "bytes": nbytes,
                        "GB_per_s": gbs,
                        "pct_of_4800_GBps_peak": 100.0 * gbs / HBM_PEAK_GBS,
                        "pct_of_4270_GBps_copy": 100.0 * gbs / HBM_CEILING_GBS,
                        "speedup_vs_megatron": base_ms / med,
                        "peak_extra_MiB": peak,
                    }
                )
        del base, t, g
        torch.cuda.empty_cache()

    header = (
        f"{'shape':<15} {'mode':<8} {'impl':<21} {'median ms':>10} {'p10':>8} {'p90':>8} {'GB/s':>7} "
        f"{'% 4.8TB/s':>9} {'% 4.27':>7} {'vs megatron':>11} {'peak MiB':>9}"
    )
    print()
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{'x'.join(map(str, r['shape'])):<15} {r['mode']:<8} {r['impl']:<21} {r['median_ms']:>10.4f} "
            f"{r['p10_ms']:>8.4f} {r['p90_ms']:>8.4f} {r['GB_per_s']:>7.0f} {r['pct_of_4800_GBps_peak']:>8.1f}% "
            f"{r['pct_of_4270_GBps_copy']:>6.1f}% {r['speedup_vs_megatron']:>10.2f}x {r['peak_extra_MiB']:>9.1f}"
        )
    write_results(
        "bench_cross_entropy",
        out_dir,
        torch.device(device),
        {
            "hbm_peak_GBps": HBM_PEAK_GBS,
            "hbm_copy_ceiling_GBps": HBM_CEILING_GBS,
            "vocab": VOCAB,
            "tokens": token_list,
            "checks": checks,
            "rows": rows,
        },
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for the JSON result")
    ap.add_argument(
        "--tokens", type=int, nargs="+", default=[4096, 8192], help="rows T of the [T, 1, V] logits"
    )
    ap.add_argument("--check-tokens", type=int, default=1024, help="rows of the correctness gate")
    args = ap.parse_args()
    if min(args.tokens) < 1 or args.check_tokens < 1:
        raise ValueError("--tokens and --check-tokens must be positive")
    if not torch.cuda.is_available():
        print("bench_cross_entropy: no CUDA device; nothing to measure (run on the GPU box)")
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
