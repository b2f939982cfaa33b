"""The support table (``dsv4_train.support``): every refused relation stops a config that uses its features with
exactly its reason; every supported relation is accepted and names a test that exists; the README's matrix is the
table's."""

import ast
import sys
from pathlib import Path

import pytest

from dsv4_train.config import TrainConfig
from dsv4_train.support import FEATURES, RELATIONS, Machine, check_run_relations

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tools"))
from readme_tables import README, with_tables  # noqa: E402

#: flat config values that turn each feature on (machine features: the Machine's fields)
ACTIVATE = {
    "tp": {"tp": 2, "micro_batch_size": 1},
    "pp": {"pp": 2},
    "vpp": {"vpp": 2},
    "ep": {"ep": 2},
    "cp": {"cp": 2},
    "packed": {"packed": True},
    "micro_batch": {"micro_batch_size": 2},
    "cuda_graph": {"cuda_graph": True, "bf16": True},
    "recompute": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
    "offload": {"optimizer_cpu_offload": True},
    "offload_overlap": {"optimizer_offload_overlap": True},
    "offload_defer": {"optimizer_offload_defer": True},
    "activation_offload": {"offload_activations": True},
    "deterministic": {"deterministic": True},
    "eval": {"eval_interval": 1},
    "resume": {"resume": True},
    "fp32": {"bf16": False},
}


def _case(rel):
    """``(flat config values, machine)`` that use exactly the relation's features (VPP gets its pipeline unless
    the relation is about its absence)."""
    values = {"bf16": True}
    for name in rel.features:
        values.update(ACTIVATE.get(name, {}))
    if "vpp" in rel.features and "pp" not in rel.without:
        values.setdefault("pp", 2)
    machine = Machine(dp=2 if "dp" in rel.features else 1, cuda="cpu" not in rel.features)
    return values, machine


def _outcome(values, machine):
    """The refusal message of the config (at construction or at run start), else ``None``."""
    try:
        tc = TrainConfig.from_flat(**values)
        check_run_relations(tc, machine)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "rel", [r for r in RELATIONS if r.verdict == "refused"], ids=lambda r: "+".join(r.features)
)
def test_every_refusal_raises_its_reason(rel):
    values, machine = _case(rel)
    want = rel.reason.format(**{**TrainConfig.from_flat().flat(), **values}, dp=machine.dp)
    assert _outcome(values, machine) == want


@pytest.mark.parametrize(
    "rel", [r for r in RELATIONS if r.verdict == "supported"], ids=lambda r: "+".join(r.features)
)
def test_every_supported_relation_is_accepted_and_tested(rel):
    values, machine = _case(rel)
    assert _outcome(values, machine) is None, rel
    path, name = rel.tested_by.split("::")
    tree = ast.parse((HERE.parent / path).read_text())
    assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, rel.tested_by


def test_every_untested_relation_is_accepted():
    """An untested combination is not refused (the run goes ahead); its reason says that no test runs it. (One
    test over the rows, not one per row: the table may have none, and an empty parametrization is a skip.)"""
    for rel in (r for r in RELATIONS if r.verdict == "untested"):
        values, machine = _case(rel)
        assert _outcome(values, machine) is None, rel
        assert "no CI test" in rel.reason, rel


def test_refusals_name_an_existing_test_and_features_are_known():
    for rel in RELATIONS:
        assert set(rel.features) | set(rel.without) <= set(FEATURES), rel
        path, name = rel.tested_by.split("::")
        tree = ast.parse((HERE.parent / path).read_text())
        assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, rel.tested_by


def test_readme_tables_are_generated():
    """The README's support matrix and config reference are the table's and the sections' (regenerate with
    tools/readme_tables.py)."""
    text = README.read_text()
    assert with_tables(text) == text, "run python3 packages/dsv4-train/tools/readme_tables.py"
