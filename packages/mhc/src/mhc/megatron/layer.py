"""``HyperConnectionLayer``: a megatron-core ``TransformerLayer`` (from any spec) as an mHC layer on streams.

The wrapped layer's own residual adds are disabled (its bias-dropout-add keeps bias + dropout, drops ``+ residual``);
each active sub-layer gets its own mHC instance, exactly like one DSv4 block (§1.2)::

    X [s, b, n·d] --view--> [s, b, n, d]
    attention sub-layer (if any):  x, post, comb = attn_hc(X);  F = inner._forward_attention(x);  X = post ⊗ F + combᵀ X
    MLP / MoE sub-layer (if any):  x, post, comb = mlp_hc(X);   F = inner._forward_mlp(x);       X = post ⊗ F + combᵀ X
    return X.view(s, b, n·d), context

The input layernorm / pre-MLP layernorm of the inner layer still apply to ``x`` (the DSv4 ``attn_norm``/``ffn_norm``).
State-dict keys: ``inner_layer.*`` (the wrapped layer), ``attn_hc.{fn,base,scale}``, ``mlp_hc.{fn,base,scale}``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import nn

from dsv4_primitives.recompute import (
    discard,
    discard_derived,
    recompute_config_of,
    recompute_scope,
    registered,
    scope_active,
)
from mhc.config import MHCConfig
from mhc.modules import ManifoldHyperConnection


def mhc_config_for(config, **overrides) -> MHCConfig:
    """An :class:`MHCConfig` for a megatron ``TransformerConfig``: ``hidden_size`` and ``norm_eps`` from it.

    Upstream's field names are honoured when present on ``config`` (``mhc_num_residual_streams``,
    ``mhc_sinkhorn_iterations``, ``mhc_init_gating_factor``); ``overrides`` win over everything.
    """
    kw = dict(hidden_size=config.hidden_size, norm_eps=config.layernorm_epsilon)
    for ours, theirs in (
        ("num_streams", "mhc_num_residual_streams"),
        ("sinkhorn_iters", "mhc_sinkhorn_iterations"),
        ("init_gating_factor", "mhc_init_gating_factor"),
    ):
        if getattr(config, theirs, None) is not None:
            kw[ours] = getattr(config, theirs)
    kw.update(overrides)
    return MHCConfig(**kw)


def _bias_dropout_no_residual(training: bool, fused: bool):
    """Drop-in for megatron's ``get_bias_dropout_add``: ``dropout(x + bias)`` without ``+ residual``."""

    def bda(x_with_bias, residual, prob: float):
        x, bias = x_with_bias
        if bias is not None:
            x = x + bias
        return F.dropout(x, p=prob, training=training)

    return bda


class _NoResidualBDA(nn.Module):
    """Module form of :func:`_bias_dropout_no_residual` (replaces ``self_attn_bda`` / ``mlp_bda``)."""

    def forward(self, training: bool, fused: bool):
        return _bias_dropout_no_residual(training, fused)


