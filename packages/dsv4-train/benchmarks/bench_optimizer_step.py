"""The optimizer step of ``dsv4 train`` at flash-smoke size (issue 34: target <= 35 ms for 3.24 B parameters), side
by side in one process with what it would be on megatron's own fallback ops and with the peer (HF transformers'
choice: ``torch.optim.AdamW(fused=True)`` directly on bf16 parameters, no fp32 master copy).

    PYTHONPATH=<all packages/*/src> python3 packages/dsv4-train/benchmarks/bench_optimizer_step.py --out DIR

Rows (each: the mean of ``--iters`` steps after 3 warm-up steps, synchronised around each ``step()``), one
``dsv4 train`` model per ``--optimizer-impl`` (built, stepped once for real, timed, freed before the next):

* ``megatron fallback``: megatron-core's ``DistributedOptimizer.step()`` (fp32 main params, fused torch AdamW,
  gradient clipping at 1.0) with megatron's local multi-tensor ops (what megatron-core uses without transformer-
  engine / apex: a host sync per gradient tensor in the norm);
* ``impl fused`` / ``impl foreach`` / ``impl unfused``: the same step with ``dsv4_primitives.megatron.multi_tensor``'s
  sync-free ``_foreach`` ops (the default of ``dsv4 train`` since dsv4-train 0.3.0) on each torch AdamW kernel;
* ``impl fused-step``: clip + AdamW + the bf16 model copy in one Triton pass (``dsv4_train.fused_step``);
* ``peer: fused AdamW on bf16``: ``torch.optim.AdamW(fused=True)`` over bf16 copies of every parameter with bf16
  gradients (no master weights, no clipping): the 28.7 ms HF measured in the issue.

The timed steps re-apply the gradients of the real step. Also printed: the bytes the step must move at least
(fp32 main param read + write, fp32 grad read, two Adam moments read + write, bf16 param write; the norm's grad
read) and the bandwidth that implies. Writes ``bench_optimizer_step.json``.

Dry run of the whole script on the CPU (no GPU; the Triton kernel in the interpreter, times meaningless):

    TRITON_INTERPRET=1 PYTHONPATH=... python3 packages/dsv4-train/benchmarks/bench_optimizer_step.py --out /tmp/b \
        --preset tiny --seq-len 64 --iters 1
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
from pathlib import Path

import torch

from dsv4_primitives.megatron import cuda_as_cpu
from dsv4_primitives.megatron.multi_tensor import (
    install_foreach_multi_tensor_ops,
    remove_foreach_multi_tensor_ops,
)
from dsv4_train.config import TrainConfig
from dsv4_train.trainer import Trainer
from dsv4_train.virtual_pipeline import ddp_chunks

IMPLS = ("fused", "foreach", "unfused", "fused-step")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, iters: int, warmup: int = 3) -> float:
    """Mean ms of ``fn`` over ``iters`` calls after ``warmup`` calls, synchronised around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return 1e3 * sum(times) / len(times)


def _trainer(args, impl: str) -> Trainer:
    tc = TrainConfig.from_flat(
        preset=args.preset,
        steps=1,
        seq_len=args.seq_len,
        global_batch_size=1,
        micro_batch_size=1,
        bf16=True,
        out="/tmp/bench_optimizer_step_run",
        overwrite=True,
        progress=False,
        warmup_steps=0,
        save_final=False,
        optimizer_impl=impl,
    )
    trainer = Trainer(tc)
    trainer.run()  # one real step: gradients and Adam state exist
    return trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="flash-smoke")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {IMPLS}")
    args = ap.parse_args()
    impls = [i for i in args.impls.split(",") if i]
    if not impls or any(i not in IMPLS for i in impls):
        raise ValueError(f"--impls must be a comma-separated subset of {IMPLS}, got {args.impls!r}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, n = {}, 0
    # on the CPU (dry run) megatron's optimizer needs its CUDA calls mapped to the CPU, as dsv4 train does
    on_device = contextlib.nullcontext if device == "cuda" else cuda_as_cpu
    for impl in impls:
        trainer = _trainer(args, impl)
        params = [p for chunk in ddp_chunks(trainer.model) for p in chunk.parameters() if p.requires_grad]
        shapes = [p.shape for p in params]
        n = sum(p.numel() for p in params)
        with on_device():
            if impl == "fused":
                remove_foreach_multi_tensor_ops()
                rows["megatron fallback"] = _time(trainer.optimizer.step, args.iters)
                install_foreach_multi_tensor_ops()
            rows[f"impl {impl}"] = _time(trainer.optimizer.step, args.iters)
        print(f"impl {impl}: {rows[f'impl {impl}']:.1f} ms", flush=True)
        trainer.close()
        del trainer, params
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()

    peer_params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=torch.bfloat16)) for s in shapes]
    for p in peer_params:
        p.grad = torch.randn_like(p) * 1e-3
    peer = torch.optim.AdamW(peer_params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    rows["peer: fused AdamW on bf16"] = _time(peer.step, args.iters)

    # fp32 main param r+w 8, grad r 4 (+4 for the norm), m and v r+w 16, bf16 param w 2
    min_bytes = n * (8 + 4 + 4 + 16 + 2)
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "preset": args.preset,
        "params": n,
        "iters": args.iters,
        "step_ms": rows,
        "min_bytes": min_bytes,
        "implied_tb_per_s": {k: min_bytes / (v * 1e-3) / 1e12 for k, v in rows.items()},
    }
    print(f"optimizer step, {args.preset}: {n / 1e9:.2f} B parameters on {result['device']}")
    print(f"{'':28s} {'ms':>8s} {'TB/s (min bytes)':>18s}")
    for k, v in rows.items():
        print(f"{k:28s} {v:8.1f} {result['implied_tb_per_s'][k]:18.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_optimizer_step.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
