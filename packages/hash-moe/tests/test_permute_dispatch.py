"""The all-to-all dispatcher's atomic-free permutation (``DSv4AlltoAllTokenDispatcher``) vs megatron's own unfused
functions in a whole ``DSv4MoELayer``: the same outputs and every gradient (bit-identical in fp64 on CPU), with and
without padding tokens, learned and hash routing; fallback to megatron where its fused / padded paths apply; the
identity chunk sort is skipped at one rank. EP=2 over gloo runs the same path in ``test_ep_parity.py``."""

import pytest
import torch
from _moe_setup import HIDDEN, TOPK, VOCAB, alltoall_dispatcher_on_cpu, build_layer

from hash_moe.megatron import DSv4AlltoAllTokenDispatcher

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def alltoall_cpu(megatron_cpu):
    with alltoall_dispatcher_on_cpu():
        yield megatron_cpu


def _step(layer, x, ids, pad, g):
    """Output and the gradients of the input and of every parameter (one forward + backward)."""
    layer.zero_grad(set_to_none=True)
    xl = x.detach().clone().requires_grad_()
    out, _ = layer(xl, padding_mask=pad, input_ids=ids)
    (out * g).sum().backward()
    grads = [xl.grad] + [
        p.grad if p.grad is not None else torch.zeros_like(p) for _, p in sorted(layer.named_parameters())
    ]
    return [out.detach()] + grads


def _batch(s, b, pad_rows, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, b, HIDDEN, generator=g, dtype=torch.float64).to(device, dtype)
    ids = torch.randint(0, VOCAB, (b, s), generator=g).to(device)
    grad = torch.randn(s, b, HIDDEN, generator=g, dtype=torch.float64).to(device, dtype)
    pad = None
    if pad_rows is not None:
        pad = torch.zeros(b, s, dtype=torch.bool)
        for row, n in pad_rows.items():
            pad[row, s - n :] = True
        pad = pad.to(device)
    return x, ids, pad, grad


@pytest.mark.parametrize("hash_routing", [False, True])
@pytest.mark.parametrize("s,b,pad_rows", [(9, 2, None), (7, 3, {1: 4, 2: 7}), (1, 1, None), (2, 1, {0: 2})])
def test_layer_equals_megatrons_permutation(alltoall_cpu, hash_routing, s, b, pad_rows):
    torch.manual_seed(s * b)
    layer, _ = build_layer(hash_routing, moe_token_dispatcher_type="alltoall", balance=1e-2)
    layer.train()
    disp = layer.token_dispatcher
    assert isinstance(disp, DSv4AlltoAllTokenDispatcher) and disp.atomic_free_permute
    x, ids, pad, g = _batch(s, b, pad_rows, torch.float64, seed=s + b)
    ours = _step(layer, x, ids, pad, g)
    assert disp.permute_map is not None  # the atomic-free path ran
    assert disp.permute_map.rows_of_token.shape == (s * b, TOPK)
    disp.atomic_free_permute = False
    theirs = _step(layer, x, ids, pad, g)
    assert disp.permute_map is None
    names = ["out", "dx"] + [n for n, _ in sorted(layer.named_parameters())]
    for name, a, w in zip(names, ours, theirs):
        assert torch.equal(a, w), name


def test_identity_chunk_sort_is_skipped_at_one_rank(alltoall_cpu, monkeypatch):
    from megatron.core.transformer.moe import token_dispatcher as td

    calls = []
    real = td.sort_chunks_by_idxs
    monkeypatch.setattr(td, "sort_chunks_by_idxs", lambda *a, **k: calls.append(1) or real(*a, **k))
    layer, _ = build_layer(False, moe_token_dispatcher_type="alltoall")
    x, ids, pad, g = _batch(5, 2, {0: 2}, torch.float64)
    _step(layer, x, ids, pad, g)
    assert calls == []  # 4 local experts, one rank: megatron would sort chunks twice (dispatch and combine)
    layer.token_dispatcher.atomic_free_permute = False
    _step(layer, x, ids, pad, g)
    assert len(calls) == 2


