"""The model a ``dsv4 train`` run builds: its preset with the run's ``model_overrides`` and pipeline layout."""

from __future__ import annotations

from dsv4_train.config import TrainConfig
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.model_flags import apply_model_overrides
from hybrid_model.presets import get_preset


def model_config_for(tc: TrainConfig) -> DSv4ModelConfig:
    """The preset of ``tc`` with its ``model_overrides`` (and ``pipeline_stages`` = ``--pp`` x ``--vpp`` unless
    overridden)."""
    cfg = get_preset(tc.model.preset)
    changes = dict(tc.model.model_overrides)
    if tc.parallel.pp > 1 and "hybrid_layer_pattern" not in changes:
        changes.setdefault(
            "pipeline_stages", tc.parallel.pp * tc.parallel.vpp
        )  # VPP: P·V segments (virtual_pipeline.py)
    return apply_model_overrides(cfg, changes, pp=tc.parallel.pp * tc.parallel.vpp)
