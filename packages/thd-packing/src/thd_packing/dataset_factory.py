"""One entry point that turns a CLI-style data argument into a :class:`~thd_packing.samples.VarlenDataset`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from thd_packing.default_corpus import DEFAULT_CORPUS_MAX_BYTES, default_corpus_dataset
from thd_packing.mock_dataset import MockVarlenConfig, MockVarlenDataset
from thd_packing.samples import VarlenDataset
from thd_packing.text_dataset import RawTextDataset, TextDatasetConfig
from thd_packing.tokenizer import Tokenizer


def build_dataset(
    data: str | Path | Sequence[str | Path] | None = None,
    *,
    seq_capacity: int,
    tokenizer: Tokenizer | str | Path | None = None,
    eod_mask_loss: bool = False,
    errors: Literal["raise", "skip"] = "raise",
    long_documents: Literal["truncate", "split"] = "split",
    mock: MockVarlenConfig | None = None,
    default_corpus_max_bytes: int = DEFAULT_CORPUS_MAX_BYTES,
) -> VarlenDataset:
    """The dataset a training command asks for.

    - ``data=None`` (or ``"default"``): the embedded default corpus (:mod:`thd_packing.default_corpus`);
    - ``data="mock"``: :class:`MockVarlenDataset` with ``mock`` (default: lognormal, ``seq_length=seq_capacity``);
    - anything else: files / directories read by :meth:`RawTextDataset.from_paths`.

    ``tokenizer`` is ``None``/``"byte"`` (built-in byte level) or a Hugging Face ``tokenizer.json`` path; every
    document longer than ``seq_capacity`` rows is split into several samples (default) or truncated (``long_documents``;
    the default corpus always splits).
    """
    if data is None or (isinstance(data, str) and data == "default"):
        return default_corpus_dataset(
            seq_capacity, tokenizer=tokenizer, eod_mask_loss=eod_mask_loss, max_bytes=default_corpus_max_bytes
        )
    if isinstance(data, str) and data == "mock":
        cfg = (
            mock
            if mock is not None
            else MockVarlenConfig(seq_length=seq_capacity, eod_mask_loss=eod_mask_loss)
        )
        if cfg.seq_length > seq_capacity:
            raise ValueError(f"mock seq_length {cfg.seq_length} exceeds seq_capacity {seq_capacity}")
        return MockVarlenDataset(cfg)
    if mock is not None:
        raise ValueError("mock=... only applies to data='mock'")
    config = TextDatasetConfig(
        seq_capacity, eod_mask_loss=eod_mask_loss, errors=errors, long_documents=long_documents
    )
    return RawTextDataset.from_paths(data, config, tokenizer)
