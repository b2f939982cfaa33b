"""``CachedDecoder``: prefill and decode steps of a whole :class:`~hybrid_model.model.DSv4Model` over per-layer caches.

Every DSv4 attention layer of the main decoder gets a :class:`dsv4_attention.decode.AttentionCache` (window ring;
CSA / HCA compressor state and entries; CSA indexer keys, the top-k recomputed for every new token) for ``B``
independent sequences of different lengths: no padding, every sequence keeps its own positions ``0, 1, ...``. One
:meth:`CachedDecoder.extend` call appends ``tokens[b]`` to sequence ``b`` (any count, 0 included) and runs the
model's own forward on the new tokens only, as a THD pack with one document per sequence::

    ids  [1, R]  (the new tokens, sequence-major)      packed_seq_params: cu_seqlens = the new-row counts
    DSv4Model.forward: embedding, mHC pre / post per layer, attention -> AttentionCache.extend (bound hook,
                       dsv4_attention.decode.bind_decode_step), MoE (hash routing by token id), HyperHead, final
                       norm, output layer                                      -> logits [1, R, V]

Everything but attention is per token, so the logits of the new rows equal the training forward's logits of the
whole sequences at those positions (fp32: within 1e-5 relative; ``tests/test_generation.py``). Prefill is the first
call (the prompts), a decode step a call of one token per unfinished sequence. :meth:`CachedDecoder.step` is the
decode step of every sequence with the ids already on the device (``generate``'s sampled tokens: no host copy, no
upload). The ids are range-checked once per call (``extend``: on the host; ``step``: asynchronously on the device,
or not at all for sampled ids), never per hash layer (``hash_moe.token_ids_checked``). MTP depths are not run here
(:class:`~hybrid_model.generation.mtp_draft.MTPDrafter` runs depth 1 for speculative decoding).

Speculative decoding verifies drafted tokens in one call with ``extend(..., undo=True)`` and drops the rejected
rows with :meth:`CachedDecoder.rollback` (every layer cache's exact
:meth:`~dsv4_attention.decode.AttentionCache.rollback`). ``extend(..., streams=True)`` also returns the main mHC
streams of the new rows (``[k, n, d]`` per sequence, the MTP depth's input).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from dsv4_attention.decode import AttentionCache, ExtendPlan, bind_decode_step
from dsv4_attention.megatron import DSv4HybridAttention
from hash_moe import token_ids_checked
from hybrid_model.generation.support import check_generation_support


class CachedDecoder:
    """Per-layer decode caches of ``model`` for ``batch_size`` sequences of up to ``max_length`` tokens each.

    Args:
        model: a :class:`~hybrid_model.model.DSv4Model` (:func:`~hybrid_model.generation.check_generation_support`).
        batch_size: ``B`` sequences.
        max_length: the most tokens any sequence will hold (the caches are preallocated for it); at most the model's
            ``max_position_embeddings``.
    """

    def __init__(self, model, batch_size: int, max_length: int) -> None:
        check_generation_support(model)
        limit = model.model_config.max_position_embeddings
        if not 1 <= max_length <= limit:
            raise ValueError(
                f"max_length must be in [1, max_position_embeddings={limit}] (the model's positions), got {max_length}"
            )
        self.model = model
        self.max_length = max_length
        self.layers = [m for m in model.decoder.modules() if isinstance(m, DSv4HybridAttention)]
        self.caches = [AttentionCache(layer, batch_size, max_length) for layer in self.layers]
        self.lengths: tuple[int, ...] = (0,) * batch_size
        self._plan: ExtendPlan | None = None
        self._broken = False

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        """Bytes held by all layer caches."""
        return sum(cache.nbytes for cache in self.caches)

    @torch.no_grad()
    def extend(
        self,
        tokens: Sequence[Sequence[int]],
        *,
        last_only: bool = False,
        undo: bool = False,
        streams: bool = False,
    ):
        """Append ``tokens[b]`` to sequence ``b``; return each sequence's logits ``[len(tokens[b]), V]`` (fp32)
        at the new positions (the model runs in eval mode for the call). ``last_only``: only each sequence's last
        new position ``[1, V]`` (``[0, V]`` for a sequence given no token): the output layer runs on those rows
        only (a prefill of ``B`` prompts of ``T`` tokens would otherwise form ``B T x V`` logits). ``undo``: the
        call's rows can be dropped again with :meth:`rollback`. ``streams``: return ``(logits, streams)``, the
        main streams before the HyperHead ``[len(tokens[b]), n, d]`` per sequence too (models with MTP only)."""
        if self._broken:
            raise ValueError(
                "an earlier extend() failed part-way; the caches are inconsistent: make a new CachedDecoder"
            )
        if len(tokens) != self.batch_size:
            raise ValueError(
                f"extend needs one token list per sequence ({self.batch_size}), got {len(tokens)}"
            )
        plan = ExtendPlan(self.lengths, tuple(len(t) for t in tokens))
        if max(plan.new_lengths) > self.max_length:
            raise ValueError(
                f"a sequence would hold {max(plan.new_lengths)} tokens, more than this decoder's "
                f"max_length={self.max_length}"
            )
        device = next(self.model.parameters()).device
        flat = [t for seq in tokens for t in seq]
        vocab = self.model.model_config.vocab_size
        bad = [t for t in flat if not 0 <= t < vocab]  # on the host: hash routing then skips its device check
        if bad:
            raise ValueError(f"extend got token ids outside [0, vocab_size={vocab}): {bad}")
        ids = torch.tensor(flat, dtype=torch.long, device=device)[None]  # [1, R]
        psp = None  # a decode step: one row per document, nothing outside attention mixes rows (no upload)
        if not plan.is_decode_step:
            cu = torch.tensor(plan.row_starts, dtype=torch.int32, device=device)  # [B + 1]
            longest = max(plan.counts)
            psp = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
                max_seqlen_q=longest,
                max_seqlen_kv=longest,
            )
        if streams and not self.model.mtp_process:
            raise ValueError(
                "extend(streams=True) needs a model with MTP depths (its decoder returns the streams)"
            )
        kept: list[torch.Tensor] = []
        head = None  # the head's rows (a decode step's rows are all last rows)
        if last_only and not plan.is_decode_step:
            ends = [end - 1 for count, end in zip(plan.counts, plan.row_starts[1:]) if count]
            head = torch.tensor(ends, device=device)
        logits = self._forward(plan, ids, psp, undo=undo, head_rows=head, kept=kept if streams else None)
        self.lengths, self._broken = plan.new_lengths, False
        if last_only:
            rows = iter(logits)
            out = [next(rows)[None] if count else logits[:0] for count in plan.counts]
        else:
            out = [logits[a:b] for a, b in zip(plan.row_starts, plan.row_starts[1:])]
        if not streams:
            return out
        x = kept[0][:, 0]  # [R, n, d]
        return out, [x[a:b] for a, b in zip(plan.row_starts, plan.row_starts[1:])]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, *, ids_checked: bool = False) -> torch.Tensor:
        """One decode step feeding every sequence one token, ``tokens [B]`` a device tensor (no host copy of the
        ids): the logits ``[B, V]`` (fp32) of the new positions, equal to ``extend([[t] for t in tokens],
        last_only=True)``. ``ids_checked``: the ids are known to lie in the vocabulary (sampled over it), so no
        range check runs; otherwise one asynchronous device-side check (no host sync; a bad id fails the device)."""
        if self._broken:
            raise ValueError(
                "an earlier extend() failed part-way; the caches are inconsistent: make a new CachedDecoder"
            )
        if tokens.shape != (self.batch_size,) or tokens.dtype.is_floating_point:
            raise ValueError(
                f"step takes one integer token id per sequence [{self.batch_size}], got {tokens.dtype} "
                f"{tuple(tokens.shape)}"
            )
        plan = ExtendPlan(self.lengths, (1,) * self.batch_size)
        if max(plan.new_lengths) > self.max_length:
            raise ValueError(
                f"a sequence would hold {max(plan.new_lengths)} tokens, more than this decoder's "
                f"max_length={self.max_length}"
            )
        ids = tokens.to(device=next(self.model.parameters()).device, dtype=torch.long)[None]  # [1, B]
        if not ids_checked:
            assert_token_ids(ids, self.model.model_config.vocab_size)
        logits = self._forward(plan, ids, None)  # [B, V]
        self.lengths, self._broken = plan.new_lengths, False
        return logits

    def _forward(
        self,
        plan: ExtendPlan,
        ids: torch.Tensor,
        psp: PackedSeqParams | None,
        *,
        undo: bool = False,
        head_rows: torch.Tensor | None = None,
        kept: list | None = None,
    ) -> torch.Tensor:
        """The model's logits ``[R, V]`` (fp32; ``head_rows``: of those hidden rows only) of ``ids [1, R]``, every
        attention layer extending its cache by ``plan`` (the ids are checked already: no host read per hash layer).
        ``kept``: the main decoder's output streams are appended to it."""
        self._plan, self._broken = plan, True
        was_training = self.model.training
        with contextlib.ExitStack() as bound:
            bound.enter_context(token_ids_checked())
            for layer, cache in zip(self.layers, self.caches):
                bound.enter_context(bind_decode_step(layer, cache, lambda: self._plan, undo=undo))
            if kept is not None:
                bound.enter_context(decoder_streams(self.model, kept))
            if head_rows is not None:
                bound.enter_context(_head_rows(self.model, head_rows))
            self.model.eval()
            try:
                return self.model(ids, None, None, packed_seq_params=psp)[0].float()  # [R, V]
            finally:
                self.model.train(was_training)

    def rollback(self, lengths: Sequence[int]) -> None:
        """Drop the newest rows of the last :meth:`extend`, made with ``undo=True``: sequence ``b`` keeps
        ``lengths[b]`` tokens (between its lengths before and after that call), exactly as if that call had
        appended only the kept rows."""
        lengths = tuple(int(n) for n in lengths)
        for cache in self.caches:
            cache.rollback(lengths)  # checks the lengths against the call (the first cache refuses bad ones)
        self.lengths = lengths


def assert_token_ids(ids: torch.Tensor, vocab: int) -> None:
    """``0 <= id < vocab`` for every id of the device tensor ``ids``, asserted on the device (no host sync: a bad id
    fails the device asynchronously; on CPU at once)."""
    torch._assert_async(((ids >= 0) & (ids < vocab)).all(), f"token ids must lie in [0, vocab_size={vocab})")


@contextlib.contextmanager
def decoder_streams(model, kept: list):
    """Inside the block, the main decoder's output streams ``[s, 1, n, d]`` are appended to ``kept``."""

    def grab(_module, _args, output):
        kept.append(output[1])

    handle = model.decoder.register_forward_hook(grab)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _head_rows(model, rows: torch.Tensor):
    """Inside the block, the model's output layer sees only the hidden rows ``rows`` (of ``[s, 1, d]``)."""

    def select(_module, args, kwargs):
        return (args[0].index_select(0, rows), *args[1:]), kwargs

    handle = model.output_layer.register_forward_pre_hook(select, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
