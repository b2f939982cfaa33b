"""The plain pre-norm residual connection of a DSv4 model with mHC switched off (``enable_mhc_connections=False``).

With mHC off the model carries one residual stream ``x [s, b, d]`` (in the stream dtype, fp32 as mHC's streams, so
pipeline buffers and the layers' inputs are the same as with mHC) and every sub-layer ``f`` (attention, MoE, MLP,
mixer; each with its own pre-norm) updates it as ``x <- x + f(x)``. :class:`PlainResidualLayer` is the drop-in of
``mhc.megatron.HyperConnectionLayer`` (same call convention, ``[s, b, 1·d]`` streams); :class:`SingleStreamHead` the
drop-in of ``HyperHead`` (the one stream, no parameters).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from torch import nn


class NoResidualBDA(nn.Module):
    """Replaces a megatron layer's ``self_attn_bda`` / ``mlp_bda`` / ``mamba_bda``: ``dropout(f + bias)`` without
    ``+ residual`` (the wrapper adds the residual, or mHC mixes it)."""

    def forward(self, training: bool, fused: bool):
        def bda(x_with_bias, residual, prob: float):
            x, bias = x_with_bias
            return F.dropout(x if bias is None else x + bias, p=prob, training=training)

        return bda


class PlainResidualLayer(MegatronModule):
    """``x <- x + f_attn(x)``, then ``x <- x + f_mlp(x)`` around a megatron ``TransformerLayer`` (or, with
    ``mixer=True``, a ``MambaLayer``) whose own residual adds are disabled (the sum is done here, in ``x``'s dtype)."""

    def __init__(self, config, inner_layer, *, mixer: bool = False) -> None:
        super().__init__(config=config)
        self.inner_layer = inner_layer
        self.mixer = mixer
        if mixer:
            inner_layer.mamba_bda = NoResidualBDA()
            self.has_attention, self.has_mlp = True, False
        else:
            self.has_attention = not isinstance(inner_layer.self_attention, IdentityOp)
            self.has_mlp = not isinstance(inner_layer.mlp, IdentityOp)
            if self.has_attention:
                inner_layer.self_attn_bda = NoResidualBDA()
            if self.has_mlp:
                inner_layer.mlp_bda = NoResidualBDA()

    @property
    def layer_number(self) -> int:
        return self.inner_layer.layer_number

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        x = hidden_states  # [s, b, d], the residual stream (stream dtype)
        dtype = torch.bfloat16 if self.config.bf16 else torch.float16 if self.config.fp16 else x.dtype
        context = None
        if self.mixer:
            f = self.inner_layer(
                x.to(dtype),
                attention_mask,
                kwargs.get("inference_context"),
                packed_seq_params=kwargs.get("packed_seq_params"),
            )
            return x + f.to(x.dtype), None
        if self.has_attention:
            f, context = self.inner_layer._forward_attention(
                x.to(dtype), attention_mask=attention_mask, **kwargs
            )
            x = x + f.to(x.dtype)
        if self.has_mlp:
            f = self.inner_layer._forward_mlp(
                x.to(dtype),
                kwargs.get("inference_context"),
                padding_mask=kwargs.get("padding_mask"),
                packed_seq_params=kwargs.get("packed_seq_params"),
            )
            x = x + f.to(x.dtype)
        return x, context


class SingleStreamHead(nn.Module):
    """``HyperHead`` of one stream: ``[s, b, 1, d] -> [s, b, d]`` (no parameters)."""

    def forward(self, streams: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        h = streams[..., 0, :]
        return h if out_dtype is None else h.to(out_dtype)
