"""dsv4_primitives.recompute: the setting's rules, checkpointed regions, discarded activations and their hooks."""

import gc
import weakref

import pytest
import torch

from dsv4_primitives.recompute import (
    RecomputeConfig,
    checkpoint_layers,
    checkpoint_region,
    discard,
    discard_derived,
    recompute_scope,
    registered,
)


def _saved_bytes(fn):
    """Bytes of the distinct storages autograd keeps for backward while ``fn()`` runs (an outer hook)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


@pytest.fixture
def net():
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(16, 16, generator=g, requires_grad=True)
    w2 = torch.randn(16, 16, generator=g, requires_grad=True)
    x = torch.randn(7, 16, generator=g, requires_grad=True)
    return w1, w2, x


def _grads(net, body):
    for p in net:
        p.grad = None
    out = body()
    out.backward()
    return [p.grad.clone() for p in net]


def test_config_rules():
    assert RecomputeConfig().megatron_fields() == {}
    sel = RecomputeConfig("selective", ("mhc", "moe"), mhc_layer_num=2)
    assert sel.selects("mhc") and not sel.selects("core_attn")
    assert sel.megatron_fields() == {"recompute_granularity": "selective", "recompute_modules": ["moe"]}
    assert sel.mhc_group_ends(5) == [False, True, False, True, True]
    assert RecomputeConfig("selective", ("mhc",)).mhc_group_ends(3) == [False, False, True]
    full = RecomputeConfig("full", method="uniform", num_layers=2)
    assert full.full_chunks(5) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    block = RecomputeConfig("full", method="block", num_layers=2)
    assert block.full_chunks(5) == [(0, 1, True), (1, 2, True), (2, 5, False)]
    assert block.megatron_fields()["recompute_method"] == "block"
    bad = [
        dict(granularity="partial"),
        dict(granularity="selective"),  # no modules
        dict(granularity="selective", modules=("attention",)),
        dict(granularity="full", method="uniform"),  # no num_layers
        dict(granularity="full", method="stride", num_layers=1),
        dict(granularity="selective", modules=("mhc",), num_layers=2),
        dict(granularity="selective", modules=("core_attn",), mhc_layer_num=2),  # needs mhc
        dict(granularity="selective", modules=("mhc",), mhc_layer_num=0),
        dict(granularity="selective", modules=("moe", "moe_act")),
        dict(modules=("mhc",)),  # modules without selective
    ]
    for kw in bad:
        with pytest.raises(ValueError):
            RecomputeConfig(**kw)


@pytest.mark.parametrize("discard_outputs", [False, True])
def test_region_gradients_equal_and_keep_less(net, discard_outputs):
    w1, w2, x = net

    def plain():
        y = torch.tanh(x @ w1)
        return ((y @ w2).sin() ** 2).sum()

    def region():
        with recompute_scope():
            y = checkpoint_region(lambda a: torch.tanh(a @ w1), x, discard_outputs=discard_outputs)
            return ((y @ w2).sin() ** 2).sum()

    assert all(torch.equal(a, b) for a, b in zip(_grads(net, plain), _grads(net, region), strict=True))
    _, ref = _saved_bytes(plain)
    _, got = _saved_bytes(region)
    # plain keeps x@w1's input x, tanh's output y (and its consumer's copy), y@w2's output; the region keeps x only
    # for its own part, and with discard_outputs not y either
    assert got < ref


def test_discard_chain_and_derived_copy(net):
    """Two discarded activations in a chain and a padded copy of one: rebuilt on demand, same gradients."""
    w1, w2, x = net

    def body(recompute):
        with recompute_scope():
            a = x @ w1
            h = torch.relu(a)
            if recompute:
                discard(h, lambda: torch.relu(a))
            h2 = h * 3.0
            if recompute:
                assert discard_derived(h2, h, lambda r: r * 3.0)
            p = torch.nn.functional.pad(h2, (0, 0, 0, 2))  # a copy of h2 (saved by the matmul below)
            if recompute:
                assert discard_derived(p, h2, lambda r: torch.nn.functional.pad(r, (0, 0, 0, 2)))
                assert registered(p) is not None
            return (p @ w2).pow(2).sum()

    ref = _grads(net, lambda: body(False))
    got = _grads(net, lambda: body(True))
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


def test_freed_registration_is_forgotten():
    """A registration ends with its tensor: a new tensor in the reused memory is saved as itself."""
    w = torch.randn(4, 4, requires_grad=True)
    with recompute_scope():
        t = torch.randn(4, 4)
        discard(t, lambda: torch.zeros(4, 4))  # a wrong recipe: must never be used
        ptr = t.untyped_storage().data_ptr()
        del t
        gc.collect()
        u = torch.randn(4, 4)
        reused = u.untyped_storage().data_ptr() == ptr
        out = (u @ w).sum()
    out.backward()
    assert torch.equal(w.grad, u.sum(0)[:, None].expand(4, 4)), f"memory reused: {reused}"


def test_discard_needs_a_scope_and_region_without_grad_runs_plainly():
    t = torch.randn(3)
    with pytest.raises(RuntimeError, match="recompute_scope"):
        discard(t, lambda: t)
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        y = checkpoint_region(lambda a: a * 2, x)
    assert not y.requires_grad and torch.equal(y, x.detach() * 2)


def test_region_replays_random_numbers():
    """Dropout inside a region: the recompute draws the forward's random numbers (RNG states forked)."""
    torch.manual_seed(3)
    x = torch.randn(64, requires_grad=True)

    def f(a):
        return torch.nn.functional.dropout(a, 0.5, training=True) * a

    torch.manual_seed(5)
    f(x).sum().backward()
    ref = x.grad.clone()
    x.grad = None
    torch.manual_seed(5)
    checkpoint_region(f, x).sum().backward()
    assert torch.equal(x.grad, ref)


