"""Benchmark of the MoE token movement on one GPU: atomic-free permute / unpermute and grouped-GEMM padding.

One run, one table (bf16 tokens, fp32 routing weights; default ``T = 4096`` tokens, ``H = 4096``, ``E = 16``
experts, top-6 with 1/64 of the tokens padding, i.e. unrouted):

- ``permute`` (tokens and routing weights, expert-major), ``unpermute`` (per-token sum of its rows) and both
  chained (the dispatcher's permutation 1 and its inverse), forward and forward+backward, for
  ``hash_moe.permute`` (Triton gathers; backward = gathers through the inverse map, fp32 sums, deterministic) vs
  megatron-core 0.19.2's unfused ``moe_utils.permute`` / ``unpermute`` (``index_select`` with an atomic
  ``index_add_`` backward, ``scatter_add_``), and the latter under ``torch.use_deterministic_algorithms`` (its
  sort-based deterministic ``index_add_``), plus megatron's two chunk sorts at EP = TP = 1 (identity permutations the
  dispatcher now skips);
- ``build_permute_map`` alone (the index maps every permute builds): the two Triton map kernels (default on CUDA)
  vs the sort-free PyTorch path vs the first 0.3.0 builder (a row sort and an argsort over ``T * E``);
- the grouped GEMM's alignment padding (``hash_moe.grouped_gemm._grouped_mm_aligned``, gate_up shape: ``[R, H] x
  [E, 2F, H]``, F = ``--ffn``) with unaligned group sizes, forward and forward+backward: the row gathers of
  hash-moe 0.3 vs 0.2's ``index_copy`` / ``index_select`` (atomic ``index_add_`` backward), and with aligned sizes
  (no padding) as the floor.

Columns: median ms, GB/s of the compulsory traffic of the row movement (bf16 rows read + written; for the GEMM rows
the GEMM's operands and result) and its share of HBM bandwidth (4.8 TB/s on an H200), speed-up vs megatron / 0.2.

Correctness is checked first: the permuted rows and weights equal megatron's bit for bit; unpermute and every
gradient against the fp64 reference (project rule: error <= 2x megatron's bf16 error + atol); two backward passes
bit-identical; the padded grouped GEMM bit-identical to 0.2's (output and both gradients); the maps of both
``build_permute_map`` backends equal the sorted builder's entry for entry (exact, truncated and extended ``num_out``). Rows are printed as
measured and ``bench_permute.json`` is rewritten after every row in ``--out DIR`` and
``packages/hash-moe/benchmarks/results/`` (GPU runs); each measurement is capped at about ``--max-s`` seconds.

Run on the GPU box (plain python3, sources on PYTHONPATH):
``python3 packages/hash-moe/benchmarks/bench_permute.py --out DIR``
CPU smoke test of the script (tiny shapes, Triton interpreter):
``python3 packages/hash-moe/benchmarks/bench_permute.py --device cpu --tokens 37 --hidden 24 --experts 5 --topk 2
--ffn 8 --out /tmp/bench_permute``
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from pathlib import Path

import torch
from _bench_utils import T_START, Results, add_run_args, max_err, start_device
from _bench_utils import bench as _bench

DEVICE = "cuda"


def bench(fn, args) -> tuple[float, int]:
    """``(median milliseconds, timed calls)`` of ``fn`` on ``DEVICE`` (see ``_bench_utils.bench``)."""
    return _bench(fn, DEVICE, args.warmup, args.rep, args.max_s)


def make_inputs(args, seed: int = 0):
    """Top-k routing over random scores (the last ``T / 64`` tokens unrouted), bf16 tokens, fp32 weights."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    t, e, k, h = args.tokens, args.experts, args.topk, args.hidden
    scores = torch.rand(t, e, device=DEVICE, generator=g)
    rm = torch.zeros(t, e, dtype=torch.bool, device=DEVICE).scatter_(1, scores.topk(k, dim=1).indices, True)
    rm[t - t // 64 :] = False
    probs = torch.rand(t, e, device=DEVICE, generator=g) * rm
    x = torch.randn(t, h, device=DEVICE, generator=g).bfloat16()
    n = int(rm.sum())
    dy = torch.randn(t, h, device=DEVICE, generator=g).bfloat16()
    dp = torch.randn(n, device=DEVICE, generator=g)
    return x, rm, probs, n, dy, dp


@contextlib.contextmanager
def deterministic(on: bool):
    if not on:
        yield
        return
    import torch.utils.deterministic as det

    fill = det.fill_uninitialized_memory
    det.fill_uninitialized_memory = False  # time the deterministic kernels, not the NaN fill of torch.empty
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        det.fill_uninitialized_memory = fill


def chain(impl: str, x, rm, probs, n, k, dy, dp, backward: bool):
    """permute -> (identity experts) -> unpermute; with ``backward``: ``(y, dx, dprobs)``."""
    from megatron.core.transformer.moe.moe_utils import permute as m_permute
    from megatron.core.transformer.moe.moe_utils import unpermute as m_unpermute

    from hash_moe import permute, unpermute

    xl, pl = x.detach().requires_grad_(backward), probs.detach().requires_grad_(backward)
    with deterministic(impl == "megatron-det"):
        if impl == "hash-moe":
            x_perm, p_perm, pmap = permute(xl, rm, pl, n, max_routes_per_token=k)
            y = unpermute(x_perm, pmap, x.shape)
        else:
            x_perm, p_perm, rows, _, _ = m_permute(xl, rm, probs=pl, num_out_tokens=n)
            y = m_unpermute(x_perm, rows, restore_shape=x.shape, routing_map=rm)
        if not backward:
            return y, x_perm, p_perm
        dx, dprobs = torch.autograd.grad((y, p_perm), (xl, pl), (dy, dp))
    return y.detach(), dx, dprobs


def map_correctness(args, rm, n: int) -> list[dict]:
    """Both ``build_permute_map`` backends vs the sorted builder, entry for entry."""
    from hash_moe import build_permute_map
    from hash_moe.permute import sorted_permute_map_ref

    rows = []
    for num_out in (n, n - n // 3, n + 1000):
        want = sorted_permute_map_ref(rm, num_out, args.topk)
        for backend in ("triton", "reference"):
            pmap = build_permute_map(rm, num_out, max_routes_per_token=args.topk, backend=backend)
            got = (pmap.token_of_row, pmap.pair_of_row, pmap.row_of_pair, pmap.rows_of_token)
            ok = all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, want))
            name = f"map {backend} R={num_out} vs sorted"
            print(f"  check {name:<28} {'identical' if ok else 'DIFFERENT'}")
            rows.append({"name": name, "exact": True, "ok": ok})
    return rows


