"""gloo worker of ``test_seeded_init.py``: one model built at TP=1 and at TP=2 in the same two processes."""

from __future__ import annotations

from dsv4_testkit.megatron_cpu import megatron_cpu_context
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset
from hybrid_model.seeded_init import seed_parameters


def tp_model_params(rank: int, world: int, pattern: str, seed: int) -> dict[int, dict]:
    """``{tp: {name: (value, (partition_dim, partition_stride) | None)}}`` of the tiny preset with ``pattern``
    built at TP=1 (DP2) and at TP=2, each re-drawn by :func:`seed_parameters` with ``seed``."""
    out = {}
    for tp in (1, 2):
        with megatron_cpu_context(tp=tp):
            model = build_model(get_preset("tiny").with_pattern(pattern), tensor_model_parallel_size=tp)
            seed_parameters(model, seed)
            out[tp] = {
                n: (
                    p.detach().clone(),
                    (int(p.partition_dim), int(getattr(p, "partition_stride", 1)))
                    if getattr(p, "tensor_model_parallel", False)
                    else None,
                )
                for n, p in model.named_parameters()
            }
    return out
