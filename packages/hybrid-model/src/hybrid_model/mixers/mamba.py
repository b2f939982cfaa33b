"""``M``: megatron-core's Mamba layer, its transformer-engine spec only (``hybrid_stack_spec.mamba_layer``): it needs
transformer-engine and mamba-ssm's and causal-conv1d's compiled CUDA kernels (mamba-ssm ships no wheel). Not a
``TransformerLayer`` (:class:`hybrid_model.layers.HyperConnectionMixer` wraps it in mHC) and not counted by the
analytic parameter / FLOP formulas (a built model is counted: :func:`hybrid_model.params.count_model_params`)."""

from __future__ import annotations

from hybrid_model.config import DSv4ModelConfig
from hybrid_model.mixers.record import HOST_BOUNDARIES, TRANSFORMER_ENGINE, Dependency, SymbolRecord
from hybrid_model.symbols import MAMBA


def mamba_spec(cfg: DSv4ModelConfig, backend, is_mtp: bool = False):
    """megatron's TE spec of the Mamba layer (first the ``ImportError`` naming each missing package)."""
    RECORD.require_packages()
    # megatron's spec module imports transformer-engine's extension and its GDN module (fla where installed)
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    return hybrid_stack_spec.submodules.mamba_layer


RECORD = SymbolRecord(
    symbol=MAMBA,
    layer="Mamba (megatron has only its transformer-engine spec)",
    spec=mamba_spec,
    build_keywords=frozenset({"pp_layer_offset"}),
    mixer=True,
    dependencies=(
        TRANSFORMER_ENGINE,
        Dependency(
            "mamba_ssm", "mamba-ssm (`pip install mamba-ssm`: the compiled selective-scan CUDA kernels)"
        ),
        Dependency(
            "causal_conv1d",
            "causal-conv1d (`pip install causal-conv1d`: the compiled causal conv1d CUDA kernel)",
        ),
    ),
    refusals=(HOST_BOUNDARIES,),
)
