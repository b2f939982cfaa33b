"""The model-surface flags shared by ``dsv4 train|inspect|flops``: ``--pattern`` (a hybrid layer pattern replacing
the preset's) and ``--no-mhc`` (plain pre-norm residual layers instead of mHC).

``dsv4 train`` carries them in ``TrainConfig.model_overrides`` (``hybrid_layer_pattern``,
``enable_mhc_connections``), so a run directory records them and ``--resume`` refuses a change like any other model
field; :func:`apply_model_overrides` turns the overrides into the run's :class:`~hybrid_model.config.DSv4ModelConfig`.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from hybrid_model.config import DSv4ModelConfig
from hybrid_model.symbols import PIPE, SYMBOL_HELP, parse_pattern


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Add ``--pattern`` and ``--no-mhc`` to a sub-command's parser."""
    p.add_argument(
        "--pattern",
        help="hybrid layer pattern replacing the preset's, e.g. 'WEC-|H-C-/W-' (" + SYMBOL_HELP + "; "
        "see the hybrid-model README; default: the preset's)",
    )
    p.add_argument(
        "--no-mhc",
        dest="no_mhc",
        action="store_true",
        default=None,
        help="plain pre-norm residual layers instead of mHC (enable_mhc_connections=False; default: mHC on)",
    )


def overrides_from_args(args) -> dict[str, Any]:
    """The ``DSv4ModelConfig`` changes of the parsed flags (removed from ``args``)."""

    out: dict[str, Any] = {}
    pattern = vars(args).pop("pattern", None)
    if pattern is not None:
        parse_pattern(pattern)  # the error points at the offending character
        out["hybrid_layer_pattern"] = pattern
    if vars(args).pop("no_mhc", None):
        out["enable_mhc_connections"] = False
    return out


def apply_model_overrides(cfg: DSv4ModelConfig, overrides: dict[str, Any], *, pp: int = 1) -> DSv4ModelConfig:
    """``cfg`` with ``overrides`` applied: a ``hybrid_layer_pattern`` goes through
    :meth:`~hybrid_model.config.DSv4ModelConfig.with_pattern` (which derives the counts), then the other fields.
    A pattern's ``|`` cuts must match ``pp`` pipeline stages."""

    changes = dict(overrides)
    pattern = changes.pop("hybrid_layer_pattern", None)
    if pattern is not None:
        stages = len(parse_pattern(pattern).segments)
        if stages != pp:
            raise ValueError(
                f"pattern {pattern!r} has {stages} pipeline stage(s) ('{PIPE}' cuts) but --pp is {pp}: give one "
                f"'{PIPE}'-separated segment per pipeline stage (--pp {stages}, or remove the cuts for --pp 1)"
            )
        if "num_hash_layers" in changes:  # before the pattern: it decides whether the hash layers fit stage 1
            cfg = dataclasses.replace(cfg, num_hash_layers=changes.pop("num_hash_layers"))
        cfg = cfg.with_pattern(pattern)
        changes.pop("pipeline_stages", None)
    return cfg.replace(**changes) if changes else cfg