def test_checkpoint_layers_cpu(net):
    w1, w2, x = net
    body = lambda a: torch.tanh(a @ w1) @ w2
    ref = _grads(net, lambda: body(x).sum())
    got = _grads(net, lambda: checkpoint_layers(body, x).sum())
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


def _output_alive_in_backward(net, checkpoint):
    """Whether the recomputed output of a checkpointed chunk is still alive when the chunk's inner backward reaches
    its first op (the output's gradient is consumed by then: no formula here saves the output); and the grads."""
    w1, w2, x = net
    probe = {}

    def body(a):
        h = torch.tanh(a @ w1)
        out = h @ w2  # [7, 16] (the matmul saves h and w2, not its output)
        if torch.is_grad_enabled():  # the recompute in backward
            probe["out"] = weakref.ref(out)
            h.register_hook(lambda g: probe.update(alive=probe["out"]() is not None))
        return out

    grads = _grads(net, lambda: (checkpoint(body, x) * 2).sum())
    return probe["alive"], grads


def test_checkpoint_layers_drops_recomputed_output_in_backward(net):
    # issue 33: the reentrant backward kept the recomputed output (an mHC layer's fp32 streams) for its whole inner
    # backward; checkpoint_layers hands back data-less stand-ins, same gradients bit for bit
    plain = lambda f, *a: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=True)
    alive_plain, ref = _output_alive_in_backward(net, plain)
    alive, got = _output_alive_in_backward(net, checkpoint_layers)
    assert alive_plain  # the probe sees what the plain reentrant checkpoint keeps
    assert not alive
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


def test_checkpoint_layers_tuple_outputs_bitwise(net):
    w1, w2, x = net
    body = lambda a: (torch.tanh(a @ w1), (a @ w2).detach(), a @ w1 @ w2)
    total = lambda o: o[0].sum() + o[1].sum() + (o[2] ** 2).sum()
    ref = _grads(net, lambda: total(body(x)))
    got = _grads(net, lambda: total(checkpoint_layers(body, x)))
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
