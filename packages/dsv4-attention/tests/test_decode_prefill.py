"""Fast prefill (``dsv4_attention.decode.prefill``): the first call of an empty cache runs the training forward and
fills the cache from the prompts; its cache equals the eager :meth:`AttentionCache.extend` cache and decoding
continues identically.

Rule (fp32): outputs within ``1e-5 * max(1, max|ref|)`` (the same ops in another order); cache buffers within
``1e-6`` of the eager ones (the compressor state and entries come from the same calls; the window ring from the same
projection of fewer rows).
"""

from __future__ import annotations

import pytest
import torch

from dsv4_attention import AttentionConfig, DSv4Attention, IndexerConfig, LayerKind, rope_config_for_kind
from dsv4_attention.decode import AttentionCache, ExtendPlan
from dsv4_attention.decode import cache as cache_module
from dsv4_attention.decode.prefill import prefill, prompt_layout

RTOL = 1e-5


def make_layer(kind: LayerKind) -> DSv4Attention:
    """Window 8, 4 heads of 32, indexer 2 x 16 with top-4; every parameter random."""
    cfg = AttentionConfig(
        kind=kind,
        hidden_size=64,
        num_heads=4,
        head_dim=32,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        window=8,
        rope=rope_config_for_kind(kind, 8),
        indexer=IndexerConfig(hidden_size=64, q_lora_rank=32, n_heads=2, head_dim=16, topk=4),
    )
    torch.manual_seed(3)
    layer = DSv4Attention(cfg).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return layer


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, rtol: float = RTOL) -> None:
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = (got - ref).abs().max().item() if got.numel() else 0.0
    bound = rtol * max(1.0, ref.abs().max().item() if ref.numel() else 0.0)
    assert err <= bound, f"{name}: max|fast - eager| = {err:.3e} > {bound:.3e}"


def cache_buffers(cache: AttentionCache) -> dict[str, torch.Tensor]:
    out = {"ring": cache.window.kv}
    for label, comp in (("compressor", cache.compressed), ("indexer", cache.indexer and cache.indexer.keys)):
        if comp:
            out |= {f"{label} held kv": comp.held_kv, f"{label} held score": comp.held_score}
            out[f"{label} entries"] = comp.entries
    return out


# prompts: 1 token, an empty sequence, on the window (8), inside a ratio-4 group, on / after a ratio-128 block
PROMPTS = [1, 0, 8, 13, 128, 129]


CASES = [(kind, False) for kind in LayerKind] + [(LayerKind.CSA, True)]  # CSA's dense phase too


@pytest.mark.parametrize(
    ("kind", "dense"), CASES, ids=lambda c: getattr(c, "name", "dense" if c else "sparse")
)
def test_fast_prefill_cache_equals_eager_extend(kind, dense, monkeypatch):
    """Prefill a batch of prompts of different lengths with the fast path and with the eager extend: the same
    outputs, the same cache; then 6 decode steps per sequence give the same outputs on both caches."""
    layer = make_layer(kind)
    check_fast_prefill(layer, dense, monkeypatch, rtol_out=RTOL, rtol_cache=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("kind", "dense"), CASES, ids=lambda c: getattr(c, "name", "dense" if c else "sparse")
)
def test_fast_prefill_cache_equals_eager_extend_bf16_cuda(kind, dense, monkeypatch):
    """bf16 on CUDA (csa-kernels' Triton ops on both paths): the same check within bf16 rounding
    (``1e-2 * max(1, max|ref|)``, about two bf16 ulps)."""
    layer = make_layer(kind).cuda().bfloat16()
    check_fast_prefill(layer, dense, monkeypatch, rtol_out=1e-2, rtol_cache=1e-2)


def check_fast_prefill(layer, dense: bool, monkeypatch, *, rtol_out: float, rtol_cache: float) -> None:
    """Fast vs eager prefill of :data:`PROMPTS` on ``layer``'s device / dtype, then 6 decode steps on both."""
    calls = []
    monkeypatch.setattr(cache_module, "prefill", lambda *a: calls.append(1) or prefill(*a))
    kind = layer.kind
    weight = next(layer.linear_kv_proj.parameters())
    steps, total = 6, max(PROMPTS) + 6
    xs = [torch.randn(n + steps, 64).to(weight) for n in PROMPTS]
    fast, eager = AttentionCache(layer, len(PROMPTS), total), AttentionCache(layer, len(PROMPTS), total)
    plan = ExtendPlan(fast.lengths, PROMPTS)
    x = torch.cat([x[:n] for x, n in zip(xs, PROMPTS)])  # [R, d]
    y_fast = fast.extend(layer, x, plan, dense=dense)
    y_eager = eager.extend(layer, x, plan, dense=dense, fast_prefill=False)
    assert fast.lengths == eager.lengths == tuple(PROMPTS)
    assert calls == [1], "the first call of an empty cache must take the fast prefill (and only that call)"
    assert_close(f"{kind.name} prefill outputs", y_fast.float(), y_eager.float(), rtol_out)
    fast_buffers, eager_buffers = cache_buffers(fast), cache_buffers(eager)
    assert fast_buffers.keys() == eager_buffers.keys()
    for name, ref in eager_buffers.items():
        assert_close(f"{kind.name} {name}", fast_buffers[name].float(), ref.float(), rtol_cache)
    for step in range(steps):
        plan = ExtendPlan(fast.lengths, [1] * len(PROMPTS))
        x = torch.stack([x[n + step] for x, n in zip(xs, PROMPTS)])  # [B, d]
        y_fast = fast.extend(layer, x, plan, dense=dense)
        y_eager = eager.extend(layer, x, plan, dense=dense)
        assert_close(f"{kind.name} step {step}", y_fast.float(), y_eager.float(), rtol_out)
    assert calls == [1]


def test_fast_prefill_only_starts_empty_caches(monkeypatch):
    """A first call with ``undo`` takes the eager path (it keeps the rollback state); the prompt layout refuses
    non-empty sequences."""
    calls = []
    monkeypatch.setattr(cache_module, "prefill", lambda *a: calls.append(1) or prefill(*a))
    layer = make_layer(LayerKind.HCA)
    cache = AttentionCache(layer, 1, 16)
    cache.extend(layer, torch.randn(5, 64), ExtendPlan((0,), (5,)), undo=True)
    cache.rollback((3,))
    assert calls == [] and cache.lengths == (3,)
    plan = ExtendPlan((2, 0), (1, 3))
    with pytest.raises(ValueError, match="lengths all 0"):
        prompt_layout(plan, plan.row_positions())
