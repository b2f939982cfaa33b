"""The training data of ``dsv4 train``: the dataset of the ``--data`` sources (or the embedded default corpus), the
per-source summary printed at the start of a run, and the per-rank batch iterator.

Reading rules (thd-packing's readers, :mod:`thd_packing.text_sources`):

- every ``--data`` path is one source; repeated ``--data`` flags accumulate, all sources are read in order;
- a directory is read recursively: every ``.jsonl`` / ``.json`` / ``.parquet`` / ``.txt`` / ``.md`` file
  (extensions case-insensitive), sorted by relative path; other files, hidden entries and directory links are
  ignored and listed in the summary with the reason;
- a document longer than ``--seq-len`` tokens is split into several training sequences (``--long-docs split``, the
  default) or cut (``--long-docs truncate``; the summary counts the cut documents and the tokens not used);
- a bad record stops the run with its file and line, unless ``--skip-bad-records`` skips and counts it.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from dsv4_train.config import TrainConfig
from dsv4_train.graph_packs import max_docs_per_pack
from thd_packing import (
    BatchConfig,
    PackedBatchIterator,
    RawTextDataset,
    TextDatasetConfig,
    TextRecordError,
    default_corpus_dataset,
    format_source_stats,
)

if TYPE_CHECKING:
    from thd_packing import PackedBatchIterator, RawTextDataset, VarlenDataset

#: how the ``dsv4 train`` messages name the switch that skips bad records
SKIP_HINT = "pass --skip-bad-records"
#: bad records / ignored directory entries listed one by one in the summary (the rest are counted)
SUMMARY_LIST_LIMIT = 10


def build_text_dataset(tc: TrainConfig, sources: list[str] | None = None) -> RawTextDataset:
    """The dataset of ``tc.data.sources`` (every source, in order) or the default corpus, ``tc.data.seq_len`` rows per sample;
    ``sources`` (e.g. ``tc.eval.eval_data``) are read instead of ``tc.data.sources`` with the same settings.

    Raises ``ValueError`` (a :class:`~thd_packing.TextRecordError` for a bad record, advising
    ``--skip-bad-records``) for unreadable input.
    """

    sources = tc.data.sources if sources is None else sources
    if not sources:
        return default_corpus_dataset(tc.data.seq_len, tokenizer=tc.data.tokenizer)
    config = TextDatasetConfig(
        tc.data.seq_len,
        errors="skip" if tc.data.skip_bad_records else "raise",
        long_documents=tc.data.long_docs,
    )
    try:
        with warnings.catch_warnings():  # the run prints its own summary of skipped and truncated documents
            warnings.filterwarnings(
                "ignore", message="RawTextDataset (skipped|truncated)", category=UserWarning
            )
            return RawTextDataset.from_paths(sources, config, tc.data.tokenizer)
    except TextRecordError as err:
        raise TextRecordError(err.record, skip_hint=SKIP_HINT) from None


def data_summary(ds: RawTextDataset, tc: TrainConfig) -> str:
    """What the run read, per source: documents, tokens, samples, documents split / truncated / skipped, and
    the skipped records and ignored directory entries (the first :data:`SUMMARY_LIST_LIMIT` of each)."""

    mode = "split" if not tc.data.sources else tc.data.long_docs
    head = f"dsv4 train: data (--seq-len {tc.data.seq_len}, long documents: {mode}):"
    lines = [head, *(f"  {line}" for line in format_source_stats(ds.source_stats()).splitlines())]
    report = ds.report
    for what, items in (("skipped bad record", report.skipped), ("ignored", report.ignored)):
        lines += [f"  {what}: {item}" for item in items[:SUMMARY_LIST_LIMIT]]
        if len(items) > SUMMARY_LIST_LIMIT:
            lines.append(f"  ... and {len(items) - SUMMARY_LIST_LIMIT} more {what} entries")
    return "\n".join(lines)


def build_batches(
    ds: VarlenDataset,
    tc: TrainConfig,
    *,
    vocab_size: int,
    dp_size: int,
    dp_rank: int,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> PackedBatchIterator:
    """This DP rank's batch iterator over ``ds``: packed THD microbatches (``--packed``; pack capacity
    ``--seq-len``, longer samples split into pieces) or ``[micro_batch_size, seq_len]`` rows.

    Context parallelism (``cp_size`` > 1): the data are sharded over DP only. A THD pack keeps its capacity
    ``--seq-len`` (the scheduler packs for DP x CP with ``seq_len / cp_size`` rows per CP rank) and this CP rank gets
    its contiguous rows; ``[B, S]`` rows are loaded whole (the step runs them as one THD pack and slices it)."""

    vocab = ds.vocab_size
    if vocab > vocab_size:
        raise ValueError(
            f"the tokenizer has {vocab} ids but preset {tc.model.preset!r} has vocab_size={vocab_size}; "
            "choose a larger preset or set model_overrides.vocab_size in the config file"
        )
    if tc.data.global_batch_size % dp_size:
        raise ValueError(
            f"--global-batch-size {tc.data.global_batch_size} must be divisible by DP size {dp_size}"
        )
    return PackedBatchIterator(
        ds,
        BatchConfig(
            global_batch_size=tc.data.global_batch_size,
            max_seqlen_per_dp_cp_rank=tc.data.seq_len // cp_size if tc.data.packed else tc.data.seq_len,
            layout="thd" if tc.data.packed else "sbhd",
            micro_batch_size=tc.data.micro_batch_size,
            dp_size=dp_size,
            dp_rank=dp_rank,
            cp_size=cp_size if tc.data.packed else 1,
            cp_rank=cp_rank if tc.data.packed else 0,
            too_long="split",
            static_shape=True,
            max_num_seqs=_max_docs(tc, ds) + 1,  # documents + the dummy tail document
            # --vpp: megatron's interleaved schedule runs micro-batches in groups of --pp (packed: the scheduler
            # makes every step's pack count a multiple of it)
            microbatch_group_size_per_vp_stage=tc.parallel.pp if tc.parallel.vpp > 1 else 1,
            seed=tc.schedule.seed,
        ),
    )


def _max_docs(tc, ds) -> int:
    """The pack's document capacity (:func:`dsv4_train.graph_packs.max_docs_per_pack`)."""

    lengths = getattr(ds, "lengths", None)
    shortest = (
        int(lengths.min())
        if tc.data.packed and tc.graphs.cuda_graph and lengths is not None and len(lengths)
        else None
    )
    return max_docs_per_pack(
        tc.data.max_docs_per_pack,
        tc.data.seq_len,
        tc.graphs.cuda_graph and tc.data.packed,
        shortest,
    )


__all__ = ["SKIP_HINT", "build_batches", "build_text_dataset", "data_summary"]
