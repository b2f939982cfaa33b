"""Oracles H1-H5 of dsv4-architecture.md §10, on the reference and on the Triton kernels."""

from __future__ import annotations

import pytest
import torch

from mhc import (
    ManifoldHyperConnection,
    MHCConfig,
    mhc_coefficients,
    mhc_post,
    mhc_post_ref,
    sinkhorn_ref,
)

BACKENDS = ["reference", "triton"]


def _coeff(x, fn, scale, base, backend, iters=20):
    return mhc_coefficients(x, fn, scale, base, sinkhorn_iters=iters, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_h1_sinkhorn_marginals(backend):
    # comb logits ~ N(0, 1): entries > 0, columns sum to 1 +- 2e-6, rows within 2e-3
    torch.manual_seed(0)
    t, n, d = 64, 4, 8
    x = torch.randn(t, n, d)
    fn = torch.zeros((2 + n) * n, n * d)
    scale = torch.tensor([1.0, 1.0, 0.0])
    base = torch.zeros((2 + n) * n)
    base[2 * n :] = torch.randn(n * n)
    if backend == "triton":
        # per-token logits: route ~N(0,1) comb logits through the dynamic path
        fn[2 * n :] = torch.randn(n * n, n * d) / (n * d) ** 0.5
        scale[2] = 1.0
    _, _, comb = _coeff(x, fn, scale, base, backend)
    assert (comb > 0).all()
    assert (comb.sum(-2) - 1).abs().max() <= 2e-6
    assert (comb.sum(-1) - 1).abs().max() <= 2e-3


def test_h1_saturated_rows_are_off_but_columns_exact():
    # saturated logits: 20 iterations leave rows visibly off (expected behaviour), columns stay normalised
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(256, 4, 4, generator=g, dtype=torch.float64) * 30
    comb = sinkhorn_ref(logits, 20, 1e-6)
    assert (comb.sum(-2) - 1).abs().max() <= 2e-6
    assert (comb.sum(-1) - 1).abs().max() > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_h2_gate_ranges(backend):
    torch.manual_seed(2)
    t, n, d = 32, 4, 8
    x = torch.randn(t, n, d) * 5
    fn = torch.randn((2 + n) * n, n * d) * 3  # large logits push the sigmoids to their limits
    pre, post, _ = _coeff(x, fn, torch.tensor([10.0, 10.0, 1.0]), torch.zeros((2 + n) * n), backend, iters=3)
    eps = 1e-6
    assert (pre >= eps).all() and (pre <= 1 + eps).all()
    assert (post >= 0).all() and (post <= 2).all()
    assert ((pre - eps) < 1e-3).any() and (post > 1.99).any()  # the limits are actually reached


@pytest.mark.parametrize("backend", BACKENDS)
def test_h3_equal_streams_stay_equal(backend):
    torch.manual_seed(3)
    t, n, d = 16, 4, 32
    x1 = torch.randn(t, 1, d)
    x = x1.expand(t, n, d).contiguous()
    fn = torch.randn((2 + n) * n, n * d) * 0.5
    _, _, comb = _coeff(x, fn, torch.tensor([1.0, 1.0, 3.0]), torch.randn((2 + n) * n), backend)
    f = torch.zeros(t, d)
    out = mhc_post(f, x, torch.zeros(t, n), comb, backend=backend)  # = combᵀ X
    torch.testing.assert_close(out, x1.expand(t, n, d), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_h4_single_stream_is_prenorm_residual(backend):
    # n = 1, fn = 0, base = 0: the block is x + F(RMSNorm(x)) up to eps effects
    torch.manual_seed(4)
    t, d = 12, 32
    cfg = MHCConfig(hidden_size=d, num_streams=1, backend=backend)
    hc = ManifoldHyperConnection(cfg)
    with torch.no_grad():
        hc.fn.zero_()
    w = torch.randn(d, d) / d**0.5

    def sublayer(h):
        return torch.rms_norm(h, (d,), eps=1e-6) @ w

    x = torch.randn(t, 1, d)
    x_in, post, comb = hc(x)
    out = hc.post(sublayer(x_in), x, post, comb)
    expect = x[:, 0] + sublayer(x[:, 0])
    torch.testing.assert_close(out[:, 0], expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_h5_row_order_pre_post_comb(backend):
    # base alone decides the gates (fn = 0): pre rows -> ~eps, post rows -> ~2, comb has one hot off-diagonal M[0, 1]
    n, d, t = 4, 8, 3
    base = torch.zeros((2 + n) * n)
    base[:n] = -30.0
    base[n : 2 * n] = 30.0
    base[2 * n + 0 * n + 1] = 8.0  # M[0, 1] in row-major [i·n + j]
    x = torch.randn(t, n, d)
    pre, post, comb = _coeff(x, torch.zeros((2 + n) * n, n * d), torch.ones(3), base, backend)
    assert pre.max() < 1e-5
    assert post.min() > 1.999
    assert (comb[:, 0, 1] > 0.9).all() and (comb[:, 1, 0] < 0.5).all()  # transposed: M[1, 0] hot


@pytest.mark.parametrize("backend", BACKENDS)
def test_h5_residual_mix_uses_comb_transpose(backend):
    # hand-made, non-symmetric comb: stream j of the output is Σ_i comb[i, j] X_i (not Σ_i comb[j, i] X_i)
    n, d = 3, 4
    comb = torch.tensor([[0.7, 0.0, 0.1], [0.2, 1.0, 0.0], [0.1, 0.0, 0.9]])  # columns sum to 1, rows do not
    x = torch.stack([torch.full((d,), 1.0), torch.full((d,), 10.0), torch.full((d,), 100.0)])[
        None
    ]  # [1, 3, d]
    f = torch.zeros(1, d)
    out = mhc_post(f, x, torch.zeros(1, n), comb[None], backend=backend)[0, :, 0]
    torch.testing.assert_close(out, torch.tensor([0.7 + 2.0 + 10.0, 10.0, 0.1 + 90.0]))
    wrong = comb @ x[0, :, 0]  # comb X (the upstream transpose bug)
    assert not torch.allclose(out, wrong)
    torch.testing.assert_close(out, mhc_post_ref(f, x, torch.zeros(1, n), comb[None])[0, :, 0])


def test_sinkhorn_order_is_row_softmax_first():
    # the code's order (row softmax, then columns) differs from a column-first textbook order on saturated logits
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(8, 4, 4, generator=g, dtype=torch.float64) * 20
    ours = sinkhorn_ref(logits, 20, 1e-6)
    col_first = sinkhorn_ref(logits.transpose(-1, -2), 20, 1e-6).transpose(-1, -2)
    assert (ours - col_first).abs().max() > 1e-3
    assert (ours.sum(-2) - 1).abs().max() <= 2e-6  # last step is a column normalisation
