#!/usr/bin/env python3
"""csa-kernels benchmark on one GPU: correctness gate first, then one side-by-side table, JSON to --out and results/.

Run on the GPU box (no uv, no network), from the repository root:

    PYTHONPATH=packages/dsv4-primitives/src:packages/csa-kernels/src python3 \\
        packages/csa-kernels/benchmarks/bench_csa.py --out /tmp/bench

Implementations per shape: ours (fused Triton), the eager fp32 reference of this package, FlexAttention where it
applies (SWA-only and mask-over-concatenated-KV forms; Flex has no sink, so it computes a slightly easier function)
and cuDNN SDPA dense causal at d=128 on the same token count (the FA3-class anchor). Columns: median ms (p10/p90),
useful TFLOP/s (only valid query-key pairs: fwd ``2*H*pairs*(d_qk+d_v)``, bwd 2.5x fwd), % of the measured 804
TFLOP/s peak (and of the 989 datasheet), peak extra memory, speedup vs eager.

``--backward deterministic`` (the library's default) or ``atomic`` (``csa_kernels.set_deterministic_default(False)``):
the backward that ``ours`` fwd+bwd rows time (``deterministic=None``); every such row says which in its note, and
the JSON records it. Results committed before issue 35 timed the atomic backward (then the default).

Our timed calls pass the trusted-caller options (``cu_seqlens_host``, ``check_indices=False``: no host sync per
call, as the attention layer calls them); the correctness gates and the eager reference keep the checks.

Sections (``--sections``): attention (with ``--sweep``: forward launch configs at V4-Flash and SWA-only, each
checked against the default's output), determinism (atomic vs key-major deterministic backward, bitwise check;
``bench_det_stream.py``), det_inverted (atomic / key-major / inverted-index dkv and dk side by side at V4-Flash
S 4096 / 16384 with window, random and hot-key indices; ``bench_det_inverted.py``), indexer (+ top-k), indexer_stream (streaming top-k at S 8192 / 65536 with peak memory),
compressor (ratio 4 overlap and ratio 128; GB/s of compulsory traffic, memory bound), indexer_loss (V4-Flash /
V4-Pro sparse phase, with a launch-config sweep).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import traceback
from pathlib import Path

import torch
import triton
from bench_common import (  # noqa: F401  (re-exported: bench_scores_at.py and profile_csa.py use them)
    GATES,
    PEAK,
    PEAK_DATASHEET,
    RESULTS_DIR,
    ROWS,
    _indexer_inputs,
    attn_flops,
    attn_inputs,
    cosine,
    gate,
    peak_extra_gib,
    print_table,
    record,
    rel_l2,
    timeit,
)
from bench_csa_ops import section_compressor, section_indexer, section_indexer_loss  # noqa: F401  (main's sections)

import csa_kernels


# ------------------------------------------------------------------------------------------ sparse attention
def attn_gate():
    from csa_kernels.ops.sparse_attn.autograd import sparse_attn_triton
    from csa_kernels.ops.sparse_attn.reference import sparse_attn_ref

    print("correctness gate: sparse attention (bf16 kernel vs fp32 reference)", flush=True)
    ok = True
    for S, H, D, W, ratio, topk, dense in [
        (1024, 64, 512, 128, 4, 512, False),
        (700, 128, 512, 128, 4, 96, False),
    ]:
        q, kv, sink, idx = attn_inputs(S, H, D, W, ratio, topk, dense, seed=123)
        idx[::7, 3] = -1  # scattered holes besides the natural ones
        scale = D**-0.5
        do = torch.randn_like(q)
        leaves = [x.detach().clone().requires_grad_() for x in (q, kv, sink)]
        o, lse = sparse_attn_triton(*leaves, idx, scale)
        o.backward(do)
        ref_leaves = [x.detach().float().clone().requires_grad_() for x in (q, kv, sink)]
        ro, rlse = sparse_attn_ref(*ref_leaves, idx, scale)
        ro.backward(do.float())
        tag = f"attn S{S} H{H} K{idx.shape[1]}"
        ok &= gate(f"{tag} o", o, ro)
        ok &= gate(f"{tag} lse", lse, rlse, tol=1e-3)
        for n, a, b in zip(("dq", "dkv", "dsink"), leaves, ref_leaves):
            ok &= gate(f"{tag} {n}", a.grad, b.grad)
    return ok


def bench_attention(shapes, eager_max_s: int, flex: bool):
    from csa_kernels.ops.sparse_attn.autograd import sparse_attn_triton
    from csa_kernels.ops.sparse_attn.reference import sparse_attn_ref

    for key, shp in shapes:
        _bench_attention_shape(
            sparse_attn_triton, sparse_attn_ref, *shp, eager_max_s=eager_max_s, flex=key in flex
        )
        torch.cuda.empty_cache()


def _bench_attention_shape(
    sparse_attn_triton, sparse_attn_ref, name, S, H, D, W, ratio, topk, dense, eager_max_s, flex
):
    if True:
        q, kv, sink, idx = attn_inputs(S, H, D, W, ratio, topk, dense)
        scale = D**-0.5
        fl = attn_flops(idx, H, D)
        shape = f"{name} S{S}"
        leaves = [x.detach().clone().requires_grad_() for x in (q, kv, sink)]
        do = torch.randn_like(q)

        def ours_fwd():
            with torch.no_grad():
                return sparse_attn_triton(q, kv, sink, idx, scale, check_indices=False)

        def ours_fb():
            o, _ = sparse_attn_triton(*leaves, idx, scale, check_indices=False)
            o.backward(do)
            return o

        eager_fwd_ms = eager_fb_ms = None
        ours_f = record("attention", shape, "ours", "fwd", timeit(ours_fwd), fl, peak_extra_gib(ours_fwd))
        ours_b = record(
            "attention",
            shape,
            "ours",
            "fwd+bwd",
            timeit(ours_fb, leaves),
            3.5 * fl,
            peak_extra_gib(ours_fb),
            note=f"{_backward_name()} dkv",  # --backward: what deterministic=None means in this run
        )
        if eager_max_s >= S:

            def eager_fwd():
                with torch.no_grad():
                    return sparse_attn_ref(q, kv, sink, idx, scale)

            def eager_fb():
                o, _ = sparse_attn_ref(*leaves, idx, scale)
                o.backward(do)
                return o

            e = record(
                "attention",
                shape,
                "eager-ref",
                "fwd",
                timeit(eager_fwd, rep=60),
                fl,
                peak_extra_gib(eager_fwd),
            )
            eager_fwd_ms = e["ms"]
            e = record(
                "attention",
                shape,
                "eager-ref",
                "fwd+bwd",
                timeit(eager_fb, leaves, rep=60),
                3.5 * fl,
                peak_extra_gib(eager_fb),
            )
            eager_fb_ms = e["ms"]
            ours_f["speedup_vs_eager"] = eager_fwd_ms / ours_f["ms"]
            ours_b["speedup_vs_eager"] = eager_fb_ms / ours_b["ms"]
        if flex:
            try:
                bench_flex(shape, q, kv, idx, H, D, W, ratio, scale, fl, do)
            except Exception as exc:  # a baseline failing must not hide our numbers
                print(f"  flex failed on {shape}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        bench_cudnn_dense(shape, S)


_FLEX = None


def bench_flex(shape, q, kv, idx, H, D, W, ratio, scale, fl, do):
    """FlexAttention over the concatenated KV with a mask (window: analytic; compressed: dense bool lookup)."""
    global _FLEX
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    S = q.shape[0]
    Nkv = kv.shape[0]
    if ratio == 0:

        def mask_mod(b, h, qi, ki):
            return (ki <= qi) & (qi - ki < W)

        note = "SWA mask, no sink"
    else:
        dense = torch.zeros(S, Nkv, dtype=torch.bool, device="cuda")
        rows = torch.arange(S, device="cuda")[:, None].expand_as(idx)
        v = idx >= 0
        dense[rows[v], idx[v].long()] = True

        def mask_mod(b, h, qi, ki):
            return dense[qi, ki]

        note = "bool mask over [kv|entries], no sink"
    bm = create_block_mask(mask_mod, 1, 1, S, Nkv, device="cuda")
    qf = q.transpose(0, 1)[None]  # [1, H, S, D]
    kf = kv[None, None].expand(1, 1, Nkv, D)
    qg = qf.detach().clone().requires_grad_()
    kg = kv.detach().clone().requires_grad_()
    dof = do.transpose(0, 1)[None]

    def fwd():
        with torch.no_grad():
            return _FLEX(qf, kf, kf, block_mask=bm, scale=scale, enable_gqa=True)

    def fb():
        k4 = kg[None, None]
        o = _FLEX(qg, k4, k4, block_mask=bm, scale=scale, enable_gqa=True)
        o.backward(dof)
        return o

    record("attention", shape, "flex", "fwd", timeit(fwd), fl, peak_extra_gib(fwd), note)
    record("attention", shape, "flex", "fwd+bwd", timeit(fb, [qg, kg]), 3.5 * fl, peak_extra_gib(fb), note)


_CUDNN_DONE: set[int] = set()


def bench_cudnn_dense(shape, S):
    """cuDNN SDPA, dense causal, d=128, H=16 (H*d = 2048), same token count: the FA3-class anchor."""
    if S in _CUDNN_DONE:
        return
    _CUDNN_DONE.add(S)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    H, d = 16, 128
    q, k, v = (
        torch.randn(1, H, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    do = torch.randn_like(q)
    fl = 2.0 * H * (S * (S + 1) / 2) * (2 * d)
    F = torch.nn.functional.scaled_dot_product_attention

    def fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
            return F(q, k, v, is_causal=True)

    def fb():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F(q, k, v, is_causal=True)
        o.backward(do)
        return o

    sh = f"dense-causal S{S}"
    record("anchor", sh, "cudnn-sdpa", "fwd", timeit(fwd), fl, peak_extra_gib(fwd), "d=128 H=16")
    record(
        "anchor",
        sh,
        "cudnn-sdpa",
        "fwd+bwd",
        timeit(fb, [q, k, v]),
        3.5 * fl,
        peak_extra_gib(fb),
        "d=128 H=16",
    )


def _sweep_fwd(K, fn, shape, args, fl, cfgs):
    """Time forward configs; each is checked against the default config's output (gated above) first."""
    with torch.no_grad():
        o_ref, lse_ref = fn(*args)
    for cfg in cfgs:
        K.FWD_CONFIG_OVERRIDE = cfg
        try:
            with torch.no_grad():
                o, lse = fn(*args)
            same = rel_l2(o, o_ref) <= 1e-2 and rel_l2(lse, lse_ref) <= 1e-4  # bf16 o: rounding-level changes
            ms = timeit(lambda: fn(*args))
            record("sweep", shape, f"fwd{cfg}", "fwd", ms, fl, 0.0, "same o" if same else "WRONG o")
        except Exception as exc:
            print("  sweep fwd", cfg, "failed:", str(exc)[:200])
    K.FWD_CONFIG_OVERRIDE = None


