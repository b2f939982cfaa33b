"""DP-balanced THD packing scheduler (P7).

One training iteration brings a global batch of documents (lengths ``l_0 .. l_{n-1}``). The scheduler

1. applies the too-long policy: a document whose aligned length exceeds the pack capacity
   ``C = max_seqlen_per_dp_cp_rank * cp_size`` is split into consecutive pieces of at most ``C`` rows
   (``too_long='split'``; each piece becomes its own THD sequence, positions restart) or rejected with a
   ``ValueError`` (``too_long='reject'``);
2. packs pieces *in their original order* (first fit on the current pack) while the aligned sum stays ``<= C``
   and the pack holds at most ``max_seqs_per_pack`` pieces;
3. makes the pack count a multiple of ``dp_size * microbatch_group_size_per_vp_stage`` by repeatedly moving the
   last piece of the heaviest multi-piece pack into a new pack right after it (too few pieces -> ``ValueError``);
4. assigns packs to DP ranks, each DP rank getting exactly ``num_packs / dp_size`` packs (its microbatches):
   ``balance='seqlen_squared'`` (default) or ``'seqlen'`` runs greedy longest-processing-time on that cost with a
   cardinality limit, ties between equally loaded ranks broken by a permutation drawn from ``seed``;
   ``balance='none'`` deals packs round-robin like upstream. Microbatches keep their packing order on each rank;
5. within a DP rank, every pack is spread over the CP ranks contiguously: CP rank ``c`` owns the pack's rows
   ``[c * L, (c + 1) * L)`` with ``L = max_seqlen_per_dp_cp_rank`` (DP x CP rank ``dp * cp_size + c``);
6. reports ``seqlen_sum = sum(l)`` and ``seqlen_squared_sum = sum(l^2)`` over the scheduled pieces (FLOP
   accounting: attention cost grows with ``l^2``).

The result is a pure function of the lengths, the config and ``seed``: every rank computes the same schedule
without communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from thd_packing.packed_seqs import round_up


@dataclass(frozen=True)
class SchedulerConfig:
    """Configuration of :class:`DpBalancedScheduler`.

    Attributes:
        max_seqlen_per_dp_cp_rank: rows each CP rank holds per microbatch (``L``).
        cp_size / dp_size: context- and data-parallel sizes.
        microbatch_group_size_per_vp_stage: virtual-pipeline microbatch group; the pack count is a multiple of
            ``dp_size`` times this (1 without VPP).
        too_long: ``'split'`` or ``'reject'`` documents longer than the pack capacity.
        seq_alignment: each piece is padded to a multiple of this (1 for contiguous CP; ``2 * cp`` for zigzag).
        max_seqs_per_pack: cap on pieces per pack (static shapes: ``max_num_seqs - 1`` leaves room for the dummy).
        balance: DP balancing cost, ``'seqlen_squared'``, ``'seqlen'`` or ``'none'``.
        seed: seeds the tie-breaking permutation of DP ranks.
    """

    max_seqlen_per_dp_cp_rank: int
    cp_size: int = 1
    dp_size: int = 1
    microbatch_group_size_per_vp_stage: int = 1
    too_long: Literal["split", "reject"] = "split"
    seq_alignment: int = 1
    max_seqs_per_pack: int | None = None
    balance: Literal["seqlen_squared", "seqlen", "none"] = "seqlen_squared"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_seqlen_per_dp_cp_rank", "cp_size", "dp_size", "microbatch_group_size_per_vp_stage"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_alignment < 1:
            raise ValueError(f"SchedulerConfig.seq_alignment must be >= 1, got {self.seq_alignment}")
        if self.too_long not in ("split", "reject"):
            raise ValueError(f"SchedulerConfig.too_long must be 'split' or 'reject', got {self.too_long!r}")
        if self.balance not in ("seqlen_squared", "seqlen", "none"):
            raise ValueError(
                f"SchedulerConfig.balance must be 'seqlen_squared', 'seqlen' or 'none', got {self.balance!r}"
            )
        if self.max_seqs_per_pack is not None and self.max_seqs_per_pack < 1:
            raise ValueError(f"SchedulerConfig.max_seqs_per_pack must be >= 1, got {self.max_seqs_per_pack}")
        if self.capacity < self.seq_alignment:
            raise ValueError(
                f"pack capacity {self.capacity} (max_seqlen_per_dp_cp_rank x cp_size) is below seq_alignment "
                f"{self.seq_alignment}"
            )

    @property
    def capacity(self) -> int:
        """Rows of one pack across the CP group: ``max_seqlen_per_dp_cp_rank * cp_size``."""
        return self.max_seqlen_per_dp_cp_rank * self.cp_size

    @property
    def pack_multiple(self) -> int:
        """The pack count is a multiple of this: ``dp_size * microbatch_group_size_per_vp_stage``."""
        return self.dp_size * self.microbatch_group_size_per_vp_stage


@dataclass(frozen=True)
class DocPiece:
    """Rows ``[start, start + length)`` of document ``doc`` (``start > 0`` only for split documents)."""

    doc: int
    start: int
    length: int


@dataclass(frozen=True)
class Pack:
    """One microbatch's THD pack: its pieces in buffer order and their aligned (padded) lengths."""

    pieces: tuple[DocPiece, ...]
    padded_lengths: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(p.length for p in self.pieces)

    @property
    def num_padded_tokens(self) -> int:
        return sum(self.padded_lengths)

    @property
    def seqlen_squared_sum(self) -> int:
        return sum(p.length**2 for p in self.pieces)


