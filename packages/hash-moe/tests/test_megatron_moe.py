"""DSv4MoELayer on megatron-core 0.19.2 (CPU, world size 1): outputs and all gradients vs the fp64 reference,
padding never dispatched, token-id threading, balance loss, bias step, state dicts, recompute, spec."""

import pytest
import torch
from _moe_setup import (
    EXPERTS,
    HIDDEN,
    TOPK,
    VOCAB,
    build_layer,
    full_weights,
    layer_reference,
    load_weights,
    make_config,
    ref_leaves,
    tid2eid_table,
)

from dsv4_primitives import is_keep_in_fp32
from dsv4_testkit import assert_close_to_ref
from hash_moe import RouterConfig, sequence_balance_loss, topk_route
from hash_moe.megatron import (
    ClampedSwiGLUExperts,
    HashRouter,
    LearnedTopKRouter,
    get_dsv4_moe_spec,
    update_selection_biases,
)

RC = RouterConfig(num_experts=EXPERTS, topk=TOPK, routed_scaling_factor=1.5)


@pytest.mark.parametrize("hash_routing", [False, True])
@pytest.mark.parametrize("s,b,padded", [(1, 1, False), (7, 2, True), (16, 1, True)])
def test_layer_matches_reference_outputs_and_grads(megatron_cpu, hash_routing, s, b, padded):
    torch.manual_seed(s * 10 + b)
    layer, w = build_layer(hash_routing, balance=0.0)
    x = torch.randn(s, b, HIDDEN, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, VOCAB, (b, s))
    pad = None
    if padded:
        pad = torch.zeros(b, s, dtype=torch.bool)
        pad[0, -3:] = True
    out, bias = layer(x, padding_mask=pad, input_ids=ids)
    assert bias is None and out.shape == x.shape
    g = torch.randn_like(out)
    grads = torch.autograd.grad(
        (out * g).sum(), [x, layer.router.weight, layer.experts.gate_up_proj, layer.experts.down_proj]
    )
    leaves = ref_leaves(w)
    x64 = x.detach().clone().requires_grad_()
    ref = layer_reference(x64, ids, pad, w, leaves, hash_routing)
    ref_grads = torch.autograd.grad((ref * g).sum(), [x64, leaves["gate"], leaves["gate_up"], leaves["down"]])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for name, a, r in zip(("dx", "dgate", "dgate_up", "ddown"), grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12, msg=name)


def test_padding_tokens_never_reach_experts(megatron_cpu):
    torch.manual_seed(0)
    layer, _ = build_layer(False)
    seen = []
    layer.experts.register_forward_hook(lambda m, inp, out: seen.append(int(inp[1].sum())))
    x = torch.randn(6, 2, HIDDEN, dtype=torch.float64)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 2:] = True
    pad[0, 5] = True
    layer(x, padding_mask=pad)
    assert seen == [int((~pad).sum()) * TOPK]
    # padding tokens get the shared expert only: their output does not depend on the routed experts
    with torch.no_grad():
        layer.experts.down_proj.mul_(3.0)
    out2, _ = layer(x, padding_mask=pad)
    out1, _ = build_layer(False)[0](x, padding_mask=pad)
    pad_sb = pad.t()
    torch.testing.assert_close(out1[pad_sb], out2[pad_sb])
    assert not torch.allclose(out1[~pad_sb], out2[~pad_sb])


def test_hash_layer_needs_input_ids(megatron_cpu):
    layer, _ = build_layer(True)
    assert layer.is_hash_layer and isinstance(layer.router, HashRouter)
    x = torch.randn(4, 1, HIDDEN, dtype=torch.float64)
    with pytest.raises(ValueError, match="input_ids"):
        layer(x)
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        layer(x, input_ids=torch.zeros(4, 1, dtype=torch.long))
    ids = torch.randint(0, VOCAB, (1, 4))
    want, _ = layer(x, input_ids=ids)
    layer.set_input_ids(ids)  # the setter path (callers that cannot pass keywords)
    got, _ = layer(x)
    torch.testing.assert_close(got, want)
    assert layer.router._input_ids is None  # the router only holds ids during a forward


