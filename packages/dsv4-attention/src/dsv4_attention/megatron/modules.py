"""megatron adapters of the core submodules: linears from ``ModuleSpec``s, sizes from the megatron config.

Each class subclasses its plain-PyTorch core module (same parameters, registration order, state-dict keys and
forward) and ``MegatronModule`` (``config``, sharded state dicts). Construction keywords are what the specs of
:mod:`dsv4_attention.megatron.specs` pass through ``build_module``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from dsv4_attention.compressor import Compressor, CompressorConfig
from dsv4_attention.core import CompressedSparseAttention
from dsv4_attention.grouped_projection import GroupedOutputProjection
from dsv4_attention.indexer import LightningIndexer
from dsv4_attention.kind import LayerKind
from dsv4_attention.megatron._linears import init_method_or_skip, linear_for, param_device, tp_size_of
from dsv4_primitives import RopeConfig


def _require_pg(pg_collection, who: str):
    if pg_collection is None:
        raise ValueError(f"{who} needs an explicit ProcessGroupCollection (pg_collection)")
    return pg_collection


@dataclass
class CompressorSubmodules:
    """Submodules of :class:`MegatronCompressor`: two column-parallel linears and a weighted RMSNorm."""

    linear_wkv: Any = None
    linear_wgate: Any = None
    norm: Any = None


class MegatronCompressor(Compressor, MegatronModule):
    """:class:`~dsv4_attention.compressor.Compressor` with spec-built linears (``kind`` CSA or HCA, entry width
    ``head_dim``)."""

    def __init__(
        self,
        config,
        submodules: CompressorSubmodules,
        kind: LayerKind | int,
        head_dim: int,
        rope_cfg: RopeConfig,
        pg_collection,
    ) -> None:
        MegatronModule.__init__(self, config)
        kind = LayerKind.coerce(kind)
        if not kind.has_compressor:
            raise ValueError(f"Compressor needs kind CSA (ratio 4) or HCA (ratio 128), got {kind.name}")
        pg = _require_pg(pg_collection, "Compressor")
        cfg = CompressorConfig(kind, config.hidden_size, head_dim, config.layernorm_epsilon)
        d = config.hidden_size  # replicated under TP (linear_for: plain linears there)
        wkv = linear_for(submodules.linear_wkv, config, pg, d, cfg.width, name="csa_compressor_wkv")
        wgate = linear_for(submodules.linear_wgate, config, pg, d, cfg.width, name="csa_compressor_wgate")
        norm = build_module(
            submodules.norm, config=config, hidden_size=head_dim, eps=config.layernorm_epsilon
        )
        self._init_compressor(
            cfg, rope_cfg, wkv, wgate, norm, param_device(config), init_method_or_skip(config)
        )


@dataclass
class LightningIndexerSubmodules:
    """Submodules of :class:`MegatronLightningIndexer`."""

    linear_wq_b: Any = None
    linear_weights_proj: Any = None
    compressor: Any = None


class MegatronLightningIndexer(LightningIndexer, MegatronModule):
    """:class:`~dsv4_attention.indexer.LightningIndexer` with spec-built linears and compressor."""

    def __init__(
        self, config, submodules: LightningIndexerSubmodules, rope_cfg: RopeConfig, pg_collection
    ) -> None:
        MegatronModule.__init__(self, config)
        pg = _require_pg(pg_collection, "LightningIndexer")
        cfg = config.indexer_config()
        # the whole indexer is replicated under TP (linear_for: plain linears there)
        wq_b = linear_for(
            submodules.linear_wq_b,
            config,
            pg,
            cfg.q_lora_rank,
            cfg.n_heads * cfg.head_dim,
            name="csa_indexer_wq_b",
        )
        weights_proj = linear_for(
            submodules.linear_weights_proj,
            config,
            pg,
            cfg.hidden_size,
            cfg.n_heads,
            name="csa_indexer_weights_proj",
        )
        compressor = build_module(
            submodules.compressor,
            config=config,
            kind=LayerKind.CSA,
            head_dim=cfg.head_dim,
            rope_cfg=rope_cfg,
            pg_collection=pg,
        )
        self._init_indexer(cfg, rope_cfg, wq_b, weights_proj, compressor, None)


@dataclass
class CompressedSparseAttentionSubmodules:
    """Submodules of :class:`MegatronCompressedSparseAttention` (``None`` where the layer kind has none)."""

    compressor: Any = None
    indexer: Any = None


class MegatronCompressedSparseAttention(CompressedSparseAttention, MegatronModule):
    """:class:`~dsv4_attention.core.CompressedSparseAttention` with its compressor / indexer built from specs."""

    def __init__(
        self,
        config,
        submodules: CompressedSparseAttentionSubmodules,
        kind: LayerKind | int,
        rope_cfg: RopeConfig,
        pg_collection,
    ) -> None:
        MegatronModule.__init__(self, config)
        kind = LayerKind.coerce(kind)
        compressor = indexer = None
        if kind.has_compressor:
            if submodules.compressor is None:
                raise ValueError(f"a {kind.name} layer needs a compressor submodule in the spec")
            compressor = build_module(
                submodules.compressor,
                config=config,
                kind=kind,
                head_dim=config.v_head_dim,
                rope_cfg=rope_cfg,
                pg_collection=pg_collection,
            )
        if kind.has_indexer:
            if submodules.indexer is None:
                raise ValueError("a CSA layer needs an indexer submodule in the spec")
            indexer = build_module(
                submodules.indexer, config=config, rope_cfg=rope_cfg, pg_collection=pg_collection
            )
        core_cfg = config.core_attention_config(kind, tp_size_of(pg_collection))  # this TP rank's heads
        self._init_core(core_cfg, compressor, indexer, param_device(config))


class MegatronGroupedOutputProjection(GroupedOutputProjection, MegatronModule):
    """:class:`~dsv4_attention.grouped_projection.GroupedOutputProjection` built as
    ``build_module(spec, in_features, groups, rank, config=..., init_method=...)`` (``params_dtype``, megatron's
    placement and ``perform_initialization``)."""

    def __init__(
        self, input_size: int, groups: int, rank: int, *, config, init_method=None, **_unused
    ) -> None:
        MegatronModule.__init__(self, config)
        self._init_projection(
            input_size,
            groups,
            rank,
            param_device(config),
            config.params_dtype,
            init_method_or_skip(config, init_method),
        )
