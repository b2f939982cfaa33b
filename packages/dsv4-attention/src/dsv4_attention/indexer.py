"""Lightning indexer of CSA layers (spec §4): scores compressed entries, picks the top-k per query.

Inputs are DETACHED (the LM loss never reaches the indexer; it is trained only by its KL loss, oracle I3):

    qI = RoPE(linear_wq_b(cQ).view(T, n_I, c_I), pos = t)       # [T, n_I, c_I], cQ = shared query latent
    KI = compressor(x)                                           # [Tc, c_I], its own ratio-4 overlapping compressor
    wI = linear_weights_proj(x) * c_I^-1/2 * n_I^-1/2            # [T, n_I]
    I[t, s] = sum_h wI[t, h] * ReLU(<qI[t, h], KI[s]>)           # visible entries of t's document, else -inf
    sel(t)  = top-k(I[t, :]), k_eff = min(k, #entries), ties -> lower index, -1 padding

The scoring and top-k numerics come from csa-kernels (``indexer_topk`` chunked over tokens; ``indexer_scores`` for
the differentiable student logits of the loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from dsv4_attention._kernels import compressed_cu_seqlens_host, indexer_scores, indexer_topk
from dsv4_attention._linears import column_parallel_kwargs
from dsv4_attention._rope import rope
from dsv4_primitives import RopeConfig


@dataclass
class LightningIndexerSubmodules:
    """Submodules of :class:`LightningIndexer`."""

    linear_wq_b: Any = None
    linear_weights_proj: Any = None
    compressor: Any = None


@dataclass
class IndexerState:
    """The indexer's per-forward tensors (kept for the loss)."""

    q: torch.Tensor  # [T, n_I, c_I]
    k: torch.Tensor  # [Tc, c_I]
    weights: torch.Tensor  # [T, n_I] (scaled)
    cu_seqlens_c: torch.Tensor  # int32 [N+1]


class LightningIndexer(MegatronModule):
    """Lightning indexer with its own ratio-4 compressor (parameters: ``wq_b``, ``weights_proj``, compressor)."""

    def __init__(
        self, config, submodules: LightningIndexerSubmodules, rope_cfg: RopeConfig, pg_collection
    ) -> None:
        super().__init__(config=config)
        if pg_collection is None:
            raise ValueError("LightningIndexer needs an explicit ProcessGroupCollection (pg_collection)")
        self.n_heads = config.dsa_indexer_n_heads
        self.head_dim = config.dsa_indexer_head_dim
        self.topk = config.dsa_indexer_topk
        self.compress_ratio = 4
        self.rope_cfg = rope_cfg
        common = column_parallel_kwargs(config, pg_collection.tp)
        self.linear_wq_b = build_module(
            submodules.linear_wq_b,
            config.q_lora_rank,
            self.n_heads * self.head_dim,
            tp_comm_buffer_name="csa_indexer_wq_b",
            **common,
        )
        self.linear_weights_proj = build_module(
            submodules.linear_weights_proj,
            config.hidden_size,
            self.n_heads,
            tp_comm_buffer_name="csa_indexer_weights_proj",
            **common,
        )
        self.compressor = build_module(
            submodules.compressor,
            config=config,
            compress_ratio=4,
            head_dim=self.head_dim,
            rope_cfg=rope_cfg,
            pg_collection=pg_collection,
        )
        self.weight_scale = (self.head_dim**-0.5) * (self.n_heads**-0.5)

    def forward(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        backend: str = "auto",
        position_offset: int = 0,
        max_position: int | None = None,
        cu_seqlens_host: list[int] | None = None,
    ) -> IndexerState:
        """``x [T, d]``, ``q_latent [T, d_c]`` (both detached here), RoPE ``positions [T]`` -> :class:`IndexerState`.

        ``position_offset`` shifts the compressed-key positions like ``positions`` (already shifted) for queries;
        ``max_position`` is a host bound of every position (no device sync to size the rotary table);
        ``cu_seqlens_host`` the host copy of ``cu_seqlens`` (no device sync in the compressor).
        """
        x = x.detach()
        q_latent = q_latent.detach()
        t = x.shape[0]
        q, _ = self.linear_wq_b(q_latent)  # [T, n_I*c_I]
        q = rope(
            q.view(t, self.n_heads, self.head_dim), positions, self.rope_cfg, max_position=max_position
        )  # [T, n_I, c_I]
        k, cu_c = self.compressor(
            x,
            cu_seqlens,
            backend=backend,
            position_offset=position_offset,
            max_position=max_position,
            cu_seqlens_host=cu_seqlens_host,
        )  # [Tc, c_I]
        w, _ = self.linear_weights_proj(x)  # [T, n_I]
        return IndexerState(q, k, w * self.weight_scale, cu_c)

    def select(
        self,
        state: IndexerState,
        cu_seqlens: torch.Tensor,
        backend: str = "auto",
        cu_seqlens_host: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k per query: ``(indices [T, k] int32 global compressed rows (-1 trailing), scores [T, k] fp32)``.

        The scores are differentiable in the indexer's parameters (the sparse-loss student); the indices are not.
        ``cu_seqlens_host``: host copy of ``cu_seqlens`` (no device sync).
        """
        idx, scores = indexer_topk(
            state.q,
            state.k,
            state.weights,
            self.compress_ratio,
            self.topk,
            cu_seqlens,
            state.cu_seqlens_c,
            backend=backend,
            **_host_kwargs(cu_seqlens_host, self.compress_ratio),
        )
        return idx, scores

    def scores(
        self,
        state: IndexerState,
        cu_seqlens: torch.Tensor,
        max_entries: int,
        backend: str = "auto",
        cu_seqlens_host: list[int] | None = None,
    ) -> torch.Tensor:
        """Differentiable scores ``[T, max_entries]`` over each token's document entries (column = local entry id,
        aligned with ``visible_compressed_indices``; ``-inf`` where invisible): the dense-loss student."""
        return indexer_scores(
            state.q,
            state.k,
            state.weights,
            self.compress_ratio,
            cu_seqlens,
            state.cu_seqlens_c,
            max_entries,
            backend=backend,
            **_host_kwargs(cu_seqlens_host, self.compress_ratio),
        )


def _host_kwargs(cu_seqlens_host: list[int] | None, ratio: int) -> dict:
    """csa-kernels' trusted-caller host copies of ``cu_seqlens`` / ``cu_seqlens_c`` (empty without a host copy)."""
    if cu_seqlens_host is None:
        return {}
    return {
        "cu_seqlens_host": cu_seqlens_host,
        "cu_seqlens_c_host": compressed_cu_seqlens_host(cu_seqlens_host, ratio),
    }
