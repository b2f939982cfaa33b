"""Shared helpers of the kernel tests (inputs, forward + backward runner, tolerance comparison)."""

from __future__ import annotations

import torch

from dsv4_testkit import assert_close_to_ref


def _params(n: int, d: int, seed: int, head: bool = False):
    g = torch.Generator().manual_seed(seed)
    m = n if head else (2 + n) * n
    fn = torch.randn(m, n * d, generator=g, dtype=torch.float64) * 0.3
    scale = torch.tensor([1.1] if head else [0.9, 1.3, 2.0], dtype=torch.float64)
    base = torch.randn(m, generator=g, dtype=torch.float64) * 0.5
    return fn, scale, base


def _run(fn, inputs, dy_seed=7):
    """Forward + backward with fixed random output grads; returns (outputs, grads of every input)."""
    ins = [t.detach().clone().requires_grad_(True) for t in inputs]
    outs = fn(*ins)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(dy_seed)
    loss = sum(
        (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)).sum() for o in outs
    )
    loss.backward()
    return outs, [t.grad for t in ins]


def _compare(names, got, truth, yard):
    for name, a, b, c in zip(names, got, truth, yard):
        assert_close_to_ref(name, a, b, c)


def _inputs(t, n, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, d, generator=g, dtype=torch.float64)
    return x.to(device)


def _triplet(t, n, d, dtype, device, head=False, seed=0):
    """(kernel inputs, truth inputs, yardstick inputs) for (x, fn, scale, base)."""
    x = _inputs(t, n, d, dtype, device, seed)
    fn, scale, base = (p.to(device) for p in _params(n, d, seed + 1, head))
    if dtype == torch.float32:
        kern = [x.float(), fn.float(), scale.float(), base.float()]
        return kern, [x, fn, scale, base], kern
    xb = x.to(dtype)
    kern = [xb, fn.float(), scale.float(), base.float()]
    truth = [xb.float(), fn.float(), scale.float(), base.float()]
    yard = [xb, fn.to(dtype), scale.to(dtype), base.to(dtype)]
    return kern, truth, yard