def test_counts_stay_on_device_at_one_rank(alltoall_cpu, monkeypatch):
    """One TP x EP rank without padding: megatron's device-to-host copy of the per-expert counts (and its
    synchronisation) is skipped; the experts get the counts as a tensor on the tokens' device. On CPU, batches with
    padding rows keep the exact routed count and megatron's sync point (CUDA uses filler rows: the GPU test below)."""
    layer, _ = build_layer(False, moe_token_dispatcher_type="alltoall")
    disp = layer.token_dispatcher
    points, seen = [], []
    real_sync = disp._maybe_dtoh_and_synchronize
    monkeypatch.setattr(
        disp, "_maybe_dtoh_and_synchronize", lambda p, t=None: points.append(p) or real_sync(p, t)
    )
    real_experts = layer.experts.forward
    monkeypatch.setattr(layer.experts, "forward", lambda x, c, p: seen.append(c) or real_experts(x, c, p))
    x, ids, _, g = _batch(5, 2, {}, torch.float64)
    ours = _step(layer, x, ids, None, g)
    # megatron's dtoh copy + sync happen at its first sync point and "before_permutation_2"; the all-to-all's own
    # "before_ep_alltoall" call is a no-op at one rank
    assert set(points) <= {"before_ep_alltoall"}
    assert isinstance(seen[-1], torch.Tensor) and seen[-1].device == x.device
    assert int(seen[-1].sum()) == 5 * 2 * TOPK
    disp.keep_counts_on_device = False
    theirs = _step(layer, x, ids, None, g)
    assert "before_permutation_1" in points  # megatron's sync points again
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    disp.keep_counts_on_device = True
    points.clear()
    x, ids, pad, g = _batch(5, 2, {0: 2}, torch.float64)
    _step(layer, x, ids, pad, g)
    assert "before_permutation_1" in points


@pytest.mark.parametrize(
    "field,value", [("moe_permute_fusion", True), ("moe_router_padding_for_quantization", True)]
)
def test_falls_back_where_megatron_takes_another_path(alltoall_cpu, field, value):
    layer, _ = build_layer(False, moe_token_dispatcher_type="alltoall")
    disp = layer.token_dispatcher
    assert disp._takes_atomic_free_path()
    setattr(disp.config, field, value)
    assert not disp._takes_atomic_free_path()
    disp.config.moe_permute_fusion = disp.config.moe_router_padding_for_quantization = False
    disp.drop_and_pad = True
    assert not disp._takes_atomic_free_path()
    disp.drop_and_pad = False
    disp.cuda_dtoh_point = "before_ep_alltoall"  # CUDA-graphed preprocess
    assert not disp._takes_atomic_free_path()


@pytest.mark.gpu
@pytest.mark.parametrize("hash_routing", [False, True])
def test_gpu_bf16_layer_close_to_megatrons_path_and_deterministic(megatron_cpu, hash_routing):
    """bf16 on the GPU: the atomic-free layer matches megatron's path within bf16 summation error (megatron sums in
    bf16 with atomics, we in fp32), and two backward passes give bit-identical gradients."""
    from dsv4_testkit import assert_close_to_ref

    torch.manual_seed(0)
    kw = dict(moe_token_dispatcher_type="alltoall", balance=0.0)
    layer, _ = build_layer(hash_routing, dtype=torch.bfloat16, bf16=True, **kw)
    layer = layer.to(DEV).train()
    x, ids, pad, g = _batch(256, 2, {1: 37}, torch.bfloat16, DEV, seed=1)
    first = _step(layer, x, ids, pad, g)
    second = _step(layer, x, ids, pad, g)
    layer.token_dispatcher.atomic_free_permute = False
    theirs = _step(layer, x, ids, pad, g)
    # fp64 reference: megatron's path on the same (bf16-rounded) weights
    layer64, _ = build_layer(hash_routing, dtype=torch.float64, **kw)
    layer64 = layer64.to(DEV).train()
    with torch.no_grad():
        for (n64, p64), (n, p) in zip(sorted(layer64.named_parameters()), sorted(layer.named_parameters())):
            assert n64 == n
            p64.copy_(p)
    layer64.token_dispatcher.atomic_free_permute = False
    ref = _step(layer64, x.double(), ids, pad, g.double())
    names = ["out", "dx"] + [n for n, _ in sorted(layer.named_parameters())]
    for name, a, b, m, r in zip(names, first, second, theirs, ref):
        assert torch.equal(a, b), f"{name} not deterministic"
        assert_close_to_ref(name, a, r, m)


@pytest.mark.gpu
@pytest.mark.parametrize("pad_rows", [None, {1: 37}])
def test_gpu_layer_is_sync_free_at_one_rank(megatron_cpu, pad_rows):
    """bf16 on the GPU at one rank: the whole layer (routing, permutation, grouped GEMMs, un-permutation, backward)
    never synchronises with the host, also with padding tokens (static-size permutation with filler rows); the
    result equals the exact-count path that syncs."""
    torch.manual_seed(0)
    layer, _ = build_layer(
        False, dtype=torch.bfloat16, bf16=True, moe_token_dispatcher_type="alltoall", balance=0.0
    )
    layer = layer.to(DEV).train()
    x, ids, pad, g = _batch(256, 2, pad_rows, torch.bfloat16, DEV, seed=2)
    _step(layer, x, ids, pad, g)  # warm-up: Triton compilation, lazy state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ours = _step(layer, x, ids, pad, g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    layer.token_dispatcher.keep_counts_on_device = False
    exact = _step(layer, x, ids, pad, g)
    for a, b in zip(ours, exact):
        assert torch.equal(a, b)
