"""The core/adapter split (0.3) keeps state-dict keys and numerics: the values recorded at commit ``784234d``
(before the split, on another machine) for every layer kind, SBHD and THD, sparse and dense phase, both loss sets.

Recorded floats are never compared bitwise (another CPU's vector width or BLAS rounds fp32 differently). Each
recorded fp32 tensor is checked with the tolerance rule against the same case evaluated now in fp64, the yardstick
being what this machine's fp32 run of the same code gets wrong: ``|recorded - now64| <= 2 |now32 - now64| + atol``.
Two fp32 evaluations of the same arithmetic are each within their rounding error of the fp64 value, so a recorded
value that fails this is a change of the arithmetic, not of the CPU. The default-initialised state dicts (torch's
RNG, no arithmetic of ours) are checked against ``atol`` alone. State-dict keys are compared exactly.
"""

from __future__ import annotations

import os

import pytest
import torch
from _refactor_cases import CASES, run_case

from dsv4_testkit import assert_close_to_ref

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "refactor_fixture.pt")


@pytest.fixture(scope="module")
def recorded():
    return torch.load(FIXTURE, weights_only=True)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_values_recorded_before_the_split(pg, recorded, name):
    now32 = run_case(name, pg)
    now64 = run_case(name, pg, dtype=torch.float64)
    before = recorded[name]
    assert now32["keys"] == before["keys"]  # state-dict keys unchanged
    assert sorted(k for k in now32 if k != "keys") == sorted(k for k in before if k != "keys")
    for key, want in before.items():
        if key == "keys":
            continue
        got = now32[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        if key.startswith("init."):
            assert_close_to_ref(f"{name}: {key}", want, got)
        else:
            assert_close_to_ref(f"{name}: {key}", want, now64[key], ref_same_dtype=got)


def test_the_rule_catches_a_changed_value(pg, recorded):
    """A recorded value off by more than the rule allows (here: 1e-4 of its scale) fails."""
    name = "window-sbhd"
    now32 = run_case(name, pg)
    now64 = run_case(name, pg, dtype=torch.float64)
    want = recorded[name]["y"].clone()
    want.view(-1)[0] += 1e-4 * max(1.0, want.abs().max().item())
    with pytest.raises(AssertionError, match="exceeds"):
        assert_close_to_ref("y", want, now64["y"], ref_same_dtype=now32["y"])
