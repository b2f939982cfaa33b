"""DSv4 attention as the ``self_attention`` of megatron-core 0.19.2's ``TransformerLayer`` (SBHD and THD), and the
MTP identity propagated by :class:`DSv4TransformerLayer`."""

from __future__ import annotations

import pytest
import torch
from _attention_testconfig import tiny_config
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.spec_utils import build_module

from dsv4_attention.megatron import DSv4HybridAttention, DSv4TransformerLayer, get_dsv4_layer_spec


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_layer_forward_backward_sbhd(pg, ratio):
    cfg = tiny_config(hidden_dropout=0.0)
    layer = build_module(get_dsv4_layer_spec(ratio), config=cfg, layer_number=1, pg_collection=pg)
    assert isinstance(layer, DSv4TransformerLayer) and isinstance(layer.self_attention, DSv4HybridAttention)
    seq = 131 if ratio == 128 else 21
    x = torch.randn(seq, 2, 64, requires_grad=True)
    out, context = layer(x, attention_mask=None)
    assert out.shape == x.shape and context is None
    # residual: out = x + attention(input_layernorm(x))
    attn, _ = layer.self_attention(layer.input_layernorm(x))
    torch.testing.assert_close(out, x + attn, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_layer_forward_thd(pg):
    cfg = tiny_config(hidden_dropout=0.0)
    layer = build_module(get_dsv4_layer_spec(4), config=cfg, layer_number=1, pg_collection=pg)
    x = torch.randn(30, 1, 64)
    cu = torch.tensor([0, 12, 30], dtype=torch.int32)
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=18, max_seqlen_kv=18
    )
    with torch.no_grad():
        out, _ = layer(x, attention_mask=None, packed_seq_params=psp)
        first, _ = layer(x[:12], attention_mask=None)
    torch.testing.assert_close(out[:12], first, rtol=1e-5, atol=1e-5)


def test_layer_rejects_an_explicit_mask(pg):
    layer = build_module(get_dsv4_layer_spec(0), config=tiny_config(), layer_number=1, pg_collection=pg)
    x = torch.randn(5, 1, 64)
    with pytest.raises(ValueError, match="explicit attention masks"):
        layer(x, attention_mask=torch.ones(1, 1, 5, 5, dtype=torch.bool))


def test_mtp_identity_is_propagated(pg):
    """The layer's is_mtp_layer reaches the attention: ratio lookup after the main layers, own tracker slot."""
    cfg = tiny_config(num_layers=3, mtp_num_layers=1, csa_compress_ratios=[4, 128, 4, 0])
    main = build_module(get_dsv4_layer_spec(None), config=cfg, layer_number=1, pg_collection=pg)
    mtp = build_module(
        get_dsv4_layer_spec(None), config=cfg, layer_number=1, pg_collection=pg, is_mtp_layer=True
    )
    assert main.self_attention.compress_ratio == 4 and not main.self_attention.is_mtp_layer
    assert mtp.self_attention.compress_ratio == 0 and mtp.self_attention.is_mtp_layer
    assert (main.self_attention.tracker_slot, mtp.self_attention.tracker_slot) == (0, 3)


def test_sharded_state_dict_covers_every_parameter(pg):
    """Distributed checkpointing: every parameter (incl. the fp32 sink / ape and the grouped wo_a) is sharded."""
    layer = build_module(get_dsv4_layer_spec(4), config=tiny_config(), layer_number=1, pg_collection=pg)
    sd = layer.sharded_state_dict(prefix="layers.0.")
    names = {f"layers.0.{n}" for n, _ in layer.named_parameters()}
    assert names <= set(sd)
    assert tuple(sd["layers.0.self_attention.core_attention.attn_sink"].global_shape) == (4,)
