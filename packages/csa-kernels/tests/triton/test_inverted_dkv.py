"""The inverted-index reduction (``csa_kernels._inverted``) and the deterministic backwards built on it: sparse
attention ``dkv`` and the index scores' ``dk``, at every index corner case, against the references, bitwise equal
over two runs. Interpreter sizes: 4 tokens per chunk and 3 pairs per piece, so hot rows span pieces and chunks."""

from __future__ import annotations

import pytest
import torch
from _cases import sparse_attn_oracle

import csa_kernels as ck
from csa_kernels._inverted import build_inverted_index, chunk_index, gather_reduce, sort_pairs
from csa_kernels._triton_utils import resolve_deterministic
from csa_kernels.ops.indexer import scores_at_config, scores_at_triton
from csa_kernels.ops.indexer.reference import indexer_scores_at_ref
from csa_kernels.ops.indexer.scores_at_autograd import indexer_scores_at_triton
from csa_kernels.ops.sparse_attn import launch_config
from csa_kernels.ops.sparse_attn import triton as attn_triton
from csa_kernels.ops.sparse_attn.autograd import sparse_attn_triton
from csa_kernels.ops.sparse_attn.reference import sparse_attn_ref
from dsv4_testkit import assert_close_to_ref, interpreting

interpreter_only = pytest.mark.skipif(
    not interpreting(), reason="CPU interpreter case (gpu-marked cases below)"
)

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="CPU interpreter tests (gpu-marked cases elsewhere)"
)


@interpreter_only
@pytest.mark.parametrize("accumulate", [False, True])
def test_gather_reduce_matches_index_add(accumulate):
    """Rows with no pair, a hot row spanning many pieces, -1 pairs whose (NaN) rows must never be read."""
    gen = torch.Generator().manual_seed(0)
    P, W, n_rows = 40, 24, 9
    key = torch.randint(-1, n_rows - 2, (P,), generator=gen)  # the last two rows get no pair
    key[::2] = 4  # hot row: 20 pairs = 7 pieces of 3
    pairs = torch.randn(P, W, generator=gen)
    pairs[key < 0] = float("nan")
    base = torch.randn(n_rows, W, generator=gen)
    index = build_inverted_index(key, n_rows, piece=3)
    assert index.n_items >= int(index.n_pieces.sum())
    out = gather_reduce(pairs, index, base.clone(), accumulate=accumulate)
    again = gather_reduce(pairs, index, base.clone(), accumulate=accumulate)
    v = key >= 0
    ref = torch.zeros(n_rows, W, dtype=torch.float64).index_add_(0, key[v], pairs[v].double())
    if accumulate:
        ref += base.double()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out, again)


@interpreter_only
def test_chunk_index_position_range_and_head_blocks():
    """One sort, then the pairs of a position range (a token chunk) with two rows per pair (head blocks): only the
    range's pairs are summed, both blocks of each."""
    gen = torch.Generator().manual_seed(1)
    P, W, n_rows, pos0, pos1 = 30, 8, 6, 7, 22
    key = torch.randint(-1, n_rows, (P,), generator=gen)
    key[pos0:pos1:3] = 0
    sp = sort_pairs(key, n_rows)
    pairs = torch.randn(2, pos1 - pos0, W, generator=gen)  # rows of positions pos0 .. pos1 - 1
    out = gather_reduce(pairs, chunk_index(sp, pos0, pos1, 2), torch.zeros(n_rows, W), accumulate=False)
    kc = key[pos0:pos1]
    v = kc >= 0
    ref = torch.zeros(n_rows, W, dtype=torch.float64).index_add_(0, kc[v], pairs[:, v].double().sum(0))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@interpreter_only
def test_gather_reduce_no_valid_pair():
    key = torch.full((5,), -1)
    out = gather_reduce(
        torch.randn(5, 8), build_inverted_index(key, 3, 2), torch.randn(3, 8), accumulate=False
    )
    assert torch.equal(out, torch.zeros(3, 8))
    with pytest.raises(ValueError, match="piece"):
        build_inverted_index(key, 3, 0)


def _attn_grads(q, kv, sink, idx, do, dtype, deterministic):
    leaves = [
        x.detach().to(dt).clone().requires_grad_()
        for x, dt in ((q, dtype), (kv, dtype), (sink, torch.float32))
    ]
    o, _ = sparse_attn_triton(*leaves, idx, q.shape[-1] ** -0.5, deterministic=deterministic)
    o.backward(do.to(dtype))
    return [x.grad for x in leaves]


