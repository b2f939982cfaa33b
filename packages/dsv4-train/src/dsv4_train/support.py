"""Which features of ``dsv4 train`` combine: one support table, read by the config, the run's setup and the README.

Each :class:`Feature` says when a run uses it (a predicate of the :class:`~dsv4_train.config.TrainConfig` and the
:class:`Machine`); each :class:`Relation` says what a set of features does together: ``refused`` (the run stops
before any work, with the relation's reason), ``supported`` (and the test that runs it) or ``untested`` (accepted,
but no test runs the combination: the reason says what is known of it and why no test runs it). A refusal that can be
decided from the config alone (``when="config"``) is raised when the config is built; one that needs the machine
(the data-parallel size, CUDA, the resolved precision) when the run starts (:func:`check_run_relations`). A new
feature adds a :class:`Feature` and its rows; ``python3 packages/dsv4-train/tools/readme_tables.py`` rewrites the
README's matrix from this table (:mod:`dsv4_train.support_render`), and the tests check that every supported row names a test that exists, every
refused row raises its reason and every untested row is accepted.

The features and the relation type live in :mod:`dsv4_train.support_features`, the rows in
:mod:`dsv4_train.support_relations`; this module checks them. All three read configs duck-typed (no import of
:mod:`dsv4_train.config`), so the config can check itself with them.
"""

from __future__ import annotations

from typing import Any

from dsv4_train.support_features import FEATURES, Feature, Machine, Relation
from dsv4_train.support_relations import RELATIONS


def _refusals(tc: Any, machine: Machine | None, when: tuple[str, ...]) -> None:
    for rel in RELATIONS:
        if rel.verdict == "refused" and rel.when in when and rel.applies(tc, machine):
            raise ValueError(rel.message(tc, machine))


def check_config_relations(tc: Any) -> None:
    """``ValueError`` with the reason of the first refused relation that the config alone decides."""
    _refusals(tc, None, ("config",))


def check_run_relations(tc: Any, machine: Machine) -> None:
    """``ValueError`` with the reason of the first refused relation of ``tc`` (resolved: bf16 decided) on
    ``machine``."""
    _refusals(tc, machine, ("config", "run"))


__all__ = [
    "FEATURES",
    "RELATIONS",
    "Feature",
    "Machine",
    "Relation",
    "check_config_relations",
    "check_run_relations",
]
