"""Tensor parallelism (TP) with sequence parallelism (SP) for the parts of a DSv4 model outside DSv4 attention.

Under ``tensor_model_parallel_size = tp > 1`` the model always runs megatron's sequence parallelism: between the
tensor-parallel linears every activation is cut along the sequence, TP rank ``r`` holding rows ``[r·s/tp,
(r+1)·s/tp)`` of the ``[s, b, ·]`` tensors (of this CP rank's rows under CP). What each part does:

* **embedding / heads**: megatron's vocab-parallel embedding (rows ``V/tp``) scatters its output to this rank's
  sequence shard; the output head is column-parallel over the vocabulary (``[V/tp, d]``). The fused linear cross
  entropy gathers the head input ``[s/tp, b, d] -> [s, b, d]`` (its backward reduce-scatters) and reduces over the
  vocabulary shards (:meth:`hybrid_model.model.DSv4Model.head_loss`); every TP rank returns the same ``[b, s]``
  losses.
* **mHC streams** ``[s/tp, b, n·d]`` (fp32) and everything else that works per token (norms, mHC's pre / post /
  residual mixing and its Sinkhorn, the HyperHead, the MTP block's projections, the MoE router): replicated
  parameters that see only this rank's tokens. Their gradients are partial sums, added over the TP group by
  megatron's ``finalize_model_grads`` for every parameter carrying ``sequence_parallel = True``
  (:func:`mark_sequence_parallel_parameters`).
* **megatron's layers** ``*`` / ``-``: megatron's column- / row-parallel linears gather the sequence on their way in
  and reduce-scatter on their way out; the shared expert of ``E`` likewise.
* **routed experts**: expert TP is 1 (``expert_tensor_parallel_size = 1``): every expert is whole on its EP rank and
  each TP rank routes and computes its own sequence shard (megatron's expert-data-parallel group, which spans the
  TP ranks, sums the experts' gradients). Expert TP > 1 is refused (:func:`transformer_config_fields`).
* **hash routing** chooses experts by token id: the router reads the ids of this rank's sequence shard
  (:func:`sequence_shard`), and the balance loss's per-sequence counts are summed over the TP (x CP) group.

* **DSv4 attention** ``W C H``: its query heads, sinks and output groups are split over TP, the rest of the layer is
  replicated and runs on the rank's sequence rows (:mod:`dsv4_attention.tp`, wired by its megatron adapter); it
  takes SBHD micro-batches of one sequence (``b = 1``) or a THD pack under TP (the whole pack ``[1, T]``, the global
  ``PackedSeqParams``; the routers get its document intervals clipped to the rank's rows).
"""

from __future__ import annotations

from typing import Any

import torch

from hybrid_model.mixers.record import Layout
from hybrid_model.mixers.registry import records_of


def transformer_config_fields(tp: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """The megatron config fields of tensor parallelism ``tp``: sequence parallelism on with TP (as megatron does),
    expert TP 1. ``ValueError`` for what is not supported: ``sequence_parallel=False`` under TP, expert TP > 1."""
    if tp < 1:
        raise ValueError(f"tensor_model_parallel_size must be >= 1, got {tp}")
    sp = overrides.get("sequence_parallel", tp > 1)
    if tp > 1 and not sp:
        raise ValueError(
            "tensor parallelism runs with sequence parallelism (the mHC streams, norms and MoE inputs are cut along "
            "the sequence): leave sequence_parallel on"
        )
    etp = overrides.get("expert_tensor_parallel_size", 1)
    if etp != 1:
        raise ValueError(
            f"expert_tensor_parallel_size={etp}: the routed experts (hash-moe's grouped SwiGLU experts) are not split "
            "over TP; each TP rank computes its sequence shard with whole experts (expert TP 1): split experts over "
            "EP instead"
        )
    return {"tensor_model_parallel_size": tp, "sequence_parallel": tp > 1, "expert_tensor_parallel_size": 1}


def check_tensor_parallel_pattern(symbols: str, tp: int) -> None:
    """``ValueError`` with the record's reason when ``tp > 1`` and ``symbols`` (a pattern) holds a symbol whose
    record refuses tensor parallelism unconditionally (conditional refusals, e.g. ``+``/``D`` on the local spec,
    are raised when their layer is built)."""
    if tp <= 1:
        return
    for rec in records_of(symbols):
        refusal = rec.refusal(Layout.TP)
        if refusal is not None and not refusal.condition:
            raise ValueError(f"--tp {tp}: " + rec.message(Layout.TP))


def mark_sequence_parallel_parameters(model: torch.nn.Module, sequence_parallel: bool) -> int:
    """Set ``sequence_parallel`` on every replicated, non-expert parameter of ``model`` (megatron's attribute:
    ``finalize_model_grads`` sums such gradients over the TP group). Under SP each of them sees only this rank's
    tokens, so its gradient is a partial sum. Tensor-parallel shards (``tensor_model_parallel``) and routed experts
    (``allreduce = False``: reduced over the expert-data-parallel group) are left alone. Returns the count marked."""
    marked = 0
    for p in model.parameters():
        if getattr(p, "tensor_model_parallel", False) or not getattr(p, "allreduce", True):
            continue
        p.sequence_parallel = bool(sequence_parallel)
        marked += int(sequence_parallel)
    return marked


def sequence_shard(x: torch.Tensor, tp_group, dim: int = -1) -> torch.Tensor:
    """This TP rank's contiguous part of ``x`` along ``dim`` (the sequence; ``[B, S]`` token ids), as megatron's
    sequence parallelism cuts the activations. ``ValueError`` when the length does not split evenly."""
    size = tp_group.size() if tp_group is not None else 1
    if size == 1:
        return x
    n = x.shape[dim]
    if n % size:
        raise ValueError(
            f"sequence parallelism over {size} TP ranks needs a sequence length divisible by {size}, got {n} tokens "
            "per rank: pick --seq-len as a multiple of --tp"
        )
    return x.narrow(dim, tp_group.rank() * (n // size), n // size)


__all__ = [
    "check_tensor_parallel_pattern",
    "mark_sequence_parallel_parameters",
    "sequence_shard",
    "transformer_config_fields",
]
