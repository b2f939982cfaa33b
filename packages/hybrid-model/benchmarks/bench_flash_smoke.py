"""flash-smoke on one GPU: forward+backward tokens/s, MFU and peak memory vs sequence length, plus a full
optimizer step; side by side with the Hugging Face transformers eager numbers measured on the same H200.

    PYTHONPATH=<all packages/*/src> python3 packages/hybrid-model/benchmarks/bench_flash_smoke.py --out DIR

Correctness first: at initialisation the LM loss must be finite and close to ln(V); the bf16 logits of a short
sequence must match an fp32 run of the same weights. Then each S in --seq-lens (default 2048 4096 8192, then
doubling until out of memory). Writes ``flash_smoke.json`` to --out and to benchmarks/results/.

``--long-context``: the full training step (forward + backward with MTP + optimizer) at 4K / 16K / 32K / 64K / the
longest that fits, for full recompute with the optimizer offloaded (F = 1, 0.5), then full / selective / no recompute,
in a bounded time (:mod:`long_context`)::

    python3 packages/hybrid-model/benchmarks/bench_flash_smoke.py --long-context --iters 2 --max-seq-len 131072 \
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


def _fwd_bwd_step(model, S: int):
    """A closure running one forward + backward of the model on a random sequence of S tokens."""
    ids = torch.randint(0, model.model_config.vocab_size, (1, S), device="cuda")
    labels = torch.roll(ids, -1, 1)

    def step() -> None:
        loss = model(ids, None, None, labels=labels).float().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


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


def _time_fwd_bwd_graphed(model, S: int, iters: int) -> dict:
    """forward+backward as ``dsv4 train --cuda-graph`` runs it: megatron's forward-backward schedule behind
    ``FullCudaGraphWrapper`` (:class:`hybrid_model.training.cuda_graph.GraphedForwardBackward`): two eager warm-up
    steps, then one captured step, then ``iters`` timed replays (each copies the batch into the static buffers).
    The capture starts without gradients, so every replay writes fresh ones (as eager ``zero_grad`` + backward)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from hybrid_model.flops import forward_flops_sbhd
    from hybrid_model.training.cuda_graph import GraphedForwardBackward

    ids = torch.randint(0, model.model_config.vocab_size, (1, S), device="cuda")
    batch = {"tokens": ids, "labels": torch.roll(ids, -1, 1)}

    def forward_step(data_iterator, m):
        b = next(data_iterator)
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

    def step():
        reports = fb(
            key=S,
            forward_step_func=forward_step,
            data_iterator=iter([batch]),
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
    flops = forward_flops_sbhd(model.model_config, S).training
    return {
        "tokens_per_s": S / dt,
        "mfu": flops / dt / H200_BF16_PEAK,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "lm_loss": loss,
    }


# Kernel-name patterns of the step's parts (first match wins), for the profile's breakdown.
_CATEGORIES = [
    ("csa-kernels: sparse attention", r"_sparse_attn|_delta_kernel"),
    ("csa-kernels: indexer + top-k + loss", r"_indexer|mbtopk|radixSort|sort|topk"),
    ("csa-kernels: compressor", r"_compressor"),
    ("mhc kernels", r"_sk_|sinkhorn|_coeff_|_pre_|_post_|_split_bf16|_mm"),
    ("rope", r"rope"),
    ("hash-moe routing", r"_topk_route"),
    ("GEMM (cuBLAS / cutlass)", r"gemm|nvjet|cutlass|xmma|cublas|Kernel2|splitK"),
    ("cross-entropy / softmax", r"softmax|nll|cross_entropy|log_softmax"),
    ("MoE permute / gather / scatter", r"index|scatter|gather|sort|cumsum|histc|bincount|nonzero|masked"),
    ("norm / reductions", r"norm|reduce_kernel|welford"),
    ("elementwise / copies", r"elementwise|copy|fill|Memcpy|Memset|cat|where|clamp"),
]


def _profile(model, S: int, out: Path, top: int = 40) -> dict:
    """One profiled fwd+bwd at length S (after a warm-up): kernel time by category, GPU busy share of the wall
    time, and the top kernels; the full table goes to ``out/flash_smoke_profile_S.txt``."""
    import re

    from torch.profiler import ProfilerActivity, profile

    step = _fwd_bwd_step(model, S)
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    us = {e.key: e.self_device_time_total for e in kernels}
    counts = {e.key: e.count for e in kernels}
    total = sum(us.values())
    cats: dict[str, float] = {}
    for name, t in us.items():
        cat = next((c for c, pat in _CATEGORIES if re.search(pat, name, re.I)), "other")
        cats[cat] = cats.get(cat, 0.0) + t
    top_rows = sorted(us.items(), key=lambda kv: -kv[1])[:top]
    lines = [
        f"flash-smoke fwd+bwd S={S}: wall {wall * 1e3:.1f} ms (profiled), kernel time {total / 1e3:.1f} ms "
        f"(GPU busy {100 * total / 1e6 / wall:.0f}%), {sum(counts.values())} kernel launches",
        "",
        f"{'category':40s} {'ms':>9} {'share':>6}",
    ]
    for c, t in sorted(cats.items(), key=lambda kv: -kv[1]):
        lines.append(f"{c:40s} {t / 1e3:9.2f} {100 * t / total:5.1f}%")
    lines += ["", f"{'kernel':90s} {'calls':>6} {'ms':>9} {'share':>6}"]
    for name, t in top_rows:
        lines.append(f"{name[:90]:90s} {counts[name]:6d} {t / 1e3:9.2f} {100 * t / total:5.1f}%")
    ops = [
        e
        for e in prof.key_averages(group_by_input_shape=True)
        if e.device_type == torch.autograd.DeviceType.CPU and e.self_device_time_total > 0
    ]
    lines += ["", "PyTorch ops by the kernel time they launched (grouped by input shapes):"]
    lines.append(f"{'op':34s} {'input shapes':70s} {'calls':>6} {'ms':>8}")
    for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:top]:
        shapes = str(e.input_shapes)[:70]
        lines.append(f"{e.key[:34]:34s} {shapes:70s} {e.count:6d} {e.self_device_time_total / 1e3:8.2f}")
    text = "\n".join(lines)
    print(text, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"flash_smoke_profile_{S}.txt").write_text(text + "\n")
    return {
        "wall_ms": wall * 1e3,
        "kernel_ms": total / 1e3,
        "launches": sum(counts.values()),
        "categories_ms": {c: t / 1e3 for c, t in cats.items()},
        "top_kernels_ms": {n[:120]: t / 1e3 for n, t in top_rows[:15]},
    }


