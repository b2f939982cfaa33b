"""Run-to-run bitwise reproducibility of the MoE layer's kernels on the GPU (issue 20): permute (rows and routing
weights), the grouped SwiGLU experts (grouped GEMMs and their weight gradients), unpermute, and the sequence
balance loss.

The permutation kernels write every row (and every gradient row) from one program, in fp32, without atomics. The
balance loss accumulates with ``index_add`` (atomics on CUDA by default), whose deterministic implementation
PyTorch selects under ``torch.use_deterministic_algorithms(True)`` (``dsv4 train --deterministic``); its gradient
is a gather either way. The CPU interpreter runs programs one after another and cannot show a race: the CPU tests
compare values with the references instead.
"""

from __future__ import annotations

import pytest
import torch

from hash_moe import grouped_swiglu_experts, permute, sequence_balance_loss, unpermute

pytestmark = pytest.mark.gpu

T, H, F, E, K = 4096, 1024, 512, 16, 6  # flash-smoke-like token count, 16 routed experts, top-6


@pytest.fixture
def deterministic_algorithms():
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _layer(x, scores, gate_up, down, experts):
    routing_map = torch.zeros(T, E, dtype=torch.bool, device="cuda").scatter_(1, experts, True)
    probs = torch.zeros(T, E, device="cuda").scatter(1, experts, scores.gather(1, experts))
    x_perm, probs_perm, pmap = permute(x, routing_map, probs, num_out=T * K, max_routes_per_token=K)
    counts = routing_map.sum(0)  # [E] on the device
    y_perm = grouped_swiglu_experts(x_perm, counts, gate_up, down, limit=7.0, probs=probs_perm)
    y = unpermute(y_perm, pmap)
    bal = sequence_balance_loss(scores, experts, coeff=1e-4)
    return y, bal


def _run(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    scores = torch.rand(T, E, generator=g).cuda().requires_grad_()
    gate_up = (0.02 * torch.randn(E, 2 * F, H, generator=g)).to("cuda", torch.bfloat16).requires_grad_()
    down = (0.02 * torch.randn(E, H, F, generator=g)).to("cuda", torch.bfloat16).requires_grad_()
    experts = torch.rand(T, E, generator=g).argsort(1)[:, :K].cuda()
    y, bal = _layer(x, scores, gate_up, down, experts)
    dy = torch.randn(T, H, generator=g).to("cuda", torch.bfloat16)
    ((y.float() * dy.float()).sum() + bal).backward()
    return [y, bal, x.grad, scores.grad, gate_up.grad, down.grad]


def test_moe_layer_kernels_bitwise(deterministic_algorithms):
    a, b = _run(), _run()
    names = ["y", "balance loss", "dx", "dscores", "dgate_up", "ddown"]
    for name, u, v in zip(names, a, b, strict=True):
        assert torch.equal(u, v), f"{name} differs between two identical runs"
