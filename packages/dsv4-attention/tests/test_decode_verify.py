"""The static speculative verify step (``AttentionCache.extend_static_pair``: two rows per sequence at device
positions ``n``, ``n + 1``) and its per-sequence on-device rollback (``rollback_static_pair``) against plain 1-row
static steps of the kept rows, per layer kind.

Rule (fp32): outputs of the kept rows within ``1e-5 * max(1, max|ref|)`` of the reference's, and every cache buffer
a later step reads (window ring, held compressor rows, entries, indexer keys) within the same bound: after a
rollback the cache is the cache of the kept rows only, so the next verify steps continue exactly.
"""

from __future__ import annotations

import pytest
import torch
from test_decode_cache import assert_rows_close, make_layer

from dsv4_attention import LayerKind
from dsv4_attention.decode import AttentionCache, ExtendPlan, PairIndices, extend_static

# verify steps from prompts inside / on the window (8), on ratio-4 boundaries, just before the ratio-128 boundary
PROMPTS = [1, 3, 8, 12, 126, 127]
STEPS = 5
# ACCEPT[b][step]: whether sequence b keeps its second row. Every sequence keeps and drops one; a dropped second row
# completes entry 0 of a ratio-4 compressor (prompt 1, step 1: position 3), a later ratio-4 entry that shifts the
# overlapping held rows (prompt 3, step 4: position 11; prompt 12, steps 1 and 4) and the ratio-128 entry 0 (prompt
# 126, step 0: position 127), so every part of the rollback (ring, held rows, entries, indexer keys) is compared.
ACCEPT = [
    [0, 0, 1, 0, 1],
    [1, 0, 1, 1, 0],
    [0, 1, 0, 1, 1],
    [1, 0, 0, 1, 0],
    [0, 1, 1, 0, 1],
    [1, 0, 1, 0, 0],
]


def _buffers(cache: AttentionCache) -> dict[str, torch.Tensor]:
    out = {"ring": cache.window.kv}
    for name, part in (("comp", cache.compressed), ("index", cache.indexer and cache.indexer.keys)):
        if part:
            out |= {
                f"{name}.kv": part.held_kv,
                f"{name}.score": part.held_score,
                f"{name}.entries": part.entries,
            }
    return out


@pytest.mark.parametrize("kind", list(LayerKind), ids=lambda k: k.name)
def test_verify_pair_and_rollback_equal_the_kept_steps(kind):
    layer = make_layer(kind, seed=4)
    bsz, total = len(PROMPTS), max(PROMPTS) + 2 * STEPS
    xs = [torch.randn(p + 2 * STEPS, 64) for p in PROMPTS]
    pair, ref = (AttentionCache(layer, bsz, total) for _ in range(2))
    plan = ExtendPlan((0,) * bsz, tuple(PROMPTS))
    for cache in (pair, ref):
        cache.extend(layer, torch.cat([x[:p] for x, p in zip(xs, PROMPTS)]), plan)
    lengths = torch.tensor(PROMPTS)  # [B] device positions
    for step in range(STEPS):
        accepted = torch.tensor([a[step] for a in ACCEPT], dtype=torch.bool)  # [B]
        rows = torch.arange(bsz)
        x_t, x_d = xs_at(xs, lengths), xs_at(xs, lengths + 1)  # [B, d] each
        y = pair.extend_static_pair(layer, torch.cat([x_t, x_d]), indices=PairIndices.of(lengths, bsz))
        pair.rollback_static_pair(accepted)
        want_t = extend_static(ref, layer, x_t, lengths.clone())  # [B, d]
        keep = rows[accepted]
        want_d = extend_static(ref, layer, x_d[keep], lengths[keep] + 1, sequences=keep)  # [K, d]
        assert_rows_close(f"{kind.name} step {step} t", y[:bsz], want_t)
        assert_rows_close(f"{kind.name} step {step} d", y[bsz:][keep], want_d)
        for name, buf in _buffers(pair).items():
            assert_rows_close(f"{kind.name} step {step} {name}", buf, _buffers(ref)[name])
        lengths += 1 + accepted.long()
    with pytest.raises(ValueError, match="bool tensor"):
        pair.rollback_static_pair(torch.ones(bsz, dtype=torch.long))


def xs_at(xs: list[torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
    """``[B, d]``: row ``positions[b]`` of sequence ``b``'s inputs."""
    return torch.stack([x[int(n)] for x, n in zip(xs, positions)])


def test_verify_pair_refusals():
    layer = make_layer(LayerKind.CSA)
    cache = AttentionCache(layer, 2, 16)
    indices = PairIndices.of(torch.tensor([0, 0]), 2)
    with pytest.raises(ValueError, match="two rows per sequence"):
        cache.extend_static_pair(layer, torch.randn(3, 64), indices=indices)
    with pytest.raises(ValueError, match="needs an extend_static_pair call"):
        cache.rollback_static_pair(torch.ones(2, dtype=torch.bool))
