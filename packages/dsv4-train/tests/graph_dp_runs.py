"""gloo workers of ``test_train_graph_dp``: DP runs of the Trainer with the ``--cuda-graph`` DP step structure
(the gradient reduction after the schedule) switched on or off, and the gloo-on-CUDA host staging.

Module-level functions only (``run_distributed`` pickles them into spawned workers). Every variant of one world
runs one after the other in the same processes (see :mod:`parallel_runs`).
"""

from __future__ import annotations

import contextlib

from parallel_runs import METRIC_KEYS, capture_first_step_grads


def train_variants(rank: int, world: int, runs: list[tuple[str, dict, dict]]) -> dict:
    """Train each ``(name, TrainConfig kwargs, variant)``; ``variant``: ``split`` (the DP gradient reduction run
    eagerly after the schedule, as ``--cuda-graph`` does with DP > 1, here without a graph) and ``staged`` (the
    distributed optimizer's collectives staged through host memory as with gloo on CUDA). Returns
    ``{name: {"metrics": [...], "grads": {...}, "recorded": bool}}`` and, under ``"unequal-microbatches"``, the
    micro-batch check's message when the two ranks claim different micro-batch counts."""
    import torch.distributed as dist

    from dsv4_train.config import TrainConfig
    from dsv4_train.gloo_cuda import host_staged_collectives
    from dsv4_train.graph_data_parallel import GradReductionAfterSchedule, check_equal_microbatches
    from dsv4_train.trainer import Trainer

    results = {}
    try:  # rank 0 claims 3 micro-batches per step, rank 1 claims 2
        check_equal_microbatches(3 if rank == 0 else 2, dist.group.WORLD, "cpu")
        results["unequal-microbatches"] = ""
    except RuntimeError as e:
        results["unequal-microbatches"] = str(e)
    for name, kw, variant in runs:
        with host_staged_collectives(cpu_too=True) if variant.get("staged") else contextlib.nullcontext():
            trainer = Trainer(TrainConfig.from_flat(progress=False, **kw))
            try:
                if variant.get("split"):
                    dp_group = trainer.ps.get_data_parallel_group(with_context_parallel=True)
                    trainer.stepper.grad_reduction = GradReductionAfterSchedule(
                        trainer.config, dp_group, trainer.device
                    )
                grads = capture_first_step_grads(trainer)
                metrics = trainer.run()
                reduction = trainer.stepper.grad_reduction
            finally:
                trainer.close()
        results[name] = {
            "metrics": [{"step": m["step"]} | {k: m.get(k) for k in METRIC_KEYS} for m in metrics],
            "grads": grads,
            "recorded": reduction is not None and reduction.call is not None and reduction.checked,
        }
    return results


def graph_vs_eager(rank: int, world: int, runs: list[tuple[str, dict]]) -> dict:
    """GPU: train each ``(name, TrainConfig kwargs)`` (``cuda_graph`` on or off) on this rank's GPU (every rank on
    the current device); per-step metrics and whether each step replayed the graph."""
    from dsv4_train.config import TrainConfig
    from dsv4_train.trainer import Trainer

    results = {}
    for name, kw in runs:
        trainer = Trainer(TrainConfig.from_flat(progress=False, **kw))
        try:
            metrics = trainer.run()
            captures = trainer._graphed.captures if trainer._graphed is not None else 0
            split = trainer.stepper.grad_reduction is not None
        finally:
            trainer.close()
        results[name] = {
            "metrics": [{"step": m["step"]} | {k: m.get(k) for k in METRIC_KEYS} for m in metrics],
            "replayed": [m.get("cuda_graph_replayed", False) for m in metrics],
            "captures": captures,
            "split": split,
        }
    return results
