"""Section ``det_inverted`` of ``bench_csa.py`` (issue 35): the sparse attention backward's ``dkv`` reductions side by
side at V4-Flash shapes (H 64, D 512, 640 slots per token, bf16), S = 4096 and 16384, three index distributions:

* ``window``: the benchmark's usual rows (window 128 + random top-k 512 of the visible compressed entries);
* ``random``: 640 uniformly random distinct rows of each token's visible keys (raw rows ``<= t`` and compressed
  entries ``< (t + 1) // 4``), the distribution of issue 35's measurements;
* ``hot``: the first 128 raw rows read by every token that sees them (hot keys), plus 512 random visible rows.

Implementations (each passes ``deterministic=`` explicitly): ``atomic`` (fp32 atomics, ``deterministic=False``: the
opt-in fast path since issue 35), ``keymajor`` (the 0.3 deterministic pass),
``inv-fp32`` / ``inv-bf16`` (the inverted-index gather-reduce with fp32 / bf16 pair rows, 1 GiB pair buffer),
``inv-fp32-4G`` (fp32 pairs, 4 GiB buffer: fewer token chunks), ``atomic-dc64`` / ``inv-fp32-dc64`` (the
token-major kernel with ``BLOCK_DC`` 64 instead of 128: far fewer register spills in ptxas' report). Rows: fwd+bwd
(3.5x the forward's useful flops) and the backward alone (2.5x). Gates: two runs of each deterministic path bitwise
equal; ``dq``, ``dkv``, ``dsink`` vs the fp32 reference at S = 4096 (``window``) and ``dkv`` vs the atomic path
elsewhere (rel. L2 <= 1e-2). Then the index scores' ``dk`` (flash-smoke shape, T 4096, HI 64, DI 128, Tc 1024, K 512:
random top-k and a hot-key variant) atomic / keymajor / inverted. A side-by-side TF/s table closes the section.

Run (GPU box, repository root)::

    PYTHONPATH=packages/dsv4-primitives/src:packages/csa-kernels/src python3 \\
        packages/csa-kernels/benchmarks/bench_csa.py --sections det_inverted --tag h200_det_inverted --out /tmp/bench
"""

from __future__ import annotations

import contextlib

import torch
from bench_common import compressed_part, window_part

from csa_kernels.ops.indexer import scores_at_config
from csa_kernels.ops.indexer.scores_at_autograd import indexer_scores_at_triton
from csa_kernels.ops.sparse_attn import launch_config
from csa_kernels.ops.sparse_attn import triton as K
from csa_kernels.ops.sparse_attn.autograd import sparse_attn_triton
from csa_kernels.ops.sparse_attn.reference import sparse_attn_ref

_GIB = 1 << 30
_DKV = (64, 128, 8, 1)  # launch_config.BWD_DKV_CONFIG today
_DKV64 = (64, 64, 8, 1)  # BLOCK_DC 64: ptxas (sm_90a) spills 116 B per thread instead of 1.7 KiB
IMPLS = {  # name: (deterministic, DETERMINISTIC_DKV, PAIR_DTYPE, PAIR_BYTES, BWD_DKV_CONFIG)
    "atomic": (False, "inverted", torch.float32, _GIB, _DKV),
    "keymajor": (True, "keymajor", torch.float32, _GIB, _DKV),
    "inv-fp32": (True, "inverted", torch.float32, _GIB, _DKV),
    "inv-bf16": (True, "inverted", torch.bfloat16, _GIB, _DKV),
    "inv-fp32-4G": (
        True,
        "inverted",
        torch.float32,
        4 * _GIB,
        _DKV,
    ),  # fewer token chunks: what chunking costs
    "atomic-dc64": (False, "inverted", torch.float32, _GIB, _DKV64),
    "inv-fp32-dc64": (True, "inverted", torch.float32, _GIB, _DKV64),
}
_KNOBS = ("DETERMINISTIC_DKV", "PAIR_DTYPE", "PAIR_BYTES", "BWD_DKV_CONFIG")


@contextlib.contextmanager
def _impl(name: str):
    det, *values = IMPLS[name]
    saved = [getattr(launch_config, k) for k in _KNOBS]
    for k, v in zip(_KNOBS, values):
        setattr(launch_config, k, v)
    try:
        yield det
    finally:
        for k, v in zip(_KNOBS, saved):
            setattr(launch_config, k, v)