def sweep_attention(backward: bool = False):
    """Launch-config sweep of the sparse attention kernels at the V4-Flash shape (S=4096); forward configs also
    at the SWA-only shape, backward configs only with ``backward``."""
    from csa_kernels.ops.sparse_attn import launch_config as LC
    from csa_kernels.ops.sparse_attn import triton as K
    from csa_kernels.ops.sparse_attn.autograd import sparse_attn_triton

    q, kv, sink, idx = attn_inputs(4096, 64, 512, 128, 4, 512, False)
    scale = 512**-0.5
    fl = attn_flops(idx, 64, 512)
    leaves = [x.detach().clone().requires_grad_() for x in (q, kv, sink)]
    do = torch.randn_like(q)
    # (BLOCK_H, BLOCK_N, warps, stages); 16 warps = the [64, 512] accumulator spread over four warp groups.
    # (An output-channel split over two programs, score GEMM recomputed, measured 2x slower: see the README.)
    # Stages > 1 move the gathered KV tile from registers (LDG) to cp.async copies into shared memory (LDGSTS in
    # the SASS; compiled for sm_90: BN 64 / 1 stage 254 registers, 128 KiB; BN 64 / 2 stages 196 KiB; BN 32 / 3-4
    # stages 233 registers, 128 KiB).
    fwd_cfgs = [
        (64, 64, 8, 1),
        (64, 64, 8, 2),
        (64, 64, 8, 3),
        (64, 32, 8, 3),
        (64, 32, 8, 4),
        (64, 16, 8, 4),
    ]
    _sweep_fwd(K, sparse_attn_triton, "flash S4096", (q, kv, sink, idx, scale), fl, fwd_cfgs)
    swa = attn_inputs(4096, 64, 512, 128, 0, 0, False)
    swa_cfgs = fwd_cfgs[:2] + fwd_cfgs[3:5]
    _sweep_fwd(K, sparse_attn_triton, "swa S4096", (*swa, scale), attn_flops(swa[3], 64, 512), swa_cfgs)
    if not backward:
        return
    o, lse = sparse_attn_triton(q, kv, sink, idx, scale)
    idx_c, cnt = K.compact_indices(idx)
    default_dkv = LC.BWD_DKV_CONFIG
    for cfg, dkv_cfg in [
        ((64, 64, 8, 1), (64, 128, 8, 1)),
        ((64, 64, 16, 1), (64, 128, 8, 1)),
        ((64, 64, 8, 1), (64, 256, 16, 1)),
    ]:
        K.BWD_CONFIG_OVERRIDE = cfg
        LC.BWD_DKV_CONFIG = dkv_cfg
        try:
            ms = timeit(lambda: K.sparse_attn_bwd(q, kv, sink, idx_c, cnt, scale, o, lse, do))
            record("sweep", "flash S4096", f"bwd{cfg}{dkv_cfg}", "bwd", ms, 2.5 * fl, 0.0)
        except Exception as exc:
            print("  sweep bwd", cfg, "failed:", str(exc)[:200])
    K.BWD_CONFIG_OVERRIDE = None
    LC.BWD_DKV_CONFIG = default_dkv
    del leaves


