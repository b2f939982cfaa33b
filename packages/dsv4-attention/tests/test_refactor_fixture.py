"""The core/adapter split (0.3) keeps state-dict keys and numerics: bitwise equal to the values recorded at commit
``784234d`` (before the split) for every layer kind, SBHD and THD, sparse and dense phase, both loss sets.

Also: the plain-PyTorch core layer (no megatron modules), loaded with the adapter's state dict, gives the same
outputs and gradients bitwise.
"""

from __future__ import annotations

import os

import pytest
import torch
from _refactor_cases import CASES, run_case

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "refactor_fixture.pt")


@pytest.fixture(scope="module")
def recorded():
    return torch.load(FIXTURE, weights_only=True)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_values_recorded_before_the_split(pg, recorded, name):
    now = run_case(name, pg)
    before = recorded[name]
    assert now["keys"] == before["keys"]  # state-dict keys unchanged
    assert sorted(k for k in now if k != "keys") == sorted(k for k in before if k != "keys")
    for key, want in before.items():
        if key == "keys":
            continue
        got = now[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got, want), f"{name}: {key} differs (max |diff| {(got - want).abs().max()})"
