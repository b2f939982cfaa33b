"""``StaticSpeculativeStep``: MTP speculative decoding on static shapes, optionally as CUDA graphs (issue 37).

The eager speculative loop (:mod:`~hybrid_model.generation.speculative`) plans every verify call on the host
(``CachedDecoder.extend(undo=True)``, a host rollback per layer). Here every sequence feeds its two rows ``[t, d]``
every step (``t``: the newest chosen token, at position ``n``; ``d``: its draft, at ``n + 1``) with the lengths
``n [B]`` in a device buffer, and acceptance, rollback and the next draft are decided on the device::

    verify   DSv4Model.forward(tokens [1, 2B] = [t (B); d (B)])      every attention layer:
               AttentionCache.extend_static_pair (rows at n and n + 1, snapshot of the second)  -> logits [2B, V],
               the main streams [2B, n_s, d]
    decide   greedy: y = argmax(logits at n), accepted = (d == y);  sampling: accept_drafts(p, q, d) (the same rule
             and generator draws as the eager loop while every sequence is live: a stopped one keeps drawing here,
             so a batch's later draws differ from the eager loop's);  bonus = next token of the logits at n + 1
    commit   every main cache: rollback_static_pair(accepted)      (the rejected second rows, per sequence)
             MTP depth 1 on the streams [2B] with the ids [y (B); bonus (B)] at n and n + 1 (its caches: the
             same pair step + rollback)  -> draft logits of row n (rejected) or n + 1 (accepted)
             t <- accepted ? bonus : y;   n <- min(n + 1 + accepted, max_length - 2);   d <- the next draft
    record   [B, 3] = (y, bonus, accepted): the step's one host read (the tokens and the counters)

so the caches of the main model and of the drafter hold exactly the eager loop's rows after every step, and greedy
decoding gives plain greedy decoding's tokens (each verify row is a plain 1-row step; fp32 rounding aside). A
sequence that stopped keeps being fed (its tokens are ignored); its length stops at ``max_length - 2`` (a live
sequence never reaches it: it holds at most ``prompt + max_new_tokens - 2`` rows before a step), so its rows stay in
the buffers. ``cuda_graph=True`` (CUDA only): the first step runs eagerly on a side stream (warm-up), then greedy
decoding captures the whole step (verify, decide, commit, draft) in one ``torch.cuda.CUDAGraph``; sampling captures
verify and commit as two graphs and runs the few random draws (decide, the next draft) eagerly between them, on the
device (the generator's state stays outside the graphs). Nothing inside a step reads the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from dsv4_attention.decode import PairIndices, bind_static_verify_step
from hash_moe import token_ids_checked
from hybrid_model.generation.decoder import CachedDecoder, decoder_streams
from hybrid_model.generation.mtp_draft import MTPDrafter
from hybrid_model.generation.sampling import SamplingConfig, next_tokens, token_probabilities
from hybrid_model.generation.spec_sampling import accept_drafts
from hybrid_model.generation.speculative import SpeculationStats, TokenSink
from hybrid_model.mtp import run_mtp_depth


class StaticSpeculativeStep:
    """Static speculative steps of ``decoder``'s and ``drafter``'s sequences (after both prefills, at equal lengths).

    Args:
        decoder: the main model's :class:`CachedDecoder` (every sequence holds >= 1 token).
        drafter: its :class:`MTPDrafter`, holding the same lengths (row ``j``: stream ``j`` and the token ``j + 1``).
        sampling: how tokens are chosen (greedy or the speculative-sampling rule).
        generator: the sampling generator (``SamplingConfig.generator``).
        cuda_graph: capture the steps in CUDA graphs (the model must be on a CUDA device).
    """

    def __init__(
        self,
        decoder: CachedDecoder,
        drafter: MTPDrafter,
        sampling: SamplingConfig,
        generator: torch.Generator | None = None,
        *,
        cuda_graph: bool = False,
    ) -> None:
        if min(decoder.lengths) < 1 or tuple(drafter.lengths) != tuple(decoder.lengths):
            raise ValueError(
                f"a static speculative step continues prefilled sequences: the decoder holds {decoder.lengths} and "
                f"the drafter {tuple(drafter.lengths)} rows; prefill both (decoder.extend, then drafter.extend of "
                "every prompt row)"
            )
        if drafter.max_length != decoder.max_length or decoder.max_length < 2:
            raise ValueError(
                f"the decoder and the drafter need the same max_length >= 2, got {decoder.max_length} and "
                f"{drafter.max_length}"
            )
        if max(decoder.lengths) > decoder.max_length - 2:
            raise ValueError(
                f"a static speculative step writes two rows per sequence (positions n and n + 1 < max_length="
                f"{decoder.max_length}), so every sequence may hold at most {decoder.max_length - 2} rows, got "
                f"{decoder.lengths}; allocate the decoder and the drafter with a larger max_length"
            )
        device = next(decoder.model.parameters()).device
        if cuda_graph and device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs the model on a CUDA device, it is on {device}")
        self.decoder, self.drafter = decoder, drafter
        self.sampling, self.generator, self.cuda_graph = sampling, generator, cuda_graph
        bsz = decoder.batch_size
        self.tokens = torch.zeros(2 * bsz, dtype=torch.long, device=device)  # [2B]: t (B), then d (B)
        self.lengths = torch.tensor(decoder.lengths, dtype=torch.long, device=device)  # [B] position of t
        self.record = torch.zeros(bsz, 3, dtype=torch.long, device=device)  # [B, 3] (y, bonus, accepted)
        self.cap = decoder.max_length - 2  # the longest length a step starts from
        self.logits: torch.Tensor | None = None  # [2B, V] fp32 verify logits
        self.streams: torch.Tensor | None = None  # [2B, n_s, d] main streams of the verify rows
        self.draft_logits: torch.Tensor | None = None  # [B, V] fp32
        self.q: torch.Tensor | None = None  # [B, V] the drafts' sampling distribution (sampling only)
        self._indices: PairIndices | None = None
        self._graphs: tuple[torch.cuda.CUDAGraph, ...] | None = None
        self._host_lengths = tuple(decoder.lengths)

    @property
    def batch(self) -> int:
        return self.decoder.batch_size

    def start(self, tokens: torch.Tensor, draft_logits: torch.Tensor) -> None:
        """Set the first step's rows: ``tokens [B]`` (each sequence's newest chosen token, not yet fed) and the
        draft of the token after it from ``draft_logits [B, V]`` (the drafter's prefill)."""
        if tokens.shape != (self.batch,) or draft_logits.shape[0] != self.batch:
            raise ValueError(
                f"start takes one token and one draft-logits row per sequence ({self.batch}), got "
                f"{tuple(tokens.shape)} and {tuple(draft_logits.shape)}"
            )
        self.tokens[: self.batch].copy_(tokens)
        self.draft_logits = draft_logits.float().clone()
        self._draw_draft()

    def _draw_draft(self) -> None:
        """``d <- `` the draft of the next step from :attr:`draft_logits` (greedy: argmax; sampling: ``q``)."""
        if self.sampling.greedy:
            self.tokens[self.batch :].copy_(self.draft_logits.argmax(dim=-1))
            return
        q = token_probabilities(self.draft_logits, self.sampling)  # [B, V]
        self.q = q if self.q is None else self.q.copy_(q)
        self.tokens[self.batch :].copy_(torch.multinomial(self.q, 1, generator=self.generator)[:, 0])

    def _bound(self, layers, caches) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(
            token_ids_checked()
        )  # sampled ids, or prompt ids checked on the host by the prefill
        for layer, cache in zip(layers, caches):
            stack.enter_context(bind_static_verify_step(layer, cache, lambda: self._indices))
        return stack

    def _verify(self) -> None:
        dec = self.decoder
        self._indices = PairIndices.of(self.lengths, self.batch)  # rows at n and n + 1, shared by every layer
        kept: list[torch.Tensor] = []
        with self._bound(dec.layers, dec.caches), decoder_streams(dec.model, kept):
            logits = dec.model(self.tokens[None], None, None)[0].float()  # [2B, V]
        streams = kept[0][:, 0]  # [2B, n_s, d]
        if self.logits is None:
            self.logits, self.streams = torch.empty_like(logits), torch.empty_like(streams)
        self.logits.copy_(logits)
        self.streams.copy_(streams)

    def _decide(self) -> None:
        bsz, s = self.batch, self.sampling
        p_rows, bonus_rows = self.logits[:bsz], self.logits[bsz:]  # [B, V] the tokens after t and after d
        drafts = self.tokens[bsz:]  # [B]
        if s.greedy:
            first = p_rows.argmax(dim=-1)
            accepted = first == drafts
        else:
            accepted, first = accept_drafts(token_probabilities(p_rows, s), self.q, drafts, self.generator)
        bonus = next_tokens(bonus_rows, s, self.generator)  # [B]
        self.record.copy_(torch.stack([first, bonus, accepted.long()], dim=1))

    def _commit(self) -> None:
        bsz, model, drafter = self.batch, self.decoder.model, self.drafter
        first, bonus = self.record[:, 0], self.record[:, 1]  # [B]
        accepted = self.record[:, 2].bool()  # [B]
        for cache in self.decoder.caches:
            cache.rollback_static_pair(accepted)
        ids = torch.cat([first, bonus])[None]  # [1, 2B] the token after each verify row
        depth = drafter.depth
        with self._bound(drafter.layers, drafter.caches):
            h, _ = run_mtp_depth(
                depth,
                model.embedding,
                self.streams[:, None].to(depth.mhc_config.stream_dtype),  # [2B, 1, n_s, d]
                ids,
                None,
                None,
                recompute=False,
                attention_mask=None,
                packed_seq_params=None,
                padding_mask=None,
            )  # [2B, 1, d]
        for cache in drafter.caches:
            cache.rollback_static_pair(accepted)
        rows = (
            torch.arange(bsz, device=h.device) + bsz * accepted.long()
        )  # the last kept row of each sequence
        logits = model.output_layer(h[rows])[0][:, 0].float()  # [B, V]
        if self.draft_logits is None:
            self.draft_logits = torch.empty_like(logits)
        self.draft_logits.copy_(logits)
        self.tokens[:bsz].copy_(torch.where(accepted, bonus, first))
        self.lengths.copy_(torch.clamp(self.lengths + 1 + accepted.long(), max=self.cap))
        if self.sampling.greedy:
            self._draw_draft()  # (sampling draws outside the graphs)

    def _phases(self) -> list[Callable[[], None]]:
        """The step's parts in order, grouped as the CUDA graphs capture them (eager parts: 1-element groups of a
        random draw, sampling only)."""
        if self.sampling.greedy:
            return [lambda: (self._verify(), self._decide(), self._commit())]
        return [self._verify, self._decide, self._commit, self._draw_draft]

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for phase in self._phases():
                phase()  # warm-up: this step, eagerly (allocations, Triton compilation, cached tables)
        torch.cuda.current_stream().wait_stream(side)
        graphs = []
        for phase in self._phases()[:: 1 if self.sampling.greedy else 2]:  # (sampling: verify, commit)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                phase()
            graphs.append(graph)
        self._graphs = tuple(graphs)

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        """Run one step (module docstring); returns :attr:`record` ``[B, 3]`` (each sequence's token after ``t``,
        the bonus token after ``d``, whether ``d`` was accepted), a buffer the next step overwrites."""
        model = self.decoder.model
        was_training = model.training
        model.eval()
        try:
            if not self.cuda_graph:
                for phase in self._phases():
                    phase()
            elif self._graphs is None:
                self._capture()  # the warm-up step is this step; the captured one is replayed from the next
            elif self.sampling.greedy:
                self._graphs[0].replay()
            else:
                verify, commit = self._graphs
                verify.replay()
                self._decide()
                commit.replay()
                self._draw_draft()
        finally:
            model.train(was_training)
        return self.record

    def advance(self, accepted: list[int]) -> None:
        """Record the host lengths after a step whose acceptance flags the caller read (the device lengths are
        advanced by the step itself)."""
        lengths = tuple(min(n + 1 + a, self.cap) for n, a in zip(self._host_lengths, accepted))
        self._host_lengths = self.decoder.lengths = self.drafter.lengths = lengths
        for cache in (*self.decoder.caches, *self.drafter.caches):
            cache.advance(lengths)


def static_speculative_generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingConfig,
    *,
    eos_token_id: int | None,
    on_token: Callable[[int, int], None] | None,
    stats: SpeculationStats | None = None,
    cuda_graph: bool = False,
) -> list[list[int]]:
    """The tokens of :func:`~hybrid_model.generation.generate` with ``speculative="mtp"`` and ``decode="static"``
    / ``"graph"`` (inputs checked there): the eager loop's prefill and first draft, then one
    :class:`StaticSpeculativeStep` per verify step, the record of each read once by the host (the tokens, the
    counters, the stopping rule: those of :func:`~hybrid_model.generation.speculative.speculative_generate`)."""
    stats = SpeculationStats() if stats is None else stats
    device = next(model.parameters()).device
    if cuda_graph and device.type != "cuda":  # refused before the prefill streams a first token
        raise ValueError(f"decode='graph' (CUDA graphs) needs the model on a CUDA device, it is on {device}")
    batch = len(prompts)
    max_length = max(len(p) for p in prompts) + max_new_tokens  # the eager loop's caches
    decoder = CachedDecoder(model, batch, max_length)
    drafter = MTPDrafter(model, batch, max_length)
    logits, streams = decoder.extend(prompts, last_only=True, streams=True)
    generator = sampling.generator(logits[0].device)
    sink = TokenSink(batch, max_new_tokens, eos_token_id, on_token)
    out, active, emit = sink.out, sink.active, sink.emit
    first = next_tokens(torch.cat(logits), sampling, generator)  # [B]
    for b, tok in enumerate(first.tolist()):
        emit(b, tok)
    if not any(active):
        return out
    # every sequence is drafted (a stopped one too: static shapes), every prompt row with the token after it
    draft_logits = drafter.extend(streams, [p[1:] + [o[0]] for p, o in zip(prompts, out)])
    step = StaticSpeculativeStep(decoder, drafter, sampling, generator, cuda_graph=cuda_graph)
    step.start(first, torch.cat(draft_logits))
    while any(active):
        record = step().tolist()  # [B, 3]: the step's one host read
        stats.steps += 1
        for b, (tok, bonus, ok) in enumerate(record):
            if not active[b]:
                continue
            sink.count_draft(stats, b, bool(ok))
            emit(b, tok)
            if ok and active[b]:
                emit(b, bonus)
        step.advance([r[2] for r in record])
    return out
