"""Shared helpers of ``bench_csa.py`` and its section modules: timing, memory, gates, the result table, inputs.

Every row goes through :func:`record` into :data:`ROWS` and every correctness gate through :func:`gate` into
:data:`GATES`, so all sections land in one table and one JSON.
"""

from __future__ import annotations

from pathlib import Path

import torch
from triton.testing import do_bench

from dsv4_primitives.varlen import SeqBoundaries

PEAK = 804e12
PEAK_DATASHEET = 989e12
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------------------------------- helpers
def timeit(fn, grad_to_none=None, rep=200) -> tuple[float, float, float]:
    """(median, p10, p90) in ms via triton's do_bench (events; warmup 25 ms)."""
    q = do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, quantiles=[0.5, 0.1, 0.9])
    return float(q[0]), float(q[1]), float(q[2])


def peak_extra_gib(fn) -> float:
    """max_memory_allocated - allocated before, in GiB, for one call of ``fn`` (inputs already allocated)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**30


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))


ROWS: list[dict] = []
GATES: list[dict] = []


def record(section, shape, impl, mode, ms3, flop, mem_gib, note="") -> dict:
    ms, p10, p90 = ms3
    tf = flop / (ms * 1e-3) / 1e12 if flop else float("nan")
    row = dict(
        section=section,
        shape=shape,
        impl=impl,
        mode=mode,
        ms=ms,
        p10=p10,
        p90=p90,
        useful_tflops=tf,
        pct_804=100 * tf * 1e12 / PEAK,
        pct_989=100 * tf * 1e12 / PEAK_DATASHEET,
        extra_mem_gib=mem_gib,
        note=note,
    )
    ROWS.append(row)
    print(
        f"  {section:10s} {shape:22s} {impl:14s} {mode:8s} {ms:9.3f} ms  {tf:7.1f} TF/s  "
        f"{row['pct_804']:5.1f}%  +{mem_gib:6.2f} GiB  {note}",
        flush=True,
    )
    return row


def gate(name, got: torch.Tensor, ref: torch.Tensor, tol=1e-2, cos_min=0.9999) -> bool:
    finite = bool(torch.isfinite(got).all())
    r, c = rel_l2(got, ref), cosine(got, ref)
    ok = finite and r <= tol and c >= cos_min
    GATES.append(dict(name=name, rel_l2=r, cos=c, finite=finite, ok=ok))
    print(f"  gate {name:40s} rel_l2={r:.2e} cos={c:.6f} {'OK' if ok else 'FAIL'}", flush=True)
    return ok


# ----------------------------------------------------------------------------------- sparse attention inputs
def window_part(T: int, W: int, device) -> torch.Tensor:
    """[T, W] rows t-W+1..t of one document starting at 0 (-1 before the start)."""
    t = torch.arange(T, device=device)[:, None]
    idx = t - W + 1 + torch.arange(W, device=device)[None, :]
    return torch.where(idx >= 0, idx, -1).to(torch.int32)


def compressed_part(T: int, ratio: int, topk: int, dense: bool, device, gen) -> tuple[torch.Tensor, int]:
    """[T, K] rows ``T + w`` of visible entries (``w < (t+1)//ratio``): random top-k (CSA) or all (HCA)."""
    Tc = T // ratio
    t = torch.arange(T, device=device)[:, None]
    w = torch.arange(Tc, device=device)[None, :]
    visible = w < (t + 1) // ratio  # [T, Tc]
    if dense:
        idx = torch.where(visible, T + w, -1)
        return idx.to(torch.int32), Tc
    scores = torch.rand(T, Tc, device=device, generator=gen).masked_fill(~visible, -1.0)
    k = min(topk, Tc)
    val, sel = scores.topk(k, dim=1)
    idx = torch.where(val >= 0, T + sel, -1)
    if k < topk:
        idx = torch.cat([idx, idx.new_full((T, topk - k), -1)], 1)
    return idx.to(torch.int32), Tc


def attn_inputs(S, H, D, W, ratio, topk, dense, seed=0, dtype=torch.bfloat16):
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(seed)
    parts = [window_part(S, W, dev)] if W else []
    Tc = 0
    if ratio:
        cp, Tc = compressed_part(S, ratio, topk, dense, dev, gen)
        parts.append(cp)
    idx = torch.cat(parts, 1).contiguous()
    q = torch.randn(S, H, D, device=dev, generator=gen, dtype=torch.float32).to(dtype)
    kv = torch.randn(S + Tc, D, device=dev, generator=gen, dtype=torch.float32).to(dtype)
    sink = torch.randn(H, device=dev, generator=gen) * 2
    return q, kv, sink, idx


def attn_flops(idx: torch.Tensor, H: int, D: int) -> float:
    pairs = int((idx >= 0).sum())
    return 2.0 * H * pairs * (D + D)


# ---------------------------------------------------------------------------------------------- indexer
def _indexer_inputs(S, HI, DI, ratio, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(S, HI, DI, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(S // ratio, DI, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(S, HI, device="cuda", generator=gen) * (HI * DI) ** -0.5).to(torch.bfloat16)
    return q, k, w, SeqBoundaries.from_host([0, S], "cuda")


HBM_BW = 4.8e12  # H200 datasheet HBM3e bandwidth, bytes/s


def print_table():
    print()
    print(
        f"{'section':10s} {'shape':22s} {'impl':14s} {'mode':8s} {'ms':>9s} {'TF/s':>7s} {'%804':>6s} {'xEager':>7s} {'+GiB':>7s}"
    )
    for r in ROWS:
        sp = r.get("speedup_vs_eager")
        sps = f"{sp:7.1f}" if sp else "      -"
        print(
            f"{r['section']:10s} {r['shape']:22s} {r['impl']:14s} {r['mode']:8s} {r['ms']:9.3f} "
            f"{r['useful_tflops']:7.1f} {r['pct_804']:6.1f} {sps} {r['extra_mem_gib']:7.2f}"
        )
