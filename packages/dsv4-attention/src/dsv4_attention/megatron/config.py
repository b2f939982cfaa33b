"""DSv4 attention configuration of the megatron adapter: a megatron-core ``MLATransformerConfig`` subclass with the
DSv4 fields, and its mapping to the core's frozen configs (:meth:`DSv4AttentionConfig.attention_config`).

Field names follow upstream Megatron-LM (D1/D2 slices; see ``upstream-megatron-dsv4.md`` §2, §3.4): the CSA fields
``csa_*``, the reused DSA indexer fields ``dsa_indexer_*``, and main's ``output_projection_groups`` /
``output_projection_lora_rank`` for the grouped output projection (dev/oracle names ``o_groups`` / ``o_lora_rank``
are read-only aliases). Shape symbols (dsv4-architecture.md §0):

=============================  =======================================  ==============  ============
symbol                          field                                    V4-Flash        V4-Pro
=============================  =======================================  ==============  ============
``d``                           ``hidden_size``                          4096            7168
``n_h``                         ``num_attention_heads``                  64              128
``c``                           ``v_head_dim`` (= q/k head dim)          512             512
``r``                           ``qk_pos_emb_head_dim``                  64              64
``d_c``                         ``q_lora_rank``                          1024            1536
``g`` / ``d_g``                 ``output_projection_groups`` / ``_lora_rank``  8 / 1024  16 / 1024
``n_win``                       ``csa_window_size``                      128             128
``n_I`` / ``c_I`` / ``k``       ``dsa_indexer_n_heads/_head_dim/_topk``  64 / 128 / 512  64 / 128 / 1024
=============================  =======================================  ==============  ============

Invalid settings raise ``ValueError`` naming the field and the fix. The config is read at construction; the
training phase (dense / sparse) is state of the layers (``DSv4HybridAttention.set_dense_attention``), not a field
to flip at run time (``csa_dense_mode`` is only the phase the layers start in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron.core.transformer.transformer_config import MLATransformerConfig

from dsv4_attention.attention import AttentionConfig, rope_config_for_kind
from dsv4_attention.core import CoreAttentionConfig
from dsv4_attention.indexer import IndexerConfig
from dsv4_attention.indexer_loss import IndexerLossAutoScaler
from dsv4_attention.kind import LAYER_KINDS, VALID_COMPRESS_RATIOS, LayerKind, check_compress_ratio
from dsv4_primitives import RopeConfig, YarnConfig
from dsv4_primitives.recompute import RecomputeConfig

__all__ = ["LAYER_KINDS", "VALID_COMPRESS_RATIOS", "DSv4AttentionConfig", "check_compress_ratio"]


def _default_loss_scale_func():
    return IndexerLossAutoScaler.set_loss_scale


@dataclass
class DSv4AttentionConfig(MLATransformerConfig):
    """``MLATransformerConfig`` + the DSv4 hybrid-attention fields (defaults: V4-Flash attention shapes).

    Derived on construction (as upstream D2 does): ``qk_head_dim = kv_lora_rank = v_head_dim - qk_pos_emb_head_dim``.
    The inherited ``rotary_base`` is the plain RoPE base of window-only layers; compressed layers use
    ``csa_compress_rotary_base`` with YaRN (``rotary_scaling_factor``, ``original_max_position_embeddings``,
    ``beta_fast``, ``beta_slow``) and never an mscale (``mscale``/``mscale_all_dim``/``rope_type`` are not read).
    """

    # --- megatron fields whose defaults differ for DSv4 ---
    experimental_attention_variant: str | None = "dsv4_hybrid"
    add_bias_linear: bool = False
    attention_dropout: float = 0.0
    layernorm_epsilon: float = 1e-6
    q_lora_rank: int = 1024
    v_head_dim: int = 512
    qk_pos_emb_head_dim: int = 64
    rotary_base: float = 10000.0
    rotary_scaling_factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    dsa_indexer_n_heads: int | None = 64
    dsa_indexer_head_dim: int | None = 128
    dsa_indexer_topk: int | None = 512
    dsa_indexer_loss_coeff: float | None = 1.0

    # --- CSA fields (upstream D1 names) ---
    csa_window_size: int = 128
    """Sliding window ``n_win`` (raw tokens incl. the query itself)."""

    csa_compress_ratios: list[int] | None = None
    """Per-layer compress ratios (``0`` window only, ``4`` CSA, ``128`` HCA) for ``num_layers`` main layers followed
    by the MTP layers; optional when every layer's ratio comes from its spec (``compress_ratio`` param)."""

    csa_compress_rotary_base: float = 160000.0
    """RoPE base of compressed (ratio 4 / 128) layers."""

    csa_compress_rope_type: Literal["yarn", "rope"] = "yarn"
    """``yarn`` (released V4 models) or ``rope`` (plain, e.g. tiny HF test configs) for compressed layers."""

    csa_dense_mode: bool = False
    """The phase the layers start in: dense (CSA layers attend every visible compressed entry and the indexer is
    trained densely) or sparse. Switch it later with ``DSv4HybridAttention.set_dense_attention`` (hybrid-model:
    ``DSv4Model.set_step_state``); changing this field after construction has no effect."""

    dsa_indexer_tie_break: Literal["lower_index", "torch_topk"] = "lower_index"
    """Exact top-k score ties: lower entry index (spec §4.2 rule 2) or CPU ``torch.topk`` (rule 1, transformers'
    CPU behaviour, for logit parity only)."""

    csa_kernel_backend: Literal["auto", "triton", "reference"] = "auto"
    """``backend`` passed to csa-kernels (``auto``: Triton on CUDA, the reference on CPU)."""

    # --- grouped output projection (upstream main names) ---
    output_projection_groups: int = 8
    """``g``: number of head groups of the block-diagonal ``wo_a``."""

    output_projection_lora_rank: int = 1024
    """``d_g``: per-group output rank."""

    # --- activation recompute (ours; megatron's recompute_* fields carry what megatron implements itself) ---
    dsv4_recompute: RecomputeConfig | None = None
    """Selective / full recompute of the DSv4 modules (:class:`dsv4_primitives.recompute.RecomputeConfig`);
    ``None`` = none. hybrid-model sets it together with megatron's ``recompute_granularity`` / ``recompute_method``
    / ``recompute_num_layers`` / ``recompute_modules`` (:meth:`RecomputeConfig.megatron_fields`)."""

    def __post_init__(self) -> None:
        if self.v_head_dim is not None and self.qk_pos_emb_head_dim is not None:
            derived = self.v_head_dim - self.qk_pos_emb_head_dim
            self.qk_head_dim = derived
            self.kv_lora_rank = derived
        if self.experimental_attention_variant_loss_scale_func is None:
            self.experimental_attention_variant_loss_scale_func = _default_loss_scale_func()
        super().__post_init__()
        self.validate_dsv4()

    # ------------------------------------------------------------------ aliases (dev/oracle names)
    @property
    def o_groups(self) -> int:
        return self.output_projection_groups

    @property
    def o_lora_rank(self) -> int:
        return self.output_projection_lora_rank

    # ------------------------------------------------------------------ validation
    def validate_dsv4(self) -> None:
        """Raise ``ValueError`` for any DSv4 attention setting this package cannot run."""
        heads, c, r = self.num_attention_heads, self.v_head_dim, self.qk_pos_emb_head_dim
        if self.q_lora_rank is None or self.q_lora_rank <= 0:
            raise ValueError(
                f"q_lora_rank must be a positive int for DSv4 attention (low-rank query), got {self.q_lora_rank}"
            )
        if c is None or c <= 0:
            raise ValueError(f"v_head_dim (the DSv4 head dim c) must be positive, got {c}")
        if r is None or r <= 0 or r % 2 or r >= c:
            raise ValueError(
                f"qk_pos_emb_head_dim (rotary width r) must be even, positive and < v_head_dim={c}, got {r}"
            )
        g = self.output_projection_groups
        if g <= 0 or heads % g:
            raise ValueError(
                f"num_attention_heads={heads} must be divisible by output_projection_groups={g} "
                "(each group of the grouped output projection holds whole heads); change either value"
            )
        if self.output_projection_lora_rank <= 0:
            raise ValueError(
                f"output_projection_lora_rank must be positive, got {self.output_projection_lora_rank}"
            )
        if self.attention_dropout:
            raise ValueError(
                f"attention_dropout={self.attention_dropout}: DSv4 attention has no attention-probability dropout; "
                "set attention_dropout=0.0"
            )
        if self.csa_window_size < 1:
            raise ValueError(f"csa_window_size must be >= 1, got {self.csa_window_size}")
        for name in ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk"):
            v = getattr(self, name)
            if v is None or v <= 0:
                raise ValueError(f"{name} must be a positive int for DSv4 CSA layers, got {v}")
        if self.dsa_indexer_head_dim < r:
            raise ValueError(
                f"dsa_indexer_head_dim={self.dsa_indexer_head_dim} must be >= qk_pos_emb_head_dim={r} "
                "(RoPE rotates the last r channels of each indexer head)"
            )
        if self.dsa_indexer_loss_coeff is not None and self.dsa_indexer_loss_coeff < 0:
            raise ValueError(
                f"dsa_indexer_loss_coeff must be >= 0 (or None), got {self.dsa_indexer_loss_coeff}"
            )
        if self.csa_compress_rope_type not in ("yarn", "rope"):
            raise ValueError(
                f"csa_compress_rope_type must be 'yarn' or 'rope', got {self.csa_compress_rope_type!r}"
            )
        if self.dsa_indexer_tie_break not in ("lower_index", "torch_topk"):
            raise ValueError(
                "dsa_indexer_tie_break must be 'lower_index' or 'torch_topk', "
                f"got {self.dsa_indexer_tie_break!r}"
            )
        if self.csa_kernel_backend not in ("auto", "triton", "reference"):
            raise ValueError(
                f"csa_kernel_backend must be 'auto', 'triton' or 'reference', got {self.csa_kernel_backend!r}"
            )
        if self.tensor_model_parallel_size > 1:
            self._check_tensor_parallel()
        if self.context_parallel_size > 1:
            self._check_context_parallel()
        if self.mla_down_proj_fusion:
            raise ValueError(
                "mla_down_proj_fusion must be False for DSv4 attention (no fused q/kv down-projection)"
            )
        if self.apply_rope_fusion:
            raise ValueError(
                "apply_rope_fusion must be False: DSv4 attention applies its own partial interleaved RoPE "
                "(dsv4_primitives), megatron's fused MLA RoPE is not used"
            )
        if self.csa_compress_ratios is not None:
            ratios = list(self.csa_compress_ratios)
            bad = [(i, x) for i, x in enumerate(ratios) if x not in VALID_COMPRESS_RATIOS]
            if bad:
                raise ValueError(
                    f"csa_compress_ratios has invalid entries {bad} (index, ratio); each ratio must be one of "
                    f"{VALID_COMPRESS_RATIOS} (0 = window only, 4 = CSA, 128 = HCA)"
                )
            need = self.num_layers + (self.mtp_num_layers or 0)
            if len(ratios) < need:
                raise ValueError(
                    f"csa_compress_ratios has {len(ratios)} entries but num_layers + mtp_num_layers = {need}; "
                    "give one ratio per layer (main layers first, then MTP layers)"
                )

    # ------------------------------------------------------------------ per-layer helpers
    def _check_tensor_parallel(self) -> None:
        """TP > 1 runs dsv4-attention's head split with sequence parallelism (:mod:`dsv4_attention.tp`)."""
        tp = self.tensor_model_parallel_size
        if not self.sequence_parallel:
            raise ValueError(
                f"tensor_model_parallel_size={tp}: DSv4 attention under tensor parallelism takes the sequence-parallel "
                "rows of its TP rank (dsv4_attention.tp); set sequence_parallel=True"
            )
        # the head split itself (o_groups % tp, TP x CP) is checked per layer (AttentionConfig, the adapter)

    def _check_context_parallel(self) -> None:
        """CP > 1 runs dsv4-attention's own static contiguous CP (:mod:`dsv4_attention.cp`); refuse the rest."""
        if self.cp_comm_type is not None:
            raise ValueError(
                f"cp_comm_type={self.cp_comm_type!r}: DSv4 attention runs its own static contiguous context "
                "parallelism (halo + compressed-entry all-gathers, dsv4_attention.cp); transformer-engine's ring / "
                "a2a CP attention kinds do not apply. Leave cp_comm_type=None"
            )
        if getattr(self, "hierarchical_context_parallel_sizes", None):
            raise ValueError(
                "hierarchical_context_parallel_sizes is not supported by DSv4 attention (one flat contiguous CP "
                "group); leave it None"
            )
        if self.dsa_indexer_tie_break != "lower_index":
            raise ValueError(
                f"dsa_indexer_tie_break={self.dsa_indexer_tie_break!r} is a CPU-parity rule for single-rank runs; "
                "context parallelism supports 'lower_index' only"
            )

    def compress_ratio_for_layer(self, layer_number: int, is_mtp_layer: bool = False) -> int:
        """Ratio of a 1-based ``layer_number`` from ``csa_compress_ratios`` (MTP layers index after the main ones)."""
        if self.csa_compress_ratios is None:
            raise ValueError(
                "no compress_ratio given for this layer and csa_compress_ratios is None: pass compress_ratio in "
                "the layer spec params or set csa_compress_ratios"
            )
        idx = (self.num_layers if is_mtp_layer else 0) + layer_number - 1
        if not 0 <= idx < len(self.csa_compress_ratios):
            raise ValueError(
                f"layer_number={layer_number} (is_mtp_layer={is_mtp_layer}) -> index {idx} is outside "
                f"csa_compress_ratios (length {len(self.csa_compress_ratios)})"
            )
        return int(self.csa_compress_ratios[idx])

    def layer_kind(self, layer_number: int, is_mtp_layer: bool = False) -> LayerKind:
        """The :class:`LayerKind` of a 1-based ``layer_number`` from ``csa_compress_ratios``."""
        return LayerKind.from_ratio(self.compress_ratio_for_layer(layer_number, is_mtp_layer))

    def rope_config_for_kind(self, kind: LayerKind) -> RopeConfig:
        """Per-layer rotary table: base ``rotary_base`` plain for window layers; compress base (+ YaRN) for CSA/HCA."""
        yarn = None
        if kind.has_compressor and self.csa_compress_rope_type == "yarn":
            yarn = YarnConfig(
                factor=float(self.rotary_scaling_factor),
                original_max_position_embeddings=int(self.original_max_position_embeddings),
                beta_fast=float(self.beta_fast),
                beta_slow=float(self.beta_slow),
            )
        return rope_config_for_kind(
            kind,
            self.qk_pos_emb_head_dim,
            base=self.rotary_base,
            compress_base=self.csa_compress_rotary_base,
            yarn=yarn,
        )

    def rope_config_for_ratio(self, compress_ratio: int) -> RopeConfig:
        """:meth:`rope_config_for_kind` of a compress ratio (0.2 API)."""
        return self.rope_config_for_kind(LayerKind.from_ratio(compress_ratio))

    # ------------------------------------------------------------------ the core's frozen configs
    def indexer_config(self) -> IndexerConfig:
        """The lightning indexer of CSA layers."""
        return IndexerConfig(
            hidden_size=self.hidden_size,
            q_lora_rank=self.q_lora_rank,
            n_heads=self.dsa_indexer_n_heads,
            head_dim=self.dsa_indexer_head_dim,
            topk=self.dsa_indexer_topk,
            eps=self.layernorm_epsilon,
            tie_break=self.dsa_indexer_tie_break,
        )

    def core_attention_config(self, kind: LayerKind, tp_size: int = 1) -> CoreAttentionConfig:
        """The core of one TP rank of ``tp_size`` (its ``n_h / tp_size`` heads)."""
        return CoreAttentionConfig(
            kind,
            self.num_attention_heads // tp_size,
            self.v_head_dim,
            self.csa_window_size,
            self.csa_kernel_backend,
            bool(self.dsa_indexer_use_sparse_loss),
        )

    def attention_config(self, kind: LayerKind, tp_size: int = 1) -> AttentionConfig:
        """The core :class:`~dsv4_attention.attention.AttentionConfig` of a layer of ``kind`` (one TP rank's shard
        of ``tp_size``)."""
        return AttentionConfig(
            kind=kind,
            hidden_size=self.hidden_size,
            num_heads=self.num_attention_heads,
            head_dim=self.v_head_dim,
            q_lora_rank=self.q_lora_rank,
            o_groups=self.output_projection_groups,
            o_lora_rank=self.output_projection_lora_rank,
            window=self.csa_window_size,
            rope=self.rope_config_for_kind(kind),
            indexer=self.indexer_config() if kind.has_indexer else None,
            eps=self.layernorm_epsilon,
            backend=self.csa_kernel_backend,
            use_sparse_loss=bool(self.dsa_indexer_use_sparse_loss),
            tp_size=tp_size,
        )

    @property
    def tracker_num_layers(self) -> int:
        """Slots of the indexer-loss tracker: main layers then MTP layers (upstream ``num_layers + mtp_num_layers``)."""
        return self.num_layers + (self.mtp_num_layers or 0)

    @property
    def num_indexer_layers(self) -> int | None:
        """Number of CSA layers in ``csa_compress_ratios`` (what the logged indexer loss averages over)."""
        if self.csa_compress_ratios is None:
            return None
        ratios = self.csa_compress_ratios[: self.tracker_num_layers]
        return sum(1 for x in ratios if LayerKind.from_ratio(x).has_indexer)
