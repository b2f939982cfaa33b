"""MTP speculative decoding (``generate(..., speculative="mtp")``; DeepSeek-V3 / V4 style, one draft per step).

Per sequence, with ``L`` tokens in the main cache, ``t`` the newest chosen token (not yet fed) and ``d`` the draft
of the token after it (:class:`~hybrid_model.generation.mtp_draft.MTPDrafter` at position ``L - 1``: main streams at
``L - 1`` and the embedding of ``t``), one step is::

    verify   CachedDecoder.extend([t, d], undo=True)     -> main logits at L (token after t) and L + 1, streams
    accept   greedy: d == argmax(logits at L);  sampling: accept_drafts(p, q, d) (spec_sampling)
             accepted: the tokens d and y ~ logits at L + 1 (the bonus token); the cache keeps both rows
             rejected: the token y (argmax / residual draw); the cache rolls back to L + 1 rows (exact)
    draft    MTPDrafter.extend(streams of the kept rows, the tokens after them) -> the next draft

so every step adds one or two tokens for one main forward over two rows and one MTP depth forward. The main cache
holds only accepted rows after a step and the drafter only rows whose next token is final, so greedy speculative
decoding gives plain greedy decoding's tokens (the logits of a 2-row call equal those of two 1-row calls up to
fp32 rounding: near ties aside) and sampling draws from the main model's distribution.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybrid_model.generation.decoder import CachedDecoder
from hybrid_model.generation.mtp_draft import MTPDrafter
from hybrid_model.generation.sampling import SamplingConfig, next_tokens, token_probabilities
from hybrid_model.generation.spec_sampling import accept_drafts

#: ``generate(speculative=...)``: ``None`` (plain decoding) or ``"mtp"``
SPECULATIVE_MODES = (None, "mtp")


@dataclass
class SpeculationStats:
    """Counters of a speculative generation, filled by ``generate(..., stats=...)``.

    Attributes:
        drafted: drafts verified (only those whose sequence still needed two or more tokens).
        accepted: drafts accepted.
        steps: verify calls of the main model (the prefill not counted).
    """

    drafted: int = 0
    accepted: int = 0
    steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        """``accepted / drafted`` (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0


class TokenSink:
    """The tokens generated per sequence (``out``) and which sequences still run (``active``): a sequence stops at
    ``eos_token_id`` or after ``max_new_tokens`` tokens; every emitted token goes to ``on_token(b, tok)`` too."""

    def __init__(
        self,
        batch: int,
        max_new_tokens: int,
        eos_token_id: int | None,
        on_token: Callable[[int, int], None] | None,
    ) -> None:
        self.max_new_tokens = max_new_tokens
        self.eos_token_id = eos_token_id
        self.on_token = on_token
        self.out: list[list[int]] = [[] for _ in range(batch)]
        self.active = [True] * batch

    def emit(self, b: int, tok: int) -> None:
        self.out[b].append(tok)
        if self.on_token is not None:
            self.on_token(b, tok)
        if tok == self.eos_token_id or len(self.out[b]) == self.max_new_tokens:
            self.active[b] = False

    def count_draft(self, stats: SpeculationStats, b: int, accepted: bool) -> None:
        """A draft of sequence ``b`` verified: counted where the sequence still needed two or more tokens."""
        if self.max_new_tokens - len(self.out[b]) >= 2:
            stats.drafted += 1
            stats.accepted += int(accepted)


def speculative_generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingConfig,
    *,
    eos_token_id: int | None,
    on_token: Callable[[int, int], None] | None,
    stats: SpeculationStats | None = None,
    drafter=None,
) -> list[list[int]]:
    """The tokens of :func:`~hybrid_model.generation.generate` with ``speculative="mtp"`` (module docstring;
    inputs checked there). ``drafter``: the draft model (default: :class:`MTPDrafter` of ``model``); any object with
    its ``extend(streams, next_ids) -> draft logits`` method."""
    stats = SpeculationStats() if stats is None else stats
    batch = len(prompts)
    # a verify call feeds 2 rows: at most prompt + max_new_tokens rows per sequence
    max_length = max(len(p) for p in prompts) + max_new_tokens
    decoder = CachedDecoder(model, batch, max_length)
    drafter = MTPDrafter(model, batch, max_length) if drafter is None else drafter
    logits, streams = decoder.extend(prompts, last_only=True, streams=True)
    generator = sampling.generator(logits[0].device)
    sink = TokenSink(batch, max_new_tokens, eos_token_id, on_token)
    out, active, emit = sink.out, sink.active, sink.emit
    for b, tok in enumerate(next_tokens(torch.cat(logits), sampling, generator).tolist()):
        emit(b, tok)
    # the drafter takes every prompt row: row t with the token at t + 1 (the last row: the first chosen token)
    feed_ids = [p[1:] + [o[0]] for p, o in zip(prompts, out)]
    while any(active):
        draft_logits = drafter.extend(
            [s if a else s[:0] for s, a in zip(streams, active)],
            [ids if a else [] for ids, a in zip(feed_ids, active)],
        )
        live = [b for b in range(batch) if active[b]]
        q_logits = torch.cat([draft_logits[b] for b in live])  # [B', V]
        q = None if sampling.greedy else token_probabilities(q_logits, sampling)
        drafts = (
            next_tokens(q_logits, sampling, generator)
            if q is None
            else torch.multinomial(q, 1, generator=generator)[:, 0]
        )
        rows = [[out[b][-1], int(d)] for b, d in zip(live, drafts.tolist())]
        feed = [[] for _ in range(batch)]
        for b, r in zip(live, rows):
            feed[b] = r
        verify, streams = decoder.extend(feed, undo=True, streams=True)  # [2, V] per live sequence
        stats.steps += 1
        p_rows = torch.stack([verify[b][0] for b in live])  # [B', V] the token after t
        bonus_rows = torch.stack([verify[b][1] for b in live])  # [B', V] the token after d
        if sampling.greedy:
            target = p_rows.argmax(dim=-1)
            accepted, first = target == drafts, target
        else:
            accepted, first = accept_drafts(token_probabilities(p_rows, sampling), q, drafts, generator)
        bonus = next_tokens(bonus_rows, sampling, generator)
        lengths = list(decoder.lengths)
        feed_ids = [[] for _ in range(batch)]
        for i, b in enumerate(live):
            ok = bool(accepted[i])
            sink.count_draft(stats, b, ok)
            emit(b, int(first[i]))
            kept = 1
            if ok and active[b]:
                emit(b, int(bonus[i]))
                kept = 2
            lengths[b] -= 2 - kept
            feed_ids[b] = out[b][-kept:]  # the token after each kept row
            streams[b] = streams[b][:kept]
        decoder.rollback(lengths)
    return out