def check(name: str, out, ref, same, atol: float = 1e-3) -> dict:
    """Project rule: err(out) <= 2 * err(megatron bf16) + atol * max|ref|."""
    err, base = max_err(out, ref), max_err(same, ref)
    scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    ok = err <= 2 * base + atol * scale
    print(f"  check {name:<28} err {err:.3e}  megatron err {base:.3e}  {'ok' if ok else 'FAIL'}")
    return {"name": name, "err": err, "megatron_err": base, "ok": ok}


def exact(name: str, a, b) -> dict:
    ok = a.shape == b.shape and torch.equal(a, b)
    print(f"  check {name:<28} {'bit-identical' if ok else 'DIFFERENT'}")
    return {"name": name, "exact": True, "ok": ok}


def correctness(args) -> list[dict]:
    from megatron.core.transformer.moe.moe_utils import permute as m_permute

    from hash_moe import permute, permute_ref, unpermute_ref

    x, rm, probs, n, dy, dp = make_inputs(args, seed=1)
    k = args.topk
    ours = chain("hash-moe", x, rm, probs, n, k, dy, dp, True)
    again = chain("hash-moe", x, rm, probs, n, k, dy, dp, True)
    meg = chain("megatron", x, rm, probs, n, k, dy, dp, True)
    # fp64 reference: y = unpermute(permute(x)), grads through autograd
    x64, p64 = x.double().requires_grad_(), probs.double().requires_grad_()
    r_perm, rp_perm = permute_ref(x64, rm, p64, n)
    r_y = unpermute_ref(r_perm, rm)
    r_dx, r_dp = torch.autograd.grad((r_y, rp_perm), (x64, p64), (dy.double(), dp.double()))
    rows = []
    mx, mp, midx, _, _ = m_permute(x, rm, probs=probs, num_out_tokens=n)
    ox, op, pmap = permute(x, rm, probs, n, max_routes_per_token=k)
    rows += [exact("permute rows vs megatron", ox, mx), exact("permute probs vs megatron", op, mp)]
    rows.append(exact("row order vs megatron", pmap.token_of_row, midx))
    for name, a, r, m in zip(("y", "dx", "dprobs"), ours, (r_y, r_dx, r_dp), meg):
        rows.append(check(f"{name} vs fp64", a, r, m))
    for name, a, b in zip(("y", "dx", "dprobs"), ours, again):
        rows.append(exact(f"{name} run-to-run", a, b))
    rows += map_correctness(args, rm, n)
    rows += grouped_correctness(args)
    return rows