# source paths of the frames the diagnostics attribute host work to: our packages and megatron-core
_OUR_FRAMES = ("/hybrid_model/", "/dsv4_attention/", "/csa_kernels/", "/hash_moe/", "/mhc/", "/dsv4_primitives/",
               "/thd_packing/", "/megatron/core/")  # fmt: skip


def _ours(path: str) -> bool:
    return any(k in path for k in _OUR_FRAMES)


def _short(path: str) -> str:
    """A source path from its package root (``hash_moe/routing.py``, ``megatron/core/...``)."""
    return path.split("/src/")[-1].split("site-packages/")[-1]


def _gap_report(S: int, model, out: Path, top: int = 30) -> dict:
    """Where the GPU waits for the host: one profiled fwd+bwd (Python stacks on), every idle interval between
    kernels longer than 5 us attributed to the code that launched the kernel ending it (innermost frames of our
    packages or megatron-core). Written to ``out/flash_smoke_gaps_S.txt``."""
    import bisect

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step = _fwd_bwd_step(model, S)
    step()
    torch.cuda.synchronize()
    # forward attribution: every module's forward runs inside a "mod:<name>" range
    hooks = []

    def pre(name):
        def hook(module, args):
            ctx = torch.profiler.record_function(f"mod:{name}")
            ctx.__enter__()
            module.__dict__.setdefault("_gap_ctx", []).append(ctx)

        return hook

    def post(module, args, output):
        module.__dict__["_gap_ctx"].pop().__exit__(None, None, None)

    for name, mod in model.named_modules():
        if name:
            hooks.append(mod.register_forward_pre_hook(pre(name)))
            hooks.append(mod.register_forward_hook(post))
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            step()
            torch.cuda.synchronize()
    finally:
        for h in hooks:
            h.remove()
    events = prof.profiler.kineto_results.events()
    gpu = sorted((e for e in events if e.device_type() == DeviceType.CUDA), key=lambda e: e.start_ns())
    launch = {}  # correlation id -> host launch time
    cpu_ops = []
    for e in events:
        if e.device_type() != DeviceType.CPU:
            continue
        if e.name().startswith(("cuda", "cu")):
            if e.correlation_id():
                launch[e.correlation_id()] = e.start_ns()
        else:
            cpu_ops.append(e)
    cpu_ops.sort(key=lambda e: e.start_ns())
    starts = [e.start_ns() for e in cpu_ops]
    # Python stacks live on the parsed events (times in us from the trace start)
    t0 = prof.profiler.kineto_results.trace_start_ns()
    stacked = sorted(
        (e for e in prof.events() if e.stack and any(_ours(f) for f in e.stack)),
        key=lambda e: e.time_range.start,
    )
    stacked_starts = [e.time_range.start for e in stacked]

    def frames_at(t_us: float) -> str:
        i = bisect.bisect_right(stacked_starts, t_us) - 1
        for j in range(i, max(i - 20000, -1), -1):
            e = stacked[j]
            if e.time_range.end >= t_us:
                return " <- ".join(_short(f) for f in [f for f in e.stack if _ours(f)][:2])
        return ""

    def site(t_ns: int) -> str:
        """Outermost and innermost host ops running at ``t_ns``, and our innermost Python frames."""
        i = bisect.bisect_right(starts, t_ns) - 1
        running = [cpu_ops[j] for j in range(i, max(i - 20000, -1), -1) if cpu_ops[j].end_ns() >= t_ns]
        if not running:
            return "(no host op)"
        inner, outer = running[0], running[-1]
        mod = next((e.name()[4:] for e in running if e.name().startswith("mod:")), None)
        where = frames_at((t_ns - t0) / 1000)
        return f"{mod or outer.name()[:50]} > {inner.name()[:40]}" + (f" @ {where}" if where else "")

    gaps: dict[str, list[float]] = {}
    end = gpu[0].start_ns() if gpu else 0
    total_gap = 0.0
    for e in gpu:
        gap = e.start_ns() - end
        if gap > 5_000:
            key = f"{site(launch.get(e.correlation_id(), e.start_ns()))} | next: {e.name()[:40]}"
            g = gaps.setdefault(key, [0.0, 0])
            g[0] += gap / 1e6
            g[1] += 1
            total_gap += gap / 1e6
        end = max(end, e.end_ns())
    span = (end - gpu[0].start_ns()) / 1e6 if gpu else 0.0
    rows = sorted(gaps.items(), key=lambda kv: -kv[1][0])
    lines = [
        f"flash-smoke fwd+bwd S={S}: GPU span {span:.1f} ms, idle {total_gap:.1f} ms in gaps > 5 us "
        f"(profiler with stacks on: host times are inflated)",
        "",
        f"{'idle ms':>8} {'gaps':>5}  launched by",
    ]
    lines += [f"{g[0]:8.2f} {g[1]:5d}  {k[:220]}" for k, g in rows[:top]]
    text = "\n".join(lines)
    print(text, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"flash_smoke_gaps_{S}.txt").write_text(text + "\n")
    return {"span_ms": span, "idle_ms": total_gap, "top": {k[:200]: g[0] for k, g in rows[:top]}}


