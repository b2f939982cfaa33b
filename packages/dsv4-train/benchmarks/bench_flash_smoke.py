"""flash-smoke on one GPU: forward+backward tokens/s, MFU and peak memory vs sequence length, plus a full
optimizer step; side by side with the Hugging Face transformers eager numbers measured on the same H200.

    PYTHONPATH=<all packages/*/src> python3 packages/dsv4-train/benchmarks/bench_flash_smoke.py --out DIR

Correctness first: at initialisation the LM loss must be finite and close to ln(V); the bf16 logits of a short
sequence must match an fp32 run of the same weights. Then each S in --seq-lens (default 2048 4096 8192, then
doubling until out of memory). Writes ``flash_smoke.json`` to --out and to benchmarks/results/.

``--kernels deterministic`` (default: what ``dsv4 train`` runs with CUDA) or ``atomic`` (``--no-deterministic``): the
sparse-attention ``dkv`` / indexer ``dk`` of every row (the model rows through
``csa_kernels.set_deterministic_default``, the optimizer-step runs through the Trainer's flag); the JSON records it.
Results committed before issue 35 timed the atomic kernels (then the default).

Graph rows: ``CUDA graph`` (``dsv4 train --cuda-graph``, ``[1, S]``) at every S, and at 4096 ``CUDA graph, packed``
(``--cuda-graph --packed``: static THD packs with device-side document boundaries, a new pack at every replay;
``--no-packed-graph`` skips it); the optimizer-step runs include ``thd_cuda_graph``. The profile, gap and sync
reports live in :mod:`flash_smoke_diagnostics`.

``--long-context``: the full training step (forward + backward with MTP + optimizer) at 4K / 16K / 32K / 64K / the
longest that fits, for full recompute with the optimizer offloaded (F = 1, 0.5), then full / selective / no recompute,
in a bounded time (:mod:`long_context`)::

    python3 packages/dsv4-train/benchmarks/bench_flash_smoke.py --long-context --iters 2 --max-seq-len 131072 \
        --budget-s 500 --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time
import traceback
from pathlib import Path

import long_context
import torch
from flash_smoke_diagnostics import fwd_bwd_step as _fwd_bwd_step
from flash_smoke_diagnostics import gap_report as _gap_report
from flash_smoke_diagnostics import profile as _profile
from flash_smoke_diagnostics import sync_report as _sync_report

import csa_kernels

# Hugging Face transformers eager DeepseekV4ForCausalLM, same shapes, fwd+bwd, no optimizer (issue 10)
HF_EAGER = {2048: (10965, 20), 4096: (8763, 40), 8192: (6075, 105)}  # S: (tokens/s, GiB)
H200_BF16_PEAK = 989e12


def _init():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from dsv4_primitives.megatron import init_rng_tracker

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    ps.initialize_model_parallel(1, 1)
    init_rng_tracker(1234, cuda_graph_safe=True)  # the CUDA-graph rows capture with megatron's wrapper


def _model(bf16: bool):
    from hybrid_model.model import build_model
    from hybrid_model.presets import get_preset

    torch.manual_seed(0)
    m = build_model(
        get_preset("flash-smoke"), bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32
    )
    return m.cuda()


def _check(model) -> dict:
    V = model.model_config.vocab_size
    ids = torch.randint(0, V, (1, 512), device="cuda")
    model.train()
    with torch.no_grad():
        loss = model(ids, None, None, labels=torch.roll(ids, -1, 1)).float().mean().item()
    if not math.isfinite(loss) or abs(loss - math.log(V)) > 1.0:
        raise SystemExit(
            f"correctness check failed: initial loss {loss:.3f}, expected about ln(V)={math.log(V):.3f}"
        )
    ref = _model(bf16=False)
    ref.load_state_dict(
        {
            k: v.float() if v.is_floating_point() else v
            for k, v in model.state_dict().items()
            if isinstance(v, torch.Tensor)
        },
        strict=False,
    )
    a = model.compute_logits(ids[:, :256])
    # the fp32 oracle runs the fp32 reference ops (attention kernels, RMSNorm / RoPE)
    os.environ["CSA_KERNELS_BACKEND"] = os.environ["DSV4_PRIMITIVES_BACKEND"] = "reference"
    try:
        b = ref.compute_logits(ids[:, :256])
    finally:
        del os.environ["CSA_KERNELS_BACKEND"], os.environ["DSV4_PRIMITIVES_BACKEND"]
    a, b = a.float(), b.float()
    rel = ((a - b).abs().max() / b.abs().max()).item()
    # bf16 can flip near-tied MoE routing choices of a few tokens (a discrete jump for those tokens), so the gate
    # is on the mean error and the cosine of all logits; the max is reported alongside.
    mean_rel = ((a - b).abs().mean() / b.abs().mean()).item()
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
    del ref
    torch.cuda.empty_cache()
    print(f"bf16 vs fp32 logits: max rel {rel:.3e}, mean rel {mean_rel:.3e}, cosine {cos:.6f}", flush=True)
    if mean_rel > 5e-2 or cos < 0.995:
        raise SystemExit(
            f"correctness check failed: bf16 vs fp32 logits mean rel {mean_rel:.3e}, cosine {cos:.6f}"
        )
    return {
        "initial_loss": loss,
        "bf16_vs_fp32_max_rel": rel,
        "bf16_vs_fp32_mean_rel": mean_rel,
        "cosine": cos,
    }


def _time_fwd_bwd(model, S: int, iters: int) -> dict:
    from hybrid_model.flops import forward_flops_sbhd

    step = _fwd_bwd_step(model, S)
    torch.cuda.reset_peak_memory_stats()
    for i in range(iters + 1):
        if i == 1:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / iters
    flops = forward_flops_sbhd(model.model_config, S).training
    return {
        "tokens_per_s": S / dt,
        "mfu": flops / dt / H200_BF16_PEAK,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def _packed_batches(model, S: int, n: int, max_docs: int = 64) -> list[tuple[dict, list[int]]]:
    """``n`` static packs of ``S`` real tokens with different document boundaries (lengths drawn in [64, 1024], the
    last document fills the pack), as ``dsv4 train --cuda-graph --packed`` copies them into the static buffers."""
    from types import SimpleNamespace

    from dsv4_train.graph_packs import static_pack_batch
    from thd_packing import PackedSeqs

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        lengths: list[int] = []
        while sum(lengths) < S:
            lengths.append(min(int(torch.randint(64, 1025, (1,), generator=g)), S - sum(lengths)))
        packed = PackedSeqs.from_lengths(lengths, total_tokens=S)
        ids = torch.randint(0, model.model_config.vocab_size, (S,), generator=g)
        mb = SimpleNamespace(
            tokens=ids,
            labels=torch.roll(ids, -1),
            loss_mask=torch.ones(S),
            position_ids=packed.position_ids,
            padding_mask=torch.zeros(S, dtype=torch.bool),
            packed_seqs=packed,
        )
        batch = static_pack_batch(mb, max_docs=max_docs, step=i)
        out.append(({k: v.cuda() for k, v in batch.items()}, lengths))
    return out


def _time_fwd_bwd_graphed(model, S: int, iters: int, packed: bool = False) -> dict:
    """forward+backward as ``dsv4 train --cuda-graph`` runs it: megatron's forward-backward schedule behind
    ``FullCudaGraphWrapper`` (:class:`dsv4_train.cuda_graph.GraphedForwardBackward`): two eager warm-up
    steps, then one captured step, then ``iters`` timed replays (each copies the batch into the static buffers).
    The capture starts without gradients, so every replay writes fresh ones (as eager ``zero_grad`` + backward).

    ``packed`` (``--cuda-graph --packed``): every step a different static THD pack of ``S`` real tokens (the replays
    run on document boundaries the capture never saw; device-side bounds, :mod:`dsv4_train.graph_packs`)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from dsv4_train.cuda_graph import GraphedForwardBackward
    from dsv4_train.graph_packs import static_packed_seq_params
    from hybrid_model.flops import forward_flops, forward_flops_sbhd

    ids = torch.randint(0, model.model_config.vocab_size, (1, S), device="cuda")
    packs = _packed_batches(model, S, iters + 3) if packed else None
    batches = [b for b, _ in packs] if packed else [{"tokens": ids, "labels": torch.roll(ids, -1, 1)}]

    def forward_step(data_iterator, m):
        b = next(data_iterator)
        if "cu_seqlens" in b:
            psp = static_packed_seq_params(b)
            out = m(b["tokens"], b["position_ids"], None, labels=b["labels"], packed_seq_params=psp)
        else:
            out = m(b["tokens"], None, None, labels=b["labels"])

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach().clone()}

        return out, loss_func

    # megatron's schedule sets the MoE aux-loss scale as a [1] tensor; the eager rows above (no schedule) let its
    # backward create a [] one, which the schedule's in-place copy then rejects: start from "unset" as a run does
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    fb = GraphedForwardBackward(get_forward_backward_func(), warmup_steps=2)

    calls = iter(range(1 << 30))

    def step():
        reports = fb(
            key=(S, packed),
            forward_step_func=forward_step,
            data_iterator=iter([batches[next(calls) % len(batches)]]),
            model=[model],
            num_microbatches=1,
            seq_length=S,
            micro_batch_size=1,
            forward_only=False,
        )
        if not fb.captured:
            model.zero_grad(set_to_none=True)
        return reports

    model.zero_grad(set_to_none=True)
    torch.cuda.reset_peak_memory_stats()
    try:
        for _ in range(3):  # two eager warm-up steps, then capture (+ its replay)
            step()
        if not fb.captured:
            raise RuntimeError("the forward-backward step was not captured")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            reports = step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / iters
        loss = float(reports[0]["lm loss"])
    finally:
        fb.close()
        model.zero_grad(set_to_none=True)
    if packed:  # the timed replays' packs (the last `iters` of `iters + 3`): per-document attention FLOPs
        flops = sum(forward_flops(model.model_config, ls).training for _, ls in packs[3:]) / iters
    else:
        flops = forward_flops_sbhd(model.model_config, S).training
    return {
        "tokens_per_s": S / dt,
        "mfu": flops / dt / H200_BF16_PEAK,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "lm_loss": loss,
        **({"documents_per_pack": [len(ls) for _, ls in packs]} if packed else {}),
    }


