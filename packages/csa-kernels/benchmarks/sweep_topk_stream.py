#!/usr/bin/env python3
"""Streaming indexer top-k on one GPU: the fused row top-k against the ``torch.topk`` merge it replaced.

Run from the repository root (GPU box, our sources on PYTHONPATH)::

    PYTHONPATH=packages/dsv4-primitives/src:packages/csa-kernels/src python3 \\
        packages/csa-kernels/benchmarks/sweep_topk_stream.py --out DIR

Gates first (both selections bitwise equal at S 8192 / 65536, and equal to the fp32 reference on a tie-heavy
pack), then a table: the whole ``indexer_topk_triton`` call per variant (entry tile, chunk bound, old merge), its
parts (score pass into ``[S, C]``, the row top-k alone, ``torch.topk`` alone) and peak extra memory; JSON to
``DIR/sweep_topk_stream.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench


def _inputs(S, HI=64, DI=128, ratio=4, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(S, HI, DI, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(S // ratio, DI, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(S, HI, device="cuda", generator=gen) * (HI * DI) ** -0.5).to(torch.bfloat16)
    return q, k, w, [0, S], [0, S // ratio]


def _peak(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def main(argv=None) -> int:
    from csa_kernels.ops.indexer import topk_streaming as TS
    from csa_kernels.ops.indexer import triton as IT
    from csa_kernels.ops.indexer.reference import indexer_topk_ref
    from csa_kernels.ops.indexer.topk_select import row_topk
    from dsv4_primitives.varlen import compressed_cu_seqlens

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sizes", default="8192,65536")
    args = ap.parse_args(argv)
    rows, gates = [], []
    topk, ratio = 512, 4

    def call(q, k, w, cu, cuc, **kw):
        dev = q.device
        return IT.indexer_topk_triton(
            q,
            k,
            w,
            ratio,
            topk,
            torch.tensor(cu, device=dev, dtype=torch.int32),
            torch.tensor(cuc, device=dev, dtype=torch.int32),
            cu_host=cu,
            cuc_host=cuc,
            **kw,
        )

    # tie-heavy THD pack vs the reference (exact ties across tiles go to the lower entry)
    gen = torch.Generator().manual_seed(3)
    T = 3000
    cu_t = torch.tensor([0, 1000, 1001, T], dtype=torch.int32)
    cuc_t = compressed_cu_seqlens(cu_t, ratio)
    kt = torch.zeros(int(cuc_t[-1]), 16)
    kt[:, 0] = torch.tensor([-1.0, 0.0, 0.5, 1.0])[torch.randint(0, 4, (kt.shape[0],), generator=gen)]
    qt = torch.zeros(T, 1, 16)
    qt[:, :, 0] = 1.0
    wt = torch.ones(T, 1)
    ridx, rval = indexer_topk_ref(qt, kt, wt, ratio, 64, cu_t, cuc_t)
    for tile in (None, 100):
        idx, val = IT.indexer_topk_triton(
            qt.cuda(), kt.cuda(), wt.cuda(), ratio, 64, cu_t.cuda(), cuc_t.cuda(), entry_tile=tile
        )
        ok = torch.equal(idx.cpu(), ridx) and torch.equal(val.cpu(), rval)
        gates.append(dict(name=f"ties vs reference tile={tile}", ok=ok))
        print(f"gate ties vs reference (tile {tile}): {ok}", flush=True)

    for S in [int(s) for s in args.sizes.split(",")]:
        q, k, w, cu, cuc = _inputs(S)
        C = S // ratio
        TS.FUSED_SELECT = False
        old = call(q, k, w, cu, cuc)
        TS.FUSED_SELECT = True
        new = call(q, k, w, cu, cuc)
        ok = torch.equal(old[0], new[0]) and torch.equal(old[1], new[1])
        gates.append(dict(name=f"S{S} fused == torch.topk merge", ok=ok))
        print(f"gate S{S} fused selection == old merge (indices and values bitwise): {ok}", flush=True)
        variants = [("fused", {}, None)]
        for tile in (1536, 2048 - 512 if C > 2048 else 1024, 4096 - 512, 8192 - 512):
            if tile < C:
                variants.append((f"fused tile{tile}", dict(entry_tile=tile), None))
        variants += [("fused 1 chunk", {}, 1 << 26), ("old merge", {}, "old")]
        for name, kw, mode in variants:
            saved = IT.TILE_ELEMENTS
            if isinstance(mode, int):
                IT.TILE_ELEMENTS = mode
            TS.FUSED_SELECT = mode != "old"
            fn = functools.partial(call, q, k, w, cu, cuc, **kw)
            try:
                ms = do_bench(fn, warmup=25, rep=100)
                mem = _peak(fn)
                rows.append(dict(S=S, impl=name, ms=ms, extra_gib=mem))
                print(f"  S{S:6d} {name:18s} {ms:8.3f} ms  +{mem:.3f} GiB", flush=True)
            except Exception as exc:
                print(f"  S{S} {name} failed: {str(exc)[:300]}", flush=True)
            IT.TILE_ELEMENTS = saved
            TS.FUSED_SELECT = True
        if S <= 8192:  # the parts: score pass into [S, C], the row top-k alone, torch.topk alone
            sc = IT.indexer_scores_triton(q, k, w, ratio, cu, cuc, C)
            for name, fn in (
                ("scores [S,C]", functools.partial(IT.indexer_scores_triton, q, k, w, ratio, cu, cuc, C)),
                ("row_topk [S,C]", functools.partial(row_topk, None, None, sc, topk, 0)),
                ("torch.topk [S,C]", functools.partial(sc.topk, topk, dim=1)),
            ):
                ms = do_bench(fn, warmup=25, rep=100)
                rows.append(dict(S=S, impl=name, ms=ms, extra_gib=0.0))
                print(f"  S{S:6d} {name:18s} {ms:8.3f} ms", flush=True)
            for cfg in ((128, 128, 8, 2), (128, 64, 8, 3), (64, 128, 4, 3), (128, 256, 8, 2), (64, 64, 4, 3)):
                IT.SCORE_CONFIG_OVERRIDE = cfg  # score-pass tiles (BLOCK_T, BLOCK_N, warps, stages)
                try:
                    same = torch.equal(IT.indexer_scores_triton(q, k, w, ratio, cu, cuc, C), sc)
                    ms = do_bench(functools.partial(call, q, k, w, cu, cuc), warmup=25, rep=100)
                    rows.append(dict(S=S, impl=f"fused score{cfg}", ms=ms, extra_gib=0.0, same_scores=same))
                    print(
                        f"  S{S:6d} fused score{cfg} {ms:8.3f} ms (scores bitwise same: {same})", flush=True
                    )
                except Exception as exc:
                    print(f"  score cfg {cfg} failed: {str(exc)[:300]}", flush=True)
                IT.SCORE_CONFIG_OVERRIDE = None
        del old, new
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    res = dict(device=torch.cuda.get_device_name(), gates=gates, rows=rows)
    (args.out / "sweep_topk_stream.json").write_text(json.dumps(res, indent=1))
    bad = [g["name"] for g in gates if not g["ok"]]
    print("FAILED: " + ", ".join(bad) if bad else "all gates passed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
