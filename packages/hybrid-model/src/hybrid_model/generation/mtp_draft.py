"""``MTPDrafter``: MTP depth 1 over its own decode caches, the draft model of speculative decoding (issue 37).

MTP depth 1 at position ``t`` reads the main streams ``X_L[t]`` (before the HyperHead) and the embedding of the
token at ``t + 1`` and predicts the token at ``t + 2`` (:mod:`hybrid_model.mtp`). Its layers (``WE`` in DSv4: window
attention + learned MoE) see the sequence like the main layers do, so each of its DSv4 attention layers gets an
:class:`~dsv4_attention.decode.AttentionCache` and one :meth:`MTPDrafter.extend` call runs the depth's own forward
on the new rows only (a THD pack, one document per sequence, like
:class:`~hybrid_model.generation.decoder.CachedDecoder`)::

    streams [R, 1, n, d] (main, new rows)   ids [1, R] (the token after each row)
    -> run_mtp_depth: e_proj(enorm(Embed(ids))) + h_proj(hnorm(streams)) -> W (AttentionCache) -> E -> HyperHead
    -> norm -> output layer (shared head) on each sequence's last new row    -> draft logits [B, V]

A row at ``t`` is fed once the token at ``t + 1`` is final (accepted), so the MTP caches never hold a rejected
draft and never roll back: the drafter trails the main decoder by the one row whose next token is still being
drafted. Its logits equal depth 1's logits of the full forward (``DSv4Model.mtp_logits``) at every position.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from dsv4_attention.decode import AttentionCache, ExtendPlan, bind_decode_step
from dsv4_attention.megatron import DSv4HybridAttention
from hybrid_model.generation.support import SUPPORTED_SYMBOLS
from hybrid_model.mtp import router_cu_seqlens, run_mtp_depth


def check_mtp_support(model) -> None:
    """``ValueError`` unless ``model`` has an MTP depth that cached drafting can run."""
    parsed = model.model_config.parsed_pattern
    if not (model.mtp_process and parsed.mtp_num_depths):
        raise ValueError(
            f"speculative='mtp' drafts with the model's MTP head, and pattern {parsed.pattern!r} has none: use a "
            "model with num_nextn_predict_layers >= 1 (a pattern with a '/...' MTP part) or plain decoding"
        )
    unsupported = sorted(set(parsed.mtp_pattern) - SUPPORTED_SYMBOLS)
    if unsupported:
        raise ValueError(
            f"the MTP part {parsed.mtp_pattern!r} holds symbol(s) {', '.join(map(repr, unsupported))} without a "
            f"decode cache; MTP drafting supports {''.join(sorted(SUPPORTED_SYMBOLS))}"
        )


class MTPDrafter:
    """MTP depth 1 of ``model`` with decode caches for ``batch_size`` sequences of up to ``max_length`` rows."""

    def __init__(self, model, batch_size: int, max_length: int) -> None:
        check_mtp_support(model)
        self.model = model
        self.depth = model.mtp
        self.layers = [m for m in self.depth.block.modules() if isinstance(m, DSv4HybridAttention)]
        self.caches = [AttentionCache(layer, batch_size, max_length) for layer in self.layers]
        self.max_length = max_length
        self.lengths: tuple[int, ...] = (0,) * batch_size
        self._plan: ExtendPlan | None = None

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for cache in self.caches)

    @torch.no_grad()
    def extend(
        self, streams: Sequence[torch.Tensor], next_ids: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        """Append rows to every sequence: ``streams[b] [k_b, n, d]`` (the main streams of its next ``k_b``
        positions) and ``next_ids[b]`` (``k_b`` tokens: the token after each of them). Returns each sequence's draft
        logits ``[1, V]`` (fp32) at its last new row (``[0, V]`` for ``k_b = 0``): the distribution of the token two
        positions after it."""
        plan = ExtendPlan(self.lengths, tuple(len(t) for t in next_ids))
        if tuple(s.shape[0] for s in streams) != plan.counts:
            raise ValueError(
                f"MTPDrafter.extend needs one streams row per next id, got {[s.shape[0] for s in streams]} rows for "
                f"{list(plan.counts)} ids"
            )
        if max(plan.new_lengths) > self.max_length:
            raise ValueError(f"the drafter was allocated for {self.max_length} rows per sequence")
        x = torch.cat(list(streams))[:, None]  # [R, 1, n, d]
        device = x.device
        ids = torch.tensor([t for seq in next_ids for t in seq], dtype=torch.long, device=device)[
            None
        ]  # [1, R]
        cu = torch.tensor(plan.row_starts, dtype=torch.int32, device=device)
        longest = max(plan.counts)
        psp = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )
        self._plan = plan
        was_training = self.model.training
        self.model.eval()
        with contextlib.ExitStack() as bound:
            bound.callback(self.model.train, was_training)
            for layer, cache in zip(self.layers, self.caches):
                bound.enter_context(bind_decode_step(layer, cache, lambda: self._plan))
            h, _ = run_mtp_depth(
                self.depth,
                self.model.embedding,
                x.to(self.depth.mhc_config.stream_dtype),
                ids,
                None,
                router_cu_seqlens(psp, ids.shape[-1]),
                recompute=False,
                attention_mask=None,
                packed_seq_params=psp,
                padding_mask=None,
            )  # [R, 1, d]
        self.lengths = plan.new_lengths
        ends = [end - 1 for count, end in zip(plan.counts, plan.row_starts[1:]) if count]
        logits = self.model.output_layer(h[ends])[0][:, 0].float()  # [B', V]
        rows = iter(logits)
        return [next(rows)[None] if count else logits[:0] for count in plan.counts]
