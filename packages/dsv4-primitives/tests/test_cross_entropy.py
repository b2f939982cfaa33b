"""vocab_parallel_cross_entropy (Triton under the interpreter on CPU, bf16 on GPU; eager backend) vs the reference and
vs megatron-core's ``tensor_parallel.vocab_parallel_cross_entropy``: losses, logits gradients, edge cases, dispatch."""

import pytest
import torch

from dsv4_primitives import vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_ref
from dsv4_testkit import assert_close_to_ref, interpreting, max_abs_err

needs_triton = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1"
)
ENV_VAR = "DSV4_PRIMITIVES_BACKEND"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["triton", "reference"]


def _loss_and_grad(fn, x, g):
    """``fn(leaf)`` and the gradient of ``sum(loss * g)`` w.r.t. a non-leaf copy of ``x``."""
    leaf = x.detach().clone().requires_grad_(True)
    xin = leaf * 1  # non-leaf (what the output layer produces)
    loss = fn(xin)
    (gx,) = torch.autograd.grad(loss, xin, g)
    return loss.detach(), gx


def _truncate_to_bf16(t):
    """fp32 -> bf16 rounding toward zero, as the Triton interpreter casts."""
    bits = t.float().contiguous().view(torch.int32) & -65536
    return bits.view(torch.float32).bfloat16()


