"""The checkpoint layout of a DSv4 attention layer under tensor parallelism: its head-split parameters as TP shards.

Under ``P > 1`` TP ranks the layer's linears are plain ``torch.nn.Linear`` / ``Parameter`` objects of one rank's size
(:func:`~dsv4_attention.megatron._linears.linear_for`), so megatron-core's default ``sharded_state_dict`` (0.19.2:
``MegatronModule.sharded_state_dict`` -> ``make_sharded_tensors_for_checkpoint`` with no TP axis map) would declare
each of them as one tensor replicated over TP: a checkpoint would hold TP rank 0's heads only, and a resume would
load them into every rank. :func:`tp_sharded_state_dict` declares every parameter that
:func:`dsv4_attention.tp.mark_tensor_parallel` marked (``tensor_model_parallel``, ``partition_dim``, stride 1; the
split of :data:`dsv4_attention.tp.params.HEAD_SPLIT`) as rank ``r``'s contiguous slice ``r`` of the TP=1 tensor
along ``partition_dim`` (megatron's ``make_tp_sharded_tensor_for_checkpoint``, with the layer's own TP group and the
metadata's DP x CP group, after the pipeline's ``sharded_offsets``): the global shape and the keys are those of the
TP=1 model, so a checkpoint written at one TP size loads at any other that divides the heads.
"""

from __future__ import annotations

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint


def tp_sharded_state_dict(
    module: MegatronModule,
    tp_group,
    prefix: str = "",
    sharded_offsets: tuple = (),
    metadata: dict | None = None,
) -> dict:
    """megatron's sharded state dict of ``module`` with each TP-split parameter (``tensor_model_parallel``) as this
    rank's shard of the TP=1 tensor (module docstring); every other entry as megatron's default declares it."""
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    out = MegatronModule.sharded_state_dict(module, prefix, sharded_offsets, metadata)
    if tp_group is None or tp_group.size() == 1:
        return out
    for name, p in module.named_parameters():
        if not getattr(p, "tensor_model_parallel", False):
            continue
        key = f"{prefix}{name}"
        if key not in out:
            raise ValueError(f"{key}: a tensor-parallel parameter without an entry in the sharded state dict")
        if getattr(p, "partition_stride", 1) != 1:
            raise ValueError(
                f"{key}: partition_stride {p.partition_stride}; DSv4 attention splits contiguously"
            )
        out[key] = make_tp_sharded_tensor_for_checkpoint(
            p,
            key,
            tp_axis=int(p.partition_dim),
            prepend_offsets=sharded_offsets,
            tp_group=tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )
    return out
