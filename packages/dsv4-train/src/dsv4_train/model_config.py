"""The model a ``dsv4 train`` run builds: its preset with the run's ``model_overrides`` and pipeline layout."""

from __future__ import annotations

from dsv4_train.config import TrainConfig
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.model_flags import apply_model_overrides
from hybrid_model.presets import get_preset
from hybrid_model.tensor_parallel import check_tensor_parallel_pattern
from hybrid_model.tensor_parallel_sizes import check_tensor_parallel_sizes


def model_config_for(tc: TrainConfig) -> DSv4ModelConfig:
    """The preset of ``tc`` with its ``model_overrides`` (and ``pipeline_stages`` = ``--pp`` x ``--vpp`` unless
    overridden). ``ValueError`` when ``--tp > 1`` and a symbol of the pattern refuses tensor parallelism (its
    record's reason), or ``--tp`` does not divide a size the model splits over TP (the size, the ``--tp`` values
    that fit and the ``model_overrides`` that make it fit: :mod:`hybrid_model.tensor_parallel_sizes`)."""
    cfg = get_preset(tc.model.preset)
    changes = dict(tc.model.model_overrides)
    if tc.parallel.pp > 1 and "hybrid_layer_pattern" not in changes:
        changes.setdefault(
            "pipeline_stages", tc.parallel.pp * tc.parallel.vpp
        )  # VPP: P·V segments (virtual_pipeline.py)
    try:
        cfg = apply_model_overrides(cfg, changes, pp=tc.parallel.pp * tc.parallel.vpp)
    except TypeError as e:  # dataclasses.replace: a key that is not a DSv4ModelConfig field
        raise ValueError(f"--model-overrides: {e} (the keys are DSv4ModelConfig fields)") from e
    except ValueError as e:
        if tc.parallel.pp == 1:
            raise
        layout = f"--pp {tc.parallel.pp}" + (f" --vpp {tc.parallel.vpp}" if tc.parallel.vpp > 1 else "")
        segments = tc.parallel.pp * tc.parallel.vpp
        fix = (
            f" ({layout} cut the model into {segments} pipeline segments, one layer at least each, and --preset "
            f"{tc.model.preset} has {cfg.num_layers} layers: lower --pp / --vpp)"
            if segments > cfg.num_layers
            else ""
        )
        raise ValueError(f"{layout} with --preset {tc.model.preset}: {e}{fix}") from e
    check_tensor_parallel_pattern(cfg.layer_pattern, tc.parallel.tp)
    check_tensor_parallel_sizes(cfg, tc.parallel.tp)
    return cfg