def group_counts(args, aligned: bool) -> list[int]:
    """Per-expert row counts of the routed rows: uneven and mostly unaligned (aligned: rounded to 8)."""
    e, rows = args.experts, args.tokens * args.topk
    weights = torch.linspace(0.5, 1.5, e)
    counts = (weights / weights.sum() * rows).long()
    counts[0] += rows - int(counts.sum())
    if aligned:
        counts = (counts // 8) * 8
    else:
        counts[counts % 8 == 0] -= 1
    return [max(int(c), 0) for c in counts]


def grouped_inputs(args, counts, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    dt = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    m = sum(counts)
    x = torch.randn(m, args.hidden, device=DEVICE, generator=g).to(dt)
    w = (
        torch.randn(args.experts, 2 * args.ffn, args.hidden, device=DEVICE, generator=g) * args.hidden**-0.5
    ).to(dt)
    gout = torch.randn(m, 2 * args.ffn, device=DEVICE, generator=g).to(dt)
    return x, w, gout


def grouped_old(x, w, counts):
    """hash-moe 0.2's padding: ``index_copy`` into zeros, ``index_select`` back (atomic ``index_add_`` backward)."""
    align = 16 // x.element_size()
    padded = [-(-c // align) * align for c in counts]
    cnt, pad = torch.tensor(counts, device=x.device), torch.tensor(padded, device=x.device)
    shift = (pad.cumsum(0) - pad) - (cnt.cumsum(0) - cnt)
    rows = torch.arange(x.shape[0], device=x.device) + torch.repeat_interleave(
        shift, cnt, output_size=x.shape[0]
    )
    xp = x.new_zeros(sum(padded), x.shape[1]).index_copy(0, rows, x)
    offs = pad.cumsum(0).to(torch.int32)
    return torch._grouped_mm(xp, w.transpose(-2, -1), offs=offs).index_select(0, rows)


def grouped_run(fn, x, w, counts, gout, backward: bool):
    xl, wl = x.detach().requires_grad_(backward), w.detach().requires_grad_(backward)
    out = fn(xl, wl, counts)
    if not backward:
        return (out,)
    return (out.detach(), *torch.autograd.grad(out, (xl, wl), gout))


def grouped_correctness(args) -> list[dict]:
    from hash_moe.grouped_gemm import _grouped_mm_aligned

    counts = group_counts(args, aligned=False)
    x, w, gout = grouped_inputs(args, counts, seed=2)
    new = grouped_run(_grouped_mm_aligned, x, w, counts, gout, True)
    old = grouped_run(grouped_old, x, w, counts, gout, True)
    return [exact(f"grouped padding {n} vs 0.2", a, b) for n, a, b in zip(("out", "dx", "dw"), new, old)]


def bench_permute_rows(args, hbm: float, emit) -> None:
    from megatron.core.transformer.moe.moe_utils import permute as m_permute
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs
    from megatron.core.transformer.moe.moe_utils import unpermute as m_unpermute

    from hash_moe import permute, unpermute

    x, rm, probs, n, dy, dp = make_inputs(args)
    k, t, h = args.topk, args.tokens, args.hidden
    row_bytes = 2 * h  # bf16
    tok, rows = t * row_bytes, n * row_bytes  # one pass over the tokens / over the permuted rows
    _, _, pmap = permute(x, rm, probs, n, max_routes_per_token=k)
    m_perm, _, m_rows, _, _ = m_permute(x, rm, probs=probs, num_out_tokens=n)
    y_perm = m_perm.clone()
    impls = ("hash-moe", "megatron", "megatron-det")

    def op_fn(op: str, impl: str, backward: bool):
        def permute_only():
            xl, pl = x.detach().requires_grad_(backward), probs.detach().requires_grad_(backward)
            with deterministic(impl == "megatron-det"):
                if impl == "hash-moe":
                    xp, pp, _ = permute(xl, rm, pl, n, max_routes_per_token=k)
                else:
                    xp, pp, _, _, _ = m_permute(xl, rm, probs=pl, num_out_tokens=n)
                if backward:
                    torch.autograd.grad((xp, pp), (xl, pl), (y_perm, dp))

        def unpermute_only():
            yl = y_perm.detach().requires_grad_(backward)
            with deterministic(impl == "megatron-det"):
                if impl == "hash-moe":
                    y = unpermute(yl, pmap, x.shape)
                else:
                    y = m_unpermute(yl, m_rows, restore_shape=x.shape, routing_map=rm)
                if backward:
                    torch.autograd.grad(y, yl, dy)

        def both():
            chain(impl, x, rm, probs, n, k, dy, dp, backward)

        return {"permute": permute_only, "unpermute": unpermute_only, "permute+unpermute": both}[op]

    one_way = {"permute": tok + rows, "unpermute": rows + tok, "permute+unpermute": 2 * (tok + rows)}
    for op in ("permute", "unpermute", "permute+unpermute"):
        for mode in ("fwd", "fwd_bwd"):
            for impl in impls:
                nbytes = one_way[op] * (2 if mode == "fwd_bwd" else 1)
                try:
                    ms, reps = bench(op_fn(op, impl, mode == "fwd_bwd"), args)
                except RuntimeError as exc:  # e.g. an op without a deterministic CUDA implementation
                    emit(
                        {"section": "permute", "op": op, "mode": mode, "impl": impl, "error": str(exc)[:200]}
                    )
                    continue
                emit(
                    {
                        "section": "permute",
                        "op": op,
                        "mode": mode,
                        "impl": impl,
                        "ms": ms,
                        "reps": reps,
                        "bytes": nbytes,
                        "gbps": nbytes / ms / 1e6,
                        "pct_hbm": nbytes / ms / 1e-3 / hbm,
                    }
                )
    # the index maps alone: Triton kernels (default on CUDA), sort-free PyTorch path, the sorted builder (before)
    from hash_moe import build_permute_map
    from hash_moe.permute import sorted_permute_map_ref

    map_fns = (
        ("hash-moe", lambda: build_permute_map(rm, n, max_routes_per_token=k, backend="triton")),
        (
            "hash-moe torch path",
            lambda: build_permute_map(rm, n, max_routes_per_token=k, backend="reference"),
        ),
        ("sorted (0.3.0 before)", lambda: sorted_permute_map_ref(rm, n, k)),
    )
    map_bytes = rm.numel() * (1 + 8) + n * 16 + t * k * 8  # routing map read; int64 maps written
    for impl, fn in map_fns:
        ms, reps = bench(fn, args)
        emit(
            {
                "section": "permute",
                "op": "build_permute_map",
                "mode": "fwd",
                "impl": impl,
                "ms": ms,
                "reps": reps,
                "bytes": map_bytes,
                "gbps": map_bytes / ms / 1e6,
                "pct_hbm": map_bytes / ms / 1e-3 / hbm,
            }
        )
    # megatron's two chunk sorts at EP = TP = 1 (dispatch and combine; identity permutations, now skipped)
    split = torch.bincount(torch.nonzero(rm.t())[:, 0], minlength=args.experts).cpu()  # rows per expert
    order = torch.arange(args.experts)
    for mode in ("fwd", "fwd_bwd"):

        def sorts(backward=mode == "fwd_bwd"):
            xl, pl = m_perm.detach().requires_grad_(backward), dp.detach().requires_grad_(backward)
            a, pa = sort_chunks_by_idxs(xl, split, order, probs=pl)
            b, _ = sort_chunks_by_idxs(a, split, order)
            if backward:
                torch.autograd.grad((b, pa), (xl, pl), (y_perm, dp))

        ms, reps = bench(sorts, args)
        nbytes = 4 * rows * (2 if mode == "fwd_bwd" else 1)
        emit(
            {
                "section": "permute",
                "op": "2x sort_chunks (EP=1)",
                "mode": mode,
                "impl": "megatron",
                "ms": ms,
                "reps": reps,
                "bytes": nbytes,
                "gbps": nbytes / ms / 1e6,
                "pct_hbm": nbytes / ms / 1e-3 / hbm,
            }
        )


def bench_grouped_rows(args, hbm: float, emit) -> None:
    from hash_moe.grouped_gemm import _grouped_mm_aligned

    for aligned in (False, True):
        counts = group_counts(args, aligned)
        x, w, gout = grouped_inputs(args, counts)
        m = sum(counts)
        fns = (("hash-moe 0.3", _grouped_mm_aligned), ("hash-moe 0.2", grouped_old))
        for mode in ("fwd", "fwd_bwd"):
            for impl, fn in fns[:1] if aligned else fns:
                call = functools.partial(grouped_run, fn, x, w, counts, gout, mode == "fwd_bwd")
                ms, reps = bench(call, args)
                operands = (x.numel() + w.numel() + gout.numel()) * x.element_size()
                nbytes = operands * (3 if mode == "fwd_bwd" else 1)
                flops = 2 * m * w.shape[1] * w.shape[2] * (3 if mode == "fwd_bwd" else 1)
                emit(
                    {
                        "section": "grouped",
                        "op": "grouped_mm " + ("aligned (no padding)" if aligned else "padded"),
                        "mode": mode,
                        "impl": impl,
                        "ms": ms,
                        "reps": reps,
                        "bytes": nbytes,
                        "gbps": nbytes / ms / 1e6,
                        "pct_hbm": nbytes / ms / 1e-3 / hbm,
                        "tflops": flops / ms / 1e9,
                        "rows": m,
                    }
                )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(".gpu-out"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument(
        "--ffn", type=int, default=2048, help="expert width F of the grouped GEMM rows ([E, 2F, H])"
    )
    add_run_args(ap)
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    started = start_device("bench_permute", DEVICE)
    if started is None:
        return 0
    name, hbm = started
    print(
        f"bench_permute on {name}: T = {args.tokens}, H = {args.hidden}, E = {args.experts}, top-{args.topk}, "
        f"F = {args.ffn}, bf16 tokens, fp32 weights",
        flush=True,
    )
    results = Results(
        "bench_permute", DEVICE, name, args, args.out, hbm_bytes_per_s=hbm, complete=False, checks=[], rows=[]
    )
    record = results.record
    for c in correctness(args):
        results.add("checks", c)
    ok = all(c["ok"] for c in record["checks"])
    print(f"  (checks {'passed' if ok else 'FAILED'} at {time.perf_counter() - T_START:.1f} s)", flush=True)

    print(f"\n| op | pass | impl | ms | GB/s | % of {hbm / 1e12:.2f} TB/s | speed-up of hash-moe |")
    print("|---|---|---|---|---|---|---|", flush=True)
    ours: dict[tuple, float] = {}

    def emit(row: dict) -> None:
        results.add("rows", row)
        if "error" in row:
            print(
                f"| {row['op']} | {row['mode'].replace('_', '+')} | {row['impl']} | error: {row['error']} | | | |"
            )
            return
        key = (row["op"], row["mode"])
        speedup = ""
        if row["impl"] in ("hash-moe", "hash-moe 0.3"):
            ours[key] = row["ms"]
        elif key in ours:
            speedup = f"{row['ms'] / ours[key]:.2f}x"
            row["speedup_of_hash_moe"] = row["ms"] / ours[key]
        extra = f" ({row['tflops']:.0f} TFLOP/s)" if "tflops" in row else ""
        print(
            f"| {row['op']} | {row['mode'].replace('_', '+')} | {row['impl']} | {row['ms']:.3f}{extra} "
            f"| {row['gbps']:.0f} | {100 * row['pct_hbm']:.0f}% | {speedup} |",
            flush=True,
        )

    bench_permute_rows(args, hbm, emit)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    bench_grouped_rows(args, hbm, emit)
    record["complete"] = True
    results.save()
    print(
        f"\nbench_permute done in {time.perf_counter() - T_START:.1f} s; JSON in {', '.join(map(str, results.dirs))}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
