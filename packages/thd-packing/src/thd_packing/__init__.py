"""thd-packing: packed THD sequences, static-shape padding (P11), raw-text / mock / default-corpus datasets (P8),
the dp-balanced packing scheduler (P7), packed and contiguous-CP MTP rolls (P9), and a training batch iterator.

See the package README for the public API table and examples.
"""

from dsv4_primitives.varlen import cu_seqlens_from_lengths
from thd_packing.batches import (
    BatchConfig,
    IterationBatch,
    PackedBatchIterator,
    SbhdMicrobatch,
    ThdMicrobatch,
)
from thd_packing.cp_layout import contiguous_cp_interval, shard_contiguous_cp
from thd_packing.cp_roll import roll_left_contiguous_cp
from thd_packing.dataset_factory import build_dataset
from thd_packing.default_corpus import (
    DEFAULT_CORPUS_MAX_BYTES,
    DefaultCorpusInfo,
    default_corpus,
    default_corpus_dataset,
    default_corpus_documents,
)
from thd_packing.mock_dataset import MockVarlenConfig, MockVarlenDataset, lognormal_lengths, read_lengths_csv
from thd_packing.pack_builder import build_pack
from thd_packing.packed_seqs import PackedSeqs
from thd_packing.roll import roll_left
from thd_packing.samples import DocumentSample, VarlenDataset
from thd_packing.scheduler import DocPiece, DpBalancedScheduler, Pack, Schedule, SchedulerConfig
from thd_packing.static_shape import (
    StaticPack,
    StaticPadInfo,
    StaticShapeConfig,
    pad_to_static_shape,
    unpad_static_shape,
)
from thd_packing.subset import VarlenSubset
from thd_packing.text_dataset import RawTextDataset, SourceStats, TextDatasetConfig, format_source_stats
from thd_packing.text_sources import (
    SUPPORTED_SUFFIXES,
    IgnoredPath,
    ReadReport,
    SkippedRecord,
    SourceReport,
    TextRecord,
    TextRecordError,
    read_text_records,
)
from thd_packing.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__version__ = "0.5.2"

__all__ = [
    "DEFAULT_CORPUS_MAX_BYTES",
    "SUPPORTED_SUFFIXES",
    "BatchConfig",
    "ByteTokenizer",
    "DefaultCorpusInfo",
    "DocPiece",
    "DocumentSample",
    "DpBalancedScheduler",
    "HFTokenizer",
    "IgnoredPath",
    "IterationBatch",
    "MockVarlenConfig",
    "MockVarlenDataset",
    "Pack",
    "PackedBatchIterator",
    "PackedSeqs",
    "RawTextDataset",
    "ReadReport",
    "SbhdMicrobatch",
    "Schedule",
    "SchedulerConfig",
    "SkippedRecord",
    "SourceReport",
    "SourceStats",
    "StaticPack",
    "StaticPadInfo",
    "StaticShapeConfig",
    "TextDatasetConfig",
    "TextRecord",
    "TextRecordError",
    "ThdMicrobatch",
    "Tokenizer",
    "VarlenDataset",
    "VarlenSubset",
    "__version__",
    "build_dataset",
    "build_pack",
    "contiguous_cp_interval",
    "cu_seqlens_from_lengths",
    "default_corpus",
    "default_corpus_dataset",
    "default_corpus_documents",
    "format_source_stats",
    "load_tokenizer",
    "lognormal_lengths",
    "pad_to_static_shape",
    "read_lengths_csv",
    "read_text_records",
    "roll_left",
    "roll_left_contiguous_cp",
    "shard_contiguous_cp",
    "unpad_static_shape",
]
