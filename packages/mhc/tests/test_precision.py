"""Dot-precision modes (``MHC_DOT_PRECISION``) of the coefficient kernels.

bf16 streams on CPU (interpreter): the ``bf16split`` mode splits the fp32 operand into three bf16 terms; its
outputs and the fp32 gradients (dfn, dscale, dbase) must be fp32-grade against the float64 reference on the same
bf16 stream values (a dropped or wrong split term shows up as a >= 1e-5 error), dX (stored in bf16) bf16-grade.
"""

from __future__ import annotations

import pytest
import torch

from mhc import mhc_pre, mhc_pre_ref
from mhc.ops.precision import DEFAULT, MODES, dot_mode, dot_plan


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("mode", MODES)
def test_modes_bf16_streams_fp32_grade(mode, monkeypatch):
    monkeypatch.setenv("MHC_DOT_PRECISION", mode)
    t, n, d, iters = 21, 4, 40, 4
    g = torch.Generator().manual_seed(11)
    x = torch.randn(t, n, d, generator=g).to(torch.bfloat16)
    m = (2 + n) * n
    fn = torch.randn(m, n * d, generator=g) * 0.3
    fn = fn + torch.randn(m, n * d, generator=g) * 1e-4  # many significant bits: needs all three split terms
    scale = torch.tensor([0.9, 1.3, 2.0])
    base = torch.randn(m, generator=g) * 0.5
    kern = [x, fn, scale, base]
    truth = [x.double(), fn.double(), scale.double(), base.double()]

    def run(fun, ins):
        ins = [v.detach().clone().requires_grad_(True) for v in ins]
        outs = fun(*ins)
        gg = torch.Generator().manual_seed(5)
        # output grads exact in bf16, so the bf16 x_in's grad is the same in both graphs
        dys = [torch.randn(o.shape, generator=gg).to(torch.bfloat16).double() for o in outs]
        loss = sum((o.double() * dy).sum() for o, dy in zip(outs, dys))
        loss.backward()
        return outs, [v.grad for v in ins]

    out, grads = run(lambda *a: mhc_pre(*a, sinkhorn_iters=iters, backend="triton"), kern)
    ref, ref_g = run(lambda *a: mhc_pre_ref(*a, sinkhorn_iters=iters), truth)
    assert out[0].dtype == torch.bfloat16
    assert _rel(out[0], ref[0]) < 8e-3  # x_in stored in bf16
    for name, a, b in zip(("post", "comb"), out[1:], ref[1:]):
        assert _rel(a, b) < 2e-5, name
    assert _rel(grads[0], ref_g[0]) < 1.6e-2  # dX stored in bf16
    for name, a, b in zip(("dfn", "dscale", "dbase"), grads[1:], ref_g[1:]):
        assert _rel(a, b) < 2e-5, name


def test_plan_and_bad_mode(monkeypatch):
    monkeypatch.delenv("MHC_DOT_PRECISION", raising=False)
    assert dot_mode() == DEFAULT
    monkeypatch.setenv("MHC_DOT_PRECISION", "bf16split")
    assert dot_plan(torch.bfloat16, interpreting=False) == dot_plan(torch.bfloat16, True).__class__(
        1, 2, "tf32x3"
    )
    assert dot_plan(torch.float32, interpreting=False).fwd_split == 0  # fp32 streams are not exact in bf16
    assert dot_plan(torch.bfloat16, interpreting=True).prec == "ieee"
    monkeypatch.setenv("MHC_DOT_PRECISION", "TF32")
    assert dot_plan(torch.bfloat16, interpreting=False).prec == "tf32"
    monkeypatch.setenv("MHC_DOT_PRECISION", "fp64")
    with pytest.raises(ValueError, match="MHC_DOT_PRECISION"):
        dot_mode()