def _attn_refs(q, kv, sink, idx, do, dtype):
    out = []
    for dt, fn in ((torch.float64, sparse_attn_ref), (dtype, sparse_attn_oracle)):
        leaves = [x.detach().to(dt).clone().requires_grad_() for x in (q, kv, sink)]
        o, _ = fn(*leaves, idx, q.shape[-1] ** -0.5)
        o.backward(do.to(dt))
        out.append([x.grad for x in leaves])
    return out


def _attn_case(name: str, gen: torch.Generator):
    """(T, H, D, Nkv, idx): the issue's corner cases."""
    if name == "holes_dups_oddk":  # -1 slots inside rows, repeated rows, K = 7, an empty row
        T, H, D, N, K = 6, 3, 24, 11, 7
        idx = torch.randint(-1, N, (T, K), generator=gen, dtype=torch.int32)
        idx[:, 2] = idx[:, 5].clamp(min=0)
        idx[3] = -1
    elif name == "all_empty":  # no valid slot anywhere: dkv = 0, dq = 0
        T, H, D, N, K = 5, 2, 16, 4, 3
        idx = torch.full((T, K), -1, dtype=torch.int32)
    elif name == "one_token":  # T = 1, odd K
        T, H, D, N, K = 1, 2, 16, 6, 5
        idx = torch.tensor([[4, -1, 0, 4, 2]], dtype=torch.int32)
    else:  # hot row: every token reads row 1 three times (pieces of 3, chunks of 4 tokens), two head blocks
        T, H, D, N, K = 6, 80, 16, 7, 6
        idx = torch.randint(-1, N, (T, K), generator=gen, dtype=torch.int32)
        idx[:, :3] = 1
    return T, H, D, N, idx


@interpreter_only
@pytest.mark.parametrize("name", ["holes_dups_oddk", "all_empty", "one_token", "hot_row"])
def test_sparse_attn_inverted_dkv_corner_cases(name):
    """The inverted-index dkv (the default deterministic path) vs the fp64 reference under the 2x rule, two runs
    bitwise equal, and the atomic path within rounding (same per-pair rows, another summation order)."""
    assert launch_config.DETERMINISTIC_DKV == "inverted"
    gen = torch.Generator().manual_seed(11)
    T, H, D, N, idx = _attn_case(name, gen)
    q, kv, sink, do = torch.randn(T, H, D), torch.randn(N, D), torch.randn(H), torch.randn(T, H, D)
    dtype = torch.bfloat16 if name == "hot_row" else torch.float32
    got = _attn_grads(q, kv, sink, idx, do, dtype, True)
    r64, rdt = _attn_refs(q, kv, sink, idx, do, dtype)
    for i, n in enumerate(("dq", "dkv", "dsink")):
        assert_close_to_ref(n, got[i], r64[i], rdt[i] if dtype != torch.float32 else None)
    again = _attn_grads(q, kv, sink, idx, do, dtype, True)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "two deterministic runs differ"
    if name == "all_empty":
        assert torch.equal(got[1], torch.zeros_like(got[1]))
    if name == "hot_row":
        atomic = _attn_grads(q, kv, sink, idx, do, dtype, False)
        torch.testing.assert_close(atomic[1].float(), got[1].float(), atol=2e-2, rtol=2e-2)


@interpreter_only
def test_sparse_attn_keymajor_switch():
    """``DETERMINISTIC_DKV = "keymajor"`` still runs the 0.3 key-major pass (same dkv as the inverted path)."""
    gen = torch.Generator().manual_seed(5)
    T, H, D, N, idx = _attn_case("holes_dups_oddk", gen)
    q, kv, sink, do = torch.randn(T, H, D), torch.randn(N, D), torch.randn(H), torch.randn(T, H, D)
    inverted = _attn_grads(q, kv, sink, idx, do, torch.float32, True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch_config, "DETERMINISTIC_DKV", "keymajor")
        keymajor = _attn_grads(q, kv, sink, idx, do, torch.float32, True)
    torch.testing.assert_close(keymajor[1], inverted[1], atol=1e-5, rtol=1e-5)


@pytest.fixture
def torch_flag_off():
    """torch.use_deterministic_algorithms(False) for the test (the flag would force the deterministic path)."""
    prev = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])


