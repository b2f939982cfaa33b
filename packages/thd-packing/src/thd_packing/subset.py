"""A view of some samples of a :class:`~thd_packing.samples.VarlenDataset` (train / held-out splits)."""

from __future__ import annotations

import numpy as np

from thd_packing.samples import DocumentSample, VarlenDataset


class VarlenSubset:
    """Samples ``indices`` of ``dataset`` (in that order) as a ``VarlenDataset``: sample ``j`` is
    ``dataset[indices[j]]``; ``eod`` / ``pad_id`` / ``vocab_size`` are the dataset's."""

    def __init__(self, dataset: VarlenDataset, indices: np.ndarray) -> None:
        indices = np.asarray(indices, dtype=np.int64)
        if indices.ndim != 1:
            raise ValueError(f"VarlenSubset indices must be 1-D, got shape {indices.shape}")
        n = len(dataset)
        if indices.size and not (indices.min() >= 0 and indices.max() < n):
            raise ValueError(
                f"VarlenSubset indices must lie in [0, {n}), got [{indices.min()}, {indices.max()}]"
            )
        self.dataset = dataset
        self.indices = indices
        self._lengths = np.asarray(dataset.lengths, dtype=np.int64)[indices]

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    @property
    def eod(self) -> int:
        return self.dataset.eod

    @property
    def pad_id(self) -> int:
        return self.dataset.pad_id

    @property
    def vocab_size(self) -> int:
        return self.dataset.vocab_size

    def __len__(self) -> int:
        return self.indices.size

    def __getitem__(self, index: int) -> DocumentSample:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples")
        return self.dataset[int(self.indices[index])]
