"""Raw-text dataset (P8): documents from JSONL / JSON / Parquet / ``.txt`` (or in-memory strings), tokenized once.

Each document's ids are ``tokenize(text) + [EOD]`` (empty text gives ``[EOD, EOD]``); a sample has
``1 <= L <= seq_capacity`` rows (see :mod:`thd_packing.samples` for tokens / labels / loss mask). Longer documents
are, by ``long_documents``:

- ``'split'`` (default): consecutive samples of ``seq_capacity`` rows, sample ``k`` taking ids
  ``[k * C, (k + 1) * C + 1)`` so its last label is the next sample's first token; only the last sample ends with
  EOD. Every token of the text is trained on.
- ``'truncate'`` (upstream): ``ids = tokenize(text)[:seq_capacity] + [EOD]``, the rest of the text is not used; a
  warning says how many documents and tokens were cut.

:meth:`RawTextDataset.source_stats` counts, per source (path argument), the documents and tokens read, the samples
made and the documents split, truncated or skipped; :func:`format_source_stats` prints them.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
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
        seq_capacity: the most rows one document sample may have (longer texts are split or truncated); for THD
            packing use at most the pack capacity ``max_seqlen_per_dp_cp_rank * cp``.
        eod_mask_loss: zero the loss mask where the label is EOD.
        text_key: the record field holding the text.
        errors: ``'raise'`` on the first bad record, or ``'skip'`` bad records and count them.
        long_documents: ``'truncate'`` or ``'split'`` documents longer than ``seq_capacity`` (module docstring).
    """

    seq_capacity: int
    eod_mask_loss: bool = False
    text_key: str = "text"
    errors: Literal["raise", "skip"] = "raise"
    long_documents: Literal["truncate", "split"] = "split"

    def __post_init__(self) -> None:
        if self.seq_capacity < 1:
            raise ValueError(f"TextDatasetConfig.seq_capacity must be >= 1, got {self.seq_capacity}")
        if self.long_documents not in ("truncate", "split"):
            raise ValueError(
                f"TextDatasetConfig.long_documents must be 'truncate' or 'split', got {self.long_documents!r}"
            )


@dataclass(frozen=True)
class SourceStats:
    """What one source (a path argument, or the in-memory texts) contributed.

    Attributes:
        source: the path as given (or a description).
        files: files read. documents: documents (records) kept. tokens: tokens of their text (EOD not counted).
        samples: training samples made of them. split: documents longer than ``seq_capacity`` split into several
            samples. truncated / truncated_tokens: documents cut to ``seq_capacity`` and the tokens not used.
        skipped: bad records skipped (``errors='skip'``). ignored: directory entries not read (wrong type, hidden).
    """

    source: str
    files: int
    documents: int
    tokens: int
    samples: int
    split: int = 0
    truncated: int = 0
    truncated_tokens: int = 0
    skipped: int = 0
    ignored: int = 0

    def summary(self) -> str:
        files = f"{self.files:,} file{'s' * (self.files != 1)}, " if self.files else ""
        text = (
            f"{self.source}: {files}{self.documents:,} documents, {self.tokens:,} tokens -> {self.samples:,} "
            f"samples; {self.split:,} split, {self.truncated:,} truncated"
        )
        if self.truncated:
            text += f" ({self.truncated_tokens:,} tokens not used)"
        text += f", {self.skipped:,} bad records skipped"
        if self.ignored:
            text += f", {self.ignored:,} directory entries ignored"
        return text


def format_source_stats(stats: Sequence[SourceStats]) -> str:
    """One line per source (:meth:`SourceStats.summary`), plus a total line when there are several."""
    lines = [s.summary() for s in stats]
    if len(stats) > 1:
        total = SourceStats(
            "total",
            *(sum(getattr(s, f) for s in stats) for f in ("files", "documents", "tokens", "samples")),
            *(sum(getattr(s, f) for s in stats) for f in ("split", "truncated", "truncated_tokens")),
            *(sum(getattr(s, f) for s in stats) for f in ("skipped", "ignored")),
        )
        lines.append(total.summary())
    return "\n".join(lines)