def _optimizer_step_child(S: int, iters: int, packed: bool, cuda_graph: bool, kernels: str) -> dict:
    """Full training steps through ``dsv4 train``'s loop (DDP + distributed optimizer, Adam, grad clipping) in this
    process; run by :func:`_time_optimizer_step` in a fresh process (the Trainer owns its parallel state)."""
    from dsv4_train.config import TrainConfig
    from dsv4_train.trainer import Trainer

    # The last `iters` of `iters + 5` steps are timed, in both modes on the same batches (tokens/s counts real tokens,
    # which vary per batch). Graphs: 2 warm-up steps + the capture, again after the MTP weight's decay starts (step 2
    # at warmup_steps=0), so steps 4, 5, ... are replays. Eager: step 1 compiles.
    tc = TrainConfig.from_flat(
        preset="flash-smoke",
        steps=iters + 5,
        cuda_graph=cuda_graph,
        seq_len=S,
        global_batch_size=1,
        micro_batch_size=1,
        bf16=True,
        packed=packed,
        out="/tmp/bench_flash_smoke_run",
        overwrite=True,  # every timed run replaces the previous one
        progress=False,
        warmup_steps=0,
        save_final=False,  # a flash-smoke checkpoint with Adam state is ~45 GB
        deterministic=kernels == "deterministic",  # --kernels: --deterministic or --no-deterministic
    )
    trainer = Trainer(tc)
    optimizer_s: list[float] = []
    if os.environ.get(
        "BENCH_STEP_BREAKDOWN"
    ):  # diagnostics: synchronise around the optimizer step and time it
        real_step = trainer.optimizer.step

        def synced_step(*a, **k):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = real_step(*a, **k)
            torch.cuda.synchronize()
            optimizer_s.append(time.perf_counter() - t0)
            return out

        trainer.optimizer.step = synced_step
    metrics = trainer.run()
    timed = metrics[-iters:]
    if cuda_graph and not all(
        prev.get("cuda_graph_replayed") and m["cuda_graph_replayed"]
        for prev, m in itertools.pairwise(metrics[-iters - 1 :])
    ):
        raise RuntimeError("--cuda-graph: the timed steps are not replays of the captured step")
    return {
        "tokens_per_s": sum(m["tokens_per_s"] for m in timed) / len(timed),
        "step_ms": 1e3 * sum(m["step_time_s"] for m in timed) / len(timed),
        "mfu": sum(m["mfu"] for m in timed) / len(timed),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "lm_loss": [m.get("lm_loss") for m in metrics],
        "layout": "thd" if packed else "sbhd",
        "cuda_graph": cuda_graph,
        "kernels": kernels,
        "step_time_s": [m["step_time_s"] for m in metrics],
        **({"optimizer_s": optimizer_s} if optimizer_s else {}),
    }


