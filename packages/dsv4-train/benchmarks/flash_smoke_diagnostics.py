"""Diagnostics of ``bench_flash_smoke.py`` (moved out of it to keep it under the 600-line guide; same output): the
fwd+bwd closure the timings and reports share, the profiled step's kernel breakdown (``--profile-seq-len``), the
host-gap report and the device-to-host sync report (``--sync-report``)."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def fwd_bwd_step(model, S: int):
    """A closure running one forward + backward of the model on a random sequence of S tokens."""
    ids = torch.randint(0, model.model_config.vocab_size, (1, S), device="cuda")
    labels = torch.roll(ids, -1, 1)

    def step() -> None:
        loss = model(ids, None, None, labels=labels).float().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


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


def profile(model, S: int, out: Path, top: int = 40) -> dict:
    """One profiled fwd+bwd at length S (after a warm-up): kernel time by category, GPU busy share of the wall
    time, and the top kernels; the full table goes to ``out/flash_smoke_profile_S.txt``."""
    import re

    from torch.profiler import ProfilerActivity, profile

    step = fwd_bwd_step(model, S)
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


def gap_report(S: int, model, out: Path, top: int = 30) -> dict:
    """Where the GPU waits for the host: one profiled fwd+bwd (Python stacks on), every idle interval between
    kernels longer than 5 us attributed to the code that launched the kernel ending it (innermost frames of our
    packages or megatron-core). Written to ``out/flash_smoke_gaps_S.txt``."""
    import bisect

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step = fwd_bwd_step(model, S)
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


def sync_report(model, S: int, out: Path, top: int = 40) -> dict:
    """One fwd+bwd at length S under ``torch.cuda.set_sync_debug_mode("warn")``: every device-to-host
    synchronisation, grouped by the innermost frames of our packages and megatron-core that triggered it (the
    host gaps of the profile). Written to ``out/flash_smoke_syncs_S.txt``."""
    import traceback as tb
    import warnings

    step = fwd_bwd_step(model, S)
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
