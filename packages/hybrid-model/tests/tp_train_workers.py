"""gloo worker of ``test_tensor_parallel.py``: one forward + backward of a tiny model at TP=1 (DP2: both ranks the
whole model) and at TP=2 (sequence parallelism) in the same two processes, from the same seed and batch."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsv4_testkit.megatron_cpu import megatron_cpu_context
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset
from hybrid_model.seeded_init import seed_parameters


def _whole(p: torch.Tensor, t: torch.Tensor, group) -> torch.Tensor:
    """The TP=1 tensor of ``t`` (``p``'s value or gradient): TP shards gathered by megatron's stride rule."""
    if not getattr(p, "tensor_model_parallel", False) or group.size() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(parts, t.contiguous(), group=group)
    dim, stride = int(p.partition_dim), int(getattr(p, "partition_stride", 1))
    chunks = [x.chunk(stride, dim) for x in parts]
    return torch.cat([c[j] for j in range(stride) for c in chunks], dim=dim)


def _finalize_tp_grads(model, group) -> None:
    """What megatron's ``finalize_model_grads`` does over the TP group here: the gradients of parameters marked
    ``sequence_parallel`` are summed; so are the routed experts' (expert TP 1: in this two-rank world their
    expert-data-parallel group is the TP group)."""
    for p in model.parameters():
        if p.grad is None:
            continue
        if getattr(p, "sequence_parallel", False) or not getattr(p, "allreduce", True):
            dist.all_reduce(p.grad, group=group)


def tp_steps(rank: int, world: int, pattern: str, seed: int, cases: list[tuple[bool, bool]]) -> dict:
    """:func:`tp_step` of every ``(bf16, fused)`` case, keyed by the case."""
    return {case: tp_step(rank, world, pattern, seed, *case) for case in cases}


def tp_step(rank: int, world: int, pattern: str, seed: int, bf16: bool, fused: bool) -> dict[int, dict]:
    """``{tp: {"loss": per-token loss [b, s], "mtp": MTP loss, "grads": {name: whole gradient}, "marked": n}}``
    for TP 1 and 2. Gradients are of ``loss.mean()`` plus the MTP and balance losses the model attaches."""
    out = {}
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (2, 16))  # [b, s]
    labels = torch.roll(ids, -1, dims=1)
    dtype = torch.bfloat16 if bf16 else torch.float32
    for tp in (1, 2):
        with megatron_cpu_context(tp=tp) as ps:
            group = ps.get_tensor_model_parallel_group()
            model = build_model(
                get_preset("tiny").with_pattern(pattern),
                tensor_model_parallel_size=tp,
                fused_linear_cross_entropy=fused,
                bf16=bf16,
                params_dtype=dtype,
            )
            seed_parameters(model, seed)
            pos = torch.arange(ids.shape[1])[None].expand_as(ids)
            loss = model(ids, pos, None, labels=labels)  # [b, s]
            loss.float().mean().backward()
            _finalize_tp_grads(model, group)
            out[tp] = {
                "loss": loss.detach().float(),
                "mtp": model.last_mtp_loss.float(),
                "grads": {n: _whole(p, p.grad, group).float() for n, p in model.named_parameters()},
                "marked": sum(bool(getattr(p, "sequence_parallel", False)) for p in model.parameters()),
            }
    return out
