"""NaN poisoning is on for every test of the workspace (the plugin's autouse fixture) and catches a kernel that
forgets to write part of its output."""

import pytest
import torch
import triton
import triton.language as tl

from dsv4_testkit import assert_close_to_ref, interpreting, poison_allocations
from dsv4_testkit.poison import sentinel


def test_fresh_allocations_are_poisoned():
    assert torch.isnan(torch.empty(5)).all()
    assert torch.isnan(torch.empty_like(torch.zeros(2, 3, dtype=torch.bfloat16))).all()
    assert torch.isnan(torch.empty_strided((2, 2), (1, 2))).all()
    assert torch.isnan(torch.zeros(1).new_empty(4)).all()
    assert (torch.empty(3, dtype=torch.int32) == torch.iinfo(torch.int32).min).all()
    assert (torch.empty(3, dtype=torch.uint8) == 255).all()
    assert torch.empty(2, dtype=torch.bool).shape == (2,)  # nothing to poison bools with
    leaf = torch.empty(3, requires_grad=True)  # parameters allocated with requires_grad stay leaves
    assert leaf.is_leaf and leaf.requires_grad and torch.isnan(leaf).all()
    assert sentinel(torch.int64) == torch.iinfo(torch.int64).min and sentinel(torch.bool) is None


@pytest.mark.no_nan_poison
def test_marker_opts_out():
    assert not hasattr(torch.empty, "__wrapped_allocator__")
    with poison_allocations():
        assert torch.isnan(torch.empty(2)).all()
    assert not hasattr(torch.empty, "__wrapped_allocator__")  # restored on exit


@triton.jit
def _copy_first_half(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    half = (n + 1) // 2  # the "bug": the kernel never writes the second half
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < half)


def _buggy_copy(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)  # the usual kernel-wrapper allocation
    _copy_first_half[(1,)](x, out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    return out


@pytest.mark.skipif(
    not torch.cuda.is_available() and not interpreting(),
    reason="needs CUDA or the Triton interpreter",
)
def test_an_unwritten_kernel_output_fails_its_reference_comparison():
    """A deliberately buggy kernel (skips half its output): with poisoning its output holds NaN and the tolerance
    rule fails (NaN counts as infinite error); without, the unwritten slots could hold anything (zeros here)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.arange(1.0, 8.0, device=dev)
    out = _buggy_copy(x)
    assert torch.isnan(out[4:]).all() and torch.equal(out[:4], x[:4])
    with pytest.raises(AssertionError, match="exceeds"):
        assert_close_to_ref("out", out, x)