@pytest.fixture
def dkv_spy(monkeypatch):
    """Which dkv reduction each backward ran: a list of "inverted" / "atomic"."""
    seen: list[str] = []
    for name, fn in (("inverted", attn_triton.dkv_inverted), ("atomic", attn_triton.dkv_atomic)):
        monkeypatch.setattr(attn_triton, f"dkv_{name}", lambda *a, _n=name, _f=fn: seen.append(_n) or _f(*a))
    return seen


@interpreter_only
def test_sparse_attn_default_backward_is_deterministic(torch_flag_off, dkv_spy):
    """Issue 35: ``deterministic=None`` without torch's flag runs the inverted-index dkv (not the atomics), and two
    such runs are bitwise equal at a hot row read three times by every token (two head blocks, bf16)."""
    assert ck.deterministic_default() is True
    T, H, D, N, idx = _attn_case("hot_row", torch.Generator().manual_seed(3))
    q, kv, sink, do = torch.randn(T, H, D), torch.randn(N, D), torch.randn(H), torch.randn(T, H, D)
    first = _attn_grads(q, kv, sink, idx, do, torch.bfloat16, None)
    again = _attn_grads(q, kv, sink, idx, do, torch.bfloat16, None)
    assert dkv_spy == ["inverted", "inverted"]
    assert all(torch.equal(a, b) for a, b in zip(first, again)), "two default runs differ"


@interpreter_only
def test_sparse_attn_default_switch_and_explicit_argument(torch_flag_off, dkv_spy):
    """``set_deterministic_default(False)`` makes ``None`` the atomic path (and returns the previous default); an
    explicit ``deterministic=`` wins over either default; the scope restores the default, also on an error;
    torch's flag forces the deterministic path whatever the default."""
    T, H, D, N, idx = _attn_case("holes_dups_oddk", torch.Generator().manual_seed(5))
    q, kv, sink, do = torch.randn(T, H, D), torch.randn(N, D), torch.randn(H), torch.randn(T, H, D)
    assert ck.set_deterministic_default(False) is True
    try:
        assert ck.deterministic_default() is False
        _attn_grads(q, kv, sink, idx, do, torch.float32, None)
        _attn_grads(q, kv, sink, idx, do, torch.float32, True)
        torch.use_deterministic_algorithms(True)
        assert resolve_deterministic(None) and not resolve_deterministic(False)
        torch.use_deterministic_algorithms(False)
    finally:
        assert ck.set_deterministic_default(True) is False
    _attn_grads(q, kv, sink, idx, do, torch.float32, False)
    assert dkv_spy == ["atomic", "inverted", "atomic"]
    with pytest.raises(RuntimeError, match="inside"), ck.deterministic_default_scope(False):
        assert not resolve_deterministic(None)
        raise RuntimeError("inside")
    assert ck.deterministic_default() is True
    with pytest.raises(ValueError, match=r"must be True .* or False"):
        ck.set_deterministic_default(None)
    assert ck.deterministic_default() is True


@interpreter_only
def test_scores_at_default_dk_is_deterministic(torch_flag_off, monkeypatch):
    """The index scores' ``dk`` under ``deterministic=None``: the key-major pass (the faster deterministic dk,
    ``scores_at_config.DETERMINISTIC_DK``) by default, the row kernel's atomics after
    ``set_deterministic_default(False)``."""
    assert scores_at_config.DETERMINISTIC_DK == "keymajor"
    seen = []
    real = scores_at_triton.scores_at_dk_keymajor
    monkeypatch.setattr(scores_at_triton, "scores_at_dk_keymajor", lambda *a: seen.append(1) or real(*a))
    gen = torch.Generator().manual_seed(6)
    q, k, w = torch.randn(5, 3, 16, generator=gen), torch.randn(4, 16, generator=gen), torch.randn(5, 3)
    idx = torch.randint(-1, 4, (5, 3), generator=gen, dtype=torch.int32)

    def dk():
        leaves = [x.clone().requires_grad_() for x in (q, k, w)]
        indexer_scores_at_triton(*leaves, idx).masked_fill(idx < 0, 0.0).sum().backward()
        return leaves[1].grad

    first = dk()
    assert seen == [1]
    with ck.deterministic_default_scope(False):
        atomic = dk()
    assert seen == [1]
    torch.testing.assert_close(atomic, first, atol=1e-5, rtol=1e-5)


