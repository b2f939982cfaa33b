"""Allocation counts of one ``dsv4 train`` step for the memory-model tests (``test_memory_model.py``,
``test_memory_tensor_parallel.py``): the bytes saved for backward by one forward and the static bytes of the built
model and optimizer, on one rank (a gloo TP rank in the TP test's workers)."""

from __future__ import annotations

import torch

from dsv4_train.config import TrainConfig
from dsv4_train.trainer import Trainer


def memory_config(out, seq_len: int, **settings) -> TrainConfig:
    """The tiny preset, one ``[1, seq_len]`` micro-batch per step, bf16, mock data; ``settings`` override."""
    flat = dict(
        preset="tiny",
        steps=2,
        seq_len=seq_len,
        global_batch_size=1,
        micro_batch_size=1,
        warmup_steps=0,
        out=str(out),
        progress=False,
        save_final=False,
        sources=("mock:docs=64",),
        bf16=True,
    )
    return TrainConfig.from_flat(**(flat | settings))


def step_saved_bytes(tc: TrainConfig) -> tuple[int, Trainer]:
    """(bytes saved for backward by one forward: distinct storages, parameters and buffers excluded, counted with
    ``saved_tensors_hooks`` until the backward starts; the trainer after the step): the caller closes it."""
    initialised = torch.distributed.is_initialized()
    trainer = Trainer(tc)
    trainer.initialised_before = initialised
    weights = {t.untyped_storage().data_ptr() for t in [*trainer.core.parameters(), *trainer.core.buffers()]}
    seen: dict[int, int] = {}
    backward = []

    def pack(t):
        storage = t.untyped_storage()
        if not backward and storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    def unpack(t):
        backward.append(True)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            trainer._train_step(next(trainer.batches))
        return sum(seen.values()), trainer
    except BaseException:
        close(trainer, initialised)
        raise


def close(trainer: Trainer, initialised_before: bool | None = None) -> None:
    """Close ``trainer`` and leave the default process group as the test found it."""
    if initialised_before is None:
        initialised_before = trainer.initialised_before
    trainer.close()
    if not initialised_before and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def static_bytes(trainer: Trainer) -> dict[str, int]:
    """This rank's parameters (and the routers' fp32 selection biases), fp32 gradient buffers, distributed-optimizer
    fp32 main params and Adam moments, in bytes; ``n_params`` the number of parameter tensors."""
    core = trainer.core
    params = sum(p.numel() * p.element_size() for p in core.parameters())
    params += sum(
        b.numel() * b.element_size() for n, b in core.named_buffers() if n.endswith("e_score_correction_bias")
    )
    buffers = trainer.model.buffers + trainer.model.expert_parallel_buffers
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    adam = main = 0
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        for state in opt.optimizer.state.values():
            adam += sum(v.numel() * v.element_size() for k, v in state.items() if k != "step")
        main += sum(p.numel() * p.element_size() for g in opt.shard_fp32_from_float16_groups for p in g)
    n_params = sum(1 for _ in core.parameters())
    return {"params": params, "grads": grads, "main": main, "adam": adam, "n_params": n_params}


def tp_rank_memory(rank: int, world: int, out: str, seq_len: int, runs: list[dict]) -> list[dict]:
    """gloo worker: for each ``settings`` of ``runs``, one ``--tp world`` step of :func:`memory_config`; this rank's
    ``{"saved": bytes saved for backward, **static_bytes}``."""
    results = []
    for settings in runs:
        tc = memory_config(out, seq_len, tp=world, **settings)
        saved, trainer = step_saved_bytes(tc)
        try:
            results.append({"saved": saved, **static_bytes(trainer)})
        finally:
            trainer.close()
    return results