def _logits(shape, dtype, scale=3.0, device=DEV, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return (scale * torch.randn(shape, generator=gen)).to(device=device, dtype=dtype)


def _targets(shape, vocab, device=DEV, seed=1, out_of_range=True):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    t = torch.randint(0, vocab, shape, generator=gen)
    if out_of_range and t.numel() >= 3:
        flat = t.view(-1)
        flat[0], flat[-1], flat[t.numel() // 2] = (
            vocab,
            -5,
            vocab + 7,
        )  # outside the vocabulary: no target logit
    return t.to(device)


def _check(x, t, backend, label_smoothing=0.0, vocab_start=0, g=None, **kw):
    """Ours vs the fp64 reference (loss and grad); yardstick: the reference in fp32 math, grad in x.dtype."""
    g = torch.randn(t.shape, device=x.device) if g is None else g
    ours = _loss_and_grad(
        lambda a: vocab_parallel_cross_entropy(
            a, t, label_smoothing=label_smoothing, vocab_start=vocab_start, backend=backend, **kw
        ),
        x,
        g,
    )
    ref = _loss_and_grad(
        lambda a: vocab_parallel_cross_entropy_ref(
            a, t, label_smoothing=label_smoothing, vocab_start=vocab_start
        ),
        x.double(),
        g.double(),
    )
    same = _loss_and_grad(
        lambda a: vocab_parallel_cross_entropy_ref(
            a, t, label_smoothing=label_smoothing, vocab_start=vocab_start
        ),
        x.float(),
        g,
    )
    loss, gx = ours
    assert loss.dtype == torch.float32 and loss.shape == t.shape
    assert gx.dtype == x.dtype and gx.shape == x.shape
    assert_close_to_ref("loss", loss, ref[0], same[0])
    yard = same[1].to(x.dtype)
    if interpreting() and backend == "triton" and x.dtype == torch.bfloat16:
        yard = max(yard, _truncate_to_bf16(same[1]), key=lambda y: max_abs_err(y, ref[1]))
    assert_close_to_ref("grad", gx, ref[1], yard)
    return ours


# --------------------------------------------------------------------------------------------- reference


def test_reference_is_torch_cross_entropy():
    x, t = _logits((7, 33), torch.float32), _targets((7,), 33, out_of_range=False)
    want = torch.nn.functional.cross_entropy(x, t, reduction="none")
    torch.testing.assert_close(vocab_parallel_cross_entropy_ref(x, t), want)
    want_ls = torch.nn.functional.cross_entropy(x, t, reduction="none", label_smoothing=0.2)
    # torch spreads a over K tokens (a/K each, 1 - a + a/K on the target): megatron's e = a K/(K-1) spreads over
    # the K - 1 others, i.e. torch's smoothing with a' = e.
    e = 0.2 * 33 / 32
    torch.testing.assert_close(
        vocab_parallel_cross_entropy_ref(x, t, label_smoothing=0.2),
        torch.nn.functional.cross_entropy(x, t, reduction="none", label_smoothing=e),
    )
    assert not torch.allclose(want_ls, vocab_parallel_cross_entropy_ref(x, t, label_smoothing=0.2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize(
    "backend", ["ref", "reference"] + (["triton"] if interpreting() or DEV == "cuda" else [])
)
def test_matches_megatron_single_process(megatron_cpu, dtype, label_smoothing, backend):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as megatron_ce

    group = megatron_cpu.get_tensor_model_parallel_group()
    x, t = _logits((6, 2, 129), dtype), _targets((6, 2), 129)
    g = torch.randn(6, 2, device=DEV)
    # megatron works in place on fp32 logits (its .float() is a no-op there): give it its own non-leaf copy
    want = _loss_and_grad(lambda a: megatron_ce(a, t, label_smoothing, group), x, g)
    if backend == "ref":  # the fp32 reference function itself; the others dispatch
        got = _loss_and_grad(
            lambda a: vocab_parallel_cross_entropy_ref(a, t, label_smoothing=label_smoothing), x, g
        )
    else:
        got = _loss_and_grad(
            lambda a: vocab_parallel_cross_entropy(
                a, t, tp_group=group, label_smoothing=label_smoothing, backend=backend
            ),
            x,
            g,
        )
    torch.testing.assert_close(got[0], want[0].float(), rtol=1e-5, atol=1e-5)
    tol = (
        dict(rtol=0, atol=1e-6)
        if dtype == torch.float32
        else dict(rtol=0, atol=2 * 2**-8 * g.abs().max().item())
    )
    torch.testing.assert_close(got[1].float(), want[1].float(), **tol)
    assert got[1].dtype == want[1].dtype == dtype


# ------------------------------------------------------------------------------------------ fused path


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "v, label_smoothing", [(1000, 0.0), (1000, 0.2), (129, 0.0), (129, 0.2), (1, 0.0), (2, 0.2)]
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(dtype, v, label_smoothing, backend):
    x, t = _logits((5, 3, v), dtype), _targets((5, 3), v)
    _check(x, t, backend, label_smoothing)


@needs_triton
def test_chunked_vocab_and_row_blocks(monkeypatch):
    """Vocabularies wider than one chunk (online max/sum over chunks, ragged last chunk), many row blocks."""
    import dsv4_primitives.cross_entropy.apply as ce_apply

    # BLOCK_V = 256 (interpreter and CUDA): V = 1000 -> 4 chunks, the last one ragged
    monkeypatch.setattr(ce_apply, "_TILE_INTERPRET", 256)
    monkeypatch.setattr(ce_apply, "_MAX_BLOCK_V_CUDA", 256)
    x, t = _logits((9, 1000), torch.bfloat16, scale=6.0), _targets((9,), 1000)
    x[2, 900:] += 30.0  # the max of row 2 lives in the last (ragged) chunk: rescaling of the running sum
    x[3, :10] += 30.0  # ... and of row 3 in the first
    _check(x, t, "triton", 0.1)
    x, t = (
        _logits((700, 3), torch.float32),
        _targets((700,), 3),
    )  # 64 (CUDA: 1024) rows per block, masked tail
    _check(x, t, "triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_row_and_zero_rows(backend):
    if backend == "triton" and not (interpreting() or DEV == "cuda"):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    _check(_logits((1, 1, 300), torch.bfloat16), torch.tensor([[17]], device=DEV), backend)  # T = 1
    _check(_logits((300,), torch.float32), torch.tensor(299, device=DEV), backend)  # logits [V], target []
    x = _logits((0, 2, 50), torch.bfloat16).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, torch.zeros(0, 2, dtype=torch.long, device=DEV), backend=backend)
    assert loss.shape == (0, 2) and loss.dtype == torch.float32
    loss.sum().backward()
    assert x.grad.shape == x.shape


@needs_triton
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_logits(backend):
    base = _logits((4, 6, 80), torch.bfloat16)  # [B, S, V]
    t = _targets((6, 4), 77)
    _check(base.transpose(0, 1), t, backend)  # [S, B, V] with unmergeable S, B: two strides, no copy
    _check(base[:, :, 3:80], _targets((4, 6), 77), backend)  # row stride 80 > V = 77
    _check(
        base.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :77], _targets((4, 6), 77), backend
    )  # V stride
    x4 = _logits((3, 2, 4, 40), torch.float32).transpose(
        0, 2
    )  # 4-D, not viewable as rows: one contiguous copy
    _check(x4, _targets(x4.shape[:-1], 40), backend, 0.1)


@needs_triton
@pytest.mark.parametrize("backend", BACKENDS)
def test_shard_with_vocab_start(backend):
    """A shard of tokens [100, 164): targets outside take megatron's value (lse - max) and no one-hot gradient."""
    x = _logits((8, 64), torch.bfloat16)
    t = torch.tensor([100, 163, 99, 164, 0, 130, 500, -1], device=DEV)
    g_rows = torch.randn(8, device=DEV)
    loss, gx = _check(x, t, backend, 0.0, vocab_start=100, g=g_rows)
    lse = torch.logsumexp(x.float(), -1) - x.float().amax(-1)
    not_owned = [2, 3, 4, 6, 7]
    torch.testing.assert_close(loss[not_owned], lse[not_owned])  # loss = lse - max
    p = torch.softmax(x.float(), -1)
    torch.testing.assert_close(gx[not_owned].float(), (p * g_rows[:, None])[not_owned], rtol=0, atol=4e-3)
    _check(x, t, backend, 0.3, vocab_start=100)


@needs_triton
@pytest.mark.parametrize("backend", BACKENDS)
def test_target_dtypes_and_grad_layouts(backend):
    x = _logits((4, 5, 70), torch.bfloat16)
    for dt in (torch.int32, torch.int64, torch.int16):
        _check(x, _targets((4, 5), 70, out_of_range=False).to(dt), backend)
    g = torch.randn(5, 4, device=DEV).t()  # non-contiguous incoming gradient
    _check(x, _targets((4, 5), 70), backend, g=g)
    leaf = x.detach().clone().requires_grad_(True)
    vocab_parallel_cross_entropy(
        leaf * 1, _targets((4, 5), 70), backend=backend
    ).mean().backward()  # expanded g
    ref = x.detach().double().requires_grad_(True)
    vocab_parallel_cross_entropy_ref(ref, _targets((4, 5), 70)).mean().backward()
    assert max_abs_err(leaf.grad, ref.grad) < 2e-3


@needs_triton
@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_backward(backend):
    x, t = _logits((3, 4, 90), torch.bfloat16), _targets((3, 4), 90)
    g = torch.randn(3, 4, device=DEV)
    want = _loss_and_grad(lambda a: vocab_parallel_cross_entropy(a, t, backend=backend), x, g)
    leaf = x.detach().clone().requires_grad_(True)
    logits = leaf * 1
    loss = vocab_parallel_cross_entropy(logits, t, backend=backend, inplace_backward=True)
    (gx,) = torch.autograd.grad(loss, logits, g)
    assert gx.data_ptr() == logits.data_ptr()  # written into the logits buffer
    torch.testing.assert_close(loss, want[0], rtol=0, atol=0)
    torch.testing.assert_close(gx, want[1], rtol=0, atol=0)
    # another op that saved the logits now fails loudly instead of reading gradients
    leaf = x.detach().clone().requires_grad_(True)
    logits = leaf * 1
    other = (logits * logits).sum()  # MulBackward saves logits
    loss = vocab_parallel_cross_entropy(logits, t, backend=backend, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss.sum() + other).backward()
    # a leaf, or a view of a leaf, is refused
    with pytest.raises(ValueError, match="leaf"):
        vocab_parallel_cross_entropy(leaf, t, backend=backend, inplace_backward=True)
    with pytest.raises(ValueError, match="leaf"):
        vocab_parallel_cross_entropy(leaf.view(12, 90), t.view(12), backend=backend, inplace_backward=True)


def test_gradcheck_fp64():
    x = _logits((3, 2, 7), torch.float64, scale=1.0).requires_grad_(True)
    t = torch.tensor([[0, 6], [3, 5], [1, 2]], device=DEV)  # in range: megatron's out-of-range loss has a max
    for ls in (0.0, 0.3):
        torch.autograd.gradcheck(
            lambda a, ls=ls: vocab_parallel_cross_entropy(a * 1, t, label_smoothing=ls, backend="reference"),
            (x,),
        )
    out = vocab_parallel_cross_entropy(
        x, t, backend="triton" if interpreting() or DEV == "cuda" else "reference"
    )
    assert out.dtype == torch.float64  # fp64 always runs the eager path in fp64


@needs_triton
def test_extreme_logits():
    """Huge spreads: fp32 math, no overflow; rows whose max sits far from the others."""
    x = _logits((4, 257), torch.float32, scale=1.0)
    x[0] *= 1e4
    x[1, 5] = 3e4
    x[2] -= 1e4
    t = torch.tensor([5, 5, 7, 256], device=DEV)
    loss, _ = _check(x, t, "triton", 0.1)
    assert torch.isfinite(loss).all()


# ------------------------------------------------------------------------------------- dispatch, errors


def test_dispatch_auto_env_and_errors(monkeypatch):
    import dsv4_primitives.cross_entropy.apply as ce_apply

    seen = []
    real = ce_apply._VocabParallelCrossEntropy.apply
    monkeypatch.setattr(
        ce_apply._VocabParallelCrossEntropy, "apply", lambda *a: seen.append(a[-1]) or real(*a)
    )
    x, t = _logits((3, 11), torch.float32), _targets((3,), 11)
    monkeypatch.delenv(ENV_VAR, raising=False)
    vocab_parallel_cross_entropy(x, t)
    assert seen[-1] == ("triton" if DEV == "cuda" else "torch")
    for env, want in (("reference", "torch"),):
        monkeypatch.setenv(ENV_VAR, env)
        vocab_parallel_cross_entropy(x, t)
        assert seen[-1] == want
    if interpreting() or DEV == "cuda":
        monkeypatch.setenv(ENV_VAR, "triton")
        vocab_parallel_cross_entropy(x, t)
        assert seen[-1] == "triton"
        vocab_parallel_cross_entropy(x, t, backend="reference")  # explicit argument wins
        assert seen[-1] == "torch"
    monkeypatch.setenv(ENV_VAR, "bogus")
    with pytest.raises(ValueError, match=ENV_VAR):
        vocab_parallel_cross_entropy(x, t)
    monkeypatch.delenv(ENV_VAR)
    with pytest.raises(ValueError, match="backend"):
        vocab_parallel_cross_entropy(x, t, backend="cuda")


def test_bad_inputs_raise_value_error():
    x, t = _logits((3, 11), torch.float32), _targets((3,), 11)
    bad = [
        (dict(logits=x.long()), "dtype"),
        (dict(logits=x[:, :0]), "V_local >= 1"),
        (dict(target=t.float()), "integer"),
        (dict(target=t.bool()), "integer"),
        (dict(target=t[:2]), "shape"),
        (dict(label_smoothing=1.0), r"\[0, 1\)"),
        (dict(label_smoothing=-0.1), r"\[0, 1\)"),
        (dict(label_smoothing="0.1"), "float"),
        (dict(vocab_start=-1), "vocab_start"),
        (dict(vocab_start=2.0), "vocab_start"),
        (dict(inplace_backward=1), "bool"),
        (dict(logits=x[:, :1], target=t, label_smoothing=0.1), "at least 2"),
    ]
    for kw, msg in bad:
        args = dict(logits=x, target=t) | kw
        with pytest.raises(ValueError, match=msg):
            vocab_parallel_cross_entropy(args.pop("logits"), args.pop("target"), **args)
    if torch.distributed.is_available() and not torch.distributed.is_initialized():
        with pytest.raises(ValueError, match="not initialised"):
            vocab_parallel_cross_entropy(x, t, tp_group=object())
    if DEV == "cuda":
        with pytest.raises(ValueError, match="move it"):
            vocab_parallel_cross_entropy(x, t.cpu())


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2048, 1, 129280), (1, 1, 129280), (37, 3, 32001)])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_gpu_bf16_realistic_shapes(shape, label_smoothing):
    x = _logits(shape, torch.bfloat16, scale=4.0)
    t = _targets(shape[:-1], shape[-1])
    _check(x, t, "triton", label_smoothing)
    _check(x, t, "triton", label_smoothing, inplace_backward=True)