class RawTextDataset:
    """Tokenized documents held as one flat int32 id array plus offsets (map-style, ``VarlenDataset``; with
    ``long_documents='split'`` an index addresses one piece of a document).

    Build with :meth:`from_paths` (files) or :meth:`from_texts` (strings). ``report`` counts files, records,
    skipped records and ignored directory entries (with ``errors='skip'`` a warning summarises the skipped ones);
    :meth:`source_stats` counts per source what was read, split, truncated and skipped.
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
        doc_tokens: list[int] = []  # per document: tokens of its text
        doc_samples: list[int] = []  # per document: samples made of it
        doc_cut: list[int] = []  # per document: tokens not used (truncate)

        cap = config.seq_capacity
        split = config.long_documents == "split"

        def flush() -> None:
            for ids in self.tokenizer.encode_batch(batch):
                doc_tokens.append(int(ids.size))
                doc_cut.append(0 if split else max(int(ids.size) - cap, 0))
                if ids.size == 0:
                    pieces = [np.array([eod, eod], dtype=np.int32)]
                else:
                    if not split:
                        ids = ids[:cap]
                    full = np.concatenate([ids.astype(np.int32, copy=False), np.array([eod], dtype=np.int32)])
                    rows = full.size - 1
                    pieces = [full[k : min(k + cap, rows) + 1] for k in range(0, rows, cap)]
                doc_samples.append(len(pieces))
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
        self._doc_tokens = np.asarray(doc_tokens, dtype=np.int64)  # [num_documents]
        self._doc_samples = np.asarray(doc_samples, dtype=np.int64)  # [num_documents]
        self._doc_cut = np.asarray(doc_cut, dtype=np.int64)  # [num_documents]
        self._doc_source = np.zeros(len(doc_tokens), dtype=np.int64)  # [num_documents] source index
        self.report = report if report is not None else ReadReport(records=len(doc_tokens))
        if self.report.num_skipped:
            warnings.warn(f"RawTextDataset skipped bad records: {self.report.summary()}", stacklevel=2)
        cut = self._doc_cut > 0
        if cut.any():
            warnings.warn(
                f"RawTextDataset truncated {int(cut.sum())} of {cut.size} documents to seq_capacity={cap} rows "
                f"({int(self._doc_cut.sum())} tokens not used); long_documents='split' trains on every token",
                stacklevel=2,
            )

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
        sources: list[int] = []

        def texts() -> Iterator[str]:
            for r in records:
                sources.append(r.source)
                yield r.text

        ds = cls(texts(), config, tokenizer, report=report)
        ds._doc_source = np.asarray(sources, dtype=np.int64)
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

    def source_stats(self) -> list[SourceStats]:
        """Per source (``report.sources``; one entry ``"<texts>"`` for :meth:`from_texts`): documents and tokens
        read, samples made, documents split / truncated, bad records skipped, directory entries ignored."""
        sources = self.report.sources or [None]
        out = []
        for i, src in enumerate(sources):
            mine = self._doc_source == i
            tokens, samples, cut = self._doc_tokens[mine], self._doc_samples[mine], self._doc_cut[mine]
            out.append(
                SourceStats(
                    source="<texts>" if src is None else src.path,
                    files=0 if src is None else src.files,
                    documents=int(mine.sum()),
                    tokens=int(tokens.sum()),
                    samples=int(samples.sum()),
                    split=int((samples > 1).sum()),
                    truncated=int((cut > 0).sum()),
                    truncated_tokens=int(cut.sum()),
                    skipped=0 if src is None else src.skipped,
                    ignored=0 if src is None else len(src.ignored),
                )
            )
        return out

    @property
    def sample_documents(self) -> np.ndarray:
        """``[num_samples]`` int64: the document (record, in reading order) each sample was made of (the pieces of
        a split document are consecutive samples)."""
        return np.repeat(np.arange(self._doc_samples.size, dtype=np.int64), self._doc_samples)

    @property
    def lengths(self) -> np.ndarray:
        """``[num_samples]`` int64 rows per sample."""
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
