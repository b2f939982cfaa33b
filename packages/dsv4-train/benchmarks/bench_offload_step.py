"""The offloaded optimizer step of ``dsv4 train --optimizer-cpu-offload`` at flash-smoke size (issue 33: 3.36 s per
step at F = 1 on one H200 inside the 64K run; target <= 1 s), side by side in one process, and its parts.

    PYTHONPATH=<all packages/*/src> python3 packages/dsv4-train/benchmarks/bench_offload_step.py --out DIR

One ``dsv4 train`` model (the model is the same with or without the offload: the flag changes the optimizer only)
runs one real step; its gradients stay in the DDP grad buffers and every row re-applies them. Rows (each the mean
of ``--iters`` ``optimizer.step()`` calls after 3 warm-ups, synchronised around each; one optimizer at a time over
the same model, built as ``dsv4_train.setup.build_optimizer`` builds the trainer's, freed before the next):

* ``no offload (peer)``: the run's own optimizer (``--optimizer-impl auto``: fused torch AdamW on the GPU);
* ``offload: megatron (today)``: megatron-core's ``HybridDeviceOptimizer`` as ``--optimizer-cpu-offload``
  configures it (``overlap_cpu_optimizer_d2h_h2d=False``: one host AdamW over all offloaded shards);
* ``offload: megatron overlap``: the same with megatron's ``overlap_cpu_optimizer_d2h_h2d=True`` (one host AdamW
  per shard, D2H on a side stream);
* ``offload: pipelined``: ``--optimizer-offload-overlap`` (:mod:`dsv4_train.offload_pipeline`).

Parts of the host step, each timed alone (host timers around synchronised work, ``--iters`` repeats) on the
optimizers of ``today`` (megatron's unpinned fp32 masters) and ``pipelined`` (pinned masters): ``d2h grads``
(every offloaded fp32 gradient into its pinned host buffer), ``cpu adamw`` (torch's fused CPU kernel, one call per
shard, as megatron runs it), ``cpu adamw chunked`` (the pipeline's chunks), ``h2d params`` (every fp32 master into
the model's bf16 shard: the copy and the bf16 conversion on the GPU), with the bytes each moves and the GB/s that
implies (PCIe for the copies, host memory for AdamW: 16 bytes read, 12 written per element). Also printed:
``torch.get_num_threads()`` (the host AdamW's threads). Writes ``bench_offload_step.json``.

What the user sees (``--full-steps K``, 0: skipped): the wall time of a whole training step (zero the grad buffers,
forward and backward of the one step's batch through megatron's schedule, ``optimizer.step()``), the mean over K
steps after 2 warm-ups, timed from before the first to after the last step's host and device work (so a deferred
step's host AdamW is counted where the next forward waits for it): ``fwd+bwd (no optimizer)``, ``pipelined``
(``--optimizer-offload-overlap``) and ``deferred`` (``--optimizer-offload-defer``, :mod:`dsv4_train.offload_defer`);
the exposed optimizer time of each is its full step minus ``fwd+bwd``.

Dry run on the CPU (times meaningless): ``tests/test_bench_offload_step.py`` runs :func:`main` with the tiny
preset under the test suite's simulated device (CPU tensors play the GPU), ``offload_context``; the full steps' forward
and backward run in ``forward_context`` (the dry run leaves the simulated device there: the model's kernels choose
by ``is_cuda``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from bench_optimizer_step import (
    _sync,
    _time,
)  # this folder: the non-offloaded optimizer's benchmark, same timing
from megatron.core.pipeline_parallel import get_forward_backward_func

from dsv4_primitives.megatron import cuda_as_cpu
from dsv4_train.config import TrainConfig
from dsv4_train.offload import hybrid_optimizers, offloaded_numel
from dsv4_train.offload_defer import DeferredHostStep
from dsv4_train.offload_pipeline import ALIGN, CHUNK_NUMEL, adamw_chunk, host_chunks
from dsv4_train.optimizer import build_optimizer
from dsv4_train.setup import optimizer_config
from dsv4_train.trainer import Trainer
from dsv4_train.virtual_pipeline import ddp_chunks

PEER = "no offload (peer)"
#: row -> (--optimizer-offload-overlap, megatron's overlap_cpu_optimizer_d2h_h2d)
OFFLOAD_ROWS = {
    "offload: megatron (today)": (False, False),
    "offload: megatron overlap": (False, True),
    "offload: pipelined": (True, False),
}
#: --rows names of the offload rows
ROW_NAMES = {
    "today": "offload: megatron (today)",
    "megatron-overlap": "offload: megatron overlap",
    "pipelined": "offload: pipelined",
}
ROW_NAMES_BY_ROW = {v: k for k, v in ROW_NAMES.items()}
PART_ROWS = ("offload: megatron (today)", "offload: pipelined")
ADAM_BYTES = (
    28  # per element: master, grad, exp_avg, exp_avg_sq read (16); master, exp_avg, exp_avg_sq written
)


def _tc(args, **offload) -> TrainConfig:
    return TrainConfig.from_flat(
        preset=args.preset,
        steps=1,
        seq_len=args.seq_len,
        global_batch_size=1,
        micro_batch_size=1,
        bf16=True,
        out=str(args.out / "run"),
        overwrite=True,
        progress=False,
        warmup_steps=0,
        save_final=False,
        **offload,
    )


def _parts(opt, iters: int, chunk_numel: int) -> dict:
    """The host step's parts on ``opt``'s hybrid optimizers, each alone: ms, bytes and GB/s."""
    hdos = hybrid_optimizers(opt)
    whole = [
        c for hdo in hdos for c in host_chunks(hdo, _whole_tensor_chunk(hdo))[0] if c.device_grad is not None
    ]
    chunked = [c for hdo in hdos for c in host_chunks(hdo, chunk_numel)[0] if c.device_grad is not None]
    n = sum(c.master.numel() for c in whole)

    def d2h():
        for c in whole:
            c.grad.copy_(c.device_grad, non_blocking=True)

    def h2d():
        for c in whole:
            c.device_param.copy_(c.master, non_blocking=True)

    def adam(chunks):
        return lambda: [adamw_chunk(c) for c in chunks]

    parts = {
        "d2h grads": (d2h, 4 * n),
        "cpu adamw": (adam(whole), ADAM_BYTES * n),
        "cpu adamw chunked": (adam(chunked), ADAM_BYTES * n),
        "h2d params": (h2d, 4 * n),
    }
    out = {"offloaded_elements": n, "masters_pinned": all(c.master.is_pinned() for c in whole)}
    for name, (fn, nbytes) in parts.items():
        ms = _time(fn, iters, warmup=1)
        out[name] = {"ms": ms, "bytes": nbytes, "gb_per_s": nbytes / (ms * 1e-3) / 1e9}
    serial = [out[k]["ms"] for k in ("d2h grads", "cpu adamw", "h2d params")]
    out["sum of d2h, adamw, h2d ms"], out["max of d2h, adamw, h2d ms"] = sum(serial), max(serial)
    return out


FULL_ROWS = ("fwd+bwd (no optimizer)", "pipelined", "deferred")


def _full_steps(trainer, batch, opt, deferred, steps: int, forward_context: Callable) -> float:
    """Mean wall ms of a whole training step on ``batch`` with ``opt`` (None: forward and backward only) and, for
    ``deferred``, its host AdamW behind the next forward; over ``steps`` steps after 2 warm-ups, from before the
    first to after the last one's host and device work."""
    chunks = ddp_chunks(trainer.model)
    stepper = trainer.stepper
    stepper.deferred = deferred  # its forward_step waits before each micro-batch's backward
    fb = get_forward_backward_func()

    def one():
        if deferred is not None:
            deferred.zero_grad_buffers(chunks)
        else:
            for chunk in chunks:
                chunk.zero_grad_buffer()
        if opt is not None:
            opt.zero_grad()
        with forward_context():
            fb(**stepper.schedule(batch, stepper.forward_step, forward_only=False))
        if opt is not None:
            assert opt.step()[0], "the benchmark's step was skipped"
        if deferred is not None:
            deferred.launch()

    def done():
        if deferred is not None:
            deferred.finish()
        _sync()

    for _ in range(2):
        one()
    done()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    done()
    stepper.deferred = None
    return 1e3 * (time.perf_counter() - t0) / steps


