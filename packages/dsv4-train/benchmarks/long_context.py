"""Long context on one GPU: the FULL training step (forward + backward with MTP + the distributed optimizer step) of
flash-smoke at growing sequence lengths, for each activation-recompute setting (``bench_flash_smoke.py
--long-context``).

Per setting (:data:`SETTINGS`, most informative first: full recompute with the optimizer CPU offload at F = 1 and
0.5, then full / selective / no recompute) one fresh process builds the model and megatron's distributed optimizer
through ``dsv4 train``'s own setup (bf16, fused AdamW or the offload, gradient clipping), then runs
:class:`StepRunner` steps on one random ``[1, S]`` sequence per point. Offload settings (optimizer or activations
to the host): S = 64K first, then longer (96K, 128K, ...) until the first out-of-memory, then 4K / 16K / 32K; the
others: S = 4K, 16K, 32K, 64K, then longer until the first out-of-memory, then one bisection probe between the last
fitting length and the first OOM. Every
point: one warm-up step, ``iters`` timed steps; tokens/s, ms per step, the optimizer step alone (``optimizer_ms``,
synchronised before and after), peak GiB (``max_memory_allocated`` over the timed steps), the static GiB (weights, gradient buffers, Adam states: allocated between steps) and GiB per 1K tokens (peak
minus static, per 1K tokens; and the marginal slope of the peak from the previous point). The total time is bounded:
a point is not started past the deadline (``--budget-s``), a child is killed at it, and a setting's child stops at
its first OOM. Results: ``long_context.json`` in ``--out`` and ``benchmarks/results/``; the Hugging Face peer
(``hf_full_step.py`` of the anchors directory, when found) runs in the same call.

On a machine without CUDA the child runs the ``tiny`` preset in fp32 (a smoke test of this code: no memory numbers).
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from csa_kernels import deterministic_default
from dsv4_train.recompute import LONG_CONTEXT_SELECTIVE

FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
# the settings compared (TrainConfig fields), most informative first (the budget may end before the last ones):
# full recompute with the whole optimizer state offloaded to the host (the 64K recipe of the README), with half of
# it offloaded, then the settings without offload (measured before: same-call comparison); "selective" is the
# recompute recipe of the README
SETTINGS: dict[str, dict] = {
    "offload-full": dict(FULL, optimizer_cpu_offload=True, optimizer_offload_fraction=1.0),
    # + the checkpointed layer inputs in pinned host memory (--offload-activations)
    "offload-full-act": dict(
        FULL, optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, offload_activations=True
    ),
    # the same with the offloaded host step pipelined (--optimizer-offload-overlap: D2H, host AdamW, H2D overlap)
    "offload-full-act-overlap": dict(
        FULL,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=1.0,
        offload_activations=True,
        optimizer_offload_overlap=True,
    ),
    # the same with the host step deferred into the next step's forward (--optimizer-offload-defer)
    "offload-full-act-defer": dict(
        FULL,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=1.0,
        offload_activations=True,
        optimizer_offload_overlap=True,
        optimizer_offload_defer=True,
    ),
    # the checkpointed layer inputs on the host, the optimizer on the GPU (64K without optimizer offload)
    "full-act": dict(FULL, offload_activations=True),
    "offload-half-full": dict(FULL, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5),
    "full": dict(FULL),
    "selective": dict(LONG_CONTEXT_SELECTIVE),
    "none": {},
}
SEQ_LENS = (4096, 16384, 32768, 65536)
# offload settings: the target length first, then longer ones until the first OOM, then the shorter ones (the
# per-1K-token slope); settings without offload keep the ascending order (they OOM before 64K)
TARGET_SEQ_LEN = 65536
PROBE_STEP = 8192  # lengths past the list grow by 50% (rounded to this); the bisection probe rounds to it too


def _batch(vocab: int, s: int, device: torch.device):
    """One global batch of one random ``[1, S]`` sequence, shaped like thd-packing's SBHD micro-batches."""
    ids = torch.randint(0, vocab, (1, s), device=device)
    mb = SimpleNamespace(
        tokens=ids,
        labels=torch.roll(ids, -1, 1),
        loss_mask=torch.ones(1, s, device=device),
        position_ids=torch.arange(s, device=device)[None],
        padding_mask=torch.zeros(1, s, dtype=torch.bool, device=device),
    )
    return SimpleNamespace(microbatches=(mb,), num_microbatches=1, seqlen_sum=s)


