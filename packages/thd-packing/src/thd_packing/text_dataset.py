"""Raw-text dataset (P8): documents from JSONL / JSON / Parquet / ``.txt`` (or in-memory strings), tokenized once.

Each document becomes ``ids = tokenize(text)[:seq_capacity] + [EOD]`` (empty text gives ``[EOD, EOD]``), so a
sample has ``1 <= L <= seq_capacity`` rows; see :mod:`thd_packing.samples` for tokens / labels / loss mask.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from thd_packing.samples import DocumentSample
from thd_packing.text_sources import ReadReport, read_text_records
from thd_packing.tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class TextDatasetConfig:
    """Tokenization and error policy of :class:`RawTextDataset`.

    Attributes:
        seq_capacity: the most rows one document sample may have (longer texts are truncated); for THD packing
            use at most the pack capacity ``max_seqlen_per_dp_cp_rank * cp``.
        eod_mask_loss: zero the loss mask where the label is EOD.
        text_key: the record field holding the text.
        errors: ``'raise'`` on the first bad record, or ``'skip'`` bad records and count them.
    """

    seq_capacity: int
    eod_mask_loss: bool = False
    text_key: str = "text"
    errors: Literal["raise", "skip"] = "raise"

    def __post_init__(self) -> None:
        if self.seq_capacity < 1:
            raise ValueError(f"TextDatasetConfig.seq_capacity must be >= 1, got {self.seq_capacity}")


class RawTextDataset:
    """Tokenized documents held as one flat int32 id array plus offsets (map-style, ``VarlenDataset``).

    Build with :meth:`from_paths` (files) or :meth:`from_texts` (strings). ``report`` counts files, records and
    skipped records (with ``errors='skip'`` a warning summarises them).
    """

    def __init__(
        self,
        texts: Iterable[str],
        config: TextDatasetConfig,
        tokenizer: Tokenizer | str | Path | None = None,
        *,
        report: ReadReport | None = None,
        batch_size: int = 512,
    ) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(tokenizer)
        eod = self.tokenizer.eod
        chunks: list[np.ndarray] = []
        offsets = [0]
        batch: list[str] = []

        def flush() -> None:
            for ids in self.tokenizer.encode_batch(batch):
                ids = ids[: config.seq_capacity]
                if ids.size == 0:
                    doc = np.array([eod, eod], dtype=np.int32)
                else:
                    doc = np.concatenate([ids.astype(np.int32, copy=False), np.array([eod], dtype=np.int32)])
                chunks.append(doc)
                offsets.append(offsets[-1] + doc.size)
            batch.clear()

        for text in texts:
            batch.append(text)
            if len(batch) >= batch_size:
                flush()
        flush()
        self._ids = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self._lengths = np.diff(self._offsets) - 1
        self.report = report if report is not None else ReadReport(records=len(self._lengths))
        if self.report.num_skipped:
            warnings.warn(f"RawTextDataset skipped bad records: {self.report.summary()}", stacklevel=2)

    @classmethod
    def from_paths(
        cls,
        paths: str | Path | Sequence[str | Path],
        config: TextDatasetConfig,
        tokenizer: Tokenizer | str | Path | None = None,
    ) -> RawTextDataset:
        """Read JSONL / JSON / Parquet files or directories of ``.txt`` files (:mod:`thd_packing.text_sources`)."""
        report = ReadReport()
        records = read_text_records(paths, text_key=config.text_key, errors=config.errors, report=report)
        ds = cls((r.text for r in records), config, tokenizer, report=report)
        if len(ds) == 0:
            raise ValueError(f"no usable documents in {paths}: {report.summary()}")
        return ds

    @classmethod
    def from_texts(
        cls, texts: Iterable[str], config: TextDatasetConfig, tokenizer: Tokenizer | str | Path | None = None
    ) -> RawTextDataset:
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise ValueError(f"text {i} is {type(t).__name__}, expected a string")
        return cls(texts, config, tokenizer)

    @property
    def lengths(self) -> np.ndarray:
        """``[num_docs]`` int64 rows per sample."""
        return self._lengths

    @property
    def eod(self) -> int:
        return self.tokenizer.eod

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def num_tokens(self) -> int:
        return int(self._lengths.sum())

    def __len__(self) -> int:
        return self._lengths.size

    def ids(self, index: int) -> np.ndarray:
        """The full id sequence of document ``index`` (ending with EOD)."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"document index {index} out of range for {len(self)} documents")
        index %= len(self)
        return self._ids[self._offsets[index] : self._offsets[index + 1]]

    def __getitem__(self, index: int) -> DocumentSample:
        return DocumentSample.from_ids(self.ids(index), self.eod, eod_mask_loss=self.config.eod_mask_loss)