def test_e2_hash_layer_routes_by_token_id_only(megatron_cpu):
    layer, _ = build_layer(True)
    chosen = []
    orig = layer.router._route
    layer.router._route = lambda *a: (chosen.append(r := orig(*a)), r)[1]
    ids = torch.randint(0, VOCAB, (1, 9))
    layer(torch.randn(9, 1, HIDDEN, dtype=torch.float64), input_ids=ids)
    layer(torch.randn(9, 1, HIDDEN, dtype=torch.float64) * 4, input_ids=ids)
    table = tid2eid_table()
    assert torch.equal(chosen[0].experts, table[ids[0]].long()) and torch.equal(
        chosen[1].experts, chosen[0].experts
    )


def test_balance_loss_gradient_and_value(megatron_cpu):
    torch.manual_seed(3)
    layer, w = build_layer(False, balance=0.1)
    layer.train()
    x = torch.randn(5, 2, HIDDEN, dtype=torch.float64)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    out, _ = layer(x, padding_mask=pad)
    (out * 0).sum().backward()  # only the attached balance loss sends a gradient into the gate
    gate = w["gate"].clone().requires_grad_()
    logits = x.reshape(10, HIDDEN) @ gate.t()
    valid = ~pad.t().reshape(-1)
    r = topk_route(logits, RC, selection_bias=w["bias"], valid=valid)
    seq = torch.arange(10) % 2
    loss = sequence_balance_loss(
        r.scores, r.experts, coeff=0.1, sequence_ids=seq, num_sequences=2, valid=valid
    )
    (want,) = torch.autograd.grad(loss, gate)
    torch.testing.assert_close(layer.router.last_balance_loss, loss.detach())
    torch.testing.assert_close(layer.router.weight.grad, want, rtol=1e-9, atol=1e-12)


def test_balance_loss_per_document_with_cu_seqlens(megatron_cpu):
    torch.manual_seed(4)
    layer, w = build_layer(False, balance=0.1)
    x = torch.randn(9, 1, HIDDEN, dtype=torch.float64)
    cu = torch.tensor([0, 4, 4, 9])
    layer(x, cu_seqlens=cu)
    r = topk_route(x.reshape(9, HIDDEN) @ w["gate"].t(), RC, selection_bias=w["bias"])
    seq = torch.tensor([0, 0, 0, 0, 2, 2, 2, 2, 2])
    want = sequence_balance_loss(r.scores, r.experts, coeff=0.1, sequence_ids=seq, num_sequences=3)
    torch.testing.assert_close(layer.router.last_balance_loss, want)


def test_selection_bias_step_after_optimizer(megatron_cpu):
    torch.manual_seed(5)
    learned, w = build_layer(False)
    hashed, _ = build_layer(True)
    model = torch.nn.ModuleList([hashed, learned]).train()
    x = torch.randn(6, 2, HIDDEN, dtype=torch.float64)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0, 4:] = True
    ids = torch.randint(0, VOCAB, (2, 6))
    out = learned(hashed(x, input_ids=ids)[0], padding_mask=pad)[0]
    with torch.no_grad():  # evaluation forwards do not count
        learned(x)
    counts = learned.router.local_tokens_per_expert.clone()
    r = topk_route(
        hashed(x, input_ids=ids)[0].detach().reshape(12, HIDDEN) @ w["gate"].t(),
        RC,
        selection_bias=w["bias"],
        valid=~pad.t().reshape(-1),
    )
    assert (
        counts.tolist() == torch.bincount(r.experts[r.valid].reshape(-1), minlength=EXPERTS).float().tolist()
    )
    assert counts.sum() == int((~pad).sum()) * TOPK
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out.square().mean().backward()
    opt.step()
    before = learned.router.e_score_correction_bias.clone()
    assert update_selection_biases(model, group=None) == 1  # the hash router has no bias
    step = torch.sign(counts.mean() - counts) * 1e-3
    torch.testing.assert_close(learned.router.e_score_correction_bias, before + step.float())
    assert (learned.router.local_tokens_per_expert == 0).all()
    assert not hasattr(hashed.router, "e_score_correction_bias")