class HyperConnectionLayer(MegatronModule):
    """mHC wrapper of one megatron ``TransformerLayer`` operating on ``[s, b, n·d]`` streams.

    Args:
        config: the megatron ``TransformerConfig``.
        inner_layer: an already built ``TransformerLayer`` (attention-only, MLP/MoE-only, or both; no cross
            attention). Alternatively pass ``inner_spec`` and the layer's build kwargs (``layer_number``,
            ``pg_collection``, ...) and it is built here with ``build_module``.
        mhc: the :class:`MHCConfig`; default :func:`mhc_config_for(config) <mhc_config_for>`.

    ``forward(hidden_states [s, b, n·d], attention_mask=None, **kwargs) -> (streams [s, b, n·d], context)``
    accepts the keyword arguments of ``TransformerLayer.forward`` (``rotary_pos_emb``, ``packed_seq_params``,
    ``inference_context``, ``padding_mask``, ...), so it is a drop-in for ``HybridStack`` / ``TransformerBlock``.
    """

    def __init__(
        self,
        config,
        inner_layer: TransformerLayer | None = None,
        *,
        inner_spec: ModuleSpec | type | None = None,
        mhc: MHCConfig | None = None,
        **layer_kwargs,
    ) -> None:
        super().__init__(config=config)
        if (inner_layer is None) == (inner_spec is None):
            raise ValueError("HyperConnectionLayer needs exactly one of inner_layer or inner_spec")
        if inner_layer is None:
            inner_layer = build_module(inner_spec, config=config, **layer_kwargs)
        elif layer_kwargs:
            raise ValueError(f"build kwargs {sorted(layer_kwargs)} are only used with inner_spec")
        if not isinstance(inner_layer, TransformerLayer):
            raise ValueError(
                f"HyperConnectionLayer wraps a megatron TransformerLayer (or subclass), got {type(inner_layer).__name__}"
            )
        if not isinstance(inner_layer.cross_attention, IdentityOp):
            raise ValueError("HyperConnectionLayer does not support cross attention (set it to IdentityOp)")
        self.mhc_config = mhc or mhc_config_for(config)
        if self.mhc_config.hidden_size != config.hidden_size:
            raise ValueError(
                f"MHCConfig.hidden_size={self.mhc_config.hidden_size} differs from config.hidden_size={config.hidden_size}"
            )
        has_attention = not isinstance(inner_layer.self_attention, IdentityOp)
        has_mlp = not isinstance(inner_layer.mlp, IdentityOp)
        if not (has_attention or has_mlp):
            raise ValueError("the wrapped layer has neither self attention nor an MLP: nothing to connect")
        self.inner_layer = inner_layer
        self.attn_hc = ManifoldHyperConnection(self.mhc_config) if has_attention else None
        self.mlp_hc = ManifoldHyperConnection(self.mhc_config) if has_mlp else None
        # the residual path is the mHC mix: the inner layer adds no residual of its own
        if has_attention:
            inner_layer.self_attn_bda = _NoResidualBDA()
        if has_mlp:
            inner_layer.mlp_bda = _NoResidualBDA()
        self.recompute = recompute_config_of(config)
        if self.recompute.selects("layernorm"):
            # attn_norm / ffn_norm: their outputs are rebuilt in backward from their inputs (which they keep)
            for norm in (inner_layer.input_layernorm, inner_layer.pre_mlp_layernorm):
                if not isinstance(norm, IdentityOp):
                    norm.register_forward_hook(_discard_norm_output)

    @property
    def layer_number(self) -> int:
        return self.inner_layer.layer_number

    def _inner_dtype(self, streams: torch.Tensor) -> torch.dtype:
        if self.config.bf16:
            return torch.bfloat16
        if self.config.fp16:
            return torch.float16
        return streams.dtype

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        discard_output: bool = False,
        **kwargs,
    ):
        """See the class docstring. ``discard_output`` (selective ``mhc`` recompute, set by the stack for layers
        inside an mHC recompute group): the returned streams are not kept for backward by the next layer's mHC
        ops; they are rebuilt there from this layer's input streams, sub-layer output and coefficients."""
        if self.recompute.granularity != "selective":
            return self._forward(hidden_states, attention_mask, False, kwargs)
        with recompute_scope():
            return self._forward(hidden_states, attention_mask, discard_output, kwargs)

    def _post(self, hc, f, streams, post, comb, discard_out: bool) -> torch.Tensor:
        """``hc.post``; with ``discard_out`` the new streams are registered for recompute (chained through
        ``streams`` when those are themselves rebuilt)."""
        out = hc.post(f, streams, post, comb)  # [s, b, n, d]
        chained = discard_out and torch.is_grad_enabled()
        if chained and not discard_derived(out, streams, lambda x: hc.post(f, x, post, comb)):
            discard(out, lambda: hc.post(f, streams, post, comb))
        return out

    def _forward(self, hidden_states, attention_mask, discard_output: bool, kwargs):
        n, d = self.mhc_config.num_streams, self.mhc_config.hidden_size
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != n * d:
            raise ValueError(
                f"HyperConnectionLayer expects streams [s, b, n·d] = [s, b, {n * d}], got {tuple(hidden_states.shape)}"
                " (expand the embedding with StreamExpansion first)"
            )
        s, b, _ = hidden_states.shape
        streams = hidden_states.view(s, b, n, d)  # [s, b, n, d]
        inner_dtype = self._inner_dtype(streams)
        context = None
        mhc = self.recompute.selects("mhc")
        if self.attn_hc is not None:
            x, post, comb = self.attn_hc(streams, out_dtype=inner_dtype)  # x [s, b, d]
            f, context = self.inner_layer._forward_attention(x, attention_mask=attention_mask, **kwargs)
            # streams between the two sub-layers of one layer are always inside its recompute group
            last = self.mlp_hc is None
            streams = self._post(self.attn_hc, f, streams, post, comb, mhc and (discard_output or not last))
        if self.mlp_hc is not None:
            x, post, comb = self.mlp_hc(streams, out_dtype=inner_dtype)
            f = self.inner_layer._forward_mlp(
                x,
                kwargs.get("inference_context"),
                padding_mask=kwargs.get("padding_mask"),
                packed_seq_params=kwargs.get("packed_seq_params"),
            )
            streams = self._post(self.mlp_hc, f, streams, post, comb, mhc and discard_output)
        out = streams.reshape(s, b, n * d)
        rec = registered(streams) if mhc and discard_output else None
        if rec is not None:
            discard(out, rec)  # the registration follows the returned view (``streams`` dies here)
        return out, context


def _discard_norm_output(module, args, output):
    """Forward hook of ``attn_norm`` / ``ffn_norm`` under ``layernorm`` recompute: the output (kept by the
    projections reading it) is rebuilt in backward from the input the norm keeps anyway."""
    if scope_active() and torch.is_grad_enabled() and isinstance(output, torch.Tensor):
        x = args[0]
        discard(output, lambda: module(x))


def hyper_connection_layer_spec(inner_spec: ModuleSpec | type, mhc: MHCConfig | None = None) -> ModuleSpec:
    """A ``ModuleSpec`` building ``HyperConnectionLayer(config, inner_spec=inner_spec, mhc=mhc, **build_kwargs)``.

    Use it in place of any layer spec of a ``HybridStackSubmodules`` / ``TransformerBlockSubmodules``; the build
    kwargs megatron passes (``layer_number``, ``pg_collection``, ...) reach the inner layer.
    """
    if isinstance(inner_spec, ModuleSpec):
        inner_spec = dataclasses.replace(inner_spec)
    return ModuleSpec(module=HyperConnectionLayer, params={"inner_spec": inner_spec, "mhc": mhc})
