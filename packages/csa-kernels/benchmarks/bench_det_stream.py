"""Sections of ``bench_csa.py`` for issue 20: deterministic backwards and the streaming indexer top-k.

* ``determinism``: sparse attention fwd+bwd with the atomic ``dkv`` (``deterministic=False``) and the atomic-free
  one (``deterministic=True``: the inverted-index path since issue 35, the key-major pass before) at V4-Flash
  S=4096 / 16384 and V4-Pro S=4096, a bitwise check of two deterministic backward runs (``dq``, ``dkv``,
  ``dsink``), the ``dkv`` gates vs the fp32 reference, a launch-config sweep of the key-major kernel, and the
  ``indexer_scores_at`` backward (``dk``) both ways at the flash-smoke shape.
* ``indexer_stream``: the streaming indexer + top-k at S = 8192 and 65536 (one document, HI 64 x DI 128, top-k 512)
  with peak extra memory, next to the ``[S, C]`` buffer it no longer needs.

The helpers (``record``, ``timeit``, ``peak_extra_gib``, ``gate``, ``attn_inputs``, ``attn_flops``) are passed in
by ``bench_csa.py`` so every row lands in its one table and JSON.
"""

from __future__ import annotations

import torch


def section_determinism(h) -> bool:
    from csa_kernels.ops.indexer.scores_at_autograd import indexer_scores_at_triton
    from csa_kernels.ops.sparse_attn import dkv_keymajor, launch_config
    from csa_kernels.ops.sparse_attn.autograd import sparse_attn_triton
    from csa_kernels.ops.sparse_attn.reference import sparse_attn_ref

    ok = True
    for name, S, H, D, W, ratio, topk in (
        ("v4-flash-csa", 4096, 64, 512, 128, 4, 512),
        ("v4-flash-csa", 16384, 64, 512, 128, 4, 512),
        ("v4-pro-csa", 4096, 128, 512, 128, 4, 1024),
    ):
        q, kv, sink, idx = h.attn_inputs(S, H, D, W, ratio, topk, False)
        scale = D**-0.5
        fl = h.attn_flops(idx, H, D)
        shape = f"{name} S{S}"
        do = torch.randn_like(q)
        leaves = [x.detach().clone().requires_grad_() for x in (q, kv, sink)]

        def fb(det, leaves=leaves, idx=idx, do=do, scale=scale):
            o, _ = sparse_attn_triton(*leaves, idx, scale, check_indices=False, deterministic=det)
            o.backward(do)
            return o

        grads = []
        for det in (True, True):
            for x in leaves:
                x.grad = None
            fb(det)
            grads.append([x.grad.clone() for x in leaves])
        same = all(torch.equal(a, b) for a, b in zip(*grads))
        h.GATES.append(dict(name=f"{shape} deterministic bwd bitwise twice", ok=same))
        print(f"  gate {shape} deterministic backward bitwise equal over two runs: {same}", flush=True)
        ok &= same
        if S <= 4096:
            ref_leaves = [x.detach().float().clone().requires_grad_() for x in (q, kv, sink)]
            ro, _ = sparse_attn_ref(*ref_leaves, idx, scale)
            ro.backward(do.float())
            for n, a, b in zip(("dq", "dkv", "dsink"), grads[0], ref_leaves):
                ok &= h.gate(f"{shape} det {n}", a, b.grad)
        for det in (False, True):
            impl = "ours-det" if det else "ours-atomic"
            h.record(
                "determinism",
                shape,
                impl,
                "fwd+bwd",
                h.timeit(lambda det=det: fb(det), leaves),
                3.5 * fl,
                h.peak_extra_gib(lambda det=det: fb(det)),
            )
        if S == 4096 and H == 64:
            for cfg in ((32, 64, 4, 1), (32, 64, 4, 2), (32, 64, 8, 1), (16, 64, 4, 1), (16, 64, 4, 2)):
                dkv_keymajor.KEYMAJOR_CONFIG_OVERRIDE = cfg
                launch_config.DETERMINISTIC_DKV = "keymajor"  # the sweep is of the key-major pass
                try:
                    h.record(
                        "sweep",
                        shape,
                        f"det{cfg}",
                        "fwd+bwd",
                        h.timeit(lambda: fb(True), leaves),
                        3.5 * fl,
                        0.0,
                    )
                except Exception as exc:  # a config that does not compile must not stop the run
                    print("  sweep det", cfg, "failed:", str(exc)[:200], flush=True)
                finally:
                    dkv_keymajor.KEYMAJOR_CONFIG_OVERRIDE = None
                    launch_config.DETERMINISTIC_DKV = "inverted"
        del q, kv, idx, leaves, grads, do
        torch.cuda.empty_cache()

    # indexer_scores_at backward (what indexer_topk adds to a step) at the flash-smoke shape, both dk paths
    T, HI, DI, Tc, K = 4096, 64, 128, 1024, 512
    gen = torch.Generator(device="cuda").manual_seed(5)
    qi = torch.randn(T, HI, DI, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    ki = torch.randn(Tc, DI, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    wi = (torch.randn(T, HI, device="cuda", generator=gen) * (HI * DI) ** -0.5).requires_grad_()
    vis = torch.arange(Tc, device="cuda")[None, :] < ((torch.arange(T, device="cuda") + 1) // 4)[:, None]
    sc = torch.rand(T, Tc, device="cuda", generator=gen).masked_fill(~vis, -1.0)
    val, sel = sc.topk(K, dim=1)
    sidx = torch.where(val >= 0, sel, -1).to(torch.int32)
    g = torch.randn(T, K, device="cuda", generator=gen)
    pairs = int((sidx >= 0).sum())
    for det in (False, True):

        def sfb(det=det):
            s = indexer_scores_at_triton(qi, ki, wi, sidx, det)
            s.backward(torch.where(sidx >= 0, g, 0.0))
            return s

        impl = "ours-det" if det else "ours-atomic"
        h.record(
            "determinism",
            f"scores_at T{T} K{K}",
            impl,
            "fwd+bwd",
            h.timeit(sfb, [qi, ki, wi]),
            3 * 2.0 * HI * DI * pairs,
            h.peak_extra_gib(sfb),
        )
    dks = []
    for _ in range(2):
        ki.grad = None
        indexer_scores_at_triton(qi, ki, wi, sidx, True).backward(torch.where(sidx >= 0, g, 0.0))
        dks.append(ki.grad.clone())
    same = torch.equal(dks[0], dks[1])
    h.GATES.append(dict(name="scores_at deterministic dk bitwise twice", ok=same))
    print(f"  gate scores_at deterministic dk bitwise equal over two runs: {same}", flush=True)
    return ok and same


def section_indexer_stream(h) -> bool:
    from csa_kernels.ops.indexer.triton import indexer_topk_triton

    ok = True
    HI, DI, ratio, topk = 64, 128, 4, 512
    for S in (8192, 65536):
        q, k, w, bounds = h.indexer_inputs(S, HI, DI, ratio)
        Tc = S // ratio
        pairs = sum((t + 1) // ratio for t in range(S))
        fl = 2.0 * HI * DI * pairs
        shape = f"idx-stream S{S} C{Tc} k{topk}"

        def ours(q=q, k=k, w=w, bounds=bounds):
            return indexer_topk_triton(q, k, w, ratio, topk, bounds)

        first = ours()
        again = ours()
        same = torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
        h.GATES.append(dict(name=f"{shape} selection reproducible", ok=same))
        ok &= same
        r = h.record(
            "indexer_stream", shape, "ours-stream", "fwd", h.timeit(ours, rep=100), fl, h.peak_extra_gib(ours)
        )
        r["dense_scores_gib"] = 4.0 * S * Tc / 2**30  # the [S, C] fp32 buffer a non-streaming top-k holds
        r["outputs_gib"] = 8.0 * S * topk / 2**30
        print(
            f"  {shape}: {r['ms']:.3f} ms, peak extra {r['extra_mem_gib']:.3f} GiB "
            f"(outputs {r['outputs_gib']:.3f}; [S, C] fp32 would be {r['dense_scores_gib']:.2f})",
            flush=True,
        )
        del q, k, w, first, again
        torch.cuda.empty_cache()
    return ok