def test_state_dict_holds_table_and_bias(megatron_cpu):
    hashed, _ = build_layer(True)
    learned, _ = build_layer(False)
    sd = hashed.state_dict()
    assert sd["router.tid2eid"].dtype == torch.int32 and torch.equal(sd["router.tid2eid"], tid2eid_table())
    assert "router.tid2eid" not in dict(hashed.named_parameters())
    assert "router.e_score_correction_bias" in learned.state_dict()
    assert "router.local_tokens_per_expert" not in learned.state_dict()
    fresh, _ = build_layer(True)
    other = torch.flip(tid2eid_table(), dims=[0]).long()  # int64, as official/HF checkpoints store it
    sd["router.tid2eid"] = other
    fresh.load_state_dict(sd)
    assert fresh.router.tid2eid.dtype == torch.int32 and torch.equal(fresh.router.tid2eid.long(), other)
    sd["router.tid2eid"] = torch.zeros_like(other)  # repeated experts
    with pytest.raises(ValueError, match="repeats"):
        fresh.load_state_dict(sd)
    # bf16 module conversion keeps the selection bias in fp32
    learned.bfloat16()
    for buf in (learned.router.e_score_correction_bias, learned.router.local_tokens_per_expert):
        assert buf.dtype == torch.float32 and is_keep_in_fp32(buf)
    learned(torch.randn(3, 1, HIDDEN, dtype=torch.bfloat16))
    assert learned.router.e_score_correction_bias.dtype == torch.float32


def test_sharded_state_dict_shards_experts(megatron_cpu):
    layer, _ = build_layer(True)
    sh = layer.sharded_state_dict(prefix="decoder.layers.0.mlp.")
    gu = sh["decoder.layers.0.mlp.experts.gate_up_proj"]
    assert gu.global_shape == (EXPERTS, 16, HIDDEN) and gu.axis_fragmentations[0] == 1
    assert sh["decoder.layers.0.mlp.router.tid2eid"].data.dtype == torch.int32


def test_moe_recompute_routes_identically(megatron_cpu):
    torch.manual_seed(6)
    plain, _ = build_layer(True, balance=0.1)
    recomp, _ = build_layer(True, balance=0.1, recompute_granularity="selective", recompute_modules=["moe"])
    assert recomp._recompute_moe
    x0 = torch.randn(5, 2, HIDDEN, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, 5))
    grads = []
    for layer in (plain, recomp):
        layer.train()
        x = x0.clone().requires_grad_()
        out, _ = layer(x, input_ids=ids)
        out.square().sum().backward()  # reentrant checkpointing: .backward(), not autograd.grad
        grads.append([x.grad, layer.router.weight.grad, layer.experts.gate_up_proj.grad])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_spec_and_router_validation(megatron_cpu):
    with pytest.raises(ValueError, match="vocab_size"):
        get_dsv4_moe_spec(hash_routing=True)
    with pytest.raises(ValueError, match="hash_routing"):
        get_dsv4_moe_spec(hash_routing=False, tid2eid=tid2eid_table())
    cfg = make_config()
    with pytest.raises(ValueError, match="MTP"):
        get_dsv4_moe_spec(hash_routing=True, vocab_size=VOCAB)(
            config=cfg, pg_collection=None, is_mtp_layer=True
        )
    mtp = get_dsv4_moe_spec(hash_routing=False)(config=cfg, pg_collection=None, is_mtp_layer=True)
    assert isinstance(mtp.router, LearnedTopKRouter) and not mtp.is_hash_layer
    with pytest.raises(ValueError, match="seq_aux_loss"):
        LearnedTopKRouter(make_config(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1))
    with pytest.raises(ValueError, match="moe_shared_expert_overlap"):
        get_dsv4_moe_spec(hash_routing=False)(
            config=make_config(moe_shared_expert_overlap=True), pg_collection=None, is_mtp_layer=False
        )
    with pytest.raises(ValueError, match="swiglu limit"):
        get_dsv4_moe_spec(hash_routing=False)(
            config=make_config(limit=-1.0), pg_collection=None, is_mtp_layer=False
        )


