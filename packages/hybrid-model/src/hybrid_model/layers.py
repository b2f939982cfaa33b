"""One hybrid layer per pattern symbol, each wrapped by mHC (the stack and every MTP depth build through here).

What each symbol builds, needs and refuses is its record (:mod:`hybrid_model.mixers`; the table there):
:func:`build_hybrid_layer` builds the record's spec (:class:`~hybrid_model.spec.DSv4StackSubmodules`) with the
keywords the record names. Every layer is a pre-norm sub-layer ``f``; the mHC wrapper supplies the residual path
(``HyperConnectionLayer`` for ``TransformerLayer`` subclasses, :class:`HyperConnectionMixer` for the Mamba layer, a
record with ``mixer=True``; :class:`~hybrid_model.residual.PlainResidualLayer` with mHC off).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from hybrid_model.mixers.record import LayerSite
from hybrid_model.mixers.registry import REGISTRY
from hybrid_model.residual import NoResidualBDA, PlainResidualLayer
from mhc import ManifoldHyperConnection
from mhc.megatron import HyperConnectionLayer


class HyperConnectionMixer(MegatronModule):
    """mHC wrapper of a megatron ``MambaLayer`` (not a ``TransformerLayer``): its ``mamba_bda`` drops the residual,
    so the layer computes ``f(x) = mixer(norm(x))`` and mHC mixes it into the streams (``[s, b, n·d]``)."""

    def __init__(self, config, inner_layer, *, mhc) -> None:
        super().__init__(config=config)
        self.mhc_config = mhc
        self.inner_layer = inner_layer
        self.mixer_hc = ManifoldHyperConnection(mhc)
        inner_layer.mamba_bda = NoResidualBDA()

    @property
    def layer_number(self) -> int:
        return self.inner_layer.layer_number

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **kwargs):
        n, d = self.mhc_config.num_streams, self.mhc_config.hidden_size
        s, b, _ = hidden_states.shape
        streams = hidden_states.view(s, b, n, d)  # [s, b, n, d]
        dtype = torch.bfloat16 if self.config.bf16 else streams.dtype
        x, post, comb = self.mixer_hc(streams, out_dtype=dtype)  # [s, b, d]
        f = self.inner_layer(
            x,
            attention_mask,
            kwargs.get("inference_context"),
            packed_seq_params=kwargs.get("packed_seq_params"),
        )
        return self.mixer_hc.post(f, streams, post, comb).reshape(s, b, n * d), None


def build_hybrid_layer(
    symbol: str,
    submodules,
    config,
    *,
    layer_number: int,
    pg_collection,
    is_mtp_layer: bool,
    pp_layer_offset: int,
    hashed: bool,
    mhc,
    plain_residual: bool = False,
):
    """The mHC-wrapped hybrid layer of one pattern symbol (``submodules``: :class:`~hybrid_model.spec.DSv4StackSubmodules`);
    ``hashed``: the hash-routed ``E`` spec; ``plain_residual``: a :class:`~hybrid_model.residual.PlainResidualLayer`
    instead (mHC switched off)."""
    if symbol not in REGISTRY:
        raise ValueError(f"no layer for pattern symbol {symbol!r} (layer {layer_number})")
    record = REGISTRY[symbol]
    site = LayerSite(config, layer_number, pg_collection, is_mtp_layer, pp_layer_offset)
    inner = record.build_inner(submodules.layer_spec(symbol, hashed=hashed), site)
    if plain_residual:
        return PlainResidualLayer(config, inner, mixer=record.mixer)
    if record.mixer:
        return HyperConnectionMixer(config, inner, mhc=mhc)
    return HyperConnectionLayer(config, inner, mhc=mhc)
