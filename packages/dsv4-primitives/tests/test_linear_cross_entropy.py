"""linear_cross_entropy (vocab-chunked output head + cross entropy; Triton CE kernels under the interpreter on CPU,
bf16 on GPU; eager backend) vs the fp32 reference and vs the unfused path (``hidden @ W.T`` then the cross entropy):
loss, hidden gradient and weight gradient, odd shapes, ignore index, loss masks, TP=2 on gloo, validation."""

import pytest
import torch

from dsv4_primitives import linear_cross_entropy, linear_cross_entropy_ref, vocab_parallel_cross_entropy
from dsv4_testkit import assert_close_to_ref, interpreting, run_distributed

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference"] + (["triton"] if interpreting() or DEV == "cuda" else [])


def _inputs(t, v, d, dtype, device=DEV, seed=0, ignore=()):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    h = (torch.randn(t, d, generator=gen)).to(device=device, dtype=dtype)
    w = (torch.randn(v, d, generator=gen) * 2 / d**0.5).to(device=device, dtype=dtype)
    y = torch.randint(0, v, (t,), generator=gen)
    for i in ignore:
        y[i] = -100
    g = torch.rand(t, generator=gen)
    return h, w, y.to(device), g.to(device)


def _grads(fn, h, w, y, g):
    """``fn(h, w, y)`` and the gradients of ``sum(loss * g)`` w.r.t. ``h`` and ``w``."""
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    loss = fn(h, w, y)
    dh, dw = torch.autograd.grad(loss, (h, w), g.to(loss.dtype))
    return loss.detach(), dh, dw


def _unfused(h, w, y):
    """The unfused path: logits in the input dtype (what the output layer makes), then the fused CE; ignored rows 0."""
    ignored = y == -100
    loss = vocab_parallel_cross_entropy(h @ w.t(), torch.where(ignored, 0, y), backend="reference")
    return torch.where(ignored, 0.0, loss)


def _check(h, w, y, g, backend, vocab_chunk):
    ours = _grads(
        lambda a, b, c: linear_cross_entropy(a, b, c, vocab_chunk=vocab_chunk, backend=backend), h, w, y, g
    )
    ref = _grads(linear_cross_entropy_ref, h.double(), w.double(), y, g.double())
    same = _grads(_unfused, h, w, y, g)  # the yardstick: plain PyTorch in the input dtype
    assert ours[0].dtype == torch.float32 and ours[0].shape == y.shape
    assert ours[1].dtype == h.dtype and ours[2].dtype == w.dtype
    for name, o, r, s in zip(("loss", "dh", "dw"), ours, ref, same, strict=True):
        assert_close_to_ref(name, o, r, s if h.dtype != torch.float32 else None)
    return ours


def test_reference_is_torch_cross_entropy():
    h, w, y, _ = _inputs(9, 37, 8, torch.float32, device="cpu", ignore=(2, 5))
    want = torch.nn.functional.cross_entropy(h @ w.t(), y, reduction="none", ignore_index=-100)
    torch.testing.assert_close(linear_cross_entropy_ref(h, w, y), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "t, v, d, chunk", [(13, 50, 16, 7), (1, 50, 16, 7), (6, 129, 24, 128), (5, 33, 8, None)]
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference_and_unfused(dtype, t, v, d, chunk, backend):
    h, w, y, g = _inputs(t, v, d, dtype, ignore=(0,) if t > 2 else ())
    _check(h, w, y, g, backend, chunk)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_tokens_ignored(backend):
    h, w, y, g = _inputs(4, 20, 8, torch.float32, ignore=range(4))
    loss, dh, dw = _grads(
        lambda a, b, c: linear_cross_entropy(a, b, c, vocab_chunk=6, backend=backend), h, w, y, g
    )
    assert torch.equal(loss, torch.zeros(4, device=DEV))
    assert torch.equal(dh, torch.zeros_like(dh)) and torch.equal(dw, torch.zeros_like(dw))


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_mask_with_zeros(backend):
    """A loss mask applied to the per-token loss (what the trainer does) reaches the gradients as zeros."""
    h, w, y, _ = _inputs(10, 45, 12, torch.bfloat16, seed=3)
    mask = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0], dtype=torch.float32, device=DEV)
    g = mask / mask.sum()
    ours = _grads(lambda a, b, c: linear_cross_entropy(a, b, c, vocab_chunk=8, backend=backend), h, w, y, g)
    assert torch.equal(ours[1][mask == 0], torch.zeros_like(ours[1][mask == 0]))
    ref = _grads(linear_cross_entropy_ref, h.double(), w.double(), y, g.double())
    same = _grads(_unfused, h, w, y, g)
    for name, o, r, s in zip(("loss", "dh", "dw"), ours, ref, same, strict=True):
        assert_close_to_ref(name, o, r, s)


def test_out_of_vocabulary_target_follows_megatron():
    h, w, y, g = _inputs(5, 20, 8, torch.float32)
    y[1], y[3] = 20, 57  # not ignore_index: megatron's value (no target logit), no one-hot
    _check(h, w, y, g, "reference", 6)


def test_leading_dims_and_zero_tokens():
    h, w, y, _ = _inputs(12, 30, 8, torch.float32)
    loss = linear_cross_entropy(h.view(3, 4, 8), w, y.view(3, 4), vocab_chunk=7)
    torch.testing.assert_close(loss, linear_cross_entropy_ref(h, w, y).view(3, 4), rtol=1e-5, atol=1e-5)
    h0 = torch.zeros(0, 8, device=DEV, requires_grad=True)
    w0 = w.clone().requires_grad_(True)
    loss0 = linear_cross_entropy(h0, w0, y[:0])
    loss0.sum().backward()
    assert loss0.shape == (0,) and torch.equal(w0.grad, torch.zeros_like(w0))


