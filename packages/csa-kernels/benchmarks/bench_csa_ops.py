"""Sections of ``bench_csa.py`` for the indexer (+ top-k), the compressor and the indexer KL loss.

Rows and gates go through :mod:`bench_common` (one table, one JSON with the attention rows).
"""

from __future__ import annotations

import torch
from bench_common import (
    GATES,
    HBM_BW,
    _indexer_inputs,
    attn_inputs,
    gate,
    peak_extra_gib,
    record,
    rel_l2,
    timeit,
)

from dsv4_primitives.varlen import SeqBoundaries


def section_indexer() -> bool:
    from csa_kernels.ops.indexer.reference import indexer_topk_ref
    from csa_kernels.ops.indexer.triton import indexer_topk_triton

    print("correctness gate: indexer + top-k (bf16 inputs, fp32 reference)", flush=True)
    S, HI, DI, ratio, topk = 2048, 64, 128, 4, 128
    q, k, w, bounds = _indexer_inputs(S, HI, DI, ratio, seed=7)
    idx, val = indexer_topk_triton(q, k, w, ratio, topk, bounds)
    ridx, rval = indexer_topk_ref(q.float(), k.float(), w.float(), ratio, topk, bounds)
    same_valid = bool(torch.equal((idx >= 0).sum(1), (ridx >= 0).sum(1)))
    hits = 0
    for a, b in zip(idx.tolist(), ridx.tolist()):
        hits += len({x for x in a if x >= 0} & {x for x in b if x >= 0})
    recall = hits / max(int((ridx >= 0).sum()), 1)
    fin = torch.isfinite(rval)
    ok = same_valid and recall >= 0.99 and gate("indexer top-k scores", val[fin], rval[fin])
    GATES.append(dict(name="indexer top-k set recall", recall=recall, same_valid_counts=same_valid, ok=ok))
    print(f"  gate indexer top-k recall={recall:.5f} same -1 counts={same_valid} {'OK' if ok else 'FAIL'}")

    S, HI, DI, ratio, topk = 8192, 64, 128, 4, 512
    q, k, w, bounds = _indexer_inputs(S, HI, DI, ratio)
    Tc = S // ratio
    pairs = sum((t + 1) // ratio for t in range(S))
    fl = 2.0 * HI * DI * pairs
    shape = f"idx S{S} C{Tc} k{topk}"

    def ours():
        return indexer_topk_triton(q, k, w, ratio, topk, bounds)

    o = record("indexer", shape, "ours", "fwd", timeit(ours), fl, peak_extra_gib(ours), "scores+topk")
    vis = torch.arange(Tc, device="cuda")[None, :] < ((torch.arange(S, device="cuda") + 1) // ratio)[:, None]

    def eager():  # Megatron-style: materialise [S, H, C], relu, weight, mask, topk
        s = torch.einsum("thd,cd->thc", q, k)
        sc = torch.einsum("thc,th->tc", torch.relu(s).float(), w.float()).masked_fill(~vis, float("-inf"))
        return sc.topk(topk, dim=1)

    e = record(
        "indexer", shape, "eager", "fwd", timeit(eager, rep=100), fl, peak_extra_gib(eager), "[S,H,C] bf16"
    )
    o["speedup_vs_eager"] = e["ms"] / o["ms"]

    def ref():
        return indexer_topk_ref(q, k, w, ratio, topk, bounds)

    record(
        "indexer",
        shape,
        "eager-ref",
        "fwd",
        timeit(ref, rep=100),
        fl,
        peak_extra_gib(ref),
        "package reference",
    )
    qf = q.reshape(S * HI, DI)

    def gemm():
        return qf @ k.T

    record(
        "indexer",
        shape,
        "gemm-full",
        "fwd",
        timeit(gemm),
        2.0 * S * HI * DI * Tc,
        0.0,
        "bf16 QK GEMM, half",
    )
    buf = torch.randn(S, Tc, device="cuda")

    def topk_only():
        return buf.topk(topk, dim=1)

    record("indexer", shape, "torch.topk", "fwd", timeit(topk_only), 0.0, 0.0, "[S, C] fp32 top-k alone")
    return ok


# ------------------------------------------------------------------------------------------- compressor
def section_compressor() -> bool:
    """Pooling of the CSA attention compressor (ratio 4, overlap, c = 512, Dk = 1024) and the HCA one (ratio 128,
    c = 512): bf16 kv / score, fp32 ape; memory bound, so the table reports GB/s of compulsory traffic."""
    ok = True
    for case in [(8192, 512, 4, True, "csa-r4"), (8192, 512, 128, False, "hca-r128")]:
        ok &= _compressor_case(*case)
        torch.cuda.empty_cache()
    return ok


def _compressor_case(S, c, ratio, overlap, name) -> bool:
    from csa_kernels.ops.compressor.autograd import compressor_pool_triton
    from csa_kernels.ops.compressor.reference import compressor_pool_ref

    ok = True
    dk = 2 * c if overlap else c
    gen = torch.Generator(device="cuda").manual_seed(11)
    lengths = [S - 1000, 997, 3]  # varlen: tails, a doc shorter than the ratio
    cu_host = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu = SeqBoundaries.from_host(cu_host, "cuda")
    kv = torch.randn(S, dk, device="cuda", generator=gen).to(torch.bfloat16)
    score = (2 * torch.randn(S, dk, device="cuda", generator=gen)).to(torch.bfloat16)
    ape = torch.randn(ratio, dk, device="cuda", generator=gen)
    leaves = [x.detach().clone().requires_grad_() for x in (kv, score, ape)]
    pooled, _ = compressor_pool_triton(*leaves, ratio, overlap, cu)
    dout = torch.randn_like(pooled)
    pooled.backward(dout)
    ref_leaves = [x.detach().float().clone().requires_grad_() for x in (kv, score, ape)]
    rp, _ = compressor_pool_ref(*ref_leaves, ratio, overlap, cu)
    rp.backward(dout)
    tag = f"compressor {name}"
    ok &= gate(f"{tag} pooled", pooled, rp)
    for n, a, b in zip(("dkv", "dscore", "dape"), leaves, ref_leaves):
        ok &= gate(f"{tag} {n}", a.grad, b.grad)
    tc = pooled.shape[0]
    bytes_f = 2 * S * dk * 2 + tc * c * 4 + ratio * dk * 4
    bytes_b = bytes_f + 2 * S * dk * 2 + ratio * dk * 4  # + dkv, dscore writes, dape
    shape = f"{name} S{S} c{c}"

    def ours_f():
        with torch.no_grad():
            return compressor_pool_triton(kv, score, ape, ratio, overlap, cu)

    def ours_fb():
        p, _ = compressor_pool_triton(*leaves, ratio, overlap, cu)
        p.backward(dout)
        return p

    def eager_f():
        with torch.no_grad():
            return compressor_pool_ref(kv, score, ape, ratio, overlap, cu)

    def eager_fb():
        p, _ = compressor_pool_ref(*leaves, ratio, overlap, cu)
        p.backward(dout)
        return p

    rows = {}
    for impl, f, fb in (("ours", ours_f, ours_fb), ("eager-ref", eager_f, eager_fb)):
        for mode, fn, nbytes in (("fwd", f, bytes_f), ("fwd+bwd", fb, bytes_f + bytes_b)):
            ms3 = timeit(fn, leaves if mode != "fwd" else None, rep=100)
            gbps = nbytes / (ms3[0] * 1e-3) / 1e9
            r = record("compressor", shape, impl, mode, ms3, 0.0, peak_extra_gib(fn), f"{gbps:.0f} GB/s")
            r["gbps"] = gbps
            r["pct_hbm"] = 100 * gbps * 1e9 / HBM_BW
            rows[impl, mode] = r
    for mode in ("fwd", "fwd+bwd"):
        rows["ours", mode]["speedup_vs_eager"] = rows["eager-ref", mode]["ms"] / rows["ours", mode]["ms"]
    return ok


# -------------------------------------------------------------------------------------------- indexer loss
def section_indexer_loss() -> bool:
    """Sparse-phase indexer KL loss at the V4-Flash / V4-Pro attention shapes (teacher over the top-k compressed
    rows with the attention's full-denominator LSE). Useful FLOPs: the teacher's score GEMM, ``2*H*pairs*D``."""
    ok = True
    for case in [
        ("v4-flash", 4096, 64, 512, 128, 4, 512, True),
        ("v4-pro", 4096, 128, 512, 128, 4, 1024, False),
    ]:
        ok &= _indexer_loss_case(*case)
        torch.cuda.empty_cache()
    return ok


def _indexer_loss_case(name, S, H, D, W, ratio, topk, eager) -> bool:
    from csa_kernels.ops.indexer_loss.autograd import indexer_loss_triton
    from csa_kernels.ops.indexer_loss.reference import indexer_loss_ref
    from csa_kernels.ops.sparse_attn.autograd import sparse_attn_triton

    ok = True
    q, kv, sink, idx = attn_inputs(S, H, D, W, ratio, topk, False, seed=5)
    scale = D**-0.5
    with torch.no_grad():
        _, lse = sparse_attn_triton(q, kv, sink, idx, scale)
    comp = idx[:, W:].contiguous()  # [S, topk] compressed rows of kv_all, -1 where not visible
    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(S, topk, device="cuda", generator=gen) * 3
    xl = x.clone().requires_grad_()
    loss, per_row = indexer_loss_triton(q, kv, sink, lse, comp, xl, scale)
    loss.backward()
    xr = x.clone().requires_grad_()
    rloss, rper_row = indexer_loss_ref(q.float(), kv.float(), sink, lse, comp, xr, scale)
    rloss.backward()
    tag = f"indexer-loss {name}"
    ok &= gate(f"{tag} loss", loss.detach().reshape(1), rloss.detach().reshape(1), tol=1e-3)
    ok &= gate(f"{tag} per_row", per_row, rper_row)
    ok &= gate(f"{tag} d_index_scores", xl.grad, xr.grad)
    fl = 2.0 * H * int((comp >= 0).sum()) * D
    shape = f"{name} S{S} k{topk}"

    def ours_f():
        with torch.no_grad():
            return indexer_loss_triton(q, kv, sink, lse, comp, x, scale, check_indices=False)

    def ours_fb():
        lo, _ = indexer_loss_triton(q, kv, sink, lse, comp, xl, scale, check_indices=False)
        lo.backward()
        return lo

    if (
        eager
    ):  # launch-config sweep of the fused forward at the Flash shape, each checked against the reference
        from csa_kernels.ops.indexer_loss import triton as LK

        for cfg in [
            (64, 32, 8, 1),
            (64, 64, 8, 1),
            (64, 64, 4, 1),
            (64, 128, 8, 1),
            (64, 64, 8, 2),
            (64, 32, 4, 2),
        ]:
            LK.FWD_CONFIG_OVERRIDE = cfg
            try:
                with torch.no_grad():
                    _, pr = indexer_loss_triton(q, kv, sink, lse, comp, x, scale, check_indices=False)
                note = "ok" if rel_l2(pr, rper_row) <= 1e-2 else "WRONG"
                record("sweep", shape, f"loss{cfg}", "fwd", timeit(ours_f), fl, 0.0, note)
            except Exception as exc:
                print("  sweep loss", cfg, "failed:", str(exc)[:200])
        LK.FWD_CONFIG_OVERRIDE = None
    f = record("indexer_loss", shape, "ours", "fwd", timeit(ours_f), fl, peak_extra_gib(ours_f))
    b = record("indexer_loss", shape, "ours", "fwd+bwd", timeit(ours_fb, [xl]), fl, peak_extra_gib(ours_fb))
    if eager:

        def eager_f():
            with torch.no_grad():
                return indexer_loss_ref(q, kv, sink, lse, comp, x, scale)

        def eager_fb():
            lo, _ = indexer_loss_ref(q, kv, sink, lse, comp, xr, scale)
            lo.backward()
            return lo

        ef = record(
            "indexer_loss",
            shape,
            "eager-ref",
            "fwd",
            timeit(eager_f, rep=60),
            fl,
            peak_extra_gib(eager_f),
        )
        eb = record(
            "indexer_loss",
            shape,
            "eager-ref",
            "fwd+bwd",
            timeit(eager_fb, [xr], rep=60),
            fl,
            peak_extra_gib(eager_fb),
        )
        f["speedup_vs_eager"] = ef["ms"] / f["ms"]
        b["speedup_vs_eager"] = eb["ms"] / b["ms"]
    return ok
