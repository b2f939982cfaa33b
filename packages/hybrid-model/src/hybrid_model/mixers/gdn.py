"""``G``: megatron-core's gated delta net layer (:class:`~hybrid_model.gated_delta_net_layer.GatedDeltaNetLayer`):
megatron's TE spec with transformer-engine, else the local spec (table in :mod:`hybrid_model.gated_delta_net`, which
also holds its sizes, parameter and FLOP formulas). It needs fla (the ``hybrid-model[gdn]`` extra) and CUDA, and
refuses context / tensor parallelism, ``--cuda-graph`` and packed batches on megatron's torch gated delta rule."""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from dsv4_primitives import RMSNorm
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.gated_delta_net import GDNSizes, gdn_core_flops, gdn_layer_params, gdn_projection_flops
from hybrid_model.gated_delta_net_layer import GatedDeltaNetLayer, fla_chunk_kernels_correct
from hybrid_model.latent_attention import TypedTorchNorm
from hybrid_model.mixers.record import (
    HOST_BOUNDARIES,
    TP_REASON,
    Dependency,
    LayerParams,
    Layout,
    Refusal,
    SymbolRecord,
    is_local,
)
from hybrid_model.symbols import GDN

TORCH_RULE = "on megatron's torch gated delta rule (--deterministic, or fla's kernels not trusted here)"
REFUSALS = (
    Refusal(
        Layout.CPU,
        "runs on a CUDA GPU only: megatron's GDN layer runs flash-linear-attention's Triton kernels, which need one; "
        "use a pattern without 'G' here",
    ),
    Refusal(
        Layout.CP,
        "does not support context parallelism here: megatron's GDN all-to-all assumes its zigzag CP layout, DSv4 "
        "shards each pack contiguously; use --cp 1 or a pattern without 'G'",
    ),
    Refusal(Layout.TP, TP_REASON),
    Refusal(
        Layout.PACKED,
        "cannot run packed THD batches here: {why}, so megatron's torch gated delta rule runs, and it has no "
        "per-document boundaries (its conv1d and recurrence would cross documents); use [B, S] batches (drop "
        "--packed), or run where fla's kernels are trusted (Triton >= 3.7.1 on Hopper, or another GPU) with "
        "--no-deterministic (dsv4 train's default with CUDA is --deterministic)",
        condition=TORCH_RULE,
    ),
    Refusal(
        Layout.CUDA_GRAPH,
        "megatron's torch gated delta rule (the 'G' layer's rule with --deterministic and on Hopper with Triton < "
        "3.7.1) builds its state on the host in every forward, which a CUDA graph capture forbids, and fla's kernels "
        "are not validated under capture; drop --cuda-graph or use a pattern without 'G'",
    ),
    HOST_BOUNDARIES,
)


def local_gdn_layer_spec():
    """The local (no transformer-engine) spec of ``G``: the table in :mod:`hybrid_model.gated_delta_net`."""
    # megatron's GDN module imports fla where it is installed (the optional `gdn` extra; it raises without a GPU)
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules

    return ModuleSpec(
        module=GatedDeltaNetLayer,
        params={"record": RECORD},
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=ModuleSpec(
                module=GatedDeltaNet,
                submodules=GatedDeltaNetSubmodules(
                    in_proj=ColumnParallelLinear, out_norm=TypedTorchNorm, out_proj=RowParallelLinear
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
        ),
    )


def te_gdn_layer_spec():
    """megatron-core's own TE spec of ``G`` (``hybrid_stack_spec.gdn_layer``), built by :class:`GatedDeltaNetLayer`."""
    # imports transformer-engine's extension and megatron's GDN module (fla where installed): optional
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    return dataclasses.replace(
        hybrid_stack_spec.submodules.gdn_layer, module=GatedDeltaNetLayer, params={"record": RECORD}
    )


def gdn_spec(cfg: DSv4ModelConfig, backend, is_mtp: bool = False):
    """The spec of ``G`` for ``backend`` (local for megatron's ``LocalSpecProvider``, or no backend and no
    transformer-engine); first the ``ImportError`` naming the extra when fla is missing."""
    RECORD.require_packages()
    return local_gdn_layer_spec() if is_local(backend) else te_gdn_layer_spec()


def check_gdn_training(pattern: str, *, packed: bool, deterministic: bool, cuda_graph: bool = False) -> None:
    """``ValueError`` for what a ``G`` layer cannot train (the record's reasons): ``--cuda-graph``, and ``--packed``
    where megatron's torch rule would run (``--deterministic``, or fla's kernels not correct on this machine)."""
    if GDN not in pattern:
        return
    if cuda_graph:
        raise ValueError(
            f"--cuda-graph cannot run the pattern {pattern!r}: {RECORD.refusal(Layout.CUDA_GRAPH).reason}"
        )
    if not packed:
        return
    RECORD.require_packages()  # fla missing: the ImportError naming the extra, before anything imports fla
    why = "--deterministic" if deterministic else ""
    if not why and torch.cuda.is_available():
        why = fla_chunk_kernels_correct()[1]
    if why:
        raise ValueError(f"--packed with the pattern {pattern!r}: " + RECORD.message(Layout.PACKED, why=why))


def _params(cfg: DSv4ModelConfig, hashed: bool) -> LayerParams:
    d = cfg.hidden_size
    n = gdn_layer_params(GDNSizes.for_hidden_size(d))
    return LayerParams(
        {"attention.gated_delta_net": n - d, "norms": d}
    )  # input_layernorm (TE: fused into in_proj)


def _flops(cfg: DSv4ModelConfig) -> dict[str, int]:
    sizes = GDNSizes.for_hidden_size(cfg.hidden_size)
    return {
        "linear_attention.projections": gdn_projection_flops(sizes),
        "linear_attention.delta_rule": gdn_core_flops(sizes),
    }


RECORD = SymbolRecord(
    symbol=GDN,
    layer="GDN (gated delta net; transformer-engine's spec or the local one)",
    spec=gdn_spec,
    dependencies=(
        Dependency(
            "fla",
            "fla-core (the `hybrid-model[gdn]` extra: flash-linear-attention's gated-delta-rule kernels)",
        ),
    ),
    refusals=REFUSALS,
    params=_params,
    flops=_flops,
)
