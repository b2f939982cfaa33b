"""The ``G`` layer's module: megatron's ``GatedDeltaNet`` in a ``TransformerLayer`` that refuses what its record
(:mod:`hybrid_model.mixers.gdn`: specs, refusals) refuses and picks the gated delta rule; sizes and counts are
:mod:`hybrid_model.gated_delta_net`."""

from __future__ import annotations

import copy
import dataclasses

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from hybrid_model.gated_delta_net import check_gdn_heads
from hybrid_model.mixers.record import Layout, SymbolRecord


def fla_chunk_kernels_correct() -> tuple[bool, str]:
    """Whether fla's chunked gated-delta-rule kernels are trusted here, and if not why. fla 0.6 refuses its gated
    ``chunk_bwd_dqkwg`` Triton kernel on Hopper with Triton in ``[3.4, 3.7.1)`` (wrong results, fla issue #640) and
    dispatches to a tilelang kernel instead when tilelang, a usable nvcc and fla's backend switches allow it, per
    call (a verifier may still send a call back to the refusing Triton kernel). torch 2.11 pins Triton 3.6, so on an
    H100 / H200 this is not trusted, with or without tilelang (its replacement is not validated here): megatron's
    torch rule runs."""
    import triton
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    if IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1:
        return False, (
            f"fla refuses its gated backward kernel on Hopper with Triton {triton.__version__} (wrong results below "
            "Triton 3.7.1, fla issue #640; its tilelang replacement is not validated here)"
        )
    return True, ""


class GatedDeltaNetLayer(TransformerLayer):
    """megatron's ``TransformerLayer`` around its ``GatedDeltaNet`` (``module`` of both specs; ``record``: the ``G``
    record, a spec parameter).

    Construction refuses what ``record`` refuses (no CUDA, context / tensor parallelism; and value heads that are
    not a multiple of the key heads) and picks the gated delta rule: fla's chunked kernels, or megatron's torch
    chunked rule (its ``deterministic_mode`` path, set on this layer's config copy) with ``--deterministic`` or
    where fla's kernels are not correct (:func:`fla_chunk_kernels_correct`); ``torch_delta_rule`` says which. The
    attention forward hands a pack's document boundaries to fla on the activations' device (the trainer keeps a
    pack's ``cu_seqlens`` on the host, where megatron's other layers read them) and refuses packed batches on the
    torch rule, which has no per-document boundaries.
    """

    def __init__(self, config, submodules, *args, record: SymbolRecord, **kwargs) -> None:
        if not torch.cuda.is_available():
            raise ValueError(record.message(Layout.CPU))
        record.check_single_rank(config, kwargs.get("pg_collection"))
        check_gdn_heads(config)
        ok, why = fla_chunk_kernels_correct()
        if not ok and not config.deterministic_mode:
            config = copy.copy(config)
            config.deterministic_mode = True  # megatron's torch conv1d + torch chunked gated delta rule
        super().__init__(config, submodules, *args, **kwargs)
        self.record = record
        self.torch_delta_rule = bool(config.deterministic_mode)
        self.torch_delta_rule_reason = why or "--deterministic"

    def _forward_attention(self, hidden_states, *args, packed_seq_params=None, **kwargs):
        if packed_seq_params is not None:
            if self.torch_delta_rule:
                raise ValueError(self.record.message(Layout.PACKED, why=self.torch_delta_rule_reason))
            packed_seq_params = packed_seq_params_on(packed_seq_params, hidden_states.device)
        return super()._forward_attention(hidden_states, *args, packed_seq_params=packed_seq_params, **kwargs)


def packed_seq_params_on(packed_seq_params, device):
    """``packed_seq_params`` with its ``cu_seqlens*`` tensors on ``device`` (the same object when they are)."""
    moved = {
        f.name: v.to(device)
        for f in dataclasses.fields(packed_seq_params)
        if f.name.startswith("cu_seqlens")
        and isinstance(v := getattr(packed_seq_params, f.name), torch.Tensor)
        and v.device != device
    }
    return dataclasses.replace(packed_seq_params, **moved) if moved else packed_seq_params