@pytest.mark.gpu
def test_gpu_matches_megatron_bf16(megatron_cpu):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as megatron_ce

    group = megatron_cpu.get_tensor_model_parallel_group()
    x, t = _logits((1024, 2, 129280), torch.bfloat16, scale=4.0), _targets((1024, 2), 129280)
    g = torch.rand(1024, 2, device=DEV)
    for ls in (0.0, 0.1):
        want = _loss_and_grad(lambda a, ls=ls: megatron_ce(a, t, ls, group), x, g)
        got = _loss_and_grad(
            lambda a, ls=ls: vocab_parallel_cross_entropy(a, t, tp_group=group, label_smoothing=ls), x, g
        )
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got[1].float(), want[1].float(), rtol=0, atol=2**-7)  # |grad| < 1: 2 ulps


def test_inplace_backward_refuses_rows_sharing_memory():
    """An expanded view (row stride 0) would have every row's gradient written to one buffer row at once."""
    base = torch.randn(1, 50, requires_grad=True)
    logits = (base * 2).expand(6, 50)  # non-leaf, rows alias one row
    target = torch.randint(0, 50, (6,))
    with pytest.raises(ValueError, match="do not share memory"):
        vocab_parallel_cross_entropy(logits, target, inplace_backward=True, backend="reference")
    # the default (a new gradient tensor) is fine
    loss = vocab_parallel_cross_entropy(logits, target, backend="reference")
    loss.sum().backward()
    ref = vocab_parallel_cross_entropy_ref(logits.detach().contiguous().requires_grad_(), target)
    assert torch.allclose(loss, ref, atol=1e-5)
