"""Per-document training samples and the dataset protocol shared by the raw-text, mock and default-corpus datasets.

A document of ``n`` token ids ``ids = [t_0, ..., t_{n-2}, EOD]`` gives one sample of ``L = n - 1`` rows:
``tokens = ids[:-1]``, ``labels = ids[1:]`` (shifted inside the document, so no label ever comes from another
document of a pack), ``loss_mask = 1`` except, with ``eod_mask_loss``, where the label is EOD.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class DocumentSample:
    """One document: ``tokens [L]`` int64, ``labels [L]`` int64, ``loss_mask [L]`` float32."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor

    @classmethod
    def from_ids(cls, ids: np.ndarray, eod: int, *, eod_mask_loss: bool = False) -> DocumentSample:
        """Sample of an id sequence ``ids`` (``>= 2`` ids; a whole document's last id is EOD)."""
        assert ids.size >= 2, "a sample needs at least 2 ids (one row)"
        ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))
        tokens, labels = ids[:-1], ids[1:]
        loss_mask = torch.ones(tokens.numel(), dtype=torch.float32)
        if eod_mask_loss:
            loss_mask[labels == eod] = 0.0
        return cls(tokens, labels, loss_mask)

    def __len__(self) -> int:
        return self.tokens.numel()


@runtime_checkable
class VarlenDataset(Protocol):
    """A map-style dataset of variable-length documents.

    ``lengths[i] == len(self[i])`` is known up front, so the scheduler can plan without touching the data.
    """

    @property
    def lengths(self) -> np.ndarray: ...  # [num_docs] int64

    @property
    def eod(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> DocumentSample: ...
