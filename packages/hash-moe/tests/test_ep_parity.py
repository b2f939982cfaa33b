"""EP=2 equals EP=1 over gloo: outputs and every gradient, with uneven token counts per rank and padding tokens,
for a learned and a hash-routed layer, through megatron's all-gather and all-to-all dispatchers (the latter with the
CPU stand-in for its CUDA side stream, see ``_moe_setup``, and the atomic-free permutation); plus the data-parallel
reductions (bias step, split balance loss)."""

import pytest
import torch
from _moe_setup import (
    EXPERTS,
    HIDDEN,
    TOPK,
    VOCAB,
    alltoall_dispatcher_on_cpu,
    build_layer,
    full_weights,
)

# rank 0: 7 tokens in one sequence; rank 1: 2 sequences of 3 with 2 padding tokens (uneven, dispatch pads to 64)
SHAPES = [(7, 1), (3, 2)]
DISPATCHERS = ("allgather", "alltoall")
NAMES = ("out", "dx", "dgate", "dgate_up", "ddown", "dshared_gate", "dshared_down", "loads")


def _batch(rank):
    g = torch.Generator().manual_seed(100 + rank)
    s, b = SHAPES[rank]
    x = torch.randn(s, b, HIDDEN, generator=g, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    pad = torch.zeros(b, s, dtype=torch.bool)
    if rank == 1:
        pad[1, 1:] = True
    grad = torch.randn(s, b, HIDDEN, generator=g, dtype=torch.float64)
    return x, ids, pad, grad


def _layer(hash_routing, ep, local_experts, dispatcher="allgather"):
    layer, _ = build_layer(hash_routing, local_experts, ep=ep, moe_token_dispatcher_type=dispatcher)
    return layer.train()


def _step(layer, rank):
    x, ids, pad, grad = _batch(rank)
    x.requires_grad_()
    out, _ = layer(x, padding_mask=pad, input_ids=ids)
    (out * grad).sum().backward()
    sh = layer.shared_experts
    loads = getattr(layer.router, "local_tokens_per_expert", torch.zeros(EXPERTS))
    vals = (
        out,
        x.grad,
        layer.router.weight.grad,
        layer.experts.gate_up_proj.grad,
        layer.experts.down_proj.grad,
        sh.linear_gate.weight.grad,
        sh.linear_down.weight.grad,
        loads,
    )
    return {k: v.detach().clone() for k, v in zip(NAMES, vals)}


def _ep2_worker(rank, world_size):
    import torch.distributed as dist

    from dsv4_testkit import megatron_cpu_context
    from hash_moe import sequence_balance_loss, update_selection_bias_
    from hash_moe.megatron import update_selection_biases

    out = {}
    with megatron_cpu_context(ep=2), alltoall_dispatcher_on_cpu():
        for dispatcher in DISPATCHERS:
            for hash_routing in (False, True):
                layer = _layer(hash_routing, 2, [2 * rank, 2 * rank + 1], dispatcher)
                assert layer.experts.num_local_experts == 2
                res = _step(layer, rank)
                if dispatcher == "allgather":  # both ranks padded to the alignment
                    assert tuple(layer.token_dispatcher.hidden_shape) == (64, HIDDEN)
                else:  # uneven counts as they are; rank 1's padding tokens are not sent
                    assert layer.token_dispatcher.permute_map is not None  # the atomic-free permutation ran
                    assert layer.token_dispatcher.hidden_shape[:-1].numel() == (7, 6)[rank]
                    assert int(layer.token_dispatcher.num_out_tokens) == (7, 4)[rank] * TOPK
                if not hash_routing:
                    update_selection_biases(layer, group=dist.group.WORLD)
                    res["bias"] = layer.router.e_score_correction_bias.clone()
                out[dispatcher, hash_routing] = res
    # the plain functions with an explicit group: bias step and a sequence split over two ranks
    local = [torch.tensor([4.0, 0.0, 1.0, 1.0]), torch.tensor([0.0, 2.0, 1.0, 3.0])][rank]
    bias = torch.full((4,), 0.5)
    load = update_selection_bias_(bias, local, 0.01, group=dist.group.WORLD)
    g = torch.Generator().manual_seed(7)
    scores = torch.rand(6, 4, generator=g, dtype=torch.float64)
    experts = torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3], [0, 3], [1, 2]])
    part = slice(0, 2) if rank == 0 else slice(2, 6)
    partial = sequence_balance_loss(scores[part], experts[part], coeff=1.0, group=dist.group.WORLD)
    full = sequence_balance_loss(scores, experts, coeff=1.0)
    out["functions"] = (bias.tolist(), load.tolist(), float(partial), float(full))
    return out


@pytest.mark.distributed
def test_ep2_equals_ep1_outputs_and_gradients(megatron_cpu):
    from dsv4_testkit import run_distributed

    ep2 = run_distributed(_ep2_worker, 2)
    for dispatcher, hash_routing in ((d, h) for d in DISPATCHERS for h in (False, True)):
        ref = [_step(_layer(hash_routing, 1, list(range(EXPERTS))), r) for r in range(2)]
        loads_sum = ref[0]["loads"] + ref[1]["loads"]
        for rank in range(2):
            got = ep2[rank][dispatcher, hash_routing]
            mine = slice(2 * rank, 2 * rank + 2)
            for name in ("out", "dx", "dgate", "dshared_gate", "dshared_down", "loads"):
                torch.testing.assert_close(
                    got[name], ref[rank][name], rtol=1e-10, atol=1e-12, msg=f"{name} rank {rank} {dispatcher}"
                )
            # experts see the tokens of both ranks: their gradients are the EP=1 sums over both batches
            for name in ("dgate_up", "ddown"):
                want = (ref[0][name] + ref[1][name])[mine]
                torch.testing.assert_close(
                    got[name], want, rtol=1e-10, atol=1e-12, msg=f"{name} rank {rank} {dispatcher}"
                )
            if not hash_routing:
                step = torch.sign(loads_sum.mean() - loads_sum) * 1e-3
                want_bias = full_weights()["bias"] + step.float()
                torch.testing.assert_close(got["bias"], want_bias)
    (b0, l0, p0, full), (b1, l1, p1, _) = (ep2[r]["functions"] for r in range(2))
    assert l0 == l1 == [4.0, 2.0, 2.0, 4.0]
    assert b0 == b1 == pytest.approx([0.49, 0.51, 0.51, 0.49])
    assert p0 + p1 == pytest.approx(full, rel=1e-12)
