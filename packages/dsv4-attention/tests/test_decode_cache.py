"""Cached prefill / decode of one DSv4 attention layer (``dsv4_attention.decode``) against the training forward.

Rule (fp32): every cached output row equals the training forward's row of the whole sequence within
``max|cached - full| <= 1e-5 * max(1, max|full|)`` (fp32 rounding of the same ops in another order; a wrong key,
entry, position or top-k choice moves rows by 1e-2 or more). Every parameter, the sinks and ``ape`` included, is
drawn at random so that no term is trivially zero.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_attention import (
    AttentionConfig,
    DSv4Attention,
    IndexerConfig,
    LayerKind,
    rope_config_for_kind,
    sbhd_layout,
)
from dsv4_attention.decode import (
    AttentionCache,
    ExtendPlan,
    bind_decode_step,
    decode_cache_bytes,
    select_topk,
    visible_entries,
)
from dsv4_primitives import YarnConfig
from dsv4_primitives.varlen import SeqBoundaries

RTOL = 1e-5


def make_layer(kind: LayerKind, seed: int = 0) -> DSv4Attention:
    """The tests' tiny layer (window 8, 4 heads of 32, indexer 2 x 16, top-4), every parameter random."""
    yarn = YarnConfig(factor=4.0, original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0)
    cfg = AttentionConfig(
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
    torch.manual_seed(seed)
    layer = DSv4Attention(cfg).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return layer


def full_forward(layer: DSv4Attention, x: torch.Tensor, dense: bool = False) -> torch.Tensor:
    """The training forward of one whole sequence ``x [T, d]`` (eval mode, no indexer loss)."""
    with torch.no_grad():
        return layer(x, sbhd_layout(x.shape[0], 1), dense=dense)[0]


def assert_rows_close(name: str, cached: torch.Tensor, full: torch.Tensor) -> None:
    err = (cached - full).abs().max().item()
    bound = RTOL * max(1.0, full.abs().max().item())
    assert err <= bound, f"{name}: max|cached - full| = {err:.3e} > {bound:.3e}"


def run_cached(layer, xs: list[torch.Tensor], chunks: list[list[int]], max_length: int, dense: bool = False):
    """Feed sequence ``b``'s rows ``xs[b]`` in calls of ``chunks[i][b]`` rows; return each sequence's output rows."""
    cache = AttentionCache(layer, len(xs), max_length)
    outs: list[list[torch.Tensor]] = [[] for _ in xs]
    for counts in chunks:
        plan = ExtendPlan(cache.lengths, counts)
        rows = [x[n : n + k] for x, n, k in zip(xs, plan.lengths, plan.counts)]
        y = cache.extend(layer, torch.cat(rows), plan, dense=dense)
        for b, (r0, r1) in enumerate(zip(plan.row_starts, plan.row_starts[1:])):
            outs[b].append(y[r0:r1])
    return [torch.cat(o) for o in outs], cache


def decode_schedule(first: list[int], lengths: list[int]) -> list[list[int]]:
    """Calls ``first`` (a prefill or ragged chunks), then one row per unfinished sequence per call."""
    done, calls = list(first), [list(first)]
    while any(d < n for d, n in zip(done, lengths)):
        calls.append([int(d < n) for d, n in zip(done, lengths)])
        done = [d + c for d, c in zip(done, calls[-1])]
    return calls


# prompts ending inside / exactly on the window (8), on ratio-4 and ratio-128 boundaries, 1-token prompts
PROMPTS = [1, 5, 8, 12, 13, 127, 128, 129]


@pytest.mark.parametrize("kind", list(LayerKind), ids=lambda k: k.name)
def test_prefill_then_decode_equals_full_forward(kind):
    """One sequence per prompt length (a batch in lockstep), each 140 tokens long (crosses the first HCA entry at
    128; CSA: 35 entries, top-4 of them): prefill, then one token per step."""
    total = 140
    layer = make_layer(kind)
    xs = [torch.randn(total, 64) for _ in PROMPTS]
    cached, cache = run_cached(layer, xs, decode_schedule(PROMPTS, [total] * len(PROMPTS)), total)
    assert cache.lengths == (total,) * len(PROMPTS)
    for prompt, x, y in zip(PROMPTS, xs, cached):
        assert_rows_close(f"{kind.name} prompt {prompt}", y, full_forward(layer, x))


@pytest.mark.parametrize("kind", list(LayerKind), ids=lambda k: k.name)
def test_batch_of_ragged_sequences_in_ragged_chunks(kind):
    """Three sequences of different lengths, advanced by different (some zero) row counts per call."""
    layer = make_layer(kind, seed=1)
    lengths = [150, 9, 131]
    xs = [torch.randn(n, 64) for n in lengths]
    chunks = [[127, 1, 4], [1, 0, 124], [3, 2, 1], [0, 3, 1]]
    first = [sum(c[b] for c in chunks) for b in range(3)]
    chunks += decode_schedule(first, lengths)[1:]
    cached, cache = run_cached(layer, xs, chunks, max(lengths))
    assert cache.lengths == tuple(lengths)
    for b, x in enumerate(xs):
        assert_rows_close(f"{kind.name} sequence {b}", cached[b], full_forward(layer, x))


def test_csa_dense_phase_and_phase_switch():
    """Dense phase (every visible entry): prefill dense; then the indexer keys kept during the dense calls serve the
    sparse steps after a switch (each row compared with the forward of its own phase)."""
    layer = make_layer(LayerKind.CSA, seed=2)
    x = torch.randn(60, 64)
    cache = AttentionCache(layer, 1, 60)
    y_dense = cache.extend(layer, x[:40], ExtendPlan((0,), (40,)), dense=True)
    assert_rows_close("dense prefill", y_dense, full_forward(layer, x[:40], dense=True))
    rows = [cache.extend(layer, x[t : t + 1], ExtendPlan((t,), (1,))) for t in range(40, 60)]
    assert_rows_close("sparse after dense", torch.cat(rows), full_forward(layer, x)[40:])


def test_exact_index_ties_follow_the_lower_entry():
    """``weights_proj = 0``: every index score is exactly 0, so the top-4 is decided by the tie rule alone (the four
    lowest visible entries, spec §4.2 rule 2) in the cached path as in training."""
    layer = make_layer(LayerKind.CSA, seed=3)
    with torch.no_grad():
        layer.core_attention.indexer.linear_weights_proj.weight.zero_()
    x = torch.randn(70, 64)
    (cached,), _ = run_cached(layer, [x], [[21]] + [[1]] * 49, 70)
    assert_rows_close("all-tie top-k", cached, full_forward(layer, x))


def test_select_topk_is_the_indexer_topk_rule():
    """``select_topk`` over the visible entries equals csa-kernels' ``indexer_topk_ref`` (lower-index ties) on
    integer scores full of exact ties."""
    from csa_kernels import indexer_scores_at_ref, indexer_topk_ref

    g = torch.Generator().manual_seed(0)
    t, n_c, k = 64, 16, 5
    q = torch.randint(-1, 2, (t, 2, 4), generator=g).float()
    keys = torch.randint(-1, 2, (n_c, 4), generator=g).float()
    w = torch.randint(1, 3, (t, 2), generator=g).float()
    ref, _ = indexer_topk_ref(q, keys, w, 4, k, SeqBoundaries.from_lengths([t]))
    plan = ExtendPlan((0,), (t,))
    pos, seq = plan.row_positions(), plan.row_sequences()
    visible = visible_entries(plan, pos, seq, 4, n_c)
    scores = indexer_scores_at_ref(q, keys, w, visible)
    cols = select_topk(scores, k)
    ours = torch.where(cols >= 0, visible.gather(1, cols.clamp(min=0)), -1)
    assert (scores[:, :-1] == scores[:, 1:]).any()  # ties exist
    assert torch.equal(ours.to(torch.int32), ref)


def test_bound_megatron_layer_runs_the_cache(build):
    """``bind_decode_step``: the megatron adapter's forward on THD rows ``[R, 1, d]`` is the cache's extend (then
    the training forward again once unbound)."""
    layer = build(4).eval()
    x = torch.randn(40, 64)
    with torch.no_grad():
        full = layer(x[:, None])[0][:, 0]  # SBHD [40, 1, d]: one sequence
    cache = AttentionCache(layer, 1, 40)
    plan = ExtendPlan((0,), (30,))
    with bind_decode_step(layer, cache, lambda: plan), torch.no_grad():
        head = layer(x[:30, None])[0][:, 0]
        plan = ExtendPlan((30,), (10,))
        tail = layer(x[30:, None])[0][:, 0]
    assert layer.decode_step is None
    assert_rows_close("bound adapter", torch.cat((head, tail)), full)
    with (
        pytest.raises(ValueError, match="no decode_step hook"),
        bind_decode_step(make_layer(LayerKind.CSA), cache, lambda: plan),
    ):
        pass


@pytest.mark.parametrize("kind", list(LayerKind), ids=lambda k: k.name)
def test_cache_bytes_formula_and_refusals(kind):
    layer = make_layer(kind)
    cache = AttentionCache(layer, 3, 300)
    assert cache.nbytes == decode_cache_bytes(
        kind, window=8, head_dim=32, index_head_dim=16, max_length=300, batch=3
    )
    x = torch.randn(5, 64)
    with pytest.raises(ValueError, match="max_length=300"):
        cache.extend(layer, torch.randn(301, 64), ExtendPlan((0, 0, 0), (301, 0, 0)))
    with pytest.raises(ValueError, match="cache holds"):
        cache.extend(layer, x, ExtendPlan((1, 0, 0), (5, 0, 0)))
    with pytest.raises(ValueError, match="at least one token"):
        ExtendPlan((0, 0, 0), (0, 0, 0))
    other = LayerKind.WINDOW if kind is not LayerKind.WINDOW else LayerKind.HCA
    with pytest.raises(ValueError, match="belongs to"):
        cache.extend(make_layer(other), x, ExtendPlan((0, 0, 0), (5, 0, 0)))


def test_torch_topk_tie_rule_is_refused():
    layer = make_layer(LayerKind.CSA)
    layer.core_attention.indexer.set_tie_break("torch_topk")
    with pytest.raises(ValueError, match="lower_index"):
        AttentionCache(layer, 1, 10)
