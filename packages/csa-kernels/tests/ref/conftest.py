"""Shared settings of the reference-op tests: deterministic seeds, float64 default for gradchecks."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class _LargestAllocation(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest storage (in elements) of any tensor an op returns, views counted by their base."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.ops += 1
                self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


@pytest.fixture
def largest_allocation():
    """Context-manager factory: ``with largest_allocation() as rec: ...; rec.largest``."""
    return _LargestAllocation