@pytest.mark.gpu
@pytest.mark.parametrize("hash_routing", [False, True])
def test_layer_bf16_alltoall_on_gpu_matches_reference(megatron_cpu, hash_routing):
    from dsv4_testkit import assert_close_to_ref

    torch.manual_seed(7)
    cfg = make_config(dtype=torch.bfloat16, bf16=True, moe_token_dispatcher_type="alltoall", balance=0.0)
    spec = get_dsv4_moe_spec(
        hash_routing=hash_routing, vocab_size=VOCAB, tid2eid=tid2eid_table() if hash_routing else None
    )
    layer = spec(config=cfg, pg_collection=None, is_mtp_layer=False).cuda()
    w = full_weights(dtype=torch.bfloat16)
    load_weights(layer, w, list(range(EXPERTS)))
    s, b = 37, 2
    x = torch.randn(s, b, HIDDEN, dtype=torch.bfloat16)
    ids = torch.randint(0, VOCAB, (b, s))
    pad = torch.zeros(b, s, dtype=torch.bool)
    pad[1, -5:] = True
    g = torch.randn(s, b, HIDDEN, dtype=torch.float64)
    xc = x.clone().cuda().requires_grad_()
    out, _ = layer(xc, padding_mask=pad.cuda(), input_ids=ids.cuda())
    out.backward(g.cuda().bfloat16())
    refs = {}
    for dt in (torch.float64, torch.bfloat16):
        wd = {k: (v if k == "bias" else v.to(dt)) for k, v in w.items()}
        leaves = ref_leaves(wd)
        xr = x.clone().to(dt).requires_grad_()
        ref = layer_reference(xr, ids, pad, wd, leaves, hash_routing)
        ref.backward(g.to(dt))
        refs[dt] = (ref.detach(), xr.grad, leaves["gate_up"].grad)
    got = (out.detach().cpu(), xc.grad.cpu(), layer.experts.gate_up_proj.grad.cpu())
    for name, a, r64, rbf in zip(("out", "dx", "dgate_up"), got, refs[torch.float64], refs[torch.bfloat16]):
        assert_close_to_ref(name, a, r64, rbf)


def test_routed_decode_path_switch(megatron_cpu):
    """The routed-expert kernels serve eval-mode no-grad CUDA forwards only; a negative row limit is refused."""
    layer, _ = build_layer(False)
    # on by default for decode-size forwards (up to 42 tokens at top-6)
    assert layer.experts.routed_max_rows == 256
    x = torch.randn(4, HIDDEN, dtype=torch.float64)
    layer.eval()
    with torch.no_grad():
        assert not layer.experts._takes_routed_path(x)  # CPU: the grouped path
    with pytest.raises(ValueError, match="routed_max_rows"):
        ClampedSwiGLUExperts(EXPERTS, make_config(), routed_max_rows=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5])
def test_layer_bf16_decode_takes_routed_kernels_on_gpu(megatron_cpu, tokens):
    """Eval + no_grad on CUDA with few rows: the routed-expert kernels, within the bf16
    rule of the fp64 reference, close to the grouped GEMM path (``routed_max_rows = 0``)."""
    torch.manual_seed(11)
    cfg = make_config(dtype=torch.bfloat16, bf16=True, moe_token_dispatcher_type="alltoall", balance=0.0)
    layer = get_dsv4_moe_spec(hash_routing=False)(config=cfg, pg_collection=None, is_mtp_layer=False).cuda()
    w = full_weights(dtype=torch.bfloat16)
    load_weights(layer, w, list(range(EXPERTS)))
    layer.eval()
    assert layer.experts.routed_max_rows == 256  # the default: decode-size forwards take the routed kernels
    x = torch.randn(1, tokens, HIDDEN, dtype=torch.bfloat16)
    ids = torch.randint(0, VOCAB, (tokens, 1))
    calls = []
    layer.experts.register_forward_pre_hook(lambda m, inp: calls.append(m._takes_routed_path(inp[0])))
    with torch.no_grad():
        out, _ = layer(x.cuda(), input_ids=ids.cuda())
        layer.experts.routed_max_rows = 0
        grouped, _ = layer(x.cuda(), input_ids=ids.cuda())
    assert calls == [True, False]
    refs = {}
    for dt in (torch.float64, torch.bfloat16):
        wd = {k: (v if k == "bias" else v.to(dt)) for k, v in w.items()}
        refs[dt] = layer_reference(x.to(dt), ids, None, wd, ref_leaves(wd), False).detach()
    assert_close_to_ref("out", out.cpu(), refs[torch.float64], refs[torch.bfloat16])
    assert_close_to_ref("grouped", grouped.cpu(), refs[torch.float64], refs[torch.bfloat16])