def _time_optimizer_step(S: int, iters: int, packed: bool, cuda_graph: bool, kernels: str) -> dict:
    """:func:`_optimizer_step_child` in a subprocess; raises with the child's output tail when it fails."""
    import subprocess
    import sys

    cmd = [
        sys.executable,
        __file__,
        "--optimizer-step-child",
        str(S),
        "--iters",
        str(iters),
        "--kernels",
        kernels,
    ]
    if packed:
        cmd.append("--packed")
    if cuda_graph:
        cmd.append("--cuda-graph")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("OPTIMIZER_STEP "):
            return json.loads(line[len("OPTIMIZER_STEP ") :])
    raise RuntimeError(
        f"optimizer-step child failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}"
    )


def _no_mtp_rows(args) -> dict:
    """flash-smoke without its MTP layer (what transformers' ``DeepseekV4ForCausalLM`` computes: it drops the MTP
    weights) at 4096 tokens: eager and CUDA-graph forward+backward."""
    from hybrid_model.model import build_model
    from hybrid_model.presets import get_preset

    torch.manual_seed(0)
    cfg = get_preset("flash-smoke")
    cfg = cfg.replace(num_nextn_predict_layers=0, compress_ratios=cfg.compress_ratios[: cfg.num_layers])
    model = build_model(cfg, bf16=True, params_dtype=torch.bfloat16).cuda()
    model.train()
    rows: dict = {}
    try:
        rows["4096"] = {"eager": _time_fwd_bwd(model, 4096, args.iters)}
        if not args.no_graphs:
            rows["4096"]["cuda_graph"] = _time_fwd_bwd_graphed(model, 4096, args.iters)
    except Exception:
        rows["error"] = traceback.format_exc()[-4000:]
    print(f"flash-smoke without MTP: {rows}", flush=True)
    del model
    torch.cuda.empty_cache()
    return rows


