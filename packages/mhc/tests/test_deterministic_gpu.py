"""Run-to-run bitwise reproducibility of every mHC kernel's forward and backward on the GPU (issue 20).

No mHC kernel uses atomics: the split-K coefficient partials and the ``dfn`` / ``dpost`` partials are written per
program and summed in a fixed order, and the mixing backwards own whole token rows. These tests pin that down at a
flash-smoke-sized shape, where a race would show (the CPU interpreter runs programs one after another, so it cannot:
the CPU tests compare values with the reference instead).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _kernel_cases import _run, _triplet

from mhc import hyper_head, mhc_coefficients, mhc_collapse, mhc_post, mhc_pre

pytestmark = pytest.mark.gpu

T, N, D = 4097, 4, 4096  # odd T, flash-smoke width


def _twice_equal(fn, inputs):
    out_a, grads_a = _run(fn, inputs)
    out_b, grads_b = _run(fn, inputs)
    for i, (a, b) in enumerate(zip((*out_a, *grads_a), (*out_b, *grads_b), strict=True)):
        assert torch.equal(a, b), f"output / gradient {i} differs between two identical runs"


@pytest.mark.parametrize("op", [mhc_coefficients, mhc_pre, hyper_head])
def test_coefficient_kernels_bitwise(op):
    kern, _, _ = _triplet(T, N, D, torch.bfloat16, "cuda", head=op is hyper_head)
    _twice_equal(lambda *a: op(*a, backend="triton"), kern)


def test_mixing_kernels_bitwise():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, N, D, generator=g).to("cuda", torch.bfloat16)
    f = torch.randn(T, D, generator=g).to("cuda", torch.bfloat16)
    post = (2 * torch.rand(T, N, generator=g)).cuda()
    comb = torch.rand(T, N, N, generator=g).cuda()
    _twice_equal(lambda *a: mhc_post(*a, backend="triton"), [f, x, post, comb])
    _twice_equal(lambda *a: mhc_collapse(*a, backend="triton"), [x, post])
