"""linear_cross_entropy's gradient-in-forward mode (token chunks, both gradients in the forward; the fused row
loss + gradient Triton kernel under the interpreter on CPU) vs the fp32 reference and the unfused path: odd shapes,
several token chunks, declared loss masks, ignore_index rows, all-masked chunks, the automatic mode choice, the
exact recompute fallback for an undeclared upstream gradient, NaN-poisoned kernel outputs."""

import pytest
import torch

from dsv4_primitives import linear_cross_entropy, linear_cross_entropy_ref, vocab_parallel_cross_entropy
from dsv4_primitives.linear_cross_entropy.chunks import token_chunk_rows
from dsv4_primitives.linear_cross_entropy.grad_in_forward import _upstream_scale
from dsv4_primitives.linear_cross_entropy.row_grad import row_loss_grad, row_loss_grad_ref
from dsv4_testkit import assert_close_to_ref, interpreting

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference"] + (["triton"] if interpreting() or DEV == "cuda" else [])


def _inputs(t, v, d, dtype, seed=0, ignore=()):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(t, d, generator=gen).to(device=DEV, dtype=dtype)
    w = (torch.randn(v, d, generator=gen) * 2 / d**0.5).to(device=DEV, dtype=dtype)
    y = torch.randint(0, v, (t,), generator=gen)
    for i in ignore:
        y[i] = -100
    return h, w, y.to(DEV)


def _grads(fn, h, w, y, g):
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    loss = fn(h, w, y)
    dh, dw = torch.autograd.grad(loss, (h, w), g.to(loss.dtype))
    return loss.detach(), dh, dw, loss.grad_fn


def _mode_of(loss_or_fn) -> str:
    """The autograd Function under the output's view: which mode ran."""
    fn = getattr(loss_or_fn, "grad_fn", loss_or_fn)
    while type(fn).__name__ == "ViewBackward0":
        fn = fn.next_functions[0][0]
    return (
        "grad_in_forward" if type(fn).__name__.startswith("LinearCrossEntropyGradInForward") else "recompute"
    )


def _unfused(h, w, y):
    ignored = y == -100
    loss = vocab_parallel_cross_entropy(h @ w.t(), torch.where(ignored, 0, y), backend="reference")
    return torch.where(ignored, 0.0, loss)


def _check(ours, h, w, y, g):
    ref = _grads(linear_cross_entropy_ref, h.double(), w.double(), y, g.double())
    same = _grads(_unfused, h, w, y, g)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == h.dtype and ours[2].dtype == w.dtype
    for name, o, r, s in zip(("loss", "dh", "dw"), ours[:3], ref[:3], same[:3], strict=True):
        assert_close_to_ref(name, o, r, s if h.dtype != torch.float32 else None)