def _print_table(result: dict) -> None:
    """Side by side with the Hugging Face eager numbers: eager and CUDA-graph rows, then flash-smoke without MTP."""
    print(
        f"{'S':>7} | {'run':>22} | {'tok/s':>9} | {'MFU':>6} | {'peak GiB':>8} | {'HF eager tok/s':>14} | "
        f"{'HF GiB':>6} | speedup"
    )
    rows = [(s, "eager", r) for s, r in result["fwd_bwd"].items()]
    rows += [(s, "CUDA graph", r) for s, r in result.get("fwd_bwd_graph", {}).items()]
    rows += [(s, "CUDA graph, packed", r) for s, r in result.get("fwd_bwd_packed_graph", {}).items()]
    for run, r in result.get("no_mtp", {}).get("4096", {}).items():
        rows.append((4096, f"no MTP, {run.replace('_', ' ')}", r))
    for s, run, r in sorted(rows, key=lambda x: (int(x[0]), x[1])):
        s = int(s)
        if not isinstance(r, dict) or "tokens_per_s" not in r:
            print(f"{s:>7} | {run:>22} | {str(r)[:40]}")
            continue
        hf = HF_EAGER.get(s)
        hf_t = f"{hf[0]:>14,}" if hf else f"{'OOM':>14}"
        hf_m = f"{hf[1]:>6}" if hf else f"{'-':>6}"
        sp = f"{r['tokens_per_s'] / hf[0]:.2f}x" if hf else "-"
        print(
            f"{s:>7} | {run:>22} | {r['tokens_per_s']:>9,.0f} | {100 * r['mfu']:5.1f}% | {r['peak_gib']:>8.1f} | "
            f"{hf_t} | {hf_m} | {sp}"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--seq-lens", type=int, nargs="*", default=[2048, 4096, 8192])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--max-seq-len", type=int, default=65536, help="stop growing S here")
    ap.add_argument("--profile-seq-len", type=int, default=4096, help="S of the profiled step (0: none)")
    ap.add_argument("--sync-report", action="store_true", help="list the step's host syncs (profile S)")
    ap.add_argument("--no-optimizer-step", action="store_true", help="skip the full optimizer-step timing")
    ap.add_argument("--optimizer-step-child", type=int, metavar="S", help=argparse.SUPPRESS)
    ap.add_argument("--packed", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cuda-graph", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--no-graphs", action="store_true", help="skip the CUDA-graph (dsv4 train --cuda-graph) rows"
    )
    ap.add_argument("--no-mtp-row", action="store_true", help="skip the flash-smoke-without-MTP rows")
    ap.add_argument(
        "--no-packed-graph",
        action="store_true",
        help="skip the --cuda-graph --packed row (4096 tokens, a new pack each replay)",
    )
    ap.add_argument(
        "--optimizer-steps",
        nargs="*",
        default=["sbhd", "thd", "sbhd_cuda_graph", "thd_cuda_graph"],
        help="full optimizer-step runs at S=4096 (sbhd, thd, sbhd_cuda_graph, thd_cuda_graph)",
    )
    ap.add_argument(
        "--kernels",
        choices=("deterministic", "atomic"),
        default="deterministic",
        help="csa-kernels' sparse-attention dkv / indexer dk: deterministic (dsv4 train's default with CUDA; the "
        "optimizer-step runs use --deterministic) or atomic (--no-deterministic); recorded in the JSON",
    )
    long_context.add_flags(ap)
    args = ap.parse_args()
    if long_context.dispatch(args, Path(args.out)):  # --long-context (its own report; CPU: a tiny smoke run)
        return
    if not torch.cuda.is_available():
        print("bench_flash_smoke: no CUDA device; nothing measured")
        return
    if args.optimizer_step_child:
        r = _optimizer_step_child(
            args.optimizer_step_child, args.iters, args.packed, args.cuda_graph, args.kernels
        )
        print("OPTIMIZER_STEP " + json.dumps(r), flush=True)
        return
    _init()
    from dsv4_train.cuda_graph import use_capture_stream

    use_capture_stream()  # as dsv4 train --cuda-graph: model and steps on the capture stream (eager rows too)
    csa_kernels.set_deterministic_default(
        args.kernels == "deterministic"
    )  # the model rows' deterministic=None
    model = _model(bf16=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "kernels": args.kernels,
        "check": _check(model),
        "fwd_bwd": {},
    }

    def save() -> None:  # after every measurement, so a run cut short keeps its numbers
        text = json.dumps(result, indent=2, default=str)
        for d in (Path(args.out), Path(__file__).parent / "results"):
            d.mkdir(parents=True, exist_ok=True)
            (d / "flash_smoke.json").write_text(text)

    def measure(s: int) -> bool:
        try:
            result["fwd_bwd"][s] = _time_fwd_bwd(model, s, args.iters)
        except torch.OutOfMemoryError:
            result["fwd_bwd"][s] = "OOM"
            model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        print(f"S={s}: {result['fwd_bwd'][s]}", flush=True)
        save()
        return result["fwd_bwd"][s] != "OOM"

    if args.sync_report:
        result["syncs"] = _sync_report(model, args.profile_seq_len or 4096, Path(args.out))
        try:  # diagnostics only: never lose the measurements below to it
            result["gaps"] = _gap_report(args.profile_seq_len or 4096, model, Path(args.out))
        except Exception:
            result["gaps"] = {"error": traceback.format_exc()[-3000:]}
            print(result["gaps"]["error"], flush=True)
        save()
    if args.profile_seq_len:
        result["profile"] = _profile(model, args.profile_seq_len, Path(args.out))
        save()
    fits = [s for s in args.seq_lens if measure(s)]
    if not args.no_graphs:
        result["fwd_bwd_graph"] = {}
        for s in fits:
            try:
                result["fwd_bwd_graph"][s] = _time_fwd_bwd_graphed(model, s, args.iters)
            except Exception:  # report, do not hide
                result["fwd_bwd_graph"][s] = {"error": traceback.format_exc()[-4000:]}
            torch.cuda.empty_cache()
            print(f"S={s} CUDA graph: {result['fwd_bwd_graph'][s]}", flush=True)
            save()
    if not args.no_graphs and not args.no_packed_graph and 4096 in fits:  # next to the unpacked graph row
        try:
            row = _time_fwd_bwd_graphed(model, 4096, args.iters, packed=True)
        except Exception:  # report, do not hide
            row = {"error": traceback.format_exc()[-4000:]}
        result["fwd_bwd_packed_graph"] = {4096: row}
        torch.cuda.empty_cache()
        print(f"S=4096 CUDA graph, packed: {row}", flush=True)
        save()
    # The longest S that fits: double past the last measured length, then bisect in steps of 2048 tokens.
    lo = max(fits, default=0)
    hi = None
    S = lo * 2
    while lo and args.max_seq_len >= S:
        if not measure(S):
            hi = S
            break
        lo, S = S, S * 2
    while hi is not None and hi - lo > 2048:
        mid = (lo + hi) // 2 // 2048 * 2048
        if measure(mid):
            lo = mid
        else:
            hi = mid
    result["longest_fitting_seq_len"] = lo
    result["first_oom_seq_len"] = hi
    save()
    model = None  # free the weights before the Trainer builds its own model
    torch.cuda.empty_cache()
    if not args.no_mtp_row:  # the Hugging Face model has no MTP layer: the like-for-like comparison
        result["no_mtp"] = _no_mtp_rows(args)
        save()
    if not args.no_optimizer_step:
        result["optimizer_step"] = {}
        runs = {
            "sbhd": (False, False),
            "thd": (True, False),
            "sbhd_cuda_graph": (False, True),
            "thd_cuda_graph": (True, True),
        }
        for key in args.optimizer_steps:
            if key not in runs or (args.no_graphs and runs[key][1]):
                continue
            packed, graph = runs[key]
            try:
                result["optimizer_step"][key] = _time_optimizer_step(
                    4096, args.iters, packed, graph, args.kernels
                )
            except Exception:  # report, do not hide: the fwd/bwd table is still useful
                result["optimizer_step"][key] = {"error": traceback.format_exc()[-4000:]}
            print(f"optimizer step S=4096 {key}:", result["optimizer_step"][key], flush=True)
            save()
    _print_table(result)
    save()


if __name__ == "__main__":
    main()
