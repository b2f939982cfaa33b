"""The ``*`` symbol's attention: the causal core against its fp32 reference (outputs and gradients, SBHD, GQA,
packed THD with padding) and the layer's own RoPE restarting at every packed document."""

from types import SimpleNamespace

import pytest
import torch

from dsv4_testkit import assert_close_to_ref
from hybrid_model.standard_attention import CausalSoftmaxAttention, causal_attention_reference, document_ids


def _core(kv_channels):
    cfg = SimpleNamespace(kv_channels=kv_channels)
    core = CausalSoftmaxAttention.__new__(CausalSoftmaxAttention)
    torch.nn.Module.__init__(core)
    core.config, core.layer_number, core.softmax_scale = cfg, 1, kv_channels**-0.5
    return core


def _grads(fn, *xs):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    out = fn(*xs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    out.backward(g)
    return out.detach(), [x.grad for x in xs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("s, b, hq, hk, d", [(13, 2, 4, 4, 8), (7, 1, 6, 2, 5), (1, 3, 2, 1, 4)])
def test_sbhd_matches_reference(dtype, s, b, hq, hk, d):
    torch.manual_seed(0)
    q, k, v = torch.randn(s, b, hq, d), torch.randn(s, b, hk, d), torch.randn(s, b, hk, d)
    core = _core(d)
    fast = lambda q, k, v: core(q.to(dtype), k.to(dtype), v.to(dtype)).view(s, b, hq, d)
    ref = lambda q, k, v: causal_attention_reference(q, k, v, d**-0.5)
    same = lambda q, k, v: causal_attention_reference(q.to(dtype), k.to(dtype), v.to(dtype), d**-0.5)
    out, grads = _grads(fast, q, k, v)
    want, want_grads = _grads(ref, q, k, v)
    same_out, same_grads = _grads(same, q, k, v) if dtype != torch.float32 else (None, [None] * 3)
    assert_close_to_ref("out", out, want, same_out)
    for name, g, w, sg in zip("qkv", grads, want_grads, same_grads):
        assert_close_to_ref(f"d{name}", g, w, sg)


def test_thd_attends_within_documents_and_padding_is_isolated():
    torch.manual_seed(1)
    cu = torch.tensor([0, 5, 6, 13])  # documents of 5, 1, 7 rows; rows 13..15 are pack padding
    T, h, d = 16, 3, 4
    q, k, v = torch.randn(T, h, d), torch.randn(T, h, d), torch.randn(T, h, d)
    psp = SimpleNamespace(cu_seqlens_q=cu, cu_seqlens_q_padded=None)
    core = _core(d)
    doc = document_ids(cu, T)
    assert doc.tolist() == [0] * 5 + [1] + [2] * 7 + [-1] * 3
    fast = lambda q, k, v: core(q, k, v, packed_seq_params=psp).view(T, 1, h, d)
    ref = lambda q, k, v: causal_attention_reference(q[:, None], k[:, None], v[:, None], d**-0.5, doc)
    out, grads = _grads(fast, q, k, v)
    want, want_grads = _grads(ref, q, k, v)
    assert_close_to_ref("out", out, want)
    for name, g, w in zip("qkv", grads, want_grads):
        assert_close_to_ref(f"d{name}", g, w)
    # each document alone (SBHD) gives the same rows
    for a, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = causal_attention_reference(q[a:e, None], k[a:e, None], v[a:e, None], d**-0.5)
        torch.testing.assert_close(out[a:e], alone, rtol=1e-5, atol=1e-6)


def test_packed_layer_equals_each_document_alone(megatron_cpu):
    """The whole '*' layer (QKV, own RoPE, core, output projection): a packed pack of two documents gives each
    document's rows of its own SBHD forward (positions restart at every document)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.spec_utils import build_module

    from hybrid_model.mixers.attention import attention_layer_spec
    from hybrid_model.presets import get_preset
    from hybrid_model.spec import select_backend, transformer_config

    cfg = get_preset("tiny").with_pattern("*E")
    tc = transformer_config(cfg)
    torch.manual_seed(0)
    layer = build_module(attention_layer_spec(cfg, select_backend("local")), config=tc, layer_number=1)
    rot = layer.self_attention.rotary
    assert rot.inv_freq.numel() * 2 == round(tc.kv_channels * cfg.qk_rope_head_dim / cfg.head_dim)
    lens = [6, 9]
    x = torch.randn(sum(lens), 1, cfg.hidden_size)
    cu = torch.tensor([0, 6, 15], dtype=torch.int32)
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9
    )
    packed, _ = layer(x, None, packed_seq_params=psp)
    for a, e in [(0, 6), (6, 15)]:
        alone, _ = layer(x[a:e], None)
        torch.testing.assert_close(packed[a:e], alone, rtol=1e-5, atol=1e-5)
