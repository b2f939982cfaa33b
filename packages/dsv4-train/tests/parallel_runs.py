"""gloo workers of the parallel-matrix tests: train one or several layouts in one set of processes and return the
per-step metrics and the first step's reduced gradients under layout-independent names.

Module-level functions only (``run_distributed`` pickles them into spawned workers). Several layouts run one after
the other in the same processes (each ``Trainer`` builds and destroys its own megatron parallel state), which pays
the process start and the imports once per world size instead of once per layout.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

METRIC_KEYS = ("lm_loss", "mtp_loss", "grad_norm", "lr", "balance_loss", "indexer_loss")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _gather_distributed_optimizer_shards(ddp) -> None:
    """After megatron's reduce-scatter each data-parallel rank holds only its own shard of every gradient bucket
    reduced; gather the other ranks' reduced shards into the rest of the bucket (test instrumentation: the
    distributed optimizer reads only the local shard, so the step is unchanged)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    from dsv4_train.virtual_pipeline import ddp_chunks

    groups = [g for c in ddp_chunks(ddp) for g in (*c.bucket_groups, *c.expert_parallel_bucket_groups)]
    for group in groups:
        size = group.intra_distributed_optimizer_instance_size
        if size == 1:
            continue
        rank = group.intra_distributed_optimizer_instance_rank
        for bucket in group.buckets:
            shards = shard_buffer(bucket.grad_data, size)
            gathered = [torch.empty_like(s) for s in shards]
            dist.all_gather(
                gathered, shards[rank].clone(), group=group.intra_distributed_optimizer_instance_group
            )
            for r, s in enumerate(shards):
                if r != rank:
                    s.copy_(gathered[r])


def global_grad_names(core) -> dict[int, tuple[str, int | None]]:
    """``id(param)`` -> (its name in the single-stage model, its EP rank for expert params else ``None``).

    Decoder layers are numbered per stage (``decoder.layers.0`` on every stage and VPP chunk); their
    ``layer_number`` is global.
    """
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank()
    out = {}
    for chunk in getattr(core, "chunks", [core]):  # VirtualPipelineChunks: each chunk is a DSv4Model
        layer_index = {i: layer.layer_number - 1 for i, layer in enumerate(chunk.decoder.layers)}
        for name, p in chunk.named_parameters():
            m = _LAYER.match(name)
            if m:
                name = f"decoder.layers.{layer_index[int(m.group(1))]}.{name[m.end() :]}"
            out[id(p)] = (name, None if getattr(p, "allreduce", True) else ep_rank)
    return out


def capture_first_step_grads(trainer) -> dict:
    """Wrap the trainer's ``finalize_model_grads_func``: after the first step's reduction, record every parameter's
    reduced gradient (fp32 ``main_grad``) as ``{(global name, ep rank | None): tensor}``."""
    captured: dict = {}
    original = trainer.config.finalize_model_grads_func
    names = global_grad_names(trainer.core)

    def finalize(*args, **kwargs):
        original(*args, **kwargs)
        if captured:
            return
        _gather_distributed_optimizer_shards(trainer.model)
        for p in trainer.core.parameters():
            captured[names[id(p)]] = p.main_grad.detach().float().clone()

    trainer.config.finalize_model_grads_func = finalize
    return captured


def run_trainer(kw: dict):
    """The ``Trainer`` of one test run: ``TrainConfig.from_flat(**kw)`` without progress output and, unless ``kw`` asks for
    one (``save_final=True``), without a final checkpoint (``save_interval`` checkpoints are written as usual)."""
    from dsv4_train.config import TrainConfig
    from dsv4_train.trainer import Trainer

    return Trainer(TrainConfig.from_flat(progress=False, **({"save_final": False} | kw)))


def train_layouts(rank: int, world: int, runs: list[tuple[str, dict]], save_initial: bool = False) -> dict:
    """Train each ``(name, TrainConfig kwargs)`` in turn (:func:`run_trainer`); ``{name: {"metrics": [...],
    "grads": {...}, "initial": {...}, ...}}`` (``grads`` / ``initial``: the first step's reduced gradients and the
    initial parameters, keyed like :func:`capture_first_step_grads`)."""
    from dsv4_primitives import is_keep_in_fp32

    results = {}
    for name, kw in runs:
        trainer = run_trainer(kw)
        try:
            if save_initial:
                trainer.save_checkpoint()  # iter_0000000: the initial weights every layout starts from
            grads = capture_first_step_grads(trainer)
            names = global_grad_names(trainer.core)
            initial = {names[id(p)]: p.detach().float().clone() for p in trainer.core.parameters()}
            keep = [p for p in trainer.core.parameters() if is_keep_in_fp32(p)]
            keep_init = {names[id(p)][0]: p.detach().clone() for p in keep}
            metrics = trainer.run()
            keep_final = {names[id(p)][0]: p.detach().clone() for p in keep}
            other_dtypes = sorted({str(p.dtype) for p in trainer.core.parameters() if not is_keep_in_fp32(p)})
        finally:
            trainer.close()
        results[name] = {
            "metrics": [{"step": m["step"]} | {k: m.get(k) for k in METRIC_KEYS} for m in metrics],
            "grads": grads,
            "initial": initial,  # every parameter before the first step, like "grads" (merge_rank_grads)
            "keep_fp32_init": keep_init,  # keep-in-fp32 params (mHC, sinks, ape) before and after training
            "keep_fp32_final": keep_final,
            "other_param_dtypes": other_dtypes,
        }
    return results


def merge_rank_grads(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """One gradient per single-stage parameter name: replicas (DP, the MTP embedding copy) must agree bitwise;
    expert tensors ``[G, ...]`` are concatenated in EP-rank order."""
    dense: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for grads in per_rank:
        for (name, ep_rank), g in grads.items():
            if ep_rank is None:
                if name in dense:
                    assert torch.equal(dense[name], g), f"replicas of {name} disagree"
                else:
                    dense[name] = g
            else:
                seen = experts.setdefault(name, {})
                if ep_rank in seen:
                    assert torch.equal(seen[ep_rank], g), f"expert-DP replicas of {name} disagree"
                else:
                    seen[ep_rank] = g
    for name, parts in experts.items():
        dense[name] = torch.cat([parts[r] for r in sorted(parts)])
    return dense
