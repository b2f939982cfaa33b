"""Shared settings of the reference-op tests: deterministic seeds, float64 default for gradchecks."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