def _sync_report(model, S: int, out: Path, top: int = 40) -> dict:
    """One fwd+bwd at length S under ``torch.cuda.set_sync_debug_mode("warn")``: every device-to-host
    synchronisation, grouped by the innermost frames of our packages and megatron-core that triggered it (the
    host gaps of the profile). Written to ``out/flash_smoke_syncs_S.txt``."""
    import traceback as tb
    import warnings

    step = _fwd_bwd_step(model, S)
    step()
    torch.cuda.synchronize()
    sites: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in tb.extract_stack()[:-1] if _ours(f.filename)]
        where = " <- ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))
        key = where or f"{filename}:{lineno}"
        sites[key] = sites.get(key, 0) + 1

    old = warnings.showwarning
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = old
    total = sum(sites.values())
    lines = [f"flash-smoke fwd+bwd S={S}: {total} device-to-host synchronisations", ""]
    lines += [f"{n:5d}  {k}" for k, n in sorted(sites.items(), key=lambda kv: -kv[1])[:top]]
    text = "\n".join(lines)
    print(text, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"flash_smoke_syncs_{S}.txt").write_text(text + "\n")
    return {"total": total, "sites": dict(sorted(sites.items(), key=lambda kv: -kv[1])[:top])}


def _optimizer_step_child(S: int, iters: int, packed: bool, cuda_graph: bool = False) -> dict:
    """Full training steps through ``dsv4 train``'s loop (DDP + distributed optimizer, Adam, grad clipping) in this
    process; run by :func:`_time_optimizer_step` in a fresh process (the Trainer owns its parallel state)."""
    from hybrid_model.training.config import TrainConfig
    from hybrid_model.training.trainer import Trainer

    # The last `iters` of `iters + 5` steps are timed, in both modes on the same batches (tokens/s counts real tokens,
    # which vary per batch). Graphs: 2 warm-up steps + the capture, again after the MTP weight's decay starts (step 2
    # at warmup_steps=0), so steps 4, 5, ... are replays. Eager: step 1 compiles.
    tc = TrainConfig(
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
        "step_time_s": [m["step_time_s"] for m in metrics],
        **({"optimizer_s": optimizer_s} if optimizer_s else {}),
    }