class _Run:
    """The model, optimizer and scheduler of one setting, built by ``dsv4 train``'s setup functions."""

    def __init__(self, setting: str, preset: str) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import ProcessGroupCollection

        from dsv4_primitives.megatron import apply_cpu_shims, init_rng_tracker
        from dsv4_train.config import TrainConfig
        from dsv4_train.model_config import model_config_for
        from dsv4_train.setup import (
            attach_schedule_hooks,
            build_model,
            build_optimizer,
            build_scheduler,
            init_distributed,
            reset_metric_trackers,
        )

        cuda = torch.cuda.is_available()
        self.tc = TrainConfig.from_flat(
            preset=preset,
            steps=1000,
            seq_len=SEQ_LENS[0],
            global_batch_size=1,
            micro_batch_size=1,
            bf16=cuda,
            warmup_steps=0,
            out="/tmp/bench_long_context_run",
            progress=False,
            save_final=False,
            **SETTINGS[setting],
        )
        apply_cpu_shims()
        init_distributed()
        ps.initialize_model_parallel(1, 1)
        init_rng_tracker(self.tc.schedule.seed)
        reset_metric_trackers()
        self.ps = ps
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.model_config = model_config_for(self.tc)
        parts = build_model(
            self.tc, self.model_config, ps, ProcessGroupCollection.use_mpu_process_groups(), self.device
        )
        self.parts = parts
        self.optimizer = build_optimizer(self.tc, parts.model)
        self.optimizer_s: list[float] = []  # synchronised wall time of each optimizer step (``optimizer_ms``)
        real_step = self.optimizer.step

        def timed_step(*a, **k):
            _sync()
            t0 = time.perf_counter()
            out = real_step(*a, **k)
            _sync()
            self.optimizer_s.append(time.perf_counter() - t0)
            return out

        self.optimizer.step = timed_step
        self.scheduler = build_scheduler(self.tc, self.optimizer)
        attach_schedule_hooks(parts.config, parts.model)
        parts.model.train()

    def step(self, s: int, batch) -> float:
        """One full training step at length ``s``; returns its wall time (synchronised)."""
        from dsv4_train.step import StepRunner

        runner = StepRunner(
            self.tc.replace(seq_len=s),
            self.model_config,
            core=self.parts.core,
            model=self.parts.model,
            config=self.parts.config,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            ps=self.ps,
            device=self.device,
            world=1,
        )
        _sync()
        t0 = time.perf_counter()
        m = runner(batch, 0)
        _sync()
        if m["nonfinite"]:
            raise RuntimeError(f"non-finite step at S={s}: {m}")
        return time.perf_counter() - t0

    def clear(self) -> None:
        """After an OOM: drop gradients and cached blocks."""
        self.parts.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _measure(run: _Run, s: int, iters: int) -> dict:
    batch = _batch(run.model_config.vocab_size, s, run.device)
    cuda = torch.cuda.is_available()
    run.step(s, batch)  # warm-up (the first point also compiles the kernels and allocates the Adam states)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        static = torch.cuda.memory_allocated() / 2**30  # weights, gradient buffers, optimizer states
    run.optimizer_s.clear()
    times = [run.step(s, batch) for _ in range(iters)]
    dt = sorted(times)[len(times) // 2]
    opt = sorted(run.optimizer_s)[len(run.optimizer_s) // 2] if run.optimizer_s else float("nan")
    # optimizer_ms: the optimizer step alone (megatron's step: grad unscale/clip, AdamW on the GPU and/or the
    # host with its copies, param copy-back), synchronised before and after
    row = {"seq_len": s, "ms": 1e3 * dt, "tokens_per_s": s / dt, "optimizer_ms": 1e3 * opt}
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**30
        row.update(
            peak_gib=peak,
            static_gib=static,
            # the step's own memory (activations, logits chunks, workspaces) per 1K tokens
            gib_per_1k_tokens=(peak - static) / (s / 1024),
        )
    return row


def _longer(s: int, max_seq_len: int):
    """Lengths past ``s``, growing by 50% (rounded to :data:`PROBE_STEP`) up to ``max_seq_len``."""
    while True:
        s = max(s + PROBE_STEP, int(s * 1.5) // PROBE_STEP * PROBE_STEP)
        if s > max_seq_len:
            return
        yield s


def _next_lengths(seq_lens, max_seq_len: int):
    yield from (s for s in seq_lens if s <= max_seq_len)
    yield from _longer(max(seq_lens), max_seq_len)


def offloads_to_host(setting: str) -> bool:
    """Whether ``setting`` moves the optimizer state or the checkpointed activations to the host."""
    return bool(
        SETTINGS[setting].get("optimizer_cpu_offload") or SETTINGS[setting].get("offload_activations")
    )


def _plan(setting: str, seq_lens, max_seq_len: int, target: int | None) -> tuple[list[int], list[int]]:
    """(growing lengths, run until the first OOM; shorter lengths, run afterwards). Offload settings start at
    ``target`` (the most informative point first; activation offload too); the others grow from the shortest."""
    if target is None or not offloads_to_host(setting) or target > max_seq_len:
        return list(_next_lengths(seq_lens, max_seq_len)), []
    return [target, *_longer(target, max_seq_len)], [s for s in seq_lens if s < target]


def child_main(
    setting: str,
    iters: int,
    deadline: float,
    max_seq_len: int,
    preset: str | None,
    points: list[int] | None = None,
) -> None:
    """One setting (in its own process): print ``LONG_CONTEXT {json}`` lines, one per point (``points``: exactly
    these lengths, in this order, instead of the plan)."""
    preset = preset or ("flash-smoke" if torch.cuda.is_available() else "tiny")
    smoke = preset != "flash-smoke"
    seq_lens = SEQ_LENS if not smoke else (64, 256)
    if smoke:  # the CPU smoke run: the listed lengths only
        max_seq_len = max(seq_lens)
    if offloads_to_host(setting) and not torch.cuda.is_available():
        print(f"LONG_CONTEXT {json.dumps({'setting': setting, 'skipped': 'host offload needs CUDA'})}")
        return
    t0 = time.time()
    run = _Run(setting, preset)
    # the CSA backwards this process runs (csa-kernels' default: deterministic since 0.6; torch's strict mode is off)
    built = {"setting": setting, "build_s": time.time() - t0, "csa_deterministic": deterministic_default()}
    print(f"LONG_CONTEXT {json.dumps(built)}", flush=True)
    growing, shorter = _plan(setting, seq_lens, max_seq_len, None if smoke else TARGET_SEQ_LEN)
    if points:
        growing, shorter = [], list(points)

    def point(s: int) -> dict | None:
        if time.time() > deadline:
            print(f"LONG_CONTEXT {json.dumps({'seq_len': s, 'skipped': 'time budget'})}", flush=True)
            return None
        row = _point(run, s, iters)
        print(f"LONG_CONTEXT {json.dumps(row)}", flush=True)
        return row

    fit, oom = 0, None
    for s in growing:
        row = point(s)
        if row is None:
            return
        if row.get("oom"):
            oom = s
            break
        fit = s
    if oom and fit and oom - fit > PROBE_STEP and time.time() < deadline:  # one bisection probe
        mid = (fit + oom) // 2 // PROBE_STEP * PROBE_STEP
        if fit < mid < oom:
            point(mid)
    for s in shorter:
        if point(s) is None:
            return


def _point(run: _Run, s: int, iters: int) -> dict:
    try:
        return _measure(run, s, iters)
    except (torch.OutOfMemoryError, RuntimeError) as e:  # cuBLAS / Triton report OOM as RuntimeErrors
        text = str(e)
        if (
            not isinstance(e, torch.OutOfMemoryError)
            and "out of memory" not in text
            and "ALLOC_FAILED" not in text
        ):
            raise
        run.clear()
        return {"seq_len": s, "oom": True, "error": text[:200]}


def _summary(setting: str, rows: list[dict]) -> dict:
    points = sorted((r for r in rows if "ms" in r), key=lambda r: r["seq_len"])
    for a, b in itertools.pairwise(points):
        if "peak_gib" in a and "peak_gib" in b:
            b["marginal_gib_per_1k_tokens"] = (b["peak_gib"] - a["peak_gib"]) / (
                (b["seq_len"] - a["seq_len"]) / 1024
            )
    ooms = sorted(r["seq_len"] for r in rows if r.get("oom"))
    return {
        "recompute": SETTINGS[setting],
        "points": points,
        "longest_fitting_seq_len": max((r["seq_len"] for r in points), default=None),
        "first_oom_seq_len": ooms[0] if ooms else None,
        "log": rows,
    }


def _hf_peer(anchors: Path | None, timeout: float) -> dict:
    """transformers' full step at 4K (``hf_full_step.py``), same machine, same call."""
    if anchors is None or not (anchors / "hf_full_step.py").exists():
        return {"skipped": "no anchors directory with hf_full_step.py (pass --hf-anchors)"}
    try:
        proc = subprocess.run(
            [sys.executable, str(anchors / "hf_full_step.py"), "4096"],
            capture_output=True,
            text=True,
            timeout=max(timeout, 1.0),
        )
    except subprocess.TimeoutExpired:
        return {"error": "timed out (time budget)"}
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {"rows": rows} if rows else {"error": (proc.stdout + proc.stderr)[-2000:]}


def find_anchors(explicit: str | None) -> Path | None:
    """``--hf-anchors``, else ``.bench/anchors`` / ``shared/anchors`` / ``../shared/anchors`` of the repository."""
    if explicit:
        return Path(explicit)
    root = Path(__file__).resolve().parents[3]
    for cand in (
        root / ".bench" / "anchors",
        root / "shared" / "anchors",
        root.parent / "shared" / "anchors",
    ):
        if (cand / "hf_full_step.py").exists():
            return cand
    return None


def run_long_context(args, out: Path) -> dict:
    """The parent: one child per setting within ``args.budget_s`` seconds, then the HF peer; writes JSON."""
    deadline = time.time() + args.budget_s
    hf_reserve = 0.0 if args.no_hf_peer else 75.0  # seconds kept for the HF peer at the end
    result: dict = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "settings": {},
    }

    def save() -> None:
        text = json.dumps(result, indent=2, default=str)
        dirs = [out] + ([Path(__file__).parent / "results"] if torch.cuda.is_available() else [])
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            (d / "long_context.json").write_text(text)

    for setting in args.settings:
        left = deadline - hf_reserve - time.time()
        if left < 30:
            result["settings"][setting] = {"skipped": "time budget"}
            continue
        cmd = [sys.executable, str(Path(__file__).parent / "bench_flash_smoke.py"), "--long-context-child", setting,
               "--iters", str(args.iters), "--max-seq-len", str(args.max_seq_len),
               "--deadline", str(deadline - hf_reserve)]  # fmt: skip
        if args.preset:
            cmd += ["--preset", args.preset]
        if args.points:
            cmd += ["--points", *map(str, args.points)]
        rows: list[dict] = []
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left + 15)
            text, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            text, rc = (
                (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""),
                "timeout",
            )
        rows = [
            json.loads(line[len("LONG_CONTEXT ") :])
            for line in text.splitlines()
            if line.startswith("LONG_CONTEXT ")
        ]
        summary = _summary(setting, rows)
        if rc not in (0,):
            summary["child_exit"] = rc
            summary["child_tail"] = text[-3000:]
        result["settings"][setting] = summary
        print(f"long context, recompute {setting}: {json.dumps(summary['points'])}", flush=True)
        save()
    if not args.no_hf_peer:
        result["hf_full_step"] = _hf_peer(find_anchors(args.hf_anchors), deadline - time.time())
        save()
    print_table(result)
    return result


def print_table(result: dict) -> None:
    print(
        f"{'setting':>17} | {'S':>7} | {'ms/step':>9} | {'opt ms':>7} | {'tok/s':>9} | {'peak GiB':>8} | "
        f"{'static':>6} | {'GiB/1K':>7} | marginal"
    )
    for setting, summary in result["settings"].items():
        for r in summary.get("points", []):
            marg = r.get("marginal_gib_per_1k_tokens")
            print(
                f"{setting:>17} | {r['seq_len']:>7} | {r['ms']:>9.1f} | {r.get('optimizer_ms', float('nan')):>7.1f} | "
                f"{r['tokens_per_s']:>9,.0f} | {r.get('peak_gib', float('nan')):>8.1f} | "
                f"{r.get('static_gib', float('nan')):>6.1f} | {r.get('gib_per_1k_tokens', float('nan')):>7.2f} | "
                + (f"{marg:.2f}" if marg is not None else "-")
            )
        if summary.get("first_oom_seq_len"):
            print(f"{setting:>17} | {summary['first_oom_seq_len']:>7} | OOM")
    hf = result.get("hf_full_step", {})
    for r in hf.get("rows", []):
        if "ms_step" in r:
            print(
                f"{'HF':>17} | {r['seq']:>7} | {r['ms_step']:>9.1f} | {'':>7} | {r['tokens_per_s']:>9,.0f} | "
                f"{r['peak_gib']:>8.1f}"
            )


def add_flags(ap) -> None:
    ap.add_argument("--long-context", action="store_true",
                    help="full training step (fwd+bwd+optimizer, MTP) at 4K/16K/32K/64K/longest per recompute setting")  # fmt: skip
    ap.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--budget-s", type=float, default=420.0, help="--long-context: total wall-time budget")
    ap.add_argument(
        "--hf-anchors", help="directory holding hf_full_step.py (default: found next to the repo)"
    )
    ap.add_argument("--no-hf-peer", action="store_true")
    ap.add_argument(
        "--points",
        type=int,
        nargs="+",
        help="--long-context: exactly these sequence lengths per setting, in order",
    )
    ap.add_argument("--preset", help=argparse_suppress())
    ap.add_argument("--long-context-child", choices=list(SETTINGS), help=argparse_suppress())
    ap.add_argument("--deadline", type=float, help=argparse_suppress())


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def dispatch(args, out: Path) -> bool:
    """Run the long-context mode when asked (``True``), else leave the rest of the benchmark to run."""
    if args.long_context_child:
        try:
            child_main(
                args.long_context_child,
                args.iters,
                args.deadline or time.time() + 600,
                args.max_seq_len,
                args.preset,
                args.points,
            )
        except Exception:
            print(traceback.format_exc(), flush=True)
            raise
        return True
    if args.long_context:
        os.environ.setdefault(
            "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"
        )  # long S: less fragmentation
        run_long_context(args, out)
        return True
    return False
