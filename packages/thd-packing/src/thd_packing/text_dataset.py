"""Raw-text dataset (P8): documents from JSONL / JSON / Parquet / ``.txt`` (or in-memory strings), tokenized once.

Each document's ids are ``tokenize(text) + [EOD]`` (empty text gives ``[EOD, EOD]``); a sample has
``1 <= L <= seq_capacity`` rows (see :mod:`thd_packing.samples` for tokens / labels / loss mask). Longer documents
are, by ``long_documents``:

- ``'truncate'`` (upstream): ``ids = tokenize(text)[:seq_capacity] + [EOD]``, the rest of the text is not used;
- ``'split'``: consecutive samples of ``seq_capacity`` rows, sample ``k`` taking ids
  ``[k * C, (k + 1) * C + 1)`` so its last label is the next sample's first token; only the last sample ends with
  EOD. Every token of the text is trained on.
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
        long_documents: ``'truncate'`` or ``'split'`` documents longer than ``seq_capacity`` (module docstring).
    """

    seq_capacity: int
    eod_mask_loss: bool = False
    text_key: str = "text"
    errors: Literal["raise", "skip"] = "raise"
    long_documents: Literal["truncate", "split"] = "truncate"

    def __post_init__(self) -> None:
        if self.seq_capacity < 1:
            raise ValueError(f"TextDatasetConfig.seq_capacity must be >= 1, got {self.seq_capacity}")
        if self.long_documents not in ("truncate", "split"):
            raise ValueError(
                f"TextDatasetConfig.long_documents must be 'truncate' or 'split', got {self.long_documents!r}"
            )


class RawTextDataset:
    """Tokenized documents held as one flat int32 id array plus offsets (map-style, ``VarlenDataset``; with
    ``long_documents='split'`` an index addresses one piece of a document).

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

        cap = config.seq_capacity
        split = config.long_documents == "split"

        def flush() -> None:
            for ids in self.tokenizer.encode_batch(batch):
                if ids.size == 0:
                    pieces = [np.array([eod, eod], dtype=np.int32)]
                else:
                    if not split:
                        ids = ids[:cap]
                    full = np.concatenate([ids.astype(np.int32, copy=False), np.array([eod], dtype=np.int32)])
                    rows = full.size - 1
                    pieces = [full[k : min(k + cap, rows) + 1] for k in range(0, rows, cap)]
                for piece in pieces:
                    chunks.append(piece)
                    offsets.append(offsets[-1] + piece.size)
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
        """The id sequence of sample ``index`` (``len + 1`` ids; a whole document's ends with EOD)."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"document index {index} out of range for {len(self)} documents")
        index %= len(self)
        return self._ids[self._offsets[index] : self._offsets[index + 1]]

    def __getitem__(self, index: int) -> DocumentSample:
        return DocumentSample.from_ids(self.ids(index), self.eod, eod_mask_loss=self.config.eod_mask_loss)
