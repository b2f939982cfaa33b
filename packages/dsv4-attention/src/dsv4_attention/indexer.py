"""Lightning indexer of CSA layers (spec §4): scores compressed entries, picks the top-k per query.

Inputs are DETACHED (the LM loss never reaches the indexer; it is trained only by its KL loss, oracle I3):

    qI = RoPE(linear_wq_b(cQ).view(T, n_I, c_I), pos = t)       # [T, n_I, c_I], cQ = shared query latent
    KI = compressor(x)                                           # [Tc, c_I], its own ratio-4 overlapping compressor
    wI = linear_weights_proj(x) * c_I^-1/2 * n_I^-1/2            # [T, n_I]
    I[t, s] = sum_h wI[t, h] * ReLU(<qI[t, h], KI[s]>)           # visible entries of t's document, else -inf
    sel(t)  = top-k(I[t, :]), k_eff = min(k, #entries), -1 padding

Exact score ties (spec §4.2): ``tie_break="lower_index"`` (rule 2, the default) keeps the lower entry index, through
csa-kernels' ``indexer_topk`` (chunked over tokens, Triton on CUDA); ``"torch_topk"`` (rule 1) is CPU ``torch.topk``
over each query's full masked row, how transformers and the official code break ties on CPU (only to reproduce
their logits; csa-kernels ``indexer_topk_ref(tie_break="torch_topk")``). ``indexer_scores`` gives the
differentiable student logits of the loss.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from csa_kernels import indexer_topk_ref
from dsv4_attention._kernels import indexer_scores, indexer_topk
from dsv4_attention._linears import linear_out, plain_linear
from dsv4_attention._rope import rope
from dsv4_attention.compressor import Compressor, CompressorConfig
from dsv4_attention.kind import LayerKind
from dsv4_primitives import RopeConfig
from dsv4_primitives.varlen import SeqBoundaries

TIE_BREAKS = ("lower_index", "torch_topk")


@dataclass(frozen=True)
class IndexerConfig:
    """Sizes and top-k rule of one lightning indexer.

    Attributes:
        hidden_size: ``d`` (input of ``weights_proj`` and of the indexer's compressor).
        q_lora_rank: ``d_c`` (the shared query latent ``cQ``).
        n_heads, head_dim: ``n_I``, ``c_I``.
        topk: ``k`` selected entries per query.
        eps: epsilon of the compressor's RMSNorm.
        tie_break: ``"lower_index"`` (spec §4.2 rule 2) or ``"torch_topk"`` (rule 1, CPU ``torch.topk``).
    """

    hidden_size: int
    q_lora_rank: int
    n_heads: int
    head_dim: int
    topk: int
    eps: float = 1e-6
    tie_break: Literal["lower_index", "torch_topk"] = "lower_index"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "q_lora_rank", "n_heads", "head_dim", "topk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"IndexerConfig.{name} must be positive, got {getattr(self, name)}")
        if self.tie_break not in TIE_BREAKS:
            raise ValueError(f"IndexerConfig.tie_break must be one of {TIE_BREAKS}, got {self.tie_break!r}")

    @property
    def compressor(self) -> CompressorConfig:
        """The indexer's own ratio-4 overlapping compressor (entries of width ``c_I``)."""
        return CompressorConfig(LayerKind.CSA, self.hidden_size, self.head_dim, self.eps)


@dataclass
class IndexerState:
    """The indexer's per-forward tensors (kept for the loss; their entries are those of
    ``bounds.compressed(4)`` of the layer's boundaries)."""

    q: torch.Tensor  # [T, n_I, c_I]
    k: torch.Tensor  # [Tc, c_I]
    weights: torch.Tensor  # [T, n_I] (scaled)


class LightningIndexer(torch.nn.Module):
    """Lightning indexer with its own ratio-4 compressor (parameters: ``wq_b``, ``weights_proj``, compressor).

    Args:
        cfg: :class:`IndexerConfig`.
        rope_cfg: the layer's rotary table.
        linear_wq_b: ``[d_c] -> [n_I*c_I]``; linear_weights_proj: ``[d] -> [n_I]`` (default bias-free ``nn.Linear``).
        compressor: the indexer's :class:`Compressor` (default: built from ``cfg.compressor``).
        device: where default submodules are created.
    """

    def __init__(
        self,
        cfg: IndexerConfig,
        rope_cfg: RopeConfig,
        *,
        linear_wq_b: torch.nn.Module | None = None,
        linear_weights_proj: torch.nn.Module | None = None,
        compressor: Compressor | None = None,
        device=None,
    ) -> None:
        super().__init__()
        self._init_indexer(cfg, rope_cfg, linear_wq_b, linear_weights_proj, compressor, device)

    def _init_indexer(self, cfg, rope_cfg, linear_wq_b, linear_weights_proj, compressor, device) -> None:
        self.cfg = cfg
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.topk = cfg.topk
        self.compress_ratio = LayerKind.CSA.compress_ratio
        self.rope_cfg = rope_cfg
        if linear_wq_b is None:
            linear_wq_b = plain_linear(cfg.q_lora_rank, cfg.n_heads * cfg.head_dim, device=device)
        if linear_weights_proj is None:
            linear_weights_proj = plain_linear(cfg.hidden_size, cfg.n_heads, device=device)
        self.linear_wq_b = linear_wq_b
        self.linear_weights_proj = linear_weights_proj
        self.compressor = (
            compressor if compressor is not None else Compressor(cfg.compressor, rope_cfg, device=device)
        )
        self.weight_scale = (self.head_dim**-0.5) * (self.n_heads**-0.5)

    def set_tie_break(self, tie_break: Literal["lower_index", "torch_topk"]) -> None:
        """Switch the top-k tie rule (validated; the config stays frozen, a new one replaces it)."""
        self.cfg = dataclasses.replace(self.cfg, tie_break=tie_break)

    def forward(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        positions: torch.Tensor,
        bounds: SeqBoundaries,
        backend: str = "auto",
        position_offset: int = 0,
        max_position: int | None = None,
    ) -> IndexerState:
        """``x [T, d]``, ``q_latent [T, d_c]`` (both detached here), RoPE ``positions [T]`` -> :class:`IndexerState`.

        ``position_offset`` shifts the compressed-key positions like ``positions`` (already shifted) for queries;
        ``max_position`` is a host bound of every position (no device sync to size the rotary table); ``bounds``
        the layer's boundaries (host ones: no device sync in the compressor).
        """
        x = x.detach()
        q, w = self.queries(x, q_latent, positions, max_position)  # [T, n_I, c_I], [T, n_I]
        k, _ = self.compressor(
            x, bounds, backend=backend, position_offset=position_offset, max_position=max_position
        )  # [Tc, c_I]
        return IndexerState(q, k, w)

    def queries(
        self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, max_position: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query side of rows ``x [T, d]`` / ``q_latent [T, d_c]`` (both detached here): ``qI [T, n_I, c_I]``
        rotated at ``positions [T]`` and the scaled weights ``wI [T, n_I]`` (the keys are the compressor's entries:
        the layer's own at CP=1, the gathered global ones under context parallelism)."""
        t = x.shape[0]
        q = linear_out(self.linear_wq_b, q_latent.detach())  # [T, n_I*c_I]
        q = rope(
            q.view(t, self.n_heads, self.head_dim), positions, self.rope_cfg, max_position=max_position
        )  # [T, n_I, c_I]
        w = linear_out(self.linear_weights_proj, x.detach())  # [T, n_I]
        return q, w * self.weight_scale

    def select(
        self, state: IndexerState, bounds: SeqBoundaries, backend: str = "auto"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k per query: ``(indices [T, k] int32 global compressed rows (-1 trailing), scores [T, k] fp32)``.

        The scores are differentiable in the indexer's parameters (the sparse-loss student); the indices are not.
        Ties follow ``cfg.tie_break``; host boundaries: no device sync; static ones (CUDA graphs): launches planned
        on the device, ``tie_break='lower_index'`` only.
        """
        if self.cfg.tie_break == "torch_topk":
            if bounds.is_static:
                raise ValueError(
                    "tie_break='torch_topk' (HF parity on CPU) reads the boundaries on the host; static-shape "
                    "(CUDA-graph) packs need tie_break='lower_index'"
                )
            return self._select_torch_topk(state, bounds)
        return indexer_topk(
            state.q, state.k, state.weights, self.compress_ratio, self.topk, bounds, backend=backend
        )

    def _select_torch_topk(self, state: IndexerState, bounds: SeqBoundaries):
        """Spec §4.2 rule 1: CPU ``torch.topk`` over each query's full masked row, results moved back to the
        state's device."""

        dev = state.q.device
        idx, scores = indexer_topk_ref(
            state.q.cpu(),
            state.k.cpu(),
            state.weights.cpu(),
            self.compress_ratio,
            self.topk,
            bounds.to("cpu"),
            tie_break="torch_topk",
        )
        return idx.to(dev), scores.to(dev)

    def scores(
        self, state: IndexerState, bounds: SeqBoundaries, max_entries: int, backend: str = "auto"
    ) -> torch.Tensor:
        """Differentiable scores ``[T, max_entries]`` over each token's document entries (column = local entry id,
        aligned with ``visible_compressed_indices``; ``-inf`` where invisible): the dense-loss student. With static
        boundaries (static-shape THD) ``max_entries`` is at least the capacity ``T // ratio``."""
        return indexer_scores(
            state.q, state.k, state.weights, self.compress_ratio, bounds, max_entries, backend=backend
        )