def _time_optimizer_step(S: int, iters: int, packed: bool, cuda_graph: bool = False) -> dict:
    """:func:`_optimizer_step_child` in a subprocess; raises with the child's output tail when it fails."""
    import subprocess
    import sys

    cmd = [sys.executable, __file__, "--optimizer-step-child", str(S), "--iters", str(iters)]
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
        "--optimizer-steps",
        nargs="*",
        default=["sbhd", "thd", "sbhd_cuda_graph"],
        help="full optimizer-step runs at S=4096 (sbhd, thd, sbhd_cuda_graph)",
    )
    long_context.add_flags(ap)
    args = ap.parse_args()
    if long_context.dispatch(args, Path(args.out)):  # --long-context (its own report; CPU: a tiny smoke run)
        return
    if not torch.cuda.is_available():
        print("bench_flash_smoke: no CUDA device; nothing measured")
        return
    if args.optimizer_step_child:
        r = _optimizer_step_child(args.optimizer_step_child, args.iters, args.packed, args.cuda_graph)
        print("OPTIMIZER_STEP " + json.dumps(r), flush=True)
        return
    _init()
    from hybrid_model.training.cuda_graph import use_capture_stream

    use_capture_stream()  # as dsv4 train --cuda-graph: model and steps on the capture stream (eager rows too)
    model = _model(bf16=True)
    result = {"device": torch.cuda.get_device_name(), "check": _check(model), "fwd_bwd": {}}

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
        runs = {"sbhd": (False, False), "thd": (True, False), "sbhd_cuda_graph": (False, True)}
        for key in args.optimizer_steps:
            if key not in runs or (args.no_graphs and runs[key][1]):
                continue
            packed, graph = runs[key]
            try:
                result["optimizer_step"][key] = _time_optimizer_step(4096, args.iters, packed, graph)
            except Exception:  # report, do not hide: the fwd/bwd table is still useful
                result["optimizer_step"][key] = {"error": traceback.format_exc()[-4000:]}
            print(f"optimizer step S=4096 {key}:", result["optimizer_step"][key], flush=True)
            save()
    _print_table(result)
    save()


if __name__ == "__main__":
    main()