DEV = "cuda"


def det_indices(S: int, dist: str, gen: torch.Generator, W: int = 128, topk: int = 512, ratio: int = 4):
    """``[S, W + topk]`` int32 rows of ``kv_all = cat(kv [S], entries [S // ratio])`` (module docstring)."""
    dev = DEV
    if dist == "window":
        return torch.cat([window_part(S, W, dev), compressed_part(S, ratio, topk, False, dev, gen)[0]], 1)
    Tc = S // ratio
    K = W + topk
    rows = []
    for t0 in range(0, S, 2048):  # [2048, S + Tc] score blocks
        t = torch.arange(t0, min(S, t0 + 2048), device=dev)[:, None]
        col = torch.arange(S + Tc, device=dev)[None, :]
        visible = torch.where(col < S, col <= t, col - S < (t + 1) // ratio)
        sc = torch.rand(t.shape[0], S + Tc, device=dev, generator=gen)
        if dist == "hot":
            sc = sc + (col < W).float() * 2.0  # the first W raw rows first
        sc = sc.masked_fill(~visible, -1.0)
        val, sel = sc.topk(K, dim=1)
        rows.append(torch.where(val >= 0, sel, -1).to(torch.int32))
    return torch.cat(rows).contiguous()


def _attention(
    h, S: int, dist: str, table: dict, H: int = 64, D: int = 512, W: int = 128, topk: int = 512
) -> bool:
    gen = torch.Generator(device=DEV).manual_seed(S + len(dist))
    idx = det_indices(S, dist, gen, W, topk)
    q = torch.randn(S, H, D, device=DEV, generator=gen).to(torch.bfloat16)
    kv = torch.randn(S + S // 4, D, device=DEV, generator=gen).to(torch.bfloat16)
    sink = torch.randn(H, device=DEV, generator=gen) * 2
    do = torch.randn_like(q)
    scale = D**-0.5
    fl = h.attn_flops(idx, H, D)
    shape = f"flash S{S} {dist}"
    leaves = [x.detach().clone().requires_grad_() for x in (q, kv, sink)]
    idx_c, cnt = K.compact_indices(idx)
    o, lse = K.sparse_attn_fwd(q, kv, sink, idx_c, cnt, scale)
    ok = True
    grads = {}
    for name in IMPLS:
        with _impl(name) as det:

            def fb(det=det):
                o_, _ = sparse_attn_triton(*leaves, idx, scale, check_indices=False, deterministic=det)
                o_.backward(do)
                return o_

            def bwd(det=det):
                return K.sparse_attn_bwd(q, kv, sink, idx_c, cnt, scale, o, lse, do, deterministic=det)

            first = bwd()
            grads[name] = first
            if det:
                same = all(torch.equal(a, b) for a, b in zip(first, bwd()))
                h.GATES.append(dict(name=f"{shape} {name} bwd bitwise twice", ok=same))
                print(f"  gate {shape} {name} backward bitwise equal over two runs: {same}", flush=True)
                ok &= same
            r = h.record(
                "det_inv", shape, name, "fwd+bwd", h.timeit(fb, leaves), 3.5 * fl, h.peak_extra_gib(fb)
            )
            table.setdefault((shape, "fwd+bwd"), {})[name] = (r["useful_tflops"], r["ms"])
            r = h.record("det_inv", shape, name, "bwd", h.timeit(bwd), 2.5 * fl, h.peak_extra_gib(bwd))
            table.setdefault((shape, "bwd"), {})[name] = (r["useful_tflops"], r["ms"])
    if S <= 4096 and dist == "window":
        ref = [x.detach().float().clone().requires_grad_() for x in (q, kv, sink)]
        ro, _ = sparse_attn_ref(*ref, idx, scale)
        ro.backward(do.float())
        for name in ("inv-fp32", "inv-bf16"):
            for n, a, b in zip(("dq", "dkv", "dsink"), grads[name], ref):
                ok &= h.gate(f"{shape} {name} {n}", a, b.grad)
    else:
        for name in ("inv-fp32", "inv-bf16"):
            ok &= h.gate(f"{shape} {name} dkv vs atomic", grads[name][1], grads["atomic"][1])
    return ok


def _scores_at(h, dist: str, table: dict, T: int = 4096, HI: int = 64, DI: int = 128, Kc: int = 512) -> bool:
    Tc = T // 4
    gen = torch.Generator(device=DEV).manual_seed(5)
    qi = torch.randn(T, HI, DI, device=DEV, generator=gen).to(torch.bfloat16).requires_grad_()
    ki = torch.randn(Tc, DI, device=DEV, generator=gen).to(torch.bfloat16).requires_grad_()
    wi = (torch.randn(T, HI, device=DEV, generator=gen) * (HI * DI) ** -0.5).requires_grad_()
    vis = torch.arange(Tc, device=DEV)[None, :] < ((torch.arange(T, device=DEV) + 1) // 4)[:, None]
    sc = torch.rand(T, Tc, device=DEV, generator=gen)
    if dist == "hot":
        sc[:, : Tc // 16] += 2.0  # the first Tc / 16 entries read by every row that sees them
    val, sel = sc.masked_fill(~vis, -1.0).topk(Kc, dim=1)
    sidx = torch.where(val >= 0, sel, -1).to(torch.int32)
    g = torch.where(sidx >= 0, torch.randn(T, Kc, device=DEV, generator=gen), 0.0)
    pairs = int((sidx >= 0).sum())
    shape = f"scores_at T{T} {dist}"
    ok = True
    dks = {}
    for name, det, algo in (
        ("atomic", False, "inverted"),
        ("keymajor", True, "keymajor"),
        ("inv-fp32", True, "inverted"),
    ):
        saved = scores_at_config.DETERMINISTIC_DK
        scores_at_config.DETERMINISTIC_DK = algo
        try:

            def sfb(det=det):
                s = indexer_scores_at_triton(qi, ki, wi, sidx, det)
                s.backward(g)
                return s

            runs = []
            for _ in range(2):
                ki.grad = None
                sfb()
                runs.append(ki.grad.clone())
            dks[name] = runs[0]
            if det:
                same = torch.equal(runs[0], runs[1])
                h.GATES.append(dict(name=f"{shape} {name} dk bitwise twice", ok=same))
                ok &= same
            r = h.record(
                "det_inv",
                shape,
                name,
                "fwd+bwd",
                h.timeit(sfb, [qi, ki, wi]),
                6.0 * HI * DI * pairs,
                h.peak_extra_gib(sfb),
            )
            table.setdefault((shape, "fwd+bwd"), {})[name] = (r["useful_tflops"], r["ms"])
        finally:
            scores_at_config.DETERMINISTIC_DK = saved
    ok &= h.gate(f"{shape} inv-fp32 dk vs atomic", dks["inv-fp32"], dks["atomic"])
    return ok


def section_det_inverted(
    h, sizes: tuple = (4096, 16384), attn_kw: dict | None = None, scores_kw: dict | None = None
) -> bool:
    """The section (module docstring); ``sizes`` / ``attn_kw`` / ``scores_kw`` shrink it for a CPU smoke run."""
    ok = True
    table: dict = {}
    for S in sizes:
        for dist in ("window", "random", "hot"):
            try:
                ok &= _attention(h, S, dist, table, **(attn_kw or {}))
            except torch.OutOfMemoryError as exc:  # one shape failing must not hide the others
                print(f"  det_inverted S{S} {dist}: out of memory ({str(exc)[:120]})", flush=True)
                ok = False
            torch.cuda.empty_cache()
    for dist in ("random", "hot"):
        ok &= _scores_at(h, dist, table, **(scores_kw or {}))
    names = list(IMPLS)
    print("\nuseful TF/s (ms) side by side (issue 35)")
    print(f"{'shape':26s} {'mode':8s} " + " ".join(f"{n:>17s}" for n in names))
    for (shape, mode), row in table.items():
        cells = " ".join(f"{row[n][0]:7.1f} ({row[n][1]:7.2f})" if n in row else f"{'-':>17s}" for n in names)
        print(f"{shape:26s} {mode:8s} {cells}")
    return ok
