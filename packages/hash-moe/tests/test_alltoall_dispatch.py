"""megatron-core's all-to-all token dispatcher (the GPU default) with padding tokens, run on CPU at EP=1.

Padding tokens have an all-False routing-map row (never dispatched). megatron's dropless all-to-all preprocess
sizes the permutation as ``num_tokens * topk``, so without :class:`hash_moe.megatron.DSv4AlltoAllTokenDispatcher`
the permutation carried the padding tokens while the per-expert counts did not, and ``sort_chunks_by_idxs``
failed (found on an H200 with ``s=37, b=2``, 5 padding tokens). EP=2 over gloo is in ``test_ep_parity.py``.
"""

import pytest
import torch
from _moe_setup import (
    HIDDEN,
    TOPK,
    VOCAB,
    alltoall_dispatcher_on_cpu,
    build_layer,
    layer_reference,
    ref_leaves,
)

from hash_moe.megatron import DSv4AlltoAllTokenDispatcher


@pytest.fixture
def alltoall_cpu(megatron_cpu):
    """World-size-1 megatron state plus the CPU stand-in for the dispatcher's CUDA side stream (see _moe_setup)."""
    with alltoall_dispatcher_on_cpu():
        yield megatron_cpu


def _build(hash_routing, dispatcher="alltoall"):
    return build_layer(hash_routing, moe_token_dispatcher_type=dispatcher, balance=0.0)


def _grads(out, g, params):
    # an all-padding batch leaves the routed experts (and, in the reference, the gate) out of the graph: zeros
    grads = torch.autograd.grad((out * g).sum(), params, allow_unused=True)
    return [torch.zeros_like(p) if d is None else d for p, d in zip(params, grads)]


@pytest.mark.parametrize("hash_routing", [False, True])
@pytest.mark.parametrize("s,b,pad_rows", [(37, 2, {1: 5}), (5, 3, {0: 5, 2: 1}), (1, 1, {}), (3, 1, {0: 3})])
def test_alltoall_layer_with_padding_matches_reference(alltoall_cpu, hash_routing, s, b, pad_rows):
    torch.manual_seed(s + b)
    layer, w = _build(hash_routing)
    assert isinstance(layer.token_dispatcher, DSv4AlltoAllTokenDispatcher)
    x = torch.randn(s, b, HIDDEN, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, VOCAB, (b, s))
    pad = torch.zeros(b, s, dtype=torch.bool)
    for (
        row,
        n,
    ) in pad_rows.items():  # the last n tokens of sequence `row` are padding (a whole sequence if n == s)
        pad[row, s - n :] = True
    seen = []
    layer.experts.register_forward_hook(lambda m, inp, out: seen.append((inp[0].shape[0], inp[1].tolist())))
    out, _ = layer(x, padding_mask=pad, input_ids=ids)
    g = torch.randn_like(out)
    params = [x, layer.router.weight, layer.experts.gate_up_proj, layer.experts.down_proj]
    grads = _grads(out, g, params)
    # only the non-padding tokens reach the experts, and the rows match the per-expert counts
    ((rows, counts),) = seen
    assert rows == sum(counts) == int((~pad).sum()) * TOPK
    leaves = ref_leaves(w)
    x64 = x.detach().clone().requires_grad_()
    ref = layer_reference(x64, ids, pad, w, leaves, hash_routing)
    ref_grads = _grads(ref, g, [x64, leaves["gate"], leaves["gate_up"], leaves["down"]])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for name, a, r in zip(("dx", "dgate", "dgate_up", "ddown"), grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12, msg=name)


def test_alltoall_without_padding_keeps_megatrons_static_count(alltoall_cpu):
    """No padding mask: the permutation size stays megatron's static ``N * topk`` (no extra device-to-host sync),
    and a padded call in between does not leave the earlier sync point behind."""
    torch.manual_seed(1)
    layer, _ = _build(False)
    gather, _ = _build(False, dispatcher="allgather")
    disp = layer.token_dispatcher
    x = torch.randn(6, 2, HIDDEN, dtype=torch.float64)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0, 3:] = True
    sync_points = []
    for mask in (None, pad, None):
        out, _ = layer(x, padding_mask=mask)
        sync_points.append(disp.cuda_sync_point)
        torch.testing.assert_close(out, gather(x, padding_mask=mask)[0], rtol=1e-12, atol=1e-13)
        want = 12 * TOPK if mask is None else int((~pad).sum()) * TOPK
        assert int(disp.num_out_tokens) == want
    assert (
        sync_points[0] == sync_points[2] != "before_permutation_1"
        and sync_points[1] == "before_permutation_1"
    )