@pytest.mark.parametrize("impl", ["torch"] + (["triton"] if "triton" in BACKENDS else []))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernel_matches_reference(impl, dtype):
    """Fused row loss + in-place gradient: odd V (not a multiple of the block), a row without a target (-1), a
    target outside the vocabulary, a zero-weight row; outputs come from NaN-poisoned allocations."""
    gen = torch.Generator().manual_seed(1)
    z0 = (torch.randn(5, 37, generator=gen) * 4).to(device=DEV, dtype=dtype)
    t = torch.tensor([3, -1, 36, 40, 0], device=DEV)
    wt = torch.tensor([1.0, 0.5, 0.0, 2.0, 0.25], device=DEV)
    want_z = z0.double().clone()
    want_loss, want_lse = row_loss_grad_ref(want_z, t, wt.double())
    z = z0.clone()
    loss, lse = row_loss_grad(z, t, wt, impl)
    assert loss.dtype == lse.dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss.double(), want_loss, **tol)
    torch.testing.assert_close(lse.double(), want_lse, **tol)
    # dz: within one rounding to the input dtype of the fp64 value
    assert_close_to_ref("dz", z, want_z, want_z.to(dtype), atol=1e-6)
    assert torch.equal(z[2], torch.zeros_like(z[2]))  # zero weight: zero gradient row
    zl = z0[3].double()  # target 40 outside [0, 37): megatron's loss lse - max, no one-hot
    torch.testing.assert_close(loss[3].double(), torch.logsumexp(zl, 0) - zl.max(), **tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, v, d, token_chunk", [(13, 50, 16, 4), (7, 33, 8, None), (1, 29, 8, 1)])
def test_declared_mask_matches_reference(backend, dtype, t, v, d, token_chunk):
    """The trainer's use: a masked mean with the mask declared as grad_weight (upstream gradient = c * mask)."""
    h, w, y = _inputs(t, v, d, dtype, ignore=(1,) if t > 2 else ())
    mask = (torch.arange(t, device=DEV) % 3 != 2).float()
    g = mask / mask.sum().clamp_min(1)

    def fn(a, b, c):
        return linear_cross_entropy(a, b, c, grad_weight=mask, token_chunk=token_chunk, backend=backend)

    ours = _grads(fn, h, w, y, g)
    assert _mode_of(ours[3]) == "grad_in_forward"
    _check(ours, h, w, y, g)
    assert torch.equal(ours[1][mask == 0], torch.zeros_like(ours[1][mask == 0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_mean_and_all_masked_chunk(backend):
    """``loss.mean()`` (default grad_weight) and a declared mask that zeroes a whole token chunk."""
    h, w, y = _inputs(12, 41, 8, torch.bfloat16, seed=2, ignore=(5,))
    ours = _grads(
        lambda a, b, c: linear_cross_entropy(a, b, c, token_chunk=4, backend=backend),
        h,
        w,
        y,
        torch.full((12,), 1 / 12, device=DEV),
    )
    _check(ours, h, w, y, torch.full((12,), 1 / 12, device=DEV))
    mask = torch.ones(12, device=DEV)
    mask[4:8] = 0  # the second chunk of 4 rows has no counted token
    ours = _grads(
        lambda a, b, c: linear_cross_entropy(a, b, c, grad_weight=mask, token_chunk=4, backend=backend),
        h,
        w,
        y,
        3.0 * mask,
    )
    _check(ours, h, w, y, 3.0 * mask)
    assert torch.equal(ours[1][4:8], torch.zeros_like(ours[1][4:8]))


def test_undeclared_gradient_falls_back_to_the_exact_recompute():
    """An upstream gradient not proportional to grad_weight: the eager backward recomputes (same bits as the
    recompute mode), never a silently wrong gradient."""
    h, w, y = _inputs(9, 30, 8, torch.bfloat16, seed=4)
    g = torch.rand(9, generator=torch.Generator().manual_seed(0)).to(DEV)
    auto = _grads(lambda a, b, c: linear_cross_entropy(a, b, c, token_chunk=4, vocab_chunk=7), h, w, y, g)
    rec = _grads(lambda a, b, c: linear_cross_entropy(a, b, c, mode="recompute", vocab_chunk=7), h, w, y, g)
    assert _mode_of(auto[3]) == "grad_in_forward"
    for a, b in zip(auto[:3], rec[:3], strict=True):
        assert torch.equal(a, b)


def test_upstream_scale():
    w = torch.tensor([1.0, 0.0, 1.0, 1.0])
    c, ok = _upstream_scale(0.25 * w, w, None, 1)
    assert bool(ok) and c.item() == pytest.approx(0.25)
    c, ok = _upstream_scale(torch.tensor([0.25, 0.1, 0.25, 0.25]), w, None, 1)
    assert not bool(ok)
    c, ok = _upstream_scale(torch.zeros(4), torch.zeros(4), None, 1)  # everything masked: zero gradients
    assert bool(ok) and c.item() == 0.0


def test_mode_choice_and_forward_only():
    h, w, y = _inputs(6, 20, 8, torch.float32)
    assert _mode_of(linear_cross_entropy(h.requires_grad_(True), w, y)) == "grad_in_forward"
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, y)
    torch.testing.assert_close(loss, linear_cross_entropy_ref(h, w, y), rtol=1e-5, atol=1e-5)
    assert _mode_of(linear_cross_entropy(h, w, y, mode="recompute")) == "recompute"


def test_zero_tokens_and_weight_only_gradient():
    h, w, y = _inputs(5, 20, 8, torch.float32)
    w0 = w.clone().requires_grad_(True)
    linear_cross_entropy(h[:0], w0, y[:0], mode="grad_in_forward").sum().backward()
    assert torch.equal(w0.grad, torch.zeros_like(w0))
    wr = w.clone().requires_grad_(True)
    linear_cross_entropy(h, wr, y, token_chunk=2).mean().backward()
    _, _, dw, _ = _grads(linear_cross_entropy_ref, h, w, y, torch.full((5,), 0.2))
    torch.testing.assert_close(wr.grad, dw, rtol=1e-5, atol=1e-6)


def test_default_token_chunk():
    assert token_chunk_rows(4096, 129280, None) == 4096
    assert token_chunk_rows(65536, 129280, None) == 4096
    assert token_chunk_rows(5000, 129280, None) == 2560  # two balanced chunks, multiples of 64
    assert token_chunk_rows(65536, 129280 // 2, None) == 8192  # TP=2: the shard holds half the vocabulary
    assert token_chunk_rows(10, 50, None) == 10
    assert token_chunk_rows(10, 50, 3) == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mode="fast"), "mode"),
        (dict(token_chunk=0), "token_chunk"),
        (dict(grad_weight=torch.ones(2)), "grad_weight"),
        (dict(grad_weight=torch.ones(3, dtype=torch.long)), "grad_weight"),
    ],
)
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.long), **kwargs)
