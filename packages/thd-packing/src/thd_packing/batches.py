"""Training batch iterator: documents -> scheduled, packed (THD) or padded (SBHD) microbatches for one rank.

Every rank builds the same deterministic document stream and schedule, then keeps its own share: no communication.

Document stream: epoch ``e`` visits the dataset in ``permutation(seed, e)`` order (or in order without
``shuffle``); iteration ``i`` takes stream positions ``[i * G, (i + 1) * G)`` with ``G = global_batch_size``
(iterations may span epochs). With ``num_epochs`` set, iteration stops before the stream runs out (the last,
incomplete global batch is not used).

THD (``layout='thd'``): the iteration's documents go through :class:`~thd_packing.scheduler.DpBalancedScheduler`;
this DP rank's packs become microbatches. A pack's global buffer has ``max_seqlen_per_dp_cp_rank * cp_size`` rows
with ``static_shape`` (P11 padding, dummy tail document, cu arrays of ``max_num_seqs + 1`` entries), else its padded
length rounded up to a multiple of ``cp_size``. Each CP rank gets its contiguous slice of rows and the *global*
``PackedSeqs``.

SBHD (``layout='sbhd'``): one document piece per row of ``S = max_seqlen_per_dp_cp_rank`` tokens (documents longer
than ``S`` are split or rejected by ``too_long``), padded with ``pad_id`` / loss mask 0; the row count is padded with
fully masked rows to a multiple of ``dp_size * micro_batch_size * microbatch_group_size_per_vp_stage``. Rows are
dealt to DP ranks in blocks of ``micro_batch_size``; CP ranks get contiguous slices of the ``S`` dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from thd_packing.cp_layout import shard_contiguous_cp
from thd_packing.pack_builder import build_pack
from thd_packing.packed_seqs import PackedSeqs, round_up
from thd_packing.samples import VarlenDataset
from thd_packing.scheduler import DocPiece, DpBalancedScheduler, SchedulerConfig
from thd_packing.static_shape import StaticShapeConfig, pad_to_static_shape


@dataclass(frozen=True)
class BatchConfig:
    """Configuration of :class:`PackedBatchIterator`.

    Attributes:
        global_batch_size: documents per training iteration, over all DP ranks.
        max_seqlen_per_dp_cp_rank: THD: rows per CP rank per microbatch (pack capacity = this x ``cp_size``);
            SBHD: the sequence length ``S`` of a row before CP slicing.
        layout: ``'thd'`` (packed) or ``'sbhd'`` (fixed ``[B, S]``).
        micro_batch_size: SBHD rows per microbatch (THD microbatches are one pack each).
        dp_size / dp_rank / cp_size / cp_rank: this rank's place in the DP x CP grid.
        microbatch_group_size_per_vp_stage: virtual-pipeline microbatch group (1 without VPP).
        too_long: ``'split'`` or ``'reject'`` documents longer than the capacity.
        seq_alignment: THD per-document padding multiple (1 for contiguous CP).
        static_shape: THD: pad every pack to the static capacity (CUDA graphs).
        max_num_seqs: THD static cu capacity, the dummy tail document included (upstream default 32).
        balance: DP balancing cost of the scheduler.
        shuffle / seed: document order per epoch (and scheduler tie-breaking).
        num_epochs: stop after this many passes (``None``: never stop).
    """

    global_batch_size: int
    max_seqlen_per_dp_cp_rank: int
    layout: Literal["thd", "sbhd"] = "thd"
    micro_batch_size: int = 1
    dp_size: int = 1
    dp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    microbatch_group_size_per_vp_stage: int = 1
    too_long: Literal["split", "reject"] = "split"
    seq_alignment: int = 1
    static_shape: bool = True
    max_num_seqs: int = 32
    balance: Literal["seqlen_squared", "seqlen", "none"] = "seqlen_squared"
    shuffle: bool = True
    seed: int = 0
    num_epochs: int | None = None

    def __post_init__(self) -> None:
        if self.layout not in ("thd", "sbhd"):
            raise ValueError(f"BatchConfig.layout must be 'thd' or 'sbhd', got {self.layout!r}")
        for name in (
            "global_batch_size",
            "max_seqlen_per_dp_cp_rank",
            "micro_batch_size",
            "dp_size",
            "cp_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"BatchConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"BatchConfig.dp_rank={self.dp_rank} must be in [0, dp_size={self.dp_size})")
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"BatchConfig.cp_rank={self.cp_rank} must be in [0, cp_size={self.cp_size})")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"BatchConfig.num_epochs must be >= 1 or None, got {self.num_epochs}")
        if self.layout == "thd" and self.static_shape and self.max_num_seqs < 2:
            raise ValueError("BatchConfig.max_num_seqs must be >= 2 (one document plus the dummy tail)")
        if self.layout == "sbhd" and self.max_seqlen_per_dp_cp_rank % self.cp_size:
            raise ValueError(
                f"SBHD sequence length {self.max_seqlen_per_dp_cp_rank} must be a multiple of cp_size {self.cp_size}"
            )

    def scheduler_config(self, iteration: int) -> SchedulerConfig:
        """The THD scheduler config of one iteration (tie-break seed mixed with the iteration index)."""
        seed = int(np.random.SeedSequence([self.seed, iteration]).generate_state(1)[0])
        return SchedulerConfig(
            max_seqlen_per_dp_cp_rank=self.max_seqlen_per_dp_cp_rank,
            cp_size=self.cp_size,
            dp_size=self.dp_size,
            microbatch_group_size_per_vp_stage=self.microbatch_group_size_per_vp_stage,
            too_long=self.too_long,
            seq_alignment=self.seq_alignment,
            max_seqs_per_pack=self.max_num_seqs - 1 if self.static_shape else None,
            balance=self.balance,
            seed=seed,
        )


@dataclass(frozen=True, eq=False)
class ThdMicrobatch:
    """One packed microbatch on one CP rank (``T_local`` rows; megatron wants ``[1, T_local]``: ``unsqueeze(0)``).

    Attributes:
        tokens / labels: ``[T_local]`` int64 (padding rows hold ``pad_id``).
        loss_mask: ``[T_local]`` float32 (0 on padding, and on EOD labels with ``eod_mask_loss``).
        position_ids: ``[T_local]`` int64, document-relative.
        padding_mask: ``[T_local]`` bool, True on rows that are not real tokens.
        packed_seqs: the *global* pack metadata (all CP ranks' rows).
        pieces: the pack's document pieces (``doc`` = dataset index), in buffer order.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    padding_mask: torch.Tensor
    packed_seqs: PackedSeqs
    cp_rank: int
    cp_size: int
    pieces: tuple[DocPiece, ...] = field(repr=False)

    def packed_seq_params(self, *, cp_group=None):
        """megatron-core ``PackedSeqParams(qkv_format='thd')`` of the global pack."""
        return self.packed_seqs.to_packed_seq_params(cp_group=cp_group)

    def to(self, device) -> ThdMicrobatch:
        return ThdMicrobatch(
            self.tokens.to(device),
            self.labels.to(device),
            self.loss_mask.to(device),
            self.position_ids.to(device),
            self.padding_mask.to(device),
            self.packed_seqs.to(device),
            self.cp_rank,
            self.cp_size,
            self.pieces,
        )


@dataclass(frozen=True, eq=False)
class SbhdMicrobatch:
    """One padded ``[B, S_local]`` microbatch (``S_local = S / cp_size``); ``pieces[b]`` is row ``b``'s piece
    (``None`` for a fully masked filler row)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    padding_mask: torch.Tensor
    cp_rank: int
    cp_size: int
    pieces: tuple[DocPiece | None, ...] = field(repr=False)

    def to(self, device) -> SbhdMicrobatch:
        return SbhdMicrobatch(
            self.tokens.to(device),
            self.labels.to(device),
            self.loss_mask.to(device),
            self.position_ids.to(device),
            self.padding_mask.to(device),
            self.cp_rank,
            self.cp_size,
            self.pieces,
        )


@dataclass(frozen=True, eq=False)
class IterationBatch:
    """This rank's work for one training iteration.

    ``num_microbatches`` is the same on every DP rank (hand it to megatron's forward-backward schedule);
    ``seqlen_sum`` / ``seqlen_squared_sum`` cover the whole global batch (FLOP accounting) and
    ``num_real_tokens`` this DP rank's real tokens (all of its CP ranks together).
    """

    iteration: int
    microbatches: tuple[ThdMicrobatch, ...] | tuple[SbhdMicrobatch, ...]
    num_microbatches: int
    seqlen_sum: int
    seqlen_squared_sum: int
    num_real_tokens: int


class PackedBatchIterator:
    """Iterate training iterations (:class:`IterationBatch`) over a :class:`VarlenDataset` (module docstring).

    Resumable: :meth:`state_dict` / :meth:`load_state_dict` hold the next iteration index.
    """

    def __init__(self, dataset: VarlenDataset, config: BatchConfig) -> None:
        if len(dataset) == 0:
            raise ValueError("the dataset has no documents")
        self.dataset = dataset
        self.config = config
        self.iteration = 0
        self._perm_cache: dict[int, np.ndarray] = {}

    def __iter__(self) -> PackedBatchIterator:
        return self

    def state_dict(self) -> dict:
        return {"iteration": self.iteration}

    def load_state_dict(self, state: dict) -> None:
        it = int(state["iteration"])
        if it < 0:
            raise ValueError(f"iteration must be >= 0, got {it}")
        self.iteration = it

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            n = len(self.dataset)
            order = np.arange(n)
            if self.config.shuffle:
                order = np.random.default_rng([self.config.seed, epoch]).permutation(n)
            self._perm_cache = {epoch: order, **{e: p for e, p in self._perm_cache.items() if e == epoch - 1}}
        return self._perm_cache[epoch]

    def documents_of(self, iteration: int) -> np.ndarray:
        """Dataset indices of the documents of ``iteration`` (in stream order)."""
        n, g = len(self.dataset), self.config.global_batch_size
        pos = np.arange(iteration * g, (iteration + 1) * g)
        out = np.empty(g, dtype=np.int64)
        for epoch in np.unique(pos // n):
            sel = pos // n == epoch
            out[sel] = self._epoch_order(int(epoch))[pos[sel] % n]
        return out

    def __next__(self) -> IterationBatch:
        cfg = self.config
        if cfg.num_epochs is not None and (self.iteration + 1) * cfg.global_batch_size > cfg.num_epochs * len(
            self.dataset
        ):
            raise StopIteration
        docs = self.documents_of(self.iteration)
        batch = self._thd(docs) if cfg.layout == "thd" else self._sbhd(docs)
        self.iteration += 1
        return batch

    def _thd(self, docs: np.ndarray) -> IterationBatch:
        cfg = self.config
        lengths = self.dataset.lengths[docs]
        schedule = DpBalancedScheduler(cfg.scheduler_config(self.iteration)).schedule(lengths.tolist())
        capacity = cfg.max_seqlen_per_dp_cp_rank * cfg.cp_size
        static = StaticShapeConfig(capacity, cfg.max_num_seqs)
        micro = []
        real = 0
        for pack in schedule.packs_for(cfg.dp_rank):
            total = (
                capacity
                if cfg.static_shape
                else max(round_up(pack.num_padded_tokens, cfg.cp_size), cfg.cp_size)
            )
            packed, tensors = build_pack(self.dataset, pack, doc_index=docs, total_tokens=total)
            padding_mask = packed.padding_mask()
            if cfg.static_shape:
                padded = pad_to_static_shape(packed, tensors, static)
                packed, tensors, padding_mask = padded.packed, padded.tensors, padded.padding_mask
            real += pack.num_tokens

            def shard(x: torch.Tensor) -> torch.Tensor:
                return shard_contiguous_cp(x, cfg.cp_rank, cfg.cp_size).clone()

            pieces = tuple(DocPiece(int(docs[p.doc]), p.start, p.length) for p in pack.pieces)
            micro.append(
                ThdMicrobatch(
                    tokens=shard(tensors["tokens"]),
                    labels=shard(tensors["labels"]),
                    loss_mask=shard(tensors["loss_mask"]),
                    position_ids=shard(packed.position_ids),
                    padding_mask=shard(padding_mask),
                    packed_seqs=packed,
                    cp_rank=cfg.cp_rank,
                    cp_size=cfg.cp_size,
                    pieces=pieces,
                )
            )
        return IterationBatch(
            self.iteration,
            tuple(micro),
            schedule.num_microbatches,
            schedule.seqlen_sum,
            schedule.seqlen_squared_sum,
            real,
        )

    def _sbhd(self, docs: np.ndarray) -> IterationBatch:
        cfg = self.config
        s = cfg.max_seqlen_per_dp_cp_rank
        pieces: list[DocPiece | None] = []
        for d in docs.tolist():
            n = int(self.dataset.lengths[d])
            if n > s and cfg.too_long == "reject":
                raise ValueError(
                    f"document {d} has {n} tokens but the SBHD sequence length is {s}; truncate documents, raise "
                    "the sequence length or use too_long='split'"
                )
            pieces += [DocPiece(d, start, min(s, n - start)) for start in range(0, max(n, 1), s)]
        block = cfg.micro_batch_size * cfg.dp_size * cfg.microbatch_group_size_per_vp_stage
        pieces += [None] * (-len(pieces) % block)
        mbs = cfg.micro_batch_size
        num_micro = len(pieces) // (mbs * cfg.dp_size)
        mine = [
            pieces[(m * cfg.dp_size + cfg.dp_rank) * mbs : (m * cfg.dp_size + cfg.dp_rank + 1) * mbs]
            for m in range(num_micro)
        ]
        real_pieces = [p for p in pieces if p is not None]
        micro = [self._sbhd_rows(rows) for rows in mine]
        return IterationBatch(
            self.iteration,
            tuple(micro),
            num_micro,
            sum(p.length for p in real_pieces),
            sum(p.length**2 for p in real_pieces),
            sum(p.length for rows in mine for p in rows if p is not None),
        )

    def _sbhd_rows(self, rows: list[DocPiece | None]) -> SbhdMicrobatch:
        cfg = self.config
        s, pad = cfg.max_seqlen_per_dp_cp_rank, self.dataset.pad_id
        b = len(rows)
        tokens = torch.full((b, s), pad, dtype=torch.int64)
        labels = torch.full((b, s), pad, dtype=torch.int64)
        loss_mask = torch.zeros(b, s, dtype=torch.float32)
        padding_mask = torch.ones(b, s, dtype=torch.bool)
        for r, piece in enumerate(rows):
            if piece is None:
                continue
            sample = self.dataset[piece.doc]
            sl = slice(piece.start, piece.start + piece.length)
            tokens[r, : piece.length] = sample.tokens[sl]
            labels[r, : piece.length] = sample.labels[sl]
            loss_mask[r, : piece.length] = sample.loss_mask[sl]
            padding_mask[r, : piece.length] = False
        position_ids = torch.arange(s, dtype=torch.int64).expand(b, s)

        def shard(x: torch.Tensor) -> torch.Tensor:
            return shard_contiguous_cp(x, cfg.cp_rank, cfg.cp_size, dim=1).clone()

        return SbhdMicrobatch(
            shard(tokens),
            shard(labels),
            shard(loss_mask),
            shard(position_ids),
            shard(padding_mask),
            cfg.cp_rank,
            cfg.cp_size,
            tuple(rows),
        )
