"""megatron-core 0.19.2 integration: the layer wrapper, the HybridStack with streams, and PP=2 transport (P3)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import mhc_megatron_model as tiny

from dsv4_testkit import run_distributed
from mhc import MHCConfig, mhc_post_ref, mhc_pre_ref

S, B, D, N = 5, 2, 32, 4


def _layer(kind: str, pg_seed: int = 0):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from mhc.megatron import hyper_connection_layer_spec

    sub = get_gpt_layer_local_spec(normalization="RMSNorm").submodules
    if kind == "attention":
        sub = dataclasses.replace(sub, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp)
    elif kind == "mlp":
        sub = dataclasses.replace(
            sub, input_layernorm=IdentityOp, self_attention=IdentityOp, self_attn_bda=IdentityFuncOp
        )
    torch.manual_seed(pg_seed)
    spec = hyper_connection_layer_spec(
        ModuleSpec(module=TransformerLayer, submodules=sub), MHCConfig(hidden_size=D, sinkhorn_iters=5)
    )
    layer = build_module(
        spec,
        config=tiny.transformer_config(1),
        layer_number=1,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    with torch.no_grad():
        for hc in (layer.attn_hc, layer.mlp_hc):
            if hc is not None:
                hc.fn.normal_(std=0.3)
                hc.scale.fill_(1.0)
                hc.base.normal_()
    return layer


def _mask():
    return torch.triu(torch.ones(S, S, dtype=torch.bool), 1)[None, None]


def test_full_layer_is_two_mhc_blocks(megatron_cpu):
    # attention + MLP TransformerLayer == DSv4 block: mHC(attn) then mHC(MLP), no inner residual anywhere
    layer = _layer("full")
    inner = layer.inner_layer
    x = torch.randn(S, B, N * D)
    out, _ = layer(x, attention_mask=_mask())

    def hc_ref(hc, streams, fn_):
        kw = dict(sinkhorn_iters=5)
        x_in, post, comb = mhc_pre_ref(streams, hc.fn, hc.scale, hc.base, **kw)
        return mhc_post_ref(fn_(x_in), streams, post, comb)

    def attn(h):
        o, _bias = inner.self_attention(inner.input_layernorm(h), attention_mask=_mask())
        return o

    def mlp(h):
        o, _bias = inner.mlp(inner.pre_mlp_layernorm(h))
        return o

    streams = x.view(S, B, N, D)
    streams = hc_ref(layer.attn_hc, streams, attn)
    streams = hc_ref(layer.mlp_hc, streams, mlp)
    torch.testing.assert_close(out, streams.reshape(S, B, N * D), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("kind", "attn", "mlp"), [("attention", True, False), ("mlp", False, True)])
def test_hybrid_layers_get_one_connection(megatron_cpu, kind, attn, mlp):
    layer = _layer(kind)
    assert (layer.attn_hc is not None) == attn and (layer.mlp_hc is not None) == mlp
    x = torch.randn(S, B, N * D, requires_grad=True)
    out, _ = layer(x, attention_mask=_mask())
    assert out.shape == x.shape and out.dtype == x.dtype
    out.square().sum().backward()
    hc = layer.attn_hc or layer.mlp_hc
    for p in (x, hc.fn, hc.base, hc.scale):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


def test_layer_rejects_unexpanded_input(megatron_cpu):
    layer = _layer("mlp")
    with pytest.raises(ValueError, match="streams"):
        layer(torch.randn(S, B, D))


def test_hc_params_stay_fp32_under_bfloat16(megatron_cpu):
    layer = _layer("attention").bfloat16()
    assert layer.inner_layer.self_attention.linear_qkv.weight.dtype == torch.bfloat16
    for p in (layer.attn_hc.fn, layer.attn_hc.base, layer.attn_hc.scale):
        assert p.dtype == torch.float32 and getattr(p, "keep_in_fp32", False)


def test_p2p_shapes(megatron_cpu):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from mhc.megatron import make_mhc_adjust_tensor_shapes_fn, mhc_p2p_tensor_shapes, mhc_pipeline_hidden_size

    pg = ProcessGroupCollection.use_mpu_process_groups()
    cfg = tiny.transformer_config(1)
    shapes = mhc_p2p_tensor_shapes(
        seq_length=16, micro_batch_size=3, config=cfg, num_streams=4, cp_group=pg.cp, tp_group=pg.tp
    )
    assert shapes == [(16, 3, 4 * D)]
    recv, send = make_mhc_adjust_tensor_shapes_fn(4)([(16, 3, D)], [(16, 3, D), ()])
    assert recv == [(16, 3, 4 * D)] and send == [(16, 3, 4 * D), ()]
    edge = dict(hidden_size=D, num_streams=4)
    assert mhc_pipeline_hidden_size(**edge, is_recv=True, is_first_stage=True, is_last_stage=False) == D
    assert mhc_pipeline_hidden_size(**edge, is_recv=False, is_first_stage=False, is_last_stage=True) == D
    assert mhc_pipeline_hidden_size(**edge, is_recv=True, is_first_stage=False, is_last_stage=True) == 4 * D
    assert mhc_pipeline_hidden_size(**edge, is_recv=False, is_first_stage=True, is_last_stage=False) == 4 * D
    with pytest.raises(ValueError):
        make_mhc_adjust_tensor_shapes_fn(0)


def test_folded_streams_round_trip_and_gradient(megatron_cpu):
    """The interleaved schedule's folded transport: [s, b, n·d] -> [s·n, b, d] -> back is the identity on values and
    on the gradient (views of one buffer), the folded shape is the schedule's [seq_length, b, d] with seq_length =
    s·n, and only VPP configs fold."""
    import dataclasses

    from mhc.megatron import fold_streams, mhc_folded_seq_length, unfold_streams, uses_folded_streams

    s, b, n = 7, 3, 4
    x = torch.randn(s, b, n * D, requires_grad=True)
    folded = fold_streams(x, n)
    assert folded.shape == (mhc_folded_seq_length(s, n), b, D)
    # the bytes on the wire are the streams' bytes in their own order
    assert torch.equal(folded.detach().flatten(), x.detach().flatten())
    wire = folded.detach().clone().requires_grad_()  # what the receiving stage gets
    back = unfold_streams(wire, n)
    assert torch.equal(back, x.detach())
    g = torch.randn(s, b, n * D)
    back.backward(g)
    folded.backward(wire.grad)  # the sending stage's backward with the received gradient
    assert torch.equal(x.grad, g)
    with pytest.raises(ValueError, match="mhc_folded_seq_length"):
        unfold_streams(torch.zeros(6, b, D), 4)
    with pytest.raises(ValueError):
        fold_streams(torch.zeros(s, b, 10), 4)
    cfg = tiny.transformer_config(2)
    assert not uses_folded_streams(cfg)
    assert uses_folded_streams(dataclasses.replace(cfg, virtual_pipeline_model_parallel_size=2))


def test_pipeline_dtype_must_be_the_stream_dtype(megatron_cpu):
    from megatron.core.transformer.spec_utils import build_module

    from mhc.megatron import check_mhc_pipeline_dtype, hyper_connection_stack_spec, mhc_pipeline_dtype

    fp32_streams = MHCConfig(hidden_size=D)
    bf16_streams = MHCConfig(hidden_size=D, stream_dtype=torch.bfloat16)
    assert mhc_pipeline_dtype(fp32_streams) == torch.float32
    assert mhc_pipeline_dtype(bf16_streams) == torch.bfloat16
    pp2_bf16 = dataclasses.replace(tiny.transformer_config(2), pipeline_dtype=torch.bfloat16)
    check_mhc_pipeline_dtype(pp2_bf16, bf16_streams)
    check_mhc_pipeline_dtype(tiny.transformer_config(2), fp32_streams)
    check_mhc_pipeline_dtype(
        dataclasses.replace(tiny.transformer_config(1), pipeline_dtype=torch.bfloat16), fp32_streams
    )
    with pytest.raises(ValueError, match=r"pipeline_dtype=torch\.float32"):
        check_mhc_pipeline_dtype(pp2_bf16, fp32_streams)
    # the stack refuses at build time (the regression: bf16 p2p buffers for fp32 streams broke the first send)
    spec = hyper_connection_stack_spec(tiny.local_hybrid_stack_spec(), fp32_streams)
    with pytest.raises(ValueError, match="mHC streams crossing pipeline stages"):
        build_module(spec, pp2_bf16, pre_process=True, post_process=False, layer_type_list=["*", "-"])


@pytest.mark.slow
@pytest.mark.distributed
def test_pp2_matches_pp1():
    # HybridModel "*-|*-" with our mHC stack on 2 gloo pipeline stages == the same model on one stage
    ref = tiny.run_stage(0, 1)
    stages = run_distributed(tiny.run_stage, 2)
    assert stages[0]["loss"] is None and stages[1]["loss"] is not None
    assert abs(stages[1]["loss"] - ref["loss"]) <= 1e-6 * max(1.0, abs(ref["loss"]))
    grads = {**stages[0]["grads"], **stages[1]["grads"]}
    assert set(grads) == set(ref["grads"])
    assert any(".attn_hc." in k for k in grads) and any("hyper_head" in k for k in grads)
    for name, g in ref["grads"].items():
        err = float(abs(grads[name] - g).max())
        assert err <= 1e-6 * max(1.0, float(abs(g).max())), (name, err)


def test_stack_expands_collapses_and_returns_streams_for_mtp(megatron_cpu):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from mhc.megatron import hyper_connection_stack_spec

    cfg = MHCConfig(hidden_size=D, sinkhorn_iters=3, backend="reference")
    spec = hyper_connection_stack_spec(tiny.local_hybrid_stack_spec(), cfg, return_streams=True)
    stack = build_module(
        spec,
        tiny.transformer_config(1),
        pre_process=True,
        post_process=True,
        layer_type_list=["*", "-"],
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    e = torch.randn(S, B, D)
    h, streams = stack(e, attention_mask=_mask())
    assert streams.shape == (S, B, N, D) and h.shape == (S, B, D)
    torch.testing.assert_close(h, stack.final_norm(stack.hyper_head(streams)))
    # the first layer sees N identical copies of the embedding
    x0 = stack.expansion(e)
    assert torch.equal(x0[:, :, 0], e) and torch.equal(x0[:, :, 3], e)
