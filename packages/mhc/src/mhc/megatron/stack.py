"""``HyperConnectionHybridStack``: megatron-core 0.19.2 ``HybridStack`` with mHC streams end to end.

    first stage:  e [s, b, d] --StreamExpansion--> X [s, b, n·d]          (n identical copies, stream dtype)
    every layer:  X = HyperConnectionLayer(layer)(X)                          (layers built from the hybrid spec)
    last stage:   streams X --HyperHead--> h [s, b, d] --final norm--> out   (MTP wants X: return_streams=True)

Pipeline stages exchange ``X`` (``n·d`` channels): see :mod:`mhc.megatron.pipeline`. Layers must be
``TransformerLayer``s (attention ``*``/``D``/``+``, MLP ``-``, MoE ``E`` symbols); Mamba/GDN layers are rejected.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.utils import WrappedTensor, make_viewless_tensor
from torch import nn

from dsv4_primitives import RMSNorm
from dsv4_primitives.recompute import checkpoint_layers, recompute_config_of, recompute_scope
from mhc.config import MHCConfig
from mhc.megatron.layer import HyperConnectionLayer, mhc_config_for
from mhc.megatron.pipeline import (
    check_mhc_pipeline_dtype,
    fold_streams,
    unfold_streams,
    uses_folded_streams,
)
from mhc.modules import HyperHead, StreamExpansion


class HyperConnectionHybridStack(HybridStack):
    """``HybridStack`` whose layers are wrapped in :class:`HyperConnectionLayer`.

    Extra constructor args (all keyword, passed through ``ModuleSpec.params`` by
    :func:`hyper_connection_stack_spec`): ``mhc`` (:class:`MHCConfig`, default from ``config``), ``final_norm``
    (spec/class of the final norm, default ``dsv4_primitives.RMSNorm``; 0.19.2's ``HybridStack`` hard-codes a
    TE norm) and ``return_streams`` (``forward`` then returns ``(hidden, streams [s, b, n, d])`` on the last
    stage, for MTP which consumes the pre-HyperHead streams).
    """

    def __init__(
        self,
        config,
        submodules,
        *args,
        mhc: MHCConfig | None = None,
        final_norm: ModuleSpec | type | None = None,
        return_streams: bool = False,
        post_layer_norm: bool = True,
        **kwargs,
    ) -> None:
        mhc = mhc or mhc_config_for(config)
        check_mhc_pipeline_dtype(config, mhc)  # the p2p buffers carry the streams: refuse before building
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        self.return_streams = return_streams
        self.mhc_config = mhc
        self.layers = nn.ModuleList(
            HyperConnectionLayer(config, layer, mhc=self.mhc_config) for layer in self.layers
        )
        if self.pre_process:
            self.expansion = StreamExpansion(self.mhc_config)
        if self.post_process:
            self.hyper_head = HyperHead(self.mhc_config)
            if post_layer_norm:
                self.final_norm = build_module(
                    final_norm or RMSNorm,
                    config=config,
                    hidden_size=config.hidden_size,
                    eps=config.layernorm_epsilon,
                )

    def forward(
        self,
        hidden_states,
        attention_mask,
        inference_context=None,
        rotary_pos_emb=None,
        *,
        inference_params=None,
        packed_seq_params=None,
        padding_mask=None,
    ):
        """``hidden_states [s, b, d]`` (first stage) or the received streams ``[s, b, n·d]`` -> see class doc."""
        if inference_context is None:
            inference_context = inference_params
        if not self.pre_process:
            hidden_states = self.input_tensor  # [s, b, n*d] from the previous stage ([s*n, b, d] folded: VPP)
        if isinstance(hidden_states, WrappedTensor):
            hidden_states = hidden_states.unwrap()
        n, d = self.mhc_config.num_streams, self.mhc_config.hidden_size
        folded = uses_folded_streams(self.config)  # the interleaved schedule's p2p shape (pipeline.py)
        if folded and not self.pre_process:
            hidden_states = unfold_streams(hidden_states, n)  # [s, b, n*d]
        if self.pre_process:
            hidden_states = self.expansion(hidden_states).flatten(-2)  # [s, b, n*d]
        layer_kwargs = dict(
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )
        hidden_states = self._forward_layers(hidden_states, layer_kwargs)
        streams = None
        if self.post_process:
            s, b, _ = hidden_states.shape
            streams = hidden_states.view(s, b, n, d)
            out_dtype = torch.bfloat16 if self.config.bf16 else torch.float16 if self.config.fp16 else None
            hidden_states = self.hyper_head(streams, out_dtype=out_dtype)  # [s, b, d]
            if self.post_layer_norm:
                hidden_states = self.final_norm(hidden_states)
        elif folded:
            hidden_states = fold_streams(hidden_states, n)  # [s*n, b, d] for the next (virtual) stage
        hidden_states = make_viewless_tensor(
            inp=hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True
        )
        if self.return_streams and streams is not None:
            return hidden_states, streams
        return hidden_states

    def capture_layer_state(self):
        """A function restoring the per-forward state the layers read besides their inputs (called at the start of
        a full-recompute chunk's recomputation in backward). Subclasses that bind state to layers before a forward
        (hybrid-model's token ids of the hash routers) override it; the default has none."""
        return lambda: None

    def _forward_layers(self, hidden_states: torch.Tensor, layer_kwargs: dict) -> torch.Tensor:
        """The layers, with the model's activation recompute (:class:`dsv4_primitives.recompute.RecomputeConfig`):
        full recompute checkpoints chunks of layers (:meth:`RecomputeConfig.full_chunks`); selective ``mhc``
        recompute discards the streams between the layers of each mHC recompute group."""
        rc = recompute_config_of(self.config)
        n = len(self.layers)
        if rc.full and self.training and torch.is_grad_enabled():
            for start, end, checkpointed in rc.full_chunks(n):
                if not checkpointed:
                    hidden_states = self._run_layers(hidden_states, start, end, layer_kwargs)
                    continue
                restore = self.capture_layer_state()

                def run(h, start=start, end=end, restore=restore):
                    restore()
                    return self._run_layers(h, start, end, layer_kwargs)

                hidden_states = checkpoint_layers(run, hidden_states)
            return hidden_states
        if not rc.selects("mhc"):
            return self._run_layers(hidden_states, 0, n, layer_kwargs)
        keep = rc.mhc_group_ends(n)
        with recompute_scope():  # the registrations of discarded streams live across the layers of a group
            for i, layer in enumerate(self.layers):
                hidden_states, _ = layer(
                    hidden_states=hidden_states, discard_output=not keep[i], **layer_kwargs
                )
        return hidden_states

    def _run_layers(
        self, hidden_states: torch.Tensor, start: int, end: int, layer_kwargs: dict
    ) -> torch.Tensor:
        for layer in self.layers[start:end]:
            hidden_states, _ = layer(hidden_states=hidden_states, **layer_kwargs)
        return hidden_states


def hyper_connection_stack_spec(
    stack_spec: ModuleSpec,
    mhc: MHCConfig | None = None,
    *,
    final_norm: ModuleSpec | type | None = None,
    return_streams: bool = False,
) -> ModuleSpec:
    """Turn a ``HybridStack`` spec (e.g. a hand-built local ``hybrid_stack_spec``) into the mHC stack spec."""
    params = dict(stack_spec.params or {})
    params.update(mhc=mhc, final_norm=final_norm, return_streams=return_streams)
    return dataclasses.replace(stack_spec, module=HyperConnectionHybridStack, params=params)
