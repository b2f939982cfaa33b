"""The plain-PyTorch core (no megatron): it builds and runs on its own, equals the megatron adapter bitwise, and its
Triton backend (under ``TRITON_INTERPRET=1`` on CPU, as the testkit sets it) matches the reference backend."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dsv4_attention import (
    AttentionConfig,
    DSv4Attention,
    IndexerConfig,
    IndexerLossAutoScaler,
    LayerKind,
    rope_config_for_kind,
    sbhd_layout,
)
from dsv4_primitives import YarnConfig
from dsv4_testkit import assert_close_to_ref


def core_config(kind: LayerKind, **overrides) -> AttentionConfig:
    """The tests' tiny megatron config (``_attention_testconfig.TINY``) as a core config."""
    yarn = YarnConfig(factor=4.0, original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0)
    kw = dict(
        kind=kind,
        hidden_size=64,
        num_heads=4,
        head_dim=32,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        window=8,
        rope=rope_config_for_kind(kind, 8, yarn=yarn),
        indexer=IndexerConfig(hidden_size=64, q_lora_rank=32, n_heads=2, head_dim=16, topk=4),
    )
    return AttentionConfig(**{**kw, **overrides})


def _randomise(m: torch.nn.Module, seed: int = 0) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)


SEQ = {LayerKind.WINDOW: 13, LayerKind.CSA: 37, LayerKind.HCA: 131}


@pytest.mark.parametrize("kind", list(LayerKind), ids=lambda k: k.name)
def test_core_equals_megatron_adapter_bitwise(build, kind):
    adapter = build(kind.compress_ratio)
    core = DSv4Attention(core_config(kind)).train()
    assert not any(type(mod).__module__.startswith("megatron") for mod in core.modules())
    # same keys and shapes (megatron's linears add an empty `_extra_state` entry each)
    sd = {k: v for k, v in adapter.state_dict().items() if not k.endswith("._extra_state")}
    core.load_state_dict(sd, strict=True)
    x = torch.randn(SEQ[kind], 2, 64)
    w = torch.randn_like(x)
    layout = sbhd_layout(SEQ[kind], 2)
    IndexerLossAutoScaler.set_loss_scale(0.5)
    try:
        xa = x.clone().requires_grad_(True)
        ya, _ = adapter(xa)
        (ya * w).sum().backward()
        xc = layout.to_tokens(x).requires_grad_(True)
        yc, loss = core(xc, layout)
        assert (loss is not None) == kind.has_indexer
        (layout.from_tokens(yc) * w).sum().backward()
    finally:
        IndexerLossAutoScaler.reset()
    assert torch.equal(layout.from_tokens(yc), ya)
    assert torch.equal(layout.from_tokens(xc.grad), xa.grad)
    grads_a = dict(adapter.named_parameters())
    for name, p in core.named_parameters():
        ga, gc = grads_a[name].grad, p.grad
        assert (ga is None) == (gc is None), name
        assert ga is None or torch.equal(ga, gc), name


@pytest.mark.parametrize("kind", list(LayerKind), ids=lambda k: k.name)
def test_triton_backend_matches_reference_backend(kind):
    """Forward and every gradient (LM loss + indexer loss) of a tiny layer: Triton (interpreted on CPU) in fp32
    against the reference backend in fp64, within 2x the reference backend's own fp32 error (project rule)."""
    t = SEQ[kind]
    ref = DSv4Attention(core_config(kind, backend="reference")).train()
    _randomise(ref)
    tri = DSv4Attention(core_config(kind, backend="triton")).train()
    tri.load_state_dict(ref.state_dict())
    ref64 = DSv4Attention(core_config(kind, backend="reference")).train()
    ref64.load_state_dict(ref.state_dict())
    ref64.double()  # attn_sink / ape stay fp32 (keep-in-FP32 marks)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(t, 64, generator=gen)
    w = torch.randn(t, 64, generator=gen)
    layout = sbhd_layout(t, 1)

    def run(m, dtype):
        xi = x.to(dtype).detach().clone().requires_grad_(True)
        y, _ = m(xi, layout)
        (y * w.to(dtype)).sum().backward()
        return y, xi.grad, {n: p.grad for n, p in m.named_parameters()}

    y_t, dx_t, g_t = run(tri, torch.float32)
    y_64, dx_64, g_64 = run(ref64, torch.float64)
    y_32, dx_32, g_32 = run(ref, torch.float32)
    assert_close_to_ref("y", y_t, y_64, y_32)
    assert_close_to_ref("dx", dx_t, dx_64, dx_32)
    for name, g in g_t.items():
        if g_64[name] is None:  # unused (e.g. no complete block): unused by both
            assert g is None or torch.count_nonzero(g) == 0, name
            continue
        assert g is not None, name
        assert_close_to_ref(f"d{name}", g, g_64[name], g_32[name])


def test_core_without_megatron():
    """``import dsv4_attention`` and every layer kind work with megatron-core absent; the adapter says which extra
    to install."""
    code = """
import sys
sys.modules["megatron"] = None  # any import of megatron raises ImportError
import torch
from dsv4_attention import AttentionConfig, DSv4Attention, IndexerConfig, LayerKind, rope_config_for_kind, sbhd_layout
for kind in LayerKind:
    cfg = AttentionConfig(kind=kind, hidden_size=32, num_heads=2, head_dim=16, q_lora_rank=8, o_groups=2,
                          o_lora_rank=4, window=4, rope=rope_config_for_kind(kind, 4),
                          indexer=IndexerConfig(hidden_size=32, q_lora_rank=8, n_heads=2, head_dim=8, topk=2))
    m = DSv4Attention(cfg).train()
    x = torch.randn(140, 32, requires_grad=True)
    y, loss = m(x, sbhd_layout(140, 1))
    assert y.shape == (140, 32) and (loss is not None) == kind.has_indexer
    y.sum().backward()
    assert torch.isfinite(x.grad).all()
try:
    import dsv4_attention.megatron
except ImportError as e:
    assert "dsv4-attention[megatron]" in str(e), e
else:
    raise AssertionError("dsv4_attention.megatron imported without megatron")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip().endswith("ok")


def test_configs_are_frozen_and_validated():
    cfg = core_config(LayerKind.CSA)
    with pytest.raises(AttributeError):
        cfg.window = 3  # frozen
    with pytest.raises(ValueError, match="needs an IndexerConfig"):
        core_config(LayerKind.CSA, indexer=None)
    with pytest.raises(ValueError, match="divisible by o_groups"):
        core_config(LayerKind.WINDOW, o_groups=3)
    with pytest.raises(ValueError, match="tie_break"):
        IndexerConfig(hidden_size=64, q_lora_rank=32, n_heads=2, head_dim=16, topk=4, tie_break="random")
    assert (
        core_config(LayerKind.HCA).compressor.ratio == 128
        and not core_config(LayerKind.HCA).compressor.kind.overlap
    )
    assert core_config(LayerKind.WINDOW).compressor is None
