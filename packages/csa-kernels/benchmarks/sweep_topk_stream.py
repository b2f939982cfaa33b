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

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import peak_extra_gib


def _inputs(S, HI=64, DI=128, ratio=4, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(S, HI, DI, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(S // ratio, DI, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(S, HI, device="cuda", generator=gen) * (HI * DI) ** -0.5).to(torch.bfloat16)
    return q, k, w, [0, S], [0, S // ratio]


def main(argv=None) -> int:
    from csa_kernels.ops.indexer import topk_select as TSEL
    from csa_kernels.ops.indexer import topk_streaming as TS
    from csa_kernels.ops.indexer import triton as IT
    from csa_kernels.ops.indexer.reference import indexer_topk_ref
    from csa_kernels.ops.indexer.topk_select import row_topk
    from dsv4_primitives.varlen import SeqBoundaries, compressed_cu_seqlens

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--sizes", default="8192,65536")
    args = ap.parse_args(argv)
    rows, gates = [], []
    topk, ratio = 512, 4

    def call(q, k, w, cu, cuc, **kw):
        return IT.indexer_topk_triton(q, k, w, ratio, topk, SeqBoundaries.from_host(cu, q.device), **kw)

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
    ridx, rval = indexer_topk_ref(qt, kt, wt, ratio, 64, SeqBoundaries.from_tensor(cu_t))
    for tile in (None, 100):
        idx, val = IT.indexer_topk_triton(
            qt.cuda(),
            kt.cuda(),
            wt.cuda(),
            ratio,
            64,
            SeqBoundaries.from_tensor(cu_t).to("cuda"),
            entry_tile=tile,
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
        # (name, call kwargs, settings): TILE_ELEMENTS (chunk bound), FUSED_SELECT, score-pass config override
        before = dict(tile_elements=1 << 24, fused=False, score=(128, 128, 8, 3))
        variants = [
            ("fused (default)", {}, {}),
            ("before (2026-12-01)", dict(entry_tile=4096), before),
            ("old merge, new tiles", {}, dict(fused=False)),
            ("fused chunk 2^24", {}, dict(tile_elements=1 << 24)),
            ("fused tile4096", dict(entry_tile=4096), {}),
            ("fused score(128,128)", {}, dict(score=(128, 128, 8, 3))),
            ("fused score(128,32)", {}, dict(score=(128, 32, 8, 3))),
            ("fused score(64,64,4)", {}, dict(score=(64, 64, 4, 3))),
        ]
        for name, kw, st in variants:
            IT.TILE_ELEMENTS = st.get("tile_elements", 1 << 25)
            TS.FUSED_SELECT = st.get("fused", True)
            IT.SCORE_CONFIG_OVERRIDE = st.get("score")
            fn = functools.partial(call, q, k, w, cu, cuc, **kw)
            try:
                got = fn()
                same = torch.equal(got[0], new[0]) and torch.equal(got[1], new[1])
                ms = do_bench(fn, warmup=25, rep=100)
                mem = peak_extra_gib(fn)
                rows.append(dict(S=S, impl=name, ms=ms, extra_gib=mem, same_selection=same))
                print(
                    f"  S{S:6d} {name:22s} {ms:8.3f} ms  +{mem:.3f} GiB  same selection: {same}", flush=True
                )
            except Exception as exc:
                print(f"  S{S} {name} failed: {str(exc)[:300]}", flush=True)
        IT.TILE_ELEMENTS, TS.FUSED_SELECT, IT.SCORE_CONFIG_OVERRIDE = 1 << 25, True, None
        if (
            S <= 8192
        ):  # the parts: score pass into [S, C], the row top-k alone (per num_warps), torch.topk alone
            sc = IT.indexer_scores_triton(q, k, w, ratio, cu, cuc, C)
            parts = [
                (
                    "scores [S,C]",
                    functools.partial(IT.indexer_scores_triton, q, k, w, ratio, cu, cuc, C),
                    None,
                ),
                ("torch.topk [S,C]", functools.partial(sc.topk, topk, dim=1), None),
            ]
            parts += [
                (f"row_topk [S,C] w{nw}", functools.partial(row_topk, None, None, sc, topk, 0), nw)
                for nw in (2, 4, 8)
            ]
            for name, fn, nw in parts:
                TSEL.ROW_TOPK_WARPS_OVERRIDE = nw
                ms = do_bench(fn, warmup=25, rep=100)
                rows.append(dict(S=S, impl=name, ms=ms, extra_gib=0.0))
                print(f"  S{S:6d} {name:22s} {ms:8.3f} ms", flush=True)
            TSEL.ROW_TOPK_WARPS_OVERRIDE = None
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