ATTN_SHAPES = {
    # name, S, H, D, W, ratio, topk, dense-compressed
    "flash": ("v4-flash-csa", 4096, 64, 512, 128, 4, 512, False),
    "flash16k": ("v4-flash-csa", 16384, 64, 512, 128, 4, 512, False),
    "pro": ("v4-pro-csa", 4096, 128, 512, 128, 4, 1024, False),
    "swa": ("swa-only", 4096, 64, 512, 128, 0, 0, False),
    "hca": ("hca", 4096, 64, 512, 128, 128, 0, True),
    "hca64k": ("hca", 65536, 64, 512, 128, 128, 0, True),
}


# ---------------------------------------------------------------------------------------------------- main
def _backward_name() -> str:
    return "deterministic" if csa_kernels.deterministic_default() else "atomic"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="directory for the JSON result")
    ap.add_argument(
        "--sections", default="attention,determinism,indexer,indexer_stream,compressor,indexer_loss"
    )
    ap.add_argument("--attn-shapes", default="flash,flash16k,pro,swa,hca,hca64k")
    ap.add_argument("--eager-max-s", type=int, default=4096, help="skip the eager reference above this S")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--flex-shapes", default="flash,swa", help="attention shapes that also run FlexAttention")
    ap.add_argument("--sweep", action="store_true", help="also sweep launch configs of the attention forward")
    ap.add_argument("--sweep-bwd", action="store_true", help="with --sweep: backward configs too")
    ap.add_argument("--tag", default="h200")
    ap.add_argument(
        "--backward",
        choices=("deterministic", "atomic"),
        default="deterministic",
        help="the sparse-attention / index-scores backward of the timed default calls (deterministic=None)",
    )
    args = ap.parse_args(argv)
    csa_kernels.set_deterministic_default(args.backward == "deterministic")
    if not torch.cuda.is_available():
        print("bench_csa: no CUDA device; nothing to measure (exit 0)")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    sections = set(args.sections.split(","))
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"backward of deterministic=None calls: {_backward_name()} (--backward)")
    failed = []
    args.out.mkdir(parents=True, exist_ok=True)
    if "attention" in sections:
        if not attn_gate():
            failed.append("attention gate")
        if args.sweep:
            sweep_attention(args.sweep_bwd)
            _dump_partial(args.out, args.tag, failed)
        shapes = [(s, ATTN_SHAPES[s]) for s in args.attn_shapes.split(",") if s]
        flex_shapes = set() if args.no_flex else set(args.flex_shapes.split(","))
        bench_attention(shapes, args.eager_max_s, flex_shapes)
        _dump_partial(args.out, args.tag, failed)
    for sec in ("determinism", "det_inverted", "indexer", "indexer_stream", "compressor", "indexer_loss"):
        if sec in sections:
            fn = globals().get(f"section_{sec}") or _issue20_section(sec)
            if fn is None:
                continue
            try:
                if not fn():
                    failed.append(f"{sec} gate")
            except Exception:
                traceback.print_exc()
                failed.append(f"{sec} crashed")
            _dump_partial(args.out, args.tag, failed)
    result = dict(
        timestamp=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        peak_tflops=PEAK / 1e12,
        backward=_backward_name(),
        gates=GATES,
        rows=ROWS,
        failed=failed,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"bench_csa_{args.tag}.json"
    for d in (args.out, RESULTS_DIR):
        try:
            d.mkdir(parents=True, exist_ok=True)
            (d / name).write_text(json.dumps(result, indent=1))
        except OSError as exc:
            print(f"could not write {d / name}: {exc}")
    print_table()
    print("FAILED: " + ", ".join(failed) if failed else "all correctness gates passed")
    return 1 if failed else 0


def _issue20_section(sec: str):
    """``determinism`` / ``indexer_stream`` from ``bench_det_stream.py`` and ``det_inverted`` from
    ``bench_det_inverted.py``, given this script's helpers."""
    import types

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_det_inverted
    import bench_det_stream

    h = types.SimpleNamespace(
        record=record,
        timeit=timeit,
        peak_extra_gib=peak_extra_gib,
        gate=gate,
        attn_inputs=attn_inputs,
        attn_flops=attn_flops,
        indexer_inputs=_indexer_inputs,
        GATES=GATES,
    )
    mod = bench_det_inverted if sec == "det_inverted" else bench_det_stream
    return lambda: getattr(mod, f"section_{sec}")(h)


def _dump_partial(out: Path, tag: str, failed: list[str]) -> None:
    """Rows so far to ``out/bench_csa_<tag>.partial.json`` (a run cut short still leaves its numbers)."""
    part = dict(gates=GATES, rows=ROWS, failed=failed, partial=True)
    (out / f"bench_csa_{tag}.partial.json").write_text(json.dumps(part, indent=1))


if __name__ == "__main__":
    sys.exit(main())
