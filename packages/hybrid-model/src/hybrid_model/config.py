"""Model configuration of a DSv4 hybrid model (names follow the released ``config.json``, spec §9.1).

``DSv4ModelConfig`` holds the architecture only; parallel sizes and training knobs live in the CLI's
``TrainConfig``. The layer pattern is derived from ``compress_ratios`` unless ``hybrid_layer_pattern`` is given,
in which case both must agree (validated in ``__post_init__``). The pattern is parsed once per config
(:attr:`DSv4ModelConfig.parsed_pattern`); every consumer reads that object. The CSA / HCA compress ratios are checked
against what dsv4-attention's layer kinds implement (:class:`dsv4_attention.LayerKind`) when the config is made.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass, field
from typing import Any

from dsv4_attention import LayerKind
from hybrid_model.symbols import (
    ATTENTION,
    MOE,
    SEQUENCE_MIXERS,
    ParsedPattern,
    hash_layer_numbers,
    layer_infos,
    mixer_ratios,
    normalize_compress_ratios,
    parse_pattern,
    pattern_from_compress_ratios,
)


@dataclass(frozen=True)
class YarnScaling:
    """YaRN parameters of the compressed (CSA/HCA) layers; no attention temperature / mscale (§2.3)."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class DSv4ModelConfig:
    """Architecture of a DeepSeek-V4 model (spec §0, §9.1). Defaults are V4-Flash.

    ``compress_ratios`` has ``num_layers + num_nextn_predict_layers`` entries (0 window, ``csa_compress_ratio``
    CSA, ``hca_compress_ratio`` HCA); ``pipeline_stages`` (int or blocks per stage) places the ``|`` cuts of the
    derived pattern. ``enable_mhc_connections`` (upstream's name; default on) wraps every layer in mHC with
    ``hc_mult`` residual streams; off, every layer is a plain pre-norm residual sub-layer ``x + f(norm(x))`` on one
    stream (no stream expansion, no HyperHead; ablations and non-mHC checkpoints).
    """

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = (0, 0) + (4, 128) * 20 + (4, 0)
    csa_compress_ratio: int = 4
    hca_compress_ratio: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnScaling | None = field(default_factory=YarnScaling)
    max_position_embeddings: int = 1048576
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    enable_mhc_connections: bool = True
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    num_hash_layers: int = 3
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    scoring_func: str = "sqrtsoftplus"
    num_nextn_predict_layers: int = 1
    mtp_loss_weight: float = 0.3
    pipeline_stages: int | tuple[int, ...] = 1
    hybrid_layer_pattern: str | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        if not isinstance(self.enable_mhc_connections, bool):
            raise ValueError(
                f"enable_mhc_connections must be true or false, got {self.enable_mhc_connections!r}"
            )
        if isinstance(self.pipeline_stages, list):
            object.__setattr__(self, "pipeline_stages", tuple(self.pipeline_stages))
        if isinstance(self.yarn, dict):
            object.__setattr__(self, "yarn", YarnScaling(**self.yarn))
        positive = [
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "head_dim",
            "qk_rope_head_dim",
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "sliding_window",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "hc_mult",
            "hc_sinkhorn_iters",
            "n_routed_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
        ]
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"DSv4ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name, kind in (("csa_compress_ratio", LayerKind.CSA), ("hca_compress_ratio", LayerKind.HCA)):
            if getattr(self, name) != kind.compress_ratio:
                raise ValueError(
                    f"DSv4ModelConfig.{name}={getattr(self, name)}: dsv4-attention's {kind.name} layers compress "
                    f"{kind.compress_ratio} tokens per entry (LayerKind.{kind.name}); set {name}={kind.compress_ratio}"
                )
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.head_dim:
            raise ValueError(
                f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and <= head_dim ({self.head_dim})"
            )
        if self.num_attention_heads % self.o_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by o_groups ({self.o_groups})"
            )
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(
                "index_head_dim must be >= qk_rope_head_dim (the indexer rotates its last r dims)"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) > n_routed_experts ({self.n_routed_experts})"
            )
        if self.n_shared_experts not in (0, 1):
            raise ValueError(f"n_shared_experts must be 0 or 1, got {self.n_shared_experts}")
        if self.scoring_func != "sqrtsoftplus":
            raise ValueError(f"scoring_func must be 'sqrtsoftplus' for DSv4, got {self.scoring_func!r}")
        if not (math.isfinite(self.mtp_loss_weight) and self.mtp_loss_weight >= 0):
            raise ValueError(
                f"mtp_loss_weight must be a finite number >= 0 (spec §8: 0.3, then 0.1), got {self.mtp_loss_weight}"
            )
        if self.hybrid_layer_pattern is not None:
            parsed = self._check_explicit_pattern()
        else:
            n_total = self.num_layers + self.num_nextn_predict_layers
            if len(self.compress_ratios) != n_total:
                raise ValueError(
                    f"compress_ratios has {len(self.compress_ratios)} entries; need num_layers + "
                    f"num_nextn_predict_layers = {n_total} (MTP blocks last)"
                )
            if self.num_nextn_predict_layers and self.compress_ratios[self.num_layers] != 0:
                raise ValueError("the MTP block is window-only in DSv4: its compress_ratios entry must be 0")
            parsed = parse_pattern(self._derived_pattern())
        hash_layer_numbers(parsed, self.num_hash_layers)  # validates placement
        _PARSED_PATTERNS[self] = parsed  # the one parse of this config

    def _check_explicit_pattern(self) -> ParsedPattern:
        """An explicit ``hybrid_layer_pattern`` decides the layers; the counts must describe the same model:
        ``num_layers`` = sequence mixers of the main part, ``num_nextn_predict_layers`` = MTP depths,
        ``compress_ratios`` = one ratio per sequence mixer (:func:`~hybrid_model.symbols.mixer_ratios`)."""
        parsed = parse_pattern(self.hybrid_layer_pattern)
        fix = "build the config with DSv4ModelConfig.with_pattern(pattern), which derives them"
        mixers = sum(s in SEQUENCE_MIXERS for s in parsed.main)
        if mixers == 0:
            raise ValueError(
                f"hybrid_layer_pattern {parsed.pattern!r} has no sequence mixer (C H W * + D G M) in its main part"
            )
        if self.num_layers != mixers or self.num_nextn_predict_layers != parsed.mtp_num_depths:
            raise ValueError(
                f"hybrid_layer_pattern {parsed.pattern!r} has {mixers} blocks (sequence mixers) and "
                f"{parsed.mtp_num_depths} MTP depth(s), but num_layers={self.num_layers} and "
                f"num_nextn_predict_layers={self.num_nextn_predict_layers}; {fix}"
            )
        if ATTENTION in parsed.all_symbols and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"pattern {parsed.pattern!r} has standard attention '*', whose heads are hidden_size / "
                f"num_attention_heads wide: hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        expected = mixer_ratios(parsed, self.csa_compress_ratio, self.hca_compress_ratio)
        if list(self.compress_ratios) != expected:
            raise ValueError(
                f"hybrid_layer_pattern {parsed.pattern!r} disagrees with compress_ratios {list(self.compress_ratios)} "
                f"(the pattern's blocks give {expected}); {fix}"
            )
        return parsed

    def with_pattern(self, pattern: str) -> DSv4ModelConfig:
        """A copy that builds ``pattern`` (every symbol of :mod:`hybrid_model.symbols`), with ``num_layers``,
        ``num_nextn_predict_layers`` and ``compress_ratios`` derived from it and ``num_hash_layers`` capped at the
        pattern's main ``E`` layers. The cap does not depend on the ``|`` cuts, so a pattern builds the same model
        under every pipeline layout: hash layers that do not fit on the first stage (which holds ``input_ids``) are
        a ``ValueError`` naming the fix, never silently learned-routed (they once were)."""
        parsed = parse_pattern(pattern)
        main_moe = parsed.main.count(MOE)
        return dataclasses.replace(
            self,
            hybrid_layer_pattern=pattern,
            num_layers=sum(s in SEQUENCE_MIXERS for s in parsed.main),
            num_nextn_predict_layers=parsed.mtp_num_depths,
            compress_ratios=tuple(mixer_ratios(parsed, self.csa_compress_ratio, self.hca_compress_ratio)),
            num_hash_layers=min(self.num_hash_layers, main_moe),
            pipeline_stages=1,
        )

    def _derived_pattern(self) -> str:
        return pattern_from_compress_ratios(
            self.compress_ratios,
            self.num_layers,
            csa_ratio=self.csa_compress_ratio,
            hca_ratio=self.hca_compress_ratio,
            pipeline_stages=self.pipeline_stages,
        )

    # ------------------------------------------------------------------ derived
    @property
    def layer_pattern(self) -> str:
        """The hybrid layer pattern (``hybrid_layer_pattern`` or derived from ``compress_ratios``)."""
        return self.parsed_pattern.pattern

    @property
    def parsed_pattern(self) -> ParsedPattern:
        """The validated, split layer pattern, parsed once per config (a frozen config never changes it). The cache
        lives beside the config, not in its ``__dict__`` (``DSv4ModelConfig(**vars(cfg))`` keeps working)."""
        parsed = _PARSED_PATTERNS.get(self)
        if parsed is None:
            source = (
                self.hybrid_layer_pattern
                if self.hybrid_layer_pattern is not None
                else self._derived_pattern()
            )
            parsed = _PARSED_PATTERNS[self] = parse_pattern(source)  # pragma: no cover (set in __post_init__)
        return parsed

    @property
    def full_compress_ratios(self) -> list[int]:
        """One ratio per hybrid layer symbol (main + MTP), 0 at ``E``."""
        return normalize_compress_ratios(
            self.parsed_pattern, csa_ratio=self.csa_compress_ratio, hca_ratio=self.hca_compress_ratio
        )

    @property
    def hash_layer_numbers(self) -> list[int]:
        """1-based hybrid positions of the hash-routed MoE layers."""
        return hash_layer_numbers(self.parsed_pattern, self.num_hash_layers)

    def layers(self):
        """Per-layer :class:`~hybrid_model.symbols.LayerInfo` list."""
        return layer_infos(
            self.parsed_pattern,
            num_hash_layers=self.num_hash_layers,
            csa_ratio=self.csa_compress_ratio,
            hca_ratio=self.hca_compress_ratio,
        )

    @property
    def num_streams(self) -> int:
        """Residual streams between layers: ``hc_mult`` with mHC, 1 (a plain residual) without."""
        return self.hc_mult if self.enable_mhc_connections else 1

    @property
    def num_moe_layers(self) -> int:
        return self.parsed_pattern.main.count(MOE)

    def replace(self, **changes: Any) -> DSv4ModelConfig:
        """A copy with ``changes`` applied (re-validated). Changing ``num_layers`` alone truncates/extends
        ``compress_ratios`` by keeping the MTP tail, when ``compress_ratios`` is not given too."""
        if "num_layers" in changes and "compress_ratios" not in changes:
            n = changes["num_layers"]
            main = list(self.compress_ratios[: self.num_layers])
            tail = list(self.compress_ratios[self.num_layers :])
            if n <= len(main):
                main = main[:n]
            else:
                raise ValueError("growing num_layers needs an explicit compress_ratios")
            changes["compress_ratios"] = tuple(main + tail)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        if isinstance(self.pipeline_stages, tuple):
            d["pipeline_stages"] = list(self.pipeline_stages)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DSv4ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown DSv4ModelConfig keys {unknown}; valid keys: {sorted(known)}")
        d = dict(d)
        if isinstance(d.get("yarn"), dict):
            d["yarn"] = YarnScaling(**d["yarn"])
        return cls(**d)


#: config -> its parsed pattern (equal configs share one entry; an entry goes with its last config)
_PARSED_PATTERNS: weakref.WeakKeyDictionary[DSv4ModelConfig, ParsedPattern] = weakref.WeakKeyDictionary()
