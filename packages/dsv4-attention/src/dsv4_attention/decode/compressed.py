"""``CompressorCache``: the streaming state of one KV compressor and the entries it emitted, for ``B`` sequences.

Spec §3.3 streaming form (oracle C1). Entry ``w`` of a sequence pools block ``w`` (positions ``[w m, (w+1) m)``;
CSA also block ``w - 1``'s channels ``[0, c)``) and exists once the block is complete. With ``L`` tokens cached a
sequence holds, as projected rows (``kv = x wkv^T``, gate logits ``x wgate^T`` before ``ape``, ``[Dk]`` each), the
positions ``[start(L), L)``::

    start(L) = m * floor(L / m)               (HCA: the partial block not yet compressed, < m rows)
    start(L) = max(m * floor(L / m) - m, 0)   (CSA: also the last complete block, whose P-half the next entry pools;
                                               < 2m rows)

A call appends its new rows' projections (the compressor's own ``linear_wkv`` / ``linear_wgate``) and pools each
sequence's held + new rows as ONE document starting at ``start(L)``, a block boundary, with csa-kernels'
``compressor_pool`` (its one-sequence SBHD form; the training op: ``ape`` by slot, per-channel softmax over the
slots, overlap), so the document's entry ``j`` is the sequence's entry ``start(L) / m + j``. The entries
``floor(L / m) <= w < floor((L + n) / m)`` are new; they are normed with the compressor's RMSNorm and rotated at
``w m`` as in ``Compressor.forward``. (For CSA the document's first entry is an already-emitted block pooled
without its previous block: never kept.)

Speculative decoding (:meth:`CompressorCache.rollback`): a call made with ``undo=True`` keeps each sequence's
document rows (held + new, positions ``[start(L), L + n)``); dropping all but the first ``k`` new rows sets the held
rows to that document's positions ``[start(L + k), L + k)``, the held rows of a call of ``k`` rows. The entries the
dropped rows completed (``w >= floor((L + k) / m)``) stay written but are invisible (``w < floor((p + 1) / m)``)
until the call that completes block ``w`` again writes them before any row attends them.
"""

from __future__ import annotations

import torch

from dsv4_attention._kernels import compressor_pool_sbhd
from dsv4_attention._linears import linear_out
from dsv4_attention._rope import rope
from dsv4_attention.compressor import Compressor
from dsv4_attention.decode.plan import ExtendPlan


class CompressorCache:
    """Held projected rows ``[B, H, Dk]`` (``H = 2m`` for CSA, ``m`` for HCA) and entries ``[B, capacity, c]``.

    Args:
        compressor: the :class:`~dsv4_attention.compressor.Compressor` whose state this is (sizes only).
        batch: ``B``.
        max_length: the longest sequence the cache can hold (``capacity = floor(max_length / m)`` entries).
        device, dtype: of the buffers (the layer's activation dtype).
    """

    def __init__(
        self, compressor: Compressor, batch: int, max_length: int, *, device=None, dtype=torch.float32
    ):
        self.ratio = compressor.compress_ratio
        self.overlap = compressor.overlap
        width = compressor.cfg.width
        held = (2 if self.overlap else 1) * self.ratio
        self.held_kv = torch.zeros(batch, held, width, device=device, dtype=dtype)  # [B, H, Dk]
        self.held_score = torch.zeros(batch, held, width, device=device, dtype=dtype)  # [B, H, Dk]
        self.capacity = max_length // self.ratio
        self.undo: list[tuple[int, torch.Tensor, torch.Tensor]] | None = (
            None  # per sequence (start, kv, score)
        )
        self.entries = torch.zeros(
            batch, self.capacity, compressor.head_dim, device=device, dtype=dtype
        )  # [B, C, c]

    def start(self, length: int) -> int:
        """First held position of a sequence of ``length`` tokens (module docstring)."""
        block = length // self.ratio * self.ratio
        return max(block - self.ratio, 0) if self.overlap else block

    def extend(
        self,
        compressor: Compressor,
        x: torch.Tensor,
        plan: ExtendPlan,
        backend: str = "auto",
        *,
        undo: bool = False,
    ) -> None:
        """Consume the call's block-input rows ``x [R, d]``: emit the entries their blocks complete, keep the new
        held rows. ``undo``: keep what :meth:`rollback` needs (module docstring)."""
        m = self.ratio
        kv = linear_out(compressor.linear_wkv, x)  # [R, Dk]
        score = linear_out(compressor.linear_wgate, x)  # [R, Dk]
        pooled, seq, entry = [], [], []
        self.undo = [] if undo else None
        for b, (n, k, r0) in enumerate(zip(plan.lengths, plan.counts, plan.row_starts)):
            first, held = self.start(n), n - self.start(n)
            kv_b = torch.cat((self.held_kv[b, :held], kv[r0 : r0 + k]))  # [S, Dk] positions [first, n + k)
            score_b = torch.cat((self.held_score[b, :held], score[r0 : r0 + k]))
            new = range(n // m, (n + k) // m)  # the entries this call completes
            if new:
                # the held + new rows as one document starting at a block boundary: its entry j is entry first/m + j
                doc = compressor_pool_sbhd(
                    kv_b[:, None], score_b[:, None], compressor.ape, m, self.overlap, backend=backend
                )[:, 0]  # [S // m, c] fp32
                pooled.append(doc[new.start - first // m :])
                seq += [b] * len(new)
                entry += list(new)
            if self.undo is not None:
                self.undo.append((first, kv_b, score_b))
            keep = self.start(n + k) - first  # the new held positions [start(n + k), n + k)
            self.held_kv[b, : kv_b.shape[0] - keep] = kv_b[keep:]
            self.held_score[b, : kv_b.shape[0] - keep] = score_b[keep:]
        if pooled:
            entry_t = torch.tensor(entry, device=x.device)
            normed = compressor.norm(torch.cat(pooled))  # [N, c] weighted RMSNorm (fp32 math)
            out = rope(normed, entry_t * m, compressor.rope_cfg, max_position=plan.max_position)  # at w * m
            self.entries[torch.tensor(seq, device=x.device), entry_t] = out.to(self.entries.dtype)

    def rollback(self, lengths: tuple[int, ...]) -> None:
        """After an ``undo=True`` :meth:`extend`: hold the rows of sequences of ``lengths[b]`` tokens (between
        the call's old and new lengths; module docstring)."""
        if self.undo is None:
            raise ValueError("rollback needs the last extend() to be called with undo=True")
        for b, (n, (first, kv_b, score_b)) in enumerate(zip(lengths, self.undo)):
            lo, held = self.start(n) - first, n - self.start(n)
            self.held_kv[b, :held] = kv_b[lo : lo + held]
            self.held_score[b, :held] = score_b[lo : lo + held]
        self.undo = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.held_kv, self.held_score, self.entries))