@interpreter_only
@pytest.mark.parametrize("mode", ["inverted", "keymajor"])
def test_scores_at_dk_hot_key_and_holes(mode, monkeypatch):
    """Index scores' deterministic dk: a key read by every row several times, -1 holes, an all -1 row, rows in
    chunks of 3; vs the fp64 reference, bitwise twice; both deterministic reductions."""
    monkeypatch.setattr(scores_at_config, "DETERMINISTIC_DK", mode)
    gen = torch.Generator().manual_seed(2)
    T, HI, DI, Tc, K = 7, 3, 16, 5, 5
    q, k, w = torch.randn(T, HI, DI, generator=gen), torch.randn(Tc, DI, generator=gen), torch.randn(T, HI)
    idx = torch.randint(-1, Tc, (T, K), generator=gen, dtype=torch.int32)
    idx[:, 0] = 2
    idx[:, 3] = 2
    idx[4] = -1
    g = torch.randn(T, K, generator=gen)

    def grads(fn, dt):
        leaves = [x.to(dt).clone().requires_grad_() for x in (q, k, w)]
        s = fn(*leaves, idx)
        s.backward(torch.where(idx >= 0, g, 0.0).to(s.dtype))
        return [x.grad for x in leaves]

    ref = grads(lambda *a: torch.where(idx >= 0, indexer_scores_at_ref(*a), 0.0), torch.float64)
    got = grads(lambda *a: indexer_scores_at_triton(*a, deterministic=True), torch.float32)
    for n, a, b in zip(("dq", "dk", "dw"), got, ref):
        assert_close_to_ref(n, a, b)
    again = grads(lambda *a: indexer_scores_at_triton(*a, deterministic=True), torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@interpreter_only
def test_sparse_attn_inverted_dkv_bf16_pairs(monkeypatch):
    """``PAIR_DTYPE = bf16`` (half the pair traffic; each pair row rounded once before the fp32 sum): bf16 inputs
    within the 2x rule, bitwise twice."""
    monkeypatch.setattr(launch_config, "PAIR_DTYPE", torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    T, H, D, N, idx = _attn_case("holes_dups_oddk", gen)
    q, kv, sink, do = torch.randn(T, H, D), torch.randn(N, D), torch.randn(H), torch.randn(T, H, D)
    got = _attn_grads(q, kv, sink, idx, do, torch.bfloat16, True)
    r64, rdt = _attn_refs(q, kv, sink, idx, do, torch.bfloat16)
    for i, n in enumerate(("dq", "dkv", "dsink")):
        assert_close_to_ref(n, got[i], r64[i], rdt[i])
    again = _attn_grads(q, kv, sink, idx, do, torch.bfloat16, True)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.gpu
@pytest.mark.parametrize("pair_dtype", [torch.float32, torch.bfloat16])
def test_sparse_attn_gpu_bf16_inverted_hot_rows(pair_dtype, monkeypatch):
    """V4-Flash heads (H 64, D 512) in bf16 on the GPU: hot rows read by every token (several slots each), -1
    holes, an empty row; a small pair buffer (several token chunks) and pieces of 16 pairs (hot rows split). dq,
    dkv, dsink vs the fp64 reference under the 2x rule, two runs bitwise equal."""
    monkeypatch.setattr(launch_config, "PAIR_BYTES", 40 * 640 * 512 * 4)
    monkeypatch.setattr(launch_config, "PIECE", 16)
    monkeypatch.setattr(launch_config, "PAIR_DTYPE", pair_dtype)
    gen = torch.Generator().manual_seed(9)
    T, H, D, N, K = 301, 64, 512, 700, 640
    idx = torch.randint(-1, N, (T, K), generator=gen, dtype=torch.int32)
    idx[:, :4] = torch.tensor([0, 5, 5, 699], dtype=torch.int32)
    idx[7] = -1
    q, kv, sink, do = torch.randn(T, H, D), torch.randn(N, D), torch.randn(H) * 2, torch.randn(T, H, D)
    idx = idx.cuda()
    q, kv, sink, do = (x.cuda() for x in (q, kv, sink, do))
    got = _attn_grads(q, kv, sink, idx, do, torch.bfloat16, True)
    r64, rdt = _attn_refs(q, kv, sink, idx, do, torch.bfloat16)
    for i, n in enumerate(("dq", "dkv", "dsink")):
        assert_close_to_ref(n, got[i], r64[i], rdt[i])
    again = _attn_grads(q, kv, sink, idx, do, torch.bfloat16, True)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