@dataclass(frozen=True)
class Schedule:
    """The schedule of one iteration.

    Attributes:
        microbatches: ``[dp_size][num_microbatches]`` packs; DP rank ``d`` runs ``microbatches[d]`` in order.
        num_microbatches: packs per DP rank (the microbatch count to hand to the pipeline schedule).
        seqlen_sum / seqlen_squared_sum: over every scheduled piece of the iteration.
        config: the scheduler config that produced it.
    """

    microbatches: tuple[tuple[Pack, ...], ...]
    num_microbatches: int
    seqlen_sum: int
    seqlen_squared_sum: int
    config: SchedulerConfig

    def packs_for(self, dp_rank: int) -> tuple[Pack, ...]:
        if not 0 <= dp_rank < self.config.dp_size:
            raise ValueError(f"dp_rank must be in [0, {self.config.dp_size}), got {dp_rank}")
        return self.microbatches[dp_rank]

    def rows_for(self, dp_rank: int, cp_rank: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of every pack of ``dp_rank`` that CP rank ``cp_rank`` holds."""
        if not 0 <= cp_rank < self.config.cp_size:
            raise ValueError(f"cp_rank must be in [0, {self.config.cp_size}), got {cp_rank}")
        self.packs_for(dp_rank)
        per_rank = self.config.max_seqlen_per_dp_cp_rank
        return cp_rank * per_rank, (cp_rank + 1) * per_rank

    def dp_cp_rank(self, dp_rank: int, cp_rank: int) -> int:
        """Rank in the DP x CP group (CP fastest, as megatron-core orders ``dp_cp``)."""
        self.rows_for(dp_rank, cp_rank)
        return dp_rank * self.config.cp_size + cp_rank


class DpBalancedScheduler:
    """Packs one iteration's documents into DP-balanced THD microbatches (see the module docstring)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    def _pieces(self, lengths: Sequence[int]) -> list[DocPiece]:
        cfg = self.config
        # the largest piece whose aligned length still fits one pack
        max_piece = cfg.capacity - cfg.capacity % cfg.seq_alignment
        pieces: list[DocPiece] = []
        for doc, n in enumerate(lengths):
            n = int(n)
            if n < 0:
                raise ValueError(f"document {doc} has negative length {n}")
            if round_up(n, cfg.seq_alignment) <= cfg.capacity:
                pieces.append(DocPiece(doc, 0, n))
            elif cfg.too_long == "reject":
                raise ValueError(
                    f"document {doc} has {n} tokens (aligned {round_up(n, cfg.seq_alignment)}) but a pack holds "
                    f"{cfg.capacity} (max_seqlen_per_dp_cp_rank {cfg.max_seqlen_per_dp_cp_rank} x cp_size "
                    f"{cfg.cp_size}); truncate documents, raise the capacity or use too_long='split'"
                )
            else:
                pieces += [DocPiece(doc, s, min(max_piece, n - s)) for s in range(0, n, max_piece)]
        return pieces

    def _pack(self, pieces: list[DocPiece]) -> list[list[DocPiece]]:
        cfg = self.config
        packs: list[list[DocPiece]] = []
        used = cfg.capacity + 1
        for p in pieces:
            size = round_up(p.length, cfg.seq_alignment)
            full = cfg.max_seqs_per_pack is not None and packs and len(packs[-1]) >= cfg.max_seqs_per_pack
            if used + size > cfg.capacity or full:
                packs.append([])
                used = 0
            packs[-1].append(p)
            used += size
        return packs

    def _make_multiple(self, packs: list[list[DocPiece]]) -> list[list[DocPiece]]:
        multiple = self.config.pack_multiple
        need = -len(packs) % multiple
        if len(packs) == 0:
            need = multiple
        while need:
            splittable = [i for i, pk in enumerate(packs) if len(pk) > 1]
            if not splittable:
                n_pieces = sum(len(pk) for pk in packs)
                raise ValueError(
                    f"cannot make the pack count a multiple of dp_size x microbatch_group_size_per_vp_stage = "
                    f"{multiple}: this iteration's documents make only {n_pieces} pieces but "
                    f"{round_up(max(n_pieces, 1), multiple)} packs would be needed; give every iteration more "
                    "documents (global batch size)"
                )
            # heaviest multi-piece pack (earliest on ties) gives up its last piece
            i = max(splittable, key=lambda j: (sum(p.length for p in packs[j]), -j))
            packs.insert(i + 1, [packs[i].pop()])
            need -= 1
        return packs

    def _assign(self, packs: list[Pack]) -> list[list[int]]:
        cfg = self.config
        dp = cfg.dp_size
        per_rank = len(packs) // dp
        if cfg.balance == "none":
            return [[i * dp + d for i in range(per_rank)] for d in range(dp)]
        cost = [p.seqlen_squared_sum if cfg.balance == "seqlen_squared" else p.num_tokens for p in packs]
        tie = np.random.default_rng(cfg.seed).permutation(dp).tolist()
        load = [0] * dp
        owned: list[list[int]] = [[] for _ in range(dp)]
        for i in sorted(range(len(packs)), key=lambda j: (-cost[j], j)):
            d = min((r for r in range(dp) if len(owned[r]) < per_rank), key=lambda r: (load[r], tie[r]))
            owned[d].append(i)
            load[d] += cost[i]
        return [sorted(o) for o in owned]

    def schedule(self, lengths: Sequence[int]) -> Schedule:
        """Schedule one iteration whose documents have ``lengths`` (tokens per document, in order)."""
        cfg = self.config
        pieces = self._pieces(lengths)
        groups = self._make_multiple(self._pack(pieces))
        packs = [Pack(tuple(g), tuple(round_up(p.length, cfg.seq_alignment) for p in g)) for g in groups]
        owned = self._assign(packs)
        micro = tuple(tuple(packs[i] for i in o) for o in owned)
        return Schedule(
            microbatches=micro,
            num_microbatches=len(packs) // cfg.dp_size,
            seqlen_sum=sum(p.length for p in pieces),
            seqlen_squared_sum=sum(p.length**2 for p in pieces),
            config=cfg,
        )
