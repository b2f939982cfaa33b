"""``ExtendPlan``: which new token rows one cached call appends to which sequence, at which positions.

A decode cache holds ``B`` independent sequences (no padding). One call appends ``counts[b] >= 0`` new tokens to
sequence ``b``, which already holds ``lengths[b]`` tokens; the call's rows are sequence-major (the ``counts[0]`` rows
of sequence 0 first), exactly the rows of a THD pack with one document per sequence. Prefill is the first call
(``lengths`` all 0, ``counts`` = the prompt lengths), a decode step a call with every ``counts[b] = 1`` (or 0 for a
sequence that stopped). Row ``r`` of sequence ``b`` sits at position ``lengths[b] + i`` (``i``-th new row of ``b``):
positions restart at 0 per sequence, as per document in training (spec §3.5).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ExtendPlan:
    """The rows of one cached call.

    Attributes:
        lengths: tokens already cached per sequence (``B`` entries).
        counts: new tokens per sequence in this call (``B`` entries, ``>= 0``, at least one row in total).
    """

    lengths: tuple[int, ...]
    counts: tuple[int, ...]
    #: device tensors of this plan, built once per device and shared by every layer of a step (not compared)
    _device: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", tuple(int(v) for v in self.lengths))
        object.__setattr__(self, "counts", tuple(int(v) for v in self.counts))
        if len(self.lengths) != len(self.counts) or not self.lengths:
            raise ValueError(
                f"ExtendPlan needs one length and one count per sequence (at least one sequence), got "
                f"{len(self.lengths)} lengths and {len(self.counts)} counts"
            )
        if min(self.lengths) < 0 or min(self.counts) < 0:
            raise ValueError(f"lengths and counts must be >= 0, got {self.lengths} and {self.counts}")
        if not sum(self.counts):
            raise ValueError("an ExtendPlan must append at least one token (every count is 0)")

    @property
    def batch(self) -> int:
        """``B``: the number of sequences."""
        return len(self.lengths)

    @property
    def num_rows(self) -> int:
        """``R``: the new rows of this call."""
        return sum(self.counts)

    @property
    def new_lengths(self) -> tuple[int, ...]:
        """Tokens per sequence after this call."""
        return tuple(n + k for n, k in zip(self.lengths, self.counts))

    @property
    def max_position(self) -> int:
        """A host bound of every RoPE position of the call (queries, keys and compressed entries)."""
        return max(self.new_lengths) - 1

    @property
    def row_starts(self) -> tuple[int, ...]:
        """First row of each sequence's new rows (``B + 1`` entries, the last one ``R``: the call's THD
        ``cu_seqlens``)."""
        return tuple(itertools.accumulate(self.counts, initial=0))

    @property
    def is_decode_step(self) -> bool:
        """At most one new row per sequence (a decode step; sequences given no row are not fed)."""
        return max(self.counts) == 1

    @staticmethod
    def _host_tensor(values: list[int], device) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    def shared(self, key: str, device, build):
        """``build(device)``, built once per ``key`` and device for this plan and shared by every layer of the call
        (device tensors and index tables derived from the plan)."""
        device = torch.device("cpu") if device is None else torch.device(device)
        out = self._device.get((key, device))
        if out is None:
            out = self._device[(key, device)] = build(device)
        return out

    def row_sequences(self, device=None) -> torch.Tensor:
        """int64 ``[R]``: the sequence of every new row (built once per device: one upload, none when every
        sequence gets one row)."""

        def build(dev):
            if all(k == 1 for k in self.counts):
                return torch.arange(self.batch, device=dev)
            return self._host_tensor([b for b, k in enumerate(self.counts) for _ in range(k)], dev)

        return self.shared("sequences", device, build)

    def row_positions(self, device=None) -> torch.Tensor:
        """int64 ``[R]``: the position of every new row in its sequence (built once per device: one upload)."""
        rows = zip(self.lengths, self.counts)
        return self.shared(
            "positions",
            device,
            lambda dev: self._host_tensor([n + i for n, k in rows for i in range(k)], dev),
        )

    def row_lengths(self, device=None) -> torch.Tensor:
        """int64 ``[R]``: ``lengths[b]`` of every new row's sequence ``b`` (its first new position; one upload)."""
        rows = zip(self.lengths, self.counts)
        return self.shared(
            "lengths", device, lambda dev: self._host_tensor([n for n, k in rows for _ in range(k)], dev)
        )

    def ring_rows(self, window: int, device=None) -> torch.Tensor:
        """int64 ``[N]``: the new rows among the last ``window`` positions of their sequence after the call (the
        rows a window ring keeps; computed on the host, one upload per device)."""

        def build(dev):
            rows = [
                r0 + i for k, r0 in zip(self.counts, self.row_starts) for i in range(max(0, k - window), k)
            ]
            return self._host_tensor(rows, dev)

        return self.shared(f"ring{window}", device, build)
