"""Which model an ``--init-from`` checkpoint holds, and what to say when its weights do not fit this run's model.

A ``dsv4 train`` checkpoint records its run's config (``dsv4_train_config.json``: the preset and
``model_overrides``); a ``dsv4 convert`` output records its model config (``dsv4_model_config.json``). When the
weights fail to load, the two models are compared on one pipeline stage (``--init-from`` reads any PP layout) and the
error names the fields that differ and the model flags that build the checkpoint's model, checked to build it
before they are suggested.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dsv4_train.config import TrainConfig
from dsv4_train.model_config import model_config_for
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.hf.convert import MODEL_CONFIG_FILE

#: the run config a ``dsv4 train`` checkpoint holds (``checkpoint.TRAIN_CONFIG_FILE``)
RUN_CONFIG_FILE = "dsv4_train_config.json"
#: fields a layer pattern decides (reported as the pattern when it differs)
PATTERN_FIELDS = frozenset(
    {"hybrid_layer_pattern", "num_layers", "num_nextn_predict_layers", "compress_ratios", "num_hash_layers"}
)


def one_stage(cfg: DSv4ModelConfig) -> DSv4ModelConfig:
    """``cfg`` on one pipeline stage: its layer pattern without ``|`` cuts (what every PP layout loads)."""
    return cfg.with_pattern(cfg.layer_pattern.replace("|", ""))


def saved_model(ckpt: Path) -> tuple[DSv4ModelConfig, TrainConfig | None] | None:
    """The model the checkpoint directory ``ckpt`` (an ``iter_XXXXXXX`` or a convert output) holds, with its run's
    config when a ``dsv4 train`` run wrote it; ``None`` when it records neither or they cannot be read (the load
    error is reported then)."""
    try:
        if (ckpt / RUN_CONFIG_FILE).is_file():
            saved = TrainConfig.from_dict(json.loads((ckpt / RUN_CONFIG_FILE).read_text()), where=str(ckpt))
            return model_config_for(saved), saved
        if (ckpt / MODEL_CONFIG_FILE).is_file():
            meta = json.loads((ckpt / MODEL_CONFIG_FILE).read_text())
            return DSv4ModelConfig.from_dict(meta["model_config"]), None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return None


def model_differences(run: DSv4ModelConfig, ckpt: DSv4ModelConfig) -> list[str]:
    """The fields in which this run's model ``run`` differs from the checkpoint's ``ckpt`` (one stage each), one
    ``"name value (checkpoint: value)"`` text each; the layer pattern once for the fields it decides."""
    a, b = one_stage(run), one_stage(ckpt)
    da, db = a.to_dict(), b.to_dict()
    lines = []
    if a.layer_pattern != b.layer_pattern:
        lines.append(f"layer pattern {a.layer_pattern!r} (checkpoint: {b.layer_pattern!r})")
    skip = PATTERN_FIELDS | {"pipeline_stages"} if lines else {"pipeline_stages", "hybrid_layer_pattern"}
    lines += [f"{k} {da[k]!r} (checkpoint: {db[k]!r})" for k in da if k not in skip and da[k] != db[k]]
    return lines


def _builds(tc: TrainConfig, preset: str, overrides: dict[str, Any], target: DSv4ModelConfig) -> bool:
    """Whether ``--preset preset --model-overrides overrides`` on ``tc`` builds ``target`` (one stage)."""
    try:
        built = model_config_for(tc.replace(preset=preset, model_overrides=overrides))
    except (ValueError, TypeError):
        return False
    return one_stage(built).to_dict() == one_stage(target).to_dict()


def model_flags_for(tc: TrainConfig, ckpt: DSv4ModelConfig, saved: TrainConfig | None) -> str | None:
    """The ``--preset`` / ``--model-overrides`` flags that make the run ``tc`` build the checkpoint's model
    ``ckpt`` (``saved``: its run's config, when known), or ``None`` when none found builds it."""
    pp = tc.parallel.pp * tc.parallel.vpp
    candidates: list[tuple[str, dict[str, Any]]] = []
    if saved is not None:
        overrides = dict(saved.model.model_overrides)
        pattern = overrides.get("hybrid_layer_pattern")
        if isinstance(pattern, str) and pp == 1:
            overrides["hybrid_layer_pattern"] = pattern.replace("|", "")
        candidates.append((saved.model.preset, overrides))
    base = model_config_for(tc.replace(model_overrides={}))
    one, target = one_stage(base).to_dict(), one_stage(ckpt)
    changed = {k: v for k, v in target.to_dict().items() if k not in PATTERN_FIELDS | {"pipeline_stages"}}
    changed = {k: v for k, v in changed.items() if one[k] != v}
    if one_stage(base).layer_pattern != target.layer_pattern:
        changed["hybrid_layer_pattern"] = target.layer_pattern
    candidates.append((tc.model.preset, changed))
    for preset, overrides in candidates:
        text = json.dumps(overrides)
        plain = not any(
            isinstance(v, dict) for v in overrides.values()
        )  # nested values (yarn) are not suggested
        if plain and "'" not in text and _builds(tc, preset, overrides, ckpt):
            if not overrides:
                return f"--preset {preset} and without --pattern / --no-mhc / --model-overrides"
            return f"--preset {preset} --model-overrides '{text}' (in place of this run's --pattern / --no-mhc / --model-overrides)"
    return None


def mismatch_message(given: str, ckpt: Path, tc: TrainConfig) -> str | None:
    """One line for an ``--init-from`` whose weights did not load because the checkpoint ``ckpt`` holds another
    model than ``tc`` builds: the differing fields and the flags that build the checkpoint's model; ``None`` when
    the models agree or the checkpoint records none (the load error is the message then)."""
    found = saved_model(ckpt)
    if found is None:
        return None
    model, saved = found
    differences = model_differences(model_config_for(tc), model)
    if not differences:
        return None
    flags = model_flags_for(tc, model, saved)
    build = (
        f"build the checkpoint's model with {flags}"
        if flags
        else f"build the checkpoint's model (its {RUN_CONFIG_FILE if saved else MODEL_CONFIG_FILE})"
    )
    where = f"--init-from {given}" + (f" ({ckpt})" if Path(given) != ckpt else "")
    return (
        f"{where} holds another model than this run builds ({'; '.join(differences)}): to start from its weights, "
        f"{build}; or leave out --init-from to train this model from scratch"
    )


__all__ = ["mismatch_message", "model_differences", "model_flags_for", "one_stage", "saved_model"]
