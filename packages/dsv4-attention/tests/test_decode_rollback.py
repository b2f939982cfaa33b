"""Rollback of a decode cache (``AttentionCache.extend(..., undo=True)`` + ``rollback``), as speculative decoding
uses it: every call appends real rows followed by junk rows (rejected drafts) and drops the junk again. If the
rollback left anything of the junk behind (a ring slot, a held compressor row, a visible entry or indexer key), a
later real row would attend it; so every real row's output must still equal the training forward of the real
sequence (fp32 rule of ``test_decode_cache.py``).
"""

from __future__ import annotations

import pytest
import torch
from test_decode_cache import assert_rows_close, full_forward, make_layer

from dsv4_attention import LayerKind
from dsv4_attention.decode import AttentionCache, ExtendPlan


@pytest.mark.parametrize("kind", list(LayerKind), ids=lambda k: k.name)
def test_rolled_back_junk_rows_leave_no_trace(kind):
    """Prompts ending inside / on the window (8), on ratio-4 and just before the ratio-128 boundary; each call
    adds 3 rows, of which 0 to 3 real ones are kept (crossing every boundary), 12 real rows per sequence."""
    layer = make_layer(kind, seed=3)
    prompts = [1, 8, 12, 126]
    totals = [p + 12 for p in prompts]
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 64, generator=g) for n in totals]
    cache = AttentionCache(layer, len(prompts), max(totals) + 3)
    plan = ExtendPlan(cache.lengths, tuple(prompts))
    y = cache.extend(layer, torch.cat([x[:p] for x, p in zip(xs, prompts)]), plan, undo=True)
    outs = [[y[a:b]] for a, b in zip(plan.row_starts, plan.row_starts[1:])]
    cache.rollback(plan.new_lengths)  # nothing dropped
    step = 0
    while any(n < total for n, total in zip(cache.lengths, totals)):
        kept = [min((step + b + 2) % 4, total - n) for b, (n, total) in enumerate(zip(cache.lengths, totals))]
        plan = ExtendPlan(cache.lengths, (3,) * len(prompts))
        rows = [
            torch.cat((x[n : n + k], torch.randn(3 - k, 64, generator=g)))
            for x, n, k in zip(xs, cache.lengths, kept)
        ]
        y = cache.extend(layer, torch.cat(rows), plan, undo=True)
        for b, (r0, k) in enumerate(zip(plan.row_starts, kept)):
            outs[b].append(y[r0 : r0 + k])
        cache.rollback(tuple(n + k for n, k in zip(plan.lengths, kept)))
        step += 1
    for b, (x, prompt) in enumerate(zip(xs, prompts)):
        assert_rows_close(f"{kind.name} prompt {prompt}", torch.cat(outs[b]), full_forward(layer, x))


def test_rollback_refusals():
    layer = make_layer(LayerKind.CSA)
    cache = AttentionCache(layer, 1, 16)
    cache.extend(layer, torch.randn(4, 64), ExtendPlan((0,), (4,)))
    with pytest.raises(ValueError, match="undo=True"):
        cache.rollback((2,))
    cache.extend(layer, torch.randn(3, 64), ExtendPlan((4,), (3,)), undo=True)
    with pytest.raises(ValueError, match=r"between the last call's lengths \(4,\) and \(7,\)"):
        cache.rollback((3,))
    cache.rollback((5,))
    assert cache.lengths == (5,)
    with pytest.raises(ValueError, match="no rollback since"):
        cache.rollback((5,))
