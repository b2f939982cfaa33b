"""Activation recompute shared by the DSv4 packages: the setting (:class:`RecomputeConfig`, megatron's vocabulary),
output-discarding checkpointed regions (:func:`checkpoint_region`, :func:`discard`, :func:`recompute_scope`) and
full-layer checkpoints (:func:`checkpoint_layers`). See the README's "Activation recompute" section."""

from dsv4_primitives.recompute.config import (
    GRANULARITIES,
    MEGATRON_MODULES,
    METHODS,
    NO_RECOMPUTE,
    SELECTIVE_MODULES,
    RecomputeConfig,
    recompute_config_of,
)
from dsv4_primitives.recompute.layers import checkpoint_layers
from dsv4_primitives.recompute.region import checkpoint_region
from dsv4_primitives.recompute.saved import (
    Recomputable,
    discard,
    discard_derived,
    recompute_scope,
    registered,
    scope_active,
)

__all__ = [
    "GRANULARITIES",
    "MEGATRON_MODULES",
    "METHODS",
    "NO_RECOMPUTE",
    "SELECTIVE_MODULES",
    "Recomputable",
    "RecomputeConfig",
    "checkpoint_layers",
    "checkpoint_region",
    "discard",
    "discard_derived",
    "recompute_config_of",
    "recompute_scope",
    "registered",
    "scope_active",
]
