"""Which parameters tensor parallelism splits, and how (megatron's parameter attributes).

A TP rank's shard of every split parameter is a contiguous slice of the TP=1 tensor along ``partition_dim``
(rank ``r`` of ``P`` holds slice ``r``; ``partition_stride`` 1), so layout-independent initialisation
(hybrid-model's ``seeded_init``) and checkpoint resharding read it from megatron's attributes
``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``:

=====================================  ===============  ================================================
parameter (TP=1 shape)                 ``partition_dim``  rank ``r`` holds
=====================================  ===============  ================================================
``linear_q_up_proj.weight`` ``[n_h*c, d_c]``   0          rows of heads ``[r n_h/P, (r+1) n_h/P)``
``core_attention.attn_sink`` ``[n_h]``          0          the same heads' sinks
``linear_o_group_proj.weight`` ``[g*d_g, n_h*c/g]``  0     rows of groups ``[r g/P, (r+1) g/P)`` (their heads)
``linear_proj.weight`` ``[d, g*d_g]``           1          columns of the same groups (row-parallel ``wo_b``)
=====================================  ===============  ================================================

Every other parameter of the layer (``linear_q_down_proj``, ``q_layernorm``, ``linear_kv_proj``, ``kv_layernorm``,
the compressors, the whole lightning indexer) is replicated and runs on the rank's sequence slice: it is marked
``sequence_parallel = True``, so megatron-core 0.19.2's ``finalize_model_grads`` (its
``_allreduce_non_tensor_model_parallel_grads``, with ``config.sequence_parallel``) sums its gradient over the TP group
(each rank's gradient covers its own rows only).
"""

from __future__ import annotations

import torch

HEAD_SPLIT = {
    "linear_q_up_proj.weight": 0,
    "core_attention.attn_sink": 0,
    "linear_o_group_proj.weight": 0,
    "linear_proj.weight": 1,
}


def mark_tensor_parallel(layer: torch.nn.Module) -> None:
    """Set megatron's TP attributes on the parameters of one ``DSv4Attention`` (module docstring)."""
    for name, p in layer.named_parameters():
        dim = HEAD_SPLIT.get(name)
        if dim is None:
            p.sequence_parallel = True
            p.tensor_model_parallel = False
        else:
            p.tensor_model_parallel = True
            p.partition_dim = dim
            p.partition_stride = 1


def check_tensor_parallel(tp_size: int, plan) -> None:
    """A layer built for ``tp_size`` ranks runs only on a plan whose heads are split over that many ranks."""
    group = plan.head_group
    got = 1 if group is None else torch.distributed.get_world_size(group)
    if got != tp_size:
        raise ValueError(
            f"the attention layer holds the heads of tensor-parallel size {tp_size} (AttentionConfig.tp_size) but "
            f"runs on a layout of TP size {got}: pass dsv4_attention.tp.tensor_parallel_layout(global_layout, tp_group) "
            "with a TP group of that size (or build the layer with tp_size=1 for a token / context-parallel layout)"
        )


def shard_of(full: torch.Tensor, name: str, rank: int, size: int) -> torch.Tensor:
    """This rank's slice of the TP=1 tensor ``full`` of parameter ``name`` (the replicated ones: ``full``)."""
    dim = HEAD_SPLIT.get(name)
    return full if dim is None else full.chunk(size, dim)[rank]
