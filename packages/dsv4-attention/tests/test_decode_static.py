"""The static-shape decode step (``AttentionCache.extend_static``: device-side lengths, fixed shapes, what a CUDA
graph captures) against the eager step (``AttentionCache.extend``) and the training forward, per layer kind.

Rule (fp32): ``max|static - eager| <= 1e-5 * max(1, max|eager|)`` (the same ops on the same rows; the static index
lists only have longer masked tails), and every row within the same bound of the full forward.
"""

from __future__ import annotations

import pytest
import torch
from test_decode_cache import RTOL, assert_rows_close, full_forward, make_layer

from dsv4_attention import LayerKind
from dsv4_attention.decode import AttentionCache, ExtendPlan, extend_static

# decoded 8 steps in lockstep: crosses the window (1 -> 9), ratio-4 entries 0 and 1 (1, 3), the first ratio-128
# block from inside (124) and from just before it (127)
PROMPTS = [1, 3, 8, 12, 13, 124, 127]
STEPS = 8


@pytest.mark.parametrize("kind", list(LayerKind), ids=lambda k: k.name)
def test_static_step_equals_eager_step_and_full_forward(kind):
    layer = make_layer(kind, seed=3)
    total = max(PROMPTS) + STEPS + 1  # + the eager call after the static steps
    xs = [torch.randn(p + STEPS, 64) for p in PROMPTS]
    eager, static = (AttentionCache(layer, len(PROMPTS), total) for _ in range(2))
    plan = ExtendPlan((0,) * len(PROMPTS), tuple(PROMPTS))
    prompt_rows = torch.cat([x[:p] for x, p in zip(xs, PROMPTS)])
    for cache in (eager, static):
        cache.extend(layer, prompt_rows, plan)
    lengths = torch.tensor(PROMPTS)  # device positions of the static path
    got_eager, got_static = [], []
    for step in range(STEPS):
        x = torch.stack([x[p + step] for x, p in zip(xs, PROMPTS)])  # [B, d]
        got_eager.append(eager.extend(layer, x, ExtendPlan(eager.lengths, (1,) * len(PROMPTS))))
        got_static.append(static.extend_static(layer, x, lengths))
        lengths += 1
    static.advance(tuple(lengths.tolist()))
    assert static.lengths == eager.lengths
    for step, (a, b) in enumerate(zip(got_static, got_eager)):
        assert torch.isfinite(a).all()
        assert_rows_close(f"{kind.name} step {step}", a, b)
    # the held compressor rows and entries match too: an eager call after static steps continues exactly
    x = torch.stack([x[-1] for x in xs]) * 0.5
    after = [c.extend(layer, x, ExtendPlan(c.lengths, (1,) * len(PROMPTS))) for c in (static, eager)]
    assert_rows_close(f"{kind.name} eager after static", after[0], after[1])
    for b, (x, p) in enumerate(zip(xs, PROMPTS)):
        full = full_forward(layer, x)[p:]  # [STEPS, d]
        assert_rows_close(f"{kind.name} prompt {p}", torch.stack([s[b] for s in got_static]), full)


def test_static_step_refuses_wrong_shapes():
    layer = make_layer(LayerKind.CSA)
    cache = AttentionCache(layer, 2, 16)
    with pytest.raises(ValueError, match="one row per sequence"):
        extend_static(cache, layer, torch.randn(3, 64), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="belongs to a CSA layer"):
        cache.extend_static(make_layer(LayerKind.HCA), torch.randn(2, 64), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="at most max_length=16"):
        cache.advance((3, 17))
    assert RTOL == 1e-5
