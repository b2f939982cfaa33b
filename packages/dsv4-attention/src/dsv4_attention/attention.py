"""``DSv4Attention``: one DSv4 self-attention layer in plain PyTorch (spec §2); the core of every layer kind.

Input ``x`` = the block input after ``attn_norm`` as packed token rows ``[T, d]`` with their
:class:`~dsv4_attention.layout.TokenLayout` (documents, positions, padding rows):

    cQ = q_layernorm(linear_q_down_proj(x))                        # [T, d_c]   query latent (shared with the indexer)
    q  = linear_q_up_proj(cQ).view(T, n_h, c)                      # [T, n_h, c]
    q  = RoPE(q / sqrt(mean(q^2) + eps), pos)                      # weightless per-head RMSNorm, RoPE on last r dims
    kv = RoPE(kv_layernorm(linear_kv_proj(x)), pos)                # [T, c]     one shared head: K = V
    o  = core_attention(q, kv, x, cQ)                              # [T, n_h, c] window (+ compressed) + sink
    o  = RoPE(o, -pos)                                             # inverse rotation at the query position
    u  = linear_o_group_proj(o.view(T, n_h*c))                     # [T, g*d_g] block-diagonal wo_a
    y  = linear_proj(u)                                            # [T, d]     wo_b

One forward for one rank and for a context-parallel rank: the layout gives the layer its attention plan
(:mod:`dsv4_attention.attention_plan`: query rows -> global positions, the key rows and compressed entries to
gather and from where, the indexer-loss count); a :class:`~dsv4_attention.layout.TokenLayout` is the trivial plan
(``T`` rows, no communication), a context-parallel layout of ``P > 1`` ranks gives ``L = T / P`` query rows and
``h + L`` key rows (``kv`` and the compressors read the halo as well).

Positions restart per document. Per-layer RoPE (``AttentionConfig.rope``): plain base 10000 for window layers,
the compress base + YaRN (no mscale) for CSA / HCA (:func:`rope_config_for_kind`). Every linear and norm may be
injected (the megatron adapter :mod:`dsv4_attention.megatron` injects megatron / transformer-engine linears built
from a ``ModuleSpec``); by default they are bias-free ``nn.Linear`` and :class:`dsv4_primitives.RMSNorm`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from dsv4_attention._linears import default_norm, linear_out, plain_linear
from dsv4_attention._rope import rope
from dsv4_attention.attention_plan import AttentionPlan
from dsv4_attention.compressor import Compressor, CompressorConfig
from dsv4_attention.core import CompressedSparseAttention, CoreAttentionConfig
from dsv4_attention.cp.layout import ContextParallelLayout
from dsv4_attention.grouped_projection import GroupedOutputProjection
from dsv4_attention.indexer import IndexerConfig, LightningIndexer
from dsv4_attention.indexer_loss import attach_indexer_loss
from dsv4_attention.kind import LayerKind
from dsv4_attention.layout import TokenLayout
from dsv4_attention.tp.layout import TensorParallelLayout
from dsv4_attention.tp.params import check_tensor_parallel, mark_tensor_parallel
from dsv4_primitives import RopeConfig, YarnConfig, rms_norm
from dsv4_primitives.recompute import (
    NO_RECOMPUTE,
    RecomputeConfig,
    checkpoint_region,
    discard,
    recompute_scope,
)


@dataclass(frozen=True)
class AttentionConfig:
    """One DSv4 attention layer (shape symbols of dsv4-architecture.md §0; defaults: none, all sizes explicit).

    Attributes:
        kind: :class:`LayerKind` (window / CSA / HCA).
        hidden_size, num_heads, head_dim: ``d``, ``n_h``, ``c``.
        q_lora_rank: ``d_c``.
        o_groups, o_lora_rank: ``g``, ``d_g`` of the grouped output projection.
        window: ``n_win``.
        rope: the layer's rotary table (``rope.rope_dim`` = ``r``).
        indexer: the lightning indexer (required for CSA, ignored otherwise).
        eps: RMSNorm epsilon.
        backend: csa-kernels ``backend``.
        use_sparse_loss: sparse-phase indexer KL over the selected top-k (True) or all visible entries (False).
        tp_size: tensor-parallel size ``P``: this module holds ``n_h / P`` heads (``g / P`` output groups) and runs
            on a :class:`~dsv4_attention.tp.TensorParallelLayout` of ``P`` ranks (:mod:`dsv4_attention.tp`); ``P``
            must divide ``o_groups``.
    """

    kind: LayerKind
    hidden_size: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    rope: RopeConfig
    indexer: IndexerConfig | None = None
    eps: float = 1e-6
    backend: Literal["auto", "triton", "reference"] = "auto"
    use_sparse_loss: bool = False
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.kind, LayerKind):
            raise ValueError(f"AttentionConfig.kind must be a LayerKind, got {self.kind!r}")
        for name in (
            "hidden_size",
            "num_heads",
            "head_dim",
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "tp_size",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"AttentionConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.o_groups:
            raise ValueError(
                f"num_heads={self.num_heads} must be divisible by o_groups={self.o_groups} (each group of the "
                "grouped output projection holds whole heads)"
            )
        if self.o_groups % self.tp_size:
            raise ValueError(
                f"tensor-parallel size {self.tp_size} must divide o_groups={self.o_groups} (each TP rank holds whole "
                "groups of the grouped output projection, and their heads)"
            )
        r = self.rope.rope_dim
        if r <= 0 or r % 2 or r >= self.head_dim:
            raise ValueError(f"rope.rope_dim must be even, positive and < head_dim={self.head_dim}, got {r}")
        if self.kind.has_indexer and self.indexer is None:
            raise ValueError("a CSA layer needs an IndexerConfig (AttentionConfig.indexer)")
        _ = self.core  # validates window / backend

    @property
    def local_heads(self) -> int:
        """``n_h / P``: the query heads (and per-head sinks) of one TP rank."""
        return self.num_heads // self.tp_size

    @property
    def local_groups(self) -> int:
        """``g / P``: the output-projection groups of one TP rank."""
        return self.o_groups // self.tp_size

    @property
    def core(self) -> CoreAttentionConfig:
        """The core of one TP rank (its ``n_h / P`` heads)."""
        return CoreAttentionConfig(
            self.kind, self.local_heads, self.head_dim, self.window, self.backend, self.use_sparse_loss
        )

    @property
    def compressor(self) -> CompressorConfig | None:
        """The KV compressor (``None`` for window layers)."""
        if not self.kind.has_compressor:
            return None
        return CompressorConfig(self.kind, self.hidden_size, self.head_dim, self.eps)


def rope_config_for_kind(
    kind: LayerKind,
    rope_dim: int,
    *,
    base: float = 10000.0,
    compress_base: float = 160000.0,
    yarn: YarnConfig | None = None,
) -> RopeConfig:
    """Per-layer rotary table: plain ``base`` for window layers; ``compress_base`` (+ ``yarn``) for CSA / HCA."""
    if not kind.has_compressor:
        return RopeConfig(rope_dim=rope_dim, base=float(base))
    return RopeConfig(rope_dim=rope_dim, base=float(compress_base), yarn=yarn)


class DSv4Attention(torch.nn.Module):
    """DSv4 self-attention of one layer kind on packed token rows.

    ``forward(x [T, d], layout, *, dense=False, indexer_loss_coeff=1.0) -> (y [T, d], loss)``: ``loss`` is the
    CSA layer's indexer loss (already attached to ``y`` with :func:`~dsv4_attention.attach_indexer_loss`, returned
    for logging) or ``None``.

    Args:
        cfg: :class:`AttentionConfig`.
        linear_*, q_layernorm, kv_layernorm, core_attention: injected submodules (default: plain PyTorch ones built
            from ``cfg``); linears may return a tensor or megatron's ``(output, bias)`` pair.
        device, dtype: of the default submodules' parameters (``attn_sink`` and ``ape`` are always fp32).
    """

    def __init__(
        self,
        cfg: AttentionConfig,
        *,
        linear_q_down_proj: torch.nn.Module | None = None,
        q_layernorm: torch.nn.Module | None = None,
        linear_q_up_proj: torch.nn.Module | None = None,
        linear_kv_proj: torch.nn.Module | None = None,
        kv_layernorm: torch.nn.Module | None = None,
        core_attention: CompressedSparseAttention | None = None,
        linear_o_group_proj: torch.nn.Module | None = None,
        linear_proj: torch.nn.Module | None = None,
        device=None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        d, n_h, c, dc = cfg.hidden_size, cfg.local_heads, cfg.head_dim, cfg.q_lora_rank
        g = cfg.local_groups
        lin = dict(device=device, dtype=dtype)

        def given(module, default):  # build a default submodule only where none is injected
            return module if module is not None else default()

        self._init_attention(
            cfg,
            given(linear_q_down_proj, lambda: plain_linear(d, dc, **lin)),
            given(q_layernorm, lambda: default_norm(dc, cfg.eps, device)),
            given(linear_q_up_proj, lambda: plain_linear(dc, n_h * c, **lin)),
            given(linear_kv_proj, lambda: plain_linear(d, c, **lin)),
            given(kv_layernorm, lambda: default_norm(c, cfg.eps, device)),
            given(core_attention, lambda: build_core_attention(cfg, device=device)),
            given(
                linear_o_group_proj,
                lambda: GroupedOutputProjection(n_h * c, g, cfg.o_lora_rank, **lin),
            ),
            given(linear_proj, lambda: plain_linear(g * cfg.o_lora_rank, d, **lin)),
        )

    def _init_attention(self, cfg, q_down, q_norm, q_up, kv_proj, kv_norm, core, o_group_proj, proj) -> None:
        """Register the submodules in checkpoint order (the state-dict keys of the 0.2 layer)."""
        if core.kind is not cfg.kind:
            raise ValueError(f"core_attention is a {core.kind.name} core but the layer is {cfg.kind.name}")
        self.cfg = cfg
        self.kind = cfg.kind
        self.compress_ratio = cfg.kind.compress_ratio
        self.rope_cfg = cfg.rope
        self.num_heads = cfg.local_heads  # this TP rank's heads (all of them at TP = 1)
        self.head_dim = cfg.head_dim
        self.groups = cfg.local_groups
        self.eps = cfg.eps
        self.linear_q_down_proj = q_down
        self.q_layernorm = q_norm
        self.linear_q_up_proj = q_up
        self.linear_kv_proj = kv_proj
        self.kv_layernorm = kv_norm
        self.core_attention = core
        self.linear_o_group_proj = o_group_proj
        self.linear_proj = proj
        self.recompute = NO_RECOMPUTE
        if cfg.tp_size > 1:
            mark_tensor_parallel(self)

    def set_recompute(self, recompute: RecomputeConfig) -> None:
        """Selective activation recompute of this layer and its core (``layernorm``: the ``q_layernorm`` output;
        ``mla_up_proj``: the up-projections with their outputs ``q``/``kv``; ``compressor`` / ``indexer`` /
        ``core_attn``: see :meth:`CompressedSparseAttention.set_recompute`)."""
        self.recompute = recompute
        self.core_attention.set_recompute(recompute)

    @property
    def layer_kind(self) -> str:
        """``"sliding_window"``, ``"csa"`` or ``"hca"`` (the 0.2 strings; prefer :attr:`kind`)."""
        return self.kind.paper_name

    def forward(
        self,
        x: torch.Tensor,
        layout: TokenLayout | ContextParallelLayout | TensorParallelLayout,
        *,
        dense: bool = False,
        indexer_loss_coeff: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x [T, d]`` -> ``(y [T, d], indexer loss or None)`` (see the class docstring).

        With a :class:`~dsv4_attention.tp.TensorParallelLayout` of TP size ``P > 1`` (``cfg.tp_size == P``), ``x`` is
        this rank's sequence-parallel ``[L, d]`` rows, ``y`` the same rows (reduce-scattered) and the loss this
        rank's partial.

        One forward for every layout: ``layout`` gives the layer its
        :class:`~dsv4_attention.attention_plan.AttentionPlan` (a :class:`~dsv4_attention.layout.TokenLayout` or a
        single-rank ``ContextParallelLayout``: the trivial plan). With a
        :class:`~dsv4_attention.cp.ContextParallelLayout` of CP size ``P > 1``, ``x`` is this rank's ``[L, d]`` slice
        and the loss is this rank's partial (:mod:`dsv4_primitives.cp_partial_loss`).
        """
        plan = self.core_attention.plan(layout)
        check_tensor_parallel(self.cfg.tp_size, plan)
        if plan.is_parallel or self.recompute.granularity != "selective":
            return self._forward(x, plan, dense, indexer_loss_coeff)
        with recompute_scope():  # saved copies of discarded activations become recompute handles
            return self._forward(x, plan, dense, indexer_loss_coeff)

    def forward_tokens(
        self, x: torch.Tensor, layout: TokenLayout, *, dense: bool = False, indexer_loss_coeff: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer on one rank's packed token rows: :meth:`forward` with a token layout."""
        return DSv4Attention.forward(self, x, layout, dense=dense, indexer_loss_coeff=indexer_loss_coeff)

    def _forward(self, x, plan: AttentionPlan, dense: bool, indexer_loss_coeff: float):
        """project -> (the plan's keys and entries) -> attend -> loss tail -> output projection."""
        # selective recompute on one rank only (under CP the layer's regions would re-run collectives)
        rc = NO_RECOMPUTE if plan.is_parallel else self.recompute
        x_keys = plan.key_rows(x)  # [h + L, d] (one rank: x)
        # the query side reads the local rows as a VIEW of x_keys: under CP the projections then keep one [h + L, d]
        # buffer for backward instead of x_keys and a second copy of the local rows
        x = x_keys[plan.halo :] if plan.halo else x_keys  # [L, d]
        entries = None
        if self.core_attention.compressor is not None and plan.is_parallel:
            # launch the entries' gather first: it overlaps the query / key projections (one rank: the core runs
            # its compressors itself, inside their recompute regions)
            entries = plan.start_entries(self.core_attention, x_keys)
        q_pre = linear_out(self.linear_q_down_proj, x)  # [L, d_c]
        q_lat = self.q_layernorm(q_pre)  # [L, d_c] shared latent
        if rc.selects("layernorm") and torch.is_grad_enabled():
            discard(q_lat, lambda: self.q_layernorm(q_pre))  # the norm keeps its input; its output is rebuilt
        up = lambda xx, ql: self._up_projections(xx, ql, plan)
        if rc.selects("mla_up_proj"):
            q, kv = checkpoint_region(up, x_keys, q_lat, discard_outputs=True)
        else:
            q, kv = up(x_keys, q_lat)

        o, loss = self.core_attention(
            q, kv, x_keys, q_lat, plan, dense=dense, indexer_loss_coeff=indexer_loss_coeff, entries=entries
        )  # [L, n_h, c]
        if loss is not None:
            o = attach_indexer_loss(o, loss)
        y = self.project_output(
            o, plan.query_positions, plan.max_position
        )  # [rows, d] (TP: this rank's heads)
        return plan.reduce_output(y), loss

    def project_output(self, o: torch.Tensor, positions: torch.Tensor, max_position: int) -> torch.Tensor:
        """``o [T, n_h, c]`` -> ``y [T, d]``: inverse RoPE at the query ``positions [T]``, ``wo_a``, ``wo_b``
        (``max_position``: a host bound of the positions). Also the output of a cached decode step
        (:mod:`dsv4_attention.decode`)."""
        t = o.shape[0]
        # de-rotate at the query position
        o = rope(o, positions, self.rope_cfg, inverse=True, max_position=max_position)
        u = linear_out(self.linear_o_group_proj, o.reshape(t, self.num_heads * self.head_dim))  # [T, g*d_g]
        return linear_out(self.linear_proj, u)  # [T, d] (no bias)

    def _up_projections(self, x_keys, q_lat, plan: AttentionPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [L, n_h, c]`` (up-projection, weightless per-head RMSNorm, RoPE at the query positions) and
        ``kv [h + L, c]`` (projection, ``kv_layernorm``, RoPE at the key positions): the ``mla_up_proj`` recompute
        region. Under TP the KV head runs on the rank's own rows and the plan all-gathers the latents and KV rows
        (``[T, d_c]``, ``[T, c]``) before the up-projection of this rank's heads."""
        max_pos = plan.max_position
        kv_x, kv_pos = plan.kv_input(x_keys)
        q_lat, kv = plan.gather_latent_kv(q_lat, self.project_kv(kv_x, kv_pos, max_pos))
        return self.project_q(q_lat, plan.query_positions, max_pos), kv

    def project_qkv(
        self, x: torch.Tensor, q_lat: torch.Tensor, pos: torch.Tensor, max_pos: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, n_h, c]`` and ``kv [T, c]`` of ``x [T, d]`` and its query latent ``q_lat [T, d_c]``, rotated at
        ``pos [T]`` (``max_pos``: a host bound of the positions). Also the queries and new KV rows of a cached
        decode step (:mod:`dsv4_attention.decode`)."""
        return self.project_q(q_lat, pos, max_pos), self.project_kv(x, pos, max_pos)

    def project_q(self, q_lat: torch.Tensor, pos: torch.Tensor, max_pos: int) -> torch.Tensor:
        """``q [T, n_h, c]``: up-projection of the query latent ``q_lat [T, d_c]``, weightless per-head RMSNorm,
        RoPE at ``pos [T]``."""
        t = q_lat.shape[0]
        q = linear_out(self.linear_q_up_proj, q_lat)  # [T, n_h*c]
        q = rms_norm(q.view(t, self.num_heads, self.head_dim), None, self.eps)  # [T, n_h, c] no weight
        # in place: the norm saved its input, not this output
        return rope(q, pos, self.rope_cfg, max_position=max_pos, inplace=True)

    def project_kv(self, x: torch.Tensor, pos: torch.Tensor, max_pos: int) -> torch.Tensor:
        """``kv [N, c]`` (K = V): projection of ``x [N, d]``, ``kv_layernorm``, RoPE at ``pos [N]``."""
        kv = linear_out(self.linear_kv_proj, x)  # [N, c]
        return rope(self.kv_layernorm(kv), pos, self.rope_cfg, max_position=max_pos, inplace=True)


def build_core_attention(cfg: AttentionConfig, *, device=None) -> CompressedSparseAttention:
    """The plain-PyTorch core attention of ``cfg`` (compressor / indexer only where the kind has them)."""
    compressor = indexer = None
    if cfg.kind.has_compressor:
        compressor = Compressor(cfg.compressor, cfg.rope, device=device)
    if cfg.kind.has_indexer:
        indexer = LightningIndexer(cfg.indexer, cfg.rope, device=device)
    return CompressedSparseAttention(cfg.core, compressor=compressor, indexer=indexer, device=device)
