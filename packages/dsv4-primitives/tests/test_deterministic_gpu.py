"""Run-to-run bitwise reproducibility of the primitives' kernels on the GPU (issue 20): RMSNorm (its weight
gradient is reduced through per-program partials summed in a fixed order, no atomics), the fused vocab-parallel
cross entropy and the fused linear cross entropy (vocab chunks accumulated in a fixed order, weight gradient by
plain GEMMs). The CPU interpreter runs programs one after another and cannot show a race: the CPU tests compare
values with the references instead.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_primitives import linear_cross_entropy, rms_norm, vocab_parallel_cross_entropy

pytestmark = pytest.mark.gpu


def _grads(fn, inputs, seed=7):
    ins = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*ins)
    g = torch.Generator().manual_seed(seed)
    (out.float() * torch.randn(out.shape, generator=g).cuda()).sum().backward()
    return [out] + [t.grad for t in ins if t.is_floating_point()]


def _twice_equal(fn, inputs):
    a, b = _grads(fn, inputs), _grads(fn, inputs)
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(u, v), f"output / gradient {i} differs between two identical runs"


@pytest.mark.parametrize("d", [512, 4096, 7168])
def test_rms_norm_bitwise(d):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4097, d, generator=g).to("cuda", torch.bfloat16)
    w = (1 + 0.1 * torch.randn(d, generator=g)).cuda()
    _twice_equal(lambda x, w: rms_norm(x, w, backend="triton"), [x, w])


def test_cross_entropy_bitwise():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2048, 2, 32768, generator=g).to("cuda", torch.bfloat16)  # [s, b, V]
    target = torch.randint(0, 32768, (2048, 2), generator=g).cuda()
    _twice_equal(lambda z, t: vocab_parallel_cross_entropy(z, t, backend="triton"), [logits, target])


def test_linear_cross_entropy_bitwise():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(4096, 1024, generator=g).to("cuda", torch.bfloat16)
    weight = (0.02 * torch.randn(32768, 1024, generator=g)).to("cuda", torch.bfloat16)
    target = torch.randint(0, 32768, (4096,), generator=g).cuda()
    target[::97] = -100  # ignored rows
    _twice_equal(
        lambda h, w, t: linear_cross_entropy(h, w, t, vocab_chunk=8192, backend="triton"),
        [hidden, weight, target],
    )
