"""gloo worker of ``test_tp_checkpoint_sharding.py``: the sharded state dict of a tiny model built at TP=2."""

from __future__ import annotations

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from dsv4_testkit.megatron_cpu import megatron_cpu_context
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset


def tp_sharded_entries(rank: int, world: int, patterns: list[str | None]) -> dict[str | None, dict]:
    """``{pattern: {"params": {id: (name, local shape, tensor_model_parallel, partition_dim)}, "sharded": [(key,
    id(param), part of it (a factory's piece), local shape, global shape, global offset, replica_id, prepend_axis_num)], "tp_rank": r}}`` of the tiny
    preset with each pattern (``None``: the preset's own) built at TP = ``world``."""
    out = {}
    for pattern in patterns:
        with megatron_cpu_context(tp=world) as ps:
            cfg = get_preset("tiny") if pattern is None else get_preset("tiny").with_pattern(pattern)
            model = build_model(cfg, tensor_model_parallel_size=world)
            entries = list(nested_values(model.sharded_state_dict()))
            params = {
                id(p): (
                    n,
                    tuple(p.shape),
                    bool(getattr(p, "tensor_model_parallel", False)),
                    getattr(p, "partition_dim", None),
                )
                for n, p in model.named_parameters()
            }
            # (a factory, e.g. megatron's gated fc1 under TP: the ShardedTensors it builds, each a part of the param)
            held = [(t, id(t.data), False) for t in entries if isinstance(t, ShardedTensor)]
            for f in (e for e in entries if isinstance(e, ShardedTensorFactory)):
                held += [
                    (t, id(f.data), True) for t in nested_values(f.build()) if isinstance(t, ShardedTensor)
                ]
            sharded = [
                (
                    t.key,
                    data_id,
                    part,
                    tuple(t.local_shape),
                    tuple(t.global_shape),
                    tuple(t.global_offset),
                    t.replica_id,
                    t.prepend_axis_num,
                )
                for t, data_id, part in held
            ]
            out[pattern] = {
                "params": params,
                "sharded": sharded,
                "tp_rank": ps.get_tensor_model_parallel_rank(),
            }
    return out
