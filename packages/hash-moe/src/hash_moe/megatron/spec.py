"""Spec builder: plug the DSv4 router, experts and shared expert into megatron-core 0.19.2's ``MoELayer``.

``get_dsv4_moe_spec(hash_routing=..., vocab_size=...)`` returns a megatron ``MlpBuilder`` (a partial of
:class:`DSv4MoELayer` with ``MoESubmodules``), usable as ``TransformerLayerSubmodules.mlp`` or called directly as
``builder(config=..., pg_collection=..., is_mtp_layer=..., name=...)``. Build one spec per layer kind: a hash spec
for the first ``num_hash_layers`` **MoE** layers (:func:`hash_moe.hash_moe_layer_flags`), the learned spec for the
rest and for MTP layers.
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core.transformer.moe.moe_layer import MoESubmodules

from hash_moe.grouped_gemm import GroupedBackend
from hash_moe.megatron.experts import ClampedSwiGLUExperts, ClampedSwiGLUSharedExpert
from hash_moe.megatron.moe_layer import DSv4MoELayer
from hash_moe.megatron.router import HashRouter, LearnedTopKRouter


def get_dsv4_moe_spec(
    *,
    hash_routing: bool,
    vocab_size: int | None = None,
    tid2eid: torch.Tensor | None = None,
    shared_expert: bool = True,
    grouped_gemm_backend: GroupedBackend = "auto",
    dispatch_alignment: int = 64,
):
    """MoE layer builder for one DSv4 layer kind.

    Args:
        hash_routing: True for the hash-routed (first MoE) layers; False for learned top-k (and MTP) layers.
        vocab_size: the (padded) vocabulary size; required when ``hash_routing``.
        tid2eid: initial ``[V, K]`` hash table (default round-robin; usually loaded from a checkpoint afterwards
            or built with :func:`hash_moe.build_tid2eid_balanced`).
        shared_expert: include the clamped shared expert (needs ``moe_shared_expert_intermediate_size``).
        grouped_gemm_backend: routed-expert GEMMs, see :mod:`hash_moe.grouped_gemm`.
        dispatch_alignment: token alignment of the padded all-gather dispatch.
    """
    if hash_routing:
        if vocab_size is None or vocab_size < 1:
            raise ValueError("hash routing needs vocab_size (the padded vocabulary the token ids come from)")
        router = partial(HashRouter, vocab_size=vocab_size, tid2eid=tid2eid)
    else:
        if tid2eid is not None:
            raise ValueError("tid2eid is only meaningful with hash_routing=True")
        router = LearnedTopKRouter
    submodules = MoESubmodules(
        experts=partial(ClampedSwiGLUExperts, backend=grouped_gemm_backend),
        shared_experts=ClampedSwiGLUSharedExpert if shared_expert else None,
        router=router,
    )
    return partial(DSv4MoELayer, submodules=submodules, dispatch_alignment=dispatch_alignment)
