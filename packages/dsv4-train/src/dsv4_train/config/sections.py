"""The sections of a ``dsv4 train`` configuration that say what is trained: the model, the data, the schedule, the
optimizer and the losses (how the run executes: :mod:`dsv4_train.config.run_sections`). Small frozen dataclasses,
each validating its own fields.

No section touches a device, the environment or another section; the rules between sections are in
:mod:`dsv4_train.support` and the values that depend on the machine (``bf16``, ``dist_backend`` left ``None``) are
resolved by :func:`dsv4_train.config.effective_config` when a run starts. Every field is a ``dsv4 train`` flag
(its :func:`~dsv4_train.config.fields.option` metadata) and a key of its section in a ``--config`` file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsv4_train.config.fields import (
    at_least,
    check_types,
    one_of,
    option,
    parse_float_or_null,
    parse_json_object,
    store_tuples,
)

#: the kernels of megatron's torch AdamW (:mod:`dsv4_train.optimizer`)
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "fused-step", "unfused")

_MOCK_HELP = (
    "'mock[:KEY=VALUE,...]', keys mean, sigma, min, max (lognormal lengths; defaults 3/4, 1.1, 1/2 and 1 x --seq-len), "
    "docs (1000000), seed (0), vocab (the preset's), lengths=CSV (lengths from a file, last key), "
    "e.g. mock:mean=96,sigma=0.5,docs=5000"
)


@dataclass(frozen=True)
class ModelSection:
    """The architecture: a preset and the fields changed on it."""

    preset: str = field(default="tiny", metadata=option("tiny | v4-flash | v4-pro | flash-smoke"))
    model_overrides: dict[str, Any] = field(
        default_factory=dict,
        metadata=option(
            "JSON object of DSv4ModelConfig fields changed on the preset", parse=parse_json_object
        ),
    )

    def __post_init__(self) -> None:
        check_types(self)


@dataclass(frozen=True)
class DataSection:
    """What is read (reading rules: :mod:`dsv4_train.data`) and how it is batched."""

    sources: tuple[str, ...] = field(
        default=(),
        metadata=option(
            "text sources, read in order (repeat the flag or list several): .jsonl/.json/.parquet/.txt/.md files "
            "or directories (read recursively, every supported format, extensions case-insensitive; other files "
            "are listed as ignored); [] = the embedded corpus. Or mock variable-length data (alone): "
            + _MOCK_HELP,
            flag="--data",
            metavar="PATH",
        ),
    )
    tokenizer: str | None = field(default=None, metadata=option("HF tokenizers JSON file; null = byte-level"))
    long_docs: str = field(
        default="split",
        metadata=option(
            "documents longer than --seq-len tokens: split into several sequences or truncate (the start summary "
            "counts what is cut)",
            choices=("split", "truncate"),
        ),
    )
    skip_bad_records: bool = field(
        default=False,
        metadata=option(
            "skip bad records (invalid JSON, missing text, undecodable bytes, empty files) and count them in the "
            "start summary, instead of stopping at the first"
        ),
    )
    seq_len: int = field(default=256, metadata=option("tokens per sequence (THD: per pack)"))
    global_batch_size: int = field(default=8, metadata=option("sequences per optimizer step"))
    micro_batch_size: int = field(default=4, metadata=option("sequences per forward pass"))
    packed: bool = field(default=False, metadata=option("packed THD batches instead of [B, S]"))
    max_docs_per_pack: int | None = field(
        default=None,
        metadata=option(
            "--packed: documents per pack at most (static cu_seqlens capacity); default: 31, with --cuda-graph "
            "min(seq_len, ceil(seq_len / shortest document))"
        ),
    )

    def __post_init__(self) -> None:
        store_tuples(self, "sources")
        check_types(self)
        at_least(self, 1, "seq_len", "global_batch_size", "micro_batch_size", "max_docs_per_pack")
        one_of(self, "long_docs")
        if self.max_docs_per_pack is not None and not self.packed:
            raise ValueError("--max-docs-per-pack only applies with --packed")


@dataclass(frozen=True)
class ScheduleSection:
    """How long the run is and what it starts from: steps, the dense warm-up, the seed, the stop rule."""

    steps: int = field(default=150, metadata=option("optimizer steps of the run"))
    dense_steps: int = field(default=0, metadata=option("dense-attention warm-up steps before sparse CSA"))
    seed: int = field(default=1234, metadata=option("model init and data order"))
    max_nonfinite_steps: int = field(
        default=5,
        metadata=option(
            "steps with a non-finite loss or gradient are skipped; this many in a row stop the run (exit 1)"
        ),
    )

    max_loss_growth: float = field(
        default=10.0,
        metadata=option(
            "a step whose LM loss is more than this many times the lowest LM loss of the run so far is treated like "
            "a non-finite step: no update, counted towards --max-nonfinite-steps; 0 = off"
        ),
    )

    def __post_init__(self) -> None:
        check_types(self)
        at_least(self, 1, "steps", "max_nonfinite_steps")
        at_least(self, 0, "max_loss_growth")
        if 0 < self.max_loss_growth <= 1:
            raise ValueError(f"--max-loss-growth must be 0 (off) or > 1, got {self.max_loss_growth}")
        at_least(self, 0, "dense_steps", "seed")


@dataclass(frozen=True)
class OptimizerSection:
    """AdamW, its learning-rate schedule, its kernel and where its state lives (:mod:`dsv4_train.optimizer`,
    :mod:`dsv4_train.offload`)."""

    lr: float = field(default=3e-3, metadata=option("peak learning rate"))
    min_lr: float = field(default=3e-4, metadata=option("learning rate at the end of the decay"))
    warmup_steps: int = field(default=10, metadata=option("linear LR warm-up steps"))
    lr_decay_style: str = field(
        default="cosine", metadata=option("cosine or warmup-stable-decay", choices=("cosine", "wsd"))
    )
    lr_wsd_decay_steps: int = field(default=0, metadata=option("wsd: length of the final anneal"))
    weight_decay: float = field(default=0.1, metadata=option("AdamW weight decay"))
    clip_grad: float = field(default=1.0, metadata=option("gradient-norm clipping; 0 = off"))
    optimizer_impl: str = field(
        default="auto",
        metadata=option(
            "kernel of megatron's torch AdamW: fused (one pass per tensor list), foreach (multi-tensor), fused-step "
            "(clip + AdamW + bf16 model copy in one Triton pass), unfused (megatron's optimizer as built); auto = "
            "fused on CUDA, unfused on CPU; checkpoints are interchangeable",
            choices=OPTIMIZER_IMPLS,
        ),
    )
    optimizer_cpu_offload: bool = field(
        default=False,
        metadata=option(
            "keep the fp32 master params and Adam moments in pinned host memory and run their AdamW step on the "
            "CPU (megatron-core's HybridDeviceOptimizer): 12 bytes/param less on the GPU, a host round trip of "
            "grads and params per step; CUDA only, checkpoints interchangeable with non-offloaded runs"
        ),
    )
    optimizer_offload_fraction: float = field(
        default=1.0,
        metadata=option(
            "with --optimizer-cpu-offload: the share of the params (by elements, in optimizer order) offloaded; "
            "the rest keeps its optimizer state on the GPU"
        ),
    )
    optimizer_offload_overlap: bool = field(
        default=False,
        metadata=option(
            "with --optimizer-cpu-offload: pipeline the host step in 32 MiB chunks (D2H of the grads, the CPU "
            "AdamW and H2D of the params overlap; fp32 masters pinned); bitwise the same step and checkpoints"
        ),
    )
    optimizer_offload_defer: bool = field(
        default=False,
        metadata=option(
            "with --optimizer-offload-overlap: run the host AdamW of a step in a host thread behind the next "
            "step's forward, each module waiting for its own params (one data-parallel rank); bitwise the same "
            "steps and checkpoints"
        ),
    )

    def __post_init__(self) -> None:
        check_types(self)
        one_of(self, "lr_decay_style")
        one_of(self, "optimizer_impl")
        at_least(self, 0, "warmup_steps", "weight_decay", "clip_grad")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(
                f"need 0 <= --min-lr <= --lr and --lr > 0, got lr={self.lr}, min_lr={self.min_lr}"
            )
        if self.lr_decay_style != "wsd" and self.lr_wsd_decay_steps:
            raise ValueError("--lr-wsd-decay-steps only applies to --lr-decay-style wsd")
        if not 0.0 < self.optimizer_offload_fraction <= 1.0:
            raise ValueError(
                f"--optimizer-offload-fraction must be in (0, 1], got {self.optimizer_offload_fraction}"
            )
        if self.optimizer_cpu_offload and self.optimizer_impl not in ("auto", "unfused"):
            raise ValueError(
                f"--optimizer-cpu-offload uses megatron's hybrid optimizer (torch AdamW(fused=True) on the host and "
                f"the GPU); --optimizer-impl {self.optimizer_impl} cannot apply: use --optimizer-impl auto"
            )


@dataclass(frozen=True)
class LossSection:
    """The weights of the auxiliary losses."""

    mtp_loss_weight_decay: float | None = field(
        default=0.1,
        metadata=option(
            "MTP loss weight from the start of the LR decay (spec; the preset's weight before); none keeps the "
            "preset's weight",
            parse=parse_float_or_null,
        ),
    )
    balance_loss_coeff: float = field(default=1e-4, metadata=option("MoE sequence balance loss"))
    indexer_loss_coeff: float = field(default=1.0, metadata=option("CSA indexer KL loss"))

    def __post_init__(self) -> None:
        check_types(self)
        at_least(self, 0, "mtp_loss_weight_decay", "balance_loss_coeff", "indexer_loss_coeff")