def test_weight_only_and_hidden_only_gradients():
    h, w, y, g = _inputs(7, 25, 8, torch.float32)
    wr = w.clone().requires_grad_(True)
    (linear_cross_entropy(h, wr, y, vocab_chunk=4) * g).sum().backward()
    hr = h.clone().requires_grad_(True)
    (linear_cross_entropy(hr, w, y, vocab_chunk=4) * g).sum().backward()
    _, dh, dw = _grads(linear_cross_entropy_ref, h, w, y, g)
    torch.testing.assert_close(wr.grad, dw, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hr.grad, dh, rtol=1e-5, atol=1e-6)


def test_default_chunk_is_bounded():
    from dsv4_primitives.linear_cross_entropy.chunks import vocab_chunk_rows as _chunk_rows

    assert _chunk_rows(4096, 129280, None) == 65536
    assert _chunk_rows(65536, 129280, None) == 4096
    assert _chunk_rows(10, 50, None) == 50
    assert _chunk_rows(1 << 24, 129280, None) == 128
    assert _chunk_rows(3, 50, 7) == 7


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(hidden=torch.zeros(3, 4, dtype=torch.float64)), "dtype"),
        (dict(weight=torch.zeros(5, 4, dtype=torch.bfloat16)), "weight must be a tensor"),
        (dict(weight=torch.zeros(5, 3)), r"weight \[V_local, d\]"),
        (dict(target=torch.zeros(3)), "integer"),
        (dict(target=torch.zeros(2, dtype=torch.long)), "target shape"),
        (dict(ignore_index=1.5), "ignore_index"),
        (dict(vocab_chunk=0), "vocab_chunk"),
        (dict(vocab_start=-1), "vocab_start"),
    ],
)
def test_validation(kwargs, match):
    args = dict(hidden=torch.zeros(3, 4), weight=torch.zeros(5, 4), target=torch.zeros(3, dtype=torch.long))
    args.update(kwargs)
    h, w, y = args.pop("hidden"), args.pop("weight"), args.pop("target")
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(h, w, y, **args)


def _tp_worker(rank, world, dtype_name):
    """This rank's vocabulary shard; loss and gradients vs the single-process op on the whole vocabulary, for the
    recompute mode, the gradient-in-forward mode with a declared loss mask (upstream gradient = c * mask), and the
    gradient-in-forward mode's recompute fallback (an undeclared per-token gradient)."""
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)
    h, w, y, g = _inputs(11, 2 * 23, 16, dtype, device="cpu", seed=5, ignore=(4,))
    mask = (torch.arange(11) % 4 != 1).float()
    shard = slice(rank * 23, (rank + 1) * 23)
    cases = {
        "recompute": (dict(mode="recompute", vocab_chunk=5), g),
        "grad_in_forward": (dict(grad_weight=mask, token_chunk=4), 0.3 * mask),
        "fallback": (dict(token_chunk=4, vocab_chunk=5), g),
    }
    out = {}
    for name, (kw, up) in cases.items():
        full = _grads(
            lambda a, b, c, kw=kw: linear_cross_entropy(a, b, c, backend="reference", **kw), h, w, y, up
        )
        ours = _grads(
            lambda a, b, c, kw=kw: linear_cross_entropy(
                a, b, c, tp_group=dist.group.WORLD, backend="reference", **kw
            ),
            h,
            w[shard],
            y,
            up,
        )
        out[name] = ([x.float() for x in full], [x.float() for x in ours])
    return out, shard


def _close_rel(name, a, b, rel):
    err = (a - b).abs().max().item()
    assert err <= rel * max(b.abs().max().item(), 1e-6), f"{name}: max|diff| {err:.3e} > {rel} max|ref|"


@pytest.mark.distributed
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_tensor_parallel_two_ranks_matches_single_process(dtype_name):
    res = run_distributed(_tp_worker, 2, dtype_name, timeout=180)
    for out, shard in res:
        for mode, (full, ours) in out.items():
            (l0, dh0, dw0), (l1, dh1, dw1) = full, ours
            if dtype_name == "float32":  # fp32: only the order of the fp32 sums differs
                tol = dict(rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(l1, l0, **tol)
                torch.testing.assert_close(dh1, dh0, **tol)
                torch.testing.assert_close(dw1, dw0[shard], **tol)
            elif mode != "grad_in_forward":
                # bf16: the logits are the same bf16 GEMM outputs and the statistics fp32 either way (loss to fp32
                # rounding); dW rows are the same bf16 GEMMs; dh sums the per-shard fp32 partials (then one bf16
                # rounding): one bf16 ulp of |dh| (2**-8 relative) apart at most
                torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(dw1, dw0[shard], rtol=0, atol=0)
                torch.testing.assert_close(dh1, dh0, rtol=2**-8, atol=1e-6)
            else:
                # gradient in forward, bf16: TP=1 rounds dh once per GEMM and once more by the scale, TP=2 sums the
                # fp32 partials first; dW is rounded per token chunk either way from the same dz up to the fp32
                # statistics' last bits: a couple of bf16 ulps of the largest entry
                torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
                _close_rel(f"{mode} dh", dh1, dh0, 2**-7)
                _close_rel(f"{mode} dw", dw1, dw0[shard], 2**-7)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "t, v, d, chunk", [(257, 1000, 64, 300), (1024, 129280 // 8, 256, None), (1, 777, 64, 128)]
)
def test_gpu_bf16_matches_reference_and_unfused(t, v, d, chunk):
    h, w, y, g = _inputs(t, v, d, torch.bfloat16, device="cuda", ignore=(0,))
    _check(h, w, y, g, "triton", chunk)
