"""The guard against Triton 3.6's interpreter leaking patches of ``triton.language`` (issue #16's order-dependent
sm_90 compile failures): the leak exists, ``restore_triton_language`` repairs it, and the plugin's autouse fixture
gives every test pristine namespaces."""

import pytest
import torch
import triton
import triton.language as tl

from dsv4_testkit import interpreting
from dsv4_testkit.triton_env import restore_triton_language

pytestmark = pytest.mark.skipif(not interpreting(), reason="the leak is a bug of the Triton interpreter")


@triton.jit
def _row_sum(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr, tl.sum(tl.load(x_ptr + offs), axis=0))  # tl.sum: a device-function call


def _run_reduction_kernel():
    x, out = torch.arange(4.0), torch.zeros(1)
    _row_sum[(1,)](x, out, BLOCK=4)
    assert out.item() == 6.0


def test_leak_exists_and_is_repaired():
    """If the first assertion fails, Triton fixed the leak and the guard can go."""
    cast = tl.core.cast
    _run_reduction_kernel()
    assert tl.core.cast is not cast  # left patched by the interpreter
    leaked = restore_triton_language()
    assert "triton.language.core.cast" in leaked and tl.core.cast is cast
    assert restore_triton_language() == []


def test_a_leaking_test_leaves_the_next_one_pristine_1():
    _run_reduction_kernel()  # leaks; the plugin's fixture repairs it after this test


def test_a_leaking_test_leaves_the_next_one_pristine_2():
    assert restore_triton_language() == []  # nothing left over from the previous test