def _whole_tensor_chunk(hdo) -> int:
    """A chunk size (a multiple of ALIGN) at least the largest offloaded shard: one chunk per shard."""
    biggest = max((p.numel() for p in hdo.gpu_params_map_cpu_copy), default=ALIGN)
    return -(-biggest // ALIGN) * ALIGN


def _free(trainer_or_none, opt) -> None:
    """Drop the optimizer (and the trainer's references to it), and the host's cached pinned blocks."""
    ref = weakref.ref(opt)
    if trainer_or_none is not None:
        t = trainer_or_none
        t.optimizer = t.scheduler = t.checkpointer = None
        t.stepper.optimizer = t.stepper.scheduler = None
    del opt
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch._C._host_emptyCache()
    if ref() is not None:
        print("warning: an optimizer is still referenced; memory of the next rows includes it", flush=True)


def main(
    argv: list[str] | None = None,
    offload_context: Callable = contextlib.nullcontext,
    forward_context: Callable = contextlib.nullcontext,
) -> dict:
    """Run the rows and parts, print the table, write the JSON; ``offload_context``: entered around building and
    stepping the offloaded optimizers (the CPU dry run's simulated device); ``forward_context``: around the full
    steps' forward and backward, inside ``offload_context``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="flash-smoke")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--fraction", type=float, default=1.0, help="--optimizer-offload-fraction of the rows")
    ap.add_argument(
        "--chunk-numel",
        type=int,
        default=CHUNK_NUMEL,
        help="elements per chunk of the pipelined row and part",
    )
    ap.add_argument(
        "--threads", type=int, default=0, help="torch.set_num_threads for the host AdamW (0: torch's)"
    )
    ap.add_argument(
        "--rows",
        nargs="+",
        default=list(ROW_NAMES),
        choices=list(ROW_NAMES),
        help="offload rows to run (each holds ~60 GB of host memory for flash-smoke while it runs)",
    )
    ap.add_argument(
        "--full-steps",
        type=int,
        default=5,
        help="whole training steps per full-step row (fwd+bwd, pipelined, deferred); 0: skip those rows",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    on_device = contextlib.nullcontext if device == "cuda" else cuda_as_cpu  # as bench_optimizer_step.py

    trainer = Trainer(_tc(args))
    trainer.run()  # one real step: the gradients stay in the grad buffers
    batch = next(trainer.batches)  # the full-step rows' batch (the same every step)
    n = sum(p.numel() for chunk in ddp_chunks(trainer.model) for p in chunk.parameters() if p.requires_grad)
    rows, parts = {}, {}
    with on_device():
        rows[PEER] = _time(trainer.optimizer.step, args.iters)
    print(f"{PEER}: {rows[PEER]:.1f} ms", flush=True)
    _free(trainer, trainer.optimizer)
    offloaded = 0
    for row, (pipelined, megatron_overlap) in OFFLOAD_ROWS.items():
        if ROW_NAMES_BY_ROW[row] not in args.rows:
            continue
        flags = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=args.fraction)
        tc = _tc(args, optimizer_offload_overlap=pipelined, **flags)
        cfg = dataclasses.replace(optimizer_config(tc), overlap_cpu_optimizer_d2h_h2d=megatron_overlap)
        with on_device(), offload_context():  # the simulated streams over cuda_as_cpu's
            # the call dsv4_train.setup.build_optimizer makes (without its cuda_as_cpu: the dry run's simulated
            # streams stay in place)
            opt = build_optimizer(
                cfg,
                ddp_chunks(trainer.model),
                impl="auto",
                offload_chunk_numel=args.chunk_numel if pipelined else None,
            )
            rows[row] = _time(opt.step, args.iters)
            offloaded = offloaded_numel(opt)[0]
            if row in PART_ROWS:
                parts[row] = _parts(opt, args.iters, args.chunk_numel)
        print(f"{row}: {rows[row]:.1f} ms", flush=True)
        _free(None, opt)

    full = {}
    for row in FULL_ROWS if args.full_steps else ():
        opt = deferred = None
        with on_device(), offload_context():
            if row != "fwd+bwd (no optimizer)":
                flags = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=args.fraction)
                tc = _tc(
                    args, optimizer_offload_overlap=True, optimizer_offload_defer=row == "deferred", **flags
                )
                opt = build_optimizer(
                    optimizer_config(tc),
                    ddp_chunks(trainer.model),
                    impl="auto",
                    offload_chunk_numel=args.chunk_numel,
                )
                if row == "deferred":
                    deferred = DeferredHostStep(opt, ddp_chunks(trainer.model))
            full[row] = _full_steps(trainer, batch, opt, deferred, args.full_steps, forward_context)
            if deferred is not None:
                deferred.close()
        print(f"full step, {row}: {full[row]:.1f} ms", flush=True)
        if opt is not None:
            _free(None, opt)
    fwd_bwd = full.get("fwd+bwd (no optimizer)")
    exposed = {row: ms - fwd_bwd for row, ms in full.items() if row != "fwd+bwd (no optimizer)"}

    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "preset": args.preset,
        "params": n,
        "offload_fraction": args.fraction,
        "offloaded_elements": offloaded,
        "chunk_numel": args.chunk_numel,
        "iters": args.iters,
        "step_ms": rows,
        "parts": parts,
        "full_steps": args.full_steps,
        "full_step_ms": full,
        "exposed_optimizer_ms": exposed,
    }
    _print(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_offload_step.json").write_text(json.dumps(result, indent=2) + "\n")
    trainer.close()
    return result


def _print(r: dict) -> None:
    print(
        f"optimizer step, {r['preset']}: {r['params'] / 1e9:.2f} B params, {r['offloaded_elements'] / 1e9:.2f} B "
        f"offloaded (F = {r['offload_fraction']}), {r['threads']} torch threads, on {r['device']}"
    )
    print(f"{'step':34s} {'ms':>9s}")
    for k, v in r["step_ms"].items():
        print(f"{k:34s} {v:9.1f}")
    names = sorted({p for row in r["parts"].values() for p in row if isinstance(row[p], dict)})
    print(f"{'part (ms | GB/s)':34s} " + " ".join(f"{row[9:]:>22s}" for row in r["parts"]))
    for name in names:
        cells = [r["parts"][row][name] for row in r["parts"]]
        print(f"{name:34s} " + " ".join(f"{c['ms']:11.1f} | {c['gb_per_s']:8.1f}" for c in cells))
    for key in ("sum of d2h, adamw, h2d ms", "max of d2h, adamw, h2d ms"):
        print(f"{key:34s} " + " ".join(f"{row[key]:11.1f} {'':10s}" for row in r["parts"].values()))
    print(
        f"{'masters pinned':34s} "
        + " ".join(f"{row['masters_pinned']!s:>22s}" for row in r["parts"].values())
    )
    if r["full_step_ms"]:
        print(f"{'full step (mean of ' + str(r['full_steps']) + ')':34s} {'ms':>9s} {'exposed ms':>11s}")
        for k, v in r["full_step_ms"].items():
            exposed = r["exposed_optimizer_ms"].get(k)
            print(f"{k:34s} {v:9.1f} {'' if exposed is None else f'{exposed:11.1f}'}")


if __name__ == "__main__":
    main()
