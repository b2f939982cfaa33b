"""megatron-core's GDN layer (``G``, gated delta net) in a DSv4 model: its sizes and parameter and FLOP counts; the
layer is :mod:`hybrid_model.gated_delta_net_layer`, its record (specs, refusals) :mod:`hybrid_model.mixers.gdn`.

megatron-core 0.19.2's ``hybrid_stack_spec.gdn_layer`` builds ``G`` from transformer-engine modules. The local spec
builds the same module (megatron's ``GatedDeltaNet`` in a ``TransformerLayer``) from megatron's local parts, with
the same math:

=====================================  ==========================================  ===============================
TE spec                                local spec                                  same math because
=====================================  ==========================================  ===============================
input RMSNorm fused into ``in_proj``   ``input_layernorm``: DSv4's ``RMSNorm``     RMSNorm then a linear
(``TELayerNormColumnParallelLinear``)  + ``in_proj``: ``ColumnParallelLinear``
``TENorm`` ``out_norm`` (RMSNorm over  ``TypedTorchNorm`` (torch ``RMSNorm``)      RMSNorm, ``layernorm_epsilon``
one value head, then the silu gate)
``TERowParallelLinear`` ``out_proj``   ``RowParallelLinear``                       TP = 1 (DSv4 refuses TP > 1)
=====================================  ==========================================  ===============================

The kernels are megatron's choice on both paths: flash-linear-attention's (``fla``, Triton, CUDA only) causal
conv1d, qk L2 norm and chunked gated delta rule; with ``deterministic_mode`` megatron's torch conv1d and torch
chunked gated delta rule, with fla's L2 norm. ``fla`` is the ``hybrid-model[gdn]`` extra (``fla-core``); megatron
refuses to build the layer without it, and fla does not import without a GPU, so ``G`` runs on CUDA only.

Sizes are megatron's ``TransformerConfig`` fields of the model config (``linear_num_key_heads`` 16,
``linear_num_value_heads`` 32, ``linear_key_head_dim`` / ``linear_value_head_dim`` 128, ``linear_conv_kernel_dim``
4: megatron's defaults). A ``G`` layer has

``P = d·(2·Hk·dk + 2·Hv·dv + 2·Hv) + K·(2·Hk·dk + Hv·dv) + 2·Hv + dv + Hv·dv·d + d``

parameters (``in_proj`` to q, k, v, the output gate z, beta and alpha; the depthwise conv over q, k, v; ``dt_bias``
and ``A_log``; ``out_norm``; ``out_proj``; the input norm): :func:`gdn_layer_params`. Forward FLOPs per token:
``2·d·(2·Hk·dk + 2·Hv·dv + 2·Hv) + 2·Hv·dv·d`` (projections, :func:`gdn_projection_flops`) ``+ 6·Hv·dk·dv`` (the
delta rule, :func:`gdn_core_flops`); the conv, norms and gates are left out as for the other layers.

The gated delta rule is fla's chunked kernels, or megatron's torch chunked rule (its ``deterministic_mode`` path)
with ``--deterministic`` and where fla's kernels are not trusted: fla 0.6 refuses its gated backward kernel on Hopper
with Triton below 3.7.1 (wrong results, fla issue #640; its per-call tilelang replacement is not validated here), and
torch 2.11 pins Triton 3.6 (:func:`hybrid_model.gated_delta_net_layer.fla_chunk_kernels_correct`). Refused with a
reason (:data:`hybrid_model.mixers.gdn.RECORD`): context parallelism
(megatron's GDN all-to-all assumes its zigzag CP layout; DSv4 shards contiguously), tensor parallelism, packed THD
batches on the torch rule (no per-document boundaries: its conv1d and recurrence would cross documents) and
``--cuda-graph`` (the torch rule copies its initial state from the host in every forward).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig

GDN_SIZE_FIELDS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


@dataclass(frozen=True)
class GDNSizes:
    """The sizes of a ``G`` layer: ``hidden_size`` ``d``, ``Hk`` key / ``Hv`` value heads of ``dk`` / ``dv`` dims,
    a depthwise causal conv of ``K`` taps (megatron's ``linear_*`` config fields)."""

    hidden_size: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int

    @classmethod
    def of(cls, config) -> GDNSizes:
        """The sizes a megatron ``TransformerConfig`` (or anything with these fields) gives the layer."""
        return cls(config.hidden_size, *(getattr(config, f) for f in GDN_SIZE_FIELDS))

    @classmethod
    def for_hidden_size(cls, hidden_size: int) -> GDNSizes:
        """The sizes of a DSv4 model's ``G`` layers: megatron's ``TransformerConfig`` defaults (the model config
        sets none of the ``linear_*`` fields)."""
        fields = TransformerConfig.__dataclass_fields__
        return cls(hidden_size, *(fields[f].default for f in GDN_SIZE_FIELDS))

    @property
    def in_proj_width(self) -> int:
        """``in_proj`` outputs: q, k (``Hk·dk`` each), v, the gate z (``Hv·dv`` each), beta and alpha (``Hv``)."""
        qk = self.linear_num_key_heads * self.linear_key_head_dim
        v = self.linear_num_value_heads * self.linear_value_head_dim
        return 2 * qk + 2 * v + 2 * self.linear_num_value_heads

    @property
    def conv_channels(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_width

    @property
    def value_width(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim


def gdn_layer_params(sizes: GDNSizes) -> int:
    """The parameter count of one ``G`` layer (module docstring), input norm included."""
    d, hv = sizes.hidden_size, sizes.linear_num_value_heads
    conv = sizes.linear_conv_kernel_dim * sizes.conv_channels  # depthwise, no bias
    return d * sizes.in_proj_width + conv + 2 * hv + sizes.linear_value_head_dim + sizes.value_width * d + d


def gdn_projection_flops(sizes: GDNSizes) -> int:
    """Forward FLOPs per token of ``in_proj`` and ``out_proj``: ``2·d·in_width + 2·Hv·dv·d``."""
    return 2 * sizes.hidden_size * (sizes.in_proj_width + sizes.value_width)


def gdn_core_flops(sizes: GDNSizes) -> int:
    """Forward FLOPs per token of the gated delta rule, counted in its recurrent form: per value head a
    ``dk x dv`` state ``S`` is read by the key (``kᵀS``), updated by a rank-1 term and read by the query (``Sᵀq``),
    three matrix-vector products of ``2·dk·dv`` each: ``6·Hv·dk·dv`` (the chunked kernel computes the same
    outputs)."""
    return 6 * sizes.linear_num_value_heads * sizes.linear_key_head_dim * sizes.linear_value_head_dim


def check_gdn_heads(config) -> None:
    """``ValueError`` unless the value heads are a multiple of the key heads (megatron's GDN layout)."""
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    if hv % hk:
        raise ValueError(
            f"pattern symbol 'G': linear_num_value_heads ({hv}) must be a multiple of linear_num_key_heads ({hk}) "
            "(each key head serves Hv / Hk value heads): change one of them"
        )
