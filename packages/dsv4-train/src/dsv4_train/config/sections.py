"""The sections of a ``dsv4 train`` configuration: small frozen dataclasses, each validating its own fields.

No section touches a device, the environment or another section; the rules between sections are in
:mod:`dsv4_train.support` and the values that depend on the machine (``bf16``, ``dist_backend`` left ``None``) are
resolved by :func:`dsv4_train.config.effective_config` when a run starts. Every field is a ``dsv4 train`` flag
(its :func:`~dsv4_train.config.fields.option` metadata) and a key of its section in a ``--config`` file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsv4_primitives.recompute import METHODS, SELECTIVE_MODULES
from dsv4_train.config.fields import (
    at_least,
    check_types,
    one_of,
    option,
    parse_float_or_null,
    parse_json_object,
    parse_resume_mode,
)

#: the distributed optimizer's checkpoint formats (megatron's ``distrib_optim_sharding_type``)
DISTOPT_FORMATS = ("dp_reshardable", "fully_reshardable")
#: the kernels of megatron's torch AdamW (:mod:`dsv4_train.optimizer`)
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "unfused")
#: ``torch.distributed`` backends of a multi-process run
DIST_BACKENDS = ("nccl", "gloo")

_MOCK_HELP = (
    "'mock[:KEY=VALUE,...]', keys mean, sigma, min, max (lognormal lengths; defaults 3/4, 1.1, 1/2 and 1 x --seq-len), "
    "docs (1000000), seed (0), vocab (the preset's), lengths=CSV (lengths from a file, last key), "
    "e.g. mock:mean=96,sigma=0.5,docs=5000"
)


def _tuple(section: Any, *names: str) -> None:
    """Store list fields as tuples (a frozen section holds no mutable lists); a single string is one item."""
    for name in names:
        value = getattr(section, name)
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            object.__setattr__(section, name, tuple(value))


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
        _tuple(self, "sources")
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

    def __post_init__(self) -> None:
        check_types(self)
        at_least(self, 1, "steps", "max_nonfinite_steps")
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
            "kernel of megatron's torch AdamW: fused (one pass), foreach (multi-tensor), unfused (megatron's "
            "optimizer as built); auto = fused on CUDA, unfused on CPU; checkpoints are interchangeable",
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


@dataclass(frozen=True)
class ParallelSection:
    """The parallel layout (DP is the rest of the world) and the process-group backend."""

    tp: int = field(default=1, metadata=option("tensor parallel size (must be 1: see the support table)"))
    pp: int = field(default=1, metadata=option("pipeline stages"))
    vpp: int = field(
        default=1,
        metadata=option(
            "virtual pipeline stages per pipeline rank (interleaved 1F1B; needs --pp >= 2 and pp*vpp <= blocks)"
        ),
    )
    ep: int = field(default=1, metadata=option("expert parallel size (DP is the rest of the world)"))
    cp: int = field(
        default=1,
        metadata=option(
            "context parallel size: each CP rank holds seq_len/cp contiguous rows of every pack (seq_len must be a "
            "multiple of cp; [B, S] batches run as a THD pack of B documents); DP = world / (tp*pp*cp)"
        ),
    )
    cp_layout: str = field(
        default="contiguous",
        metadata=option(
            "context-parallel row layout: only 'contiguous' (zigzag would split DSv4's compression groups and "
            "sliding windows)"
        ),
    )
    dist_backend: str | None = field(
        default=None,
        metadata=option(
            "torch.distributed backend of a torchrun run; gloo on CUDA lets several ranks share one GPU (tests, "
            "e.g. two data-parallel ranks with --cuda-graph on one GPU; NCCL refuses two ranks on one device) and "
            "stages the distributed optimizer's collectives through host memory",
            choices=DIST_BACKENDS,
            default_help="nccl on CUDA, gloo on CPU",
        ),
    )

    def __post_init__(self) -> None:
        check_types(self)
        at_least(self, 1, "tp", "pp", "vpp", "ep", "cp")
        one_of(self, "dist_backend")
        if self.cp_layout != "contiguous":
            raise ValueError(
                f"--cp-layout {self.cp_layout!r} is not supported: DSv4 needs the contiguous layout (CP rank r holds "
                "rows [r*L, (r+1)*L) of the pack). Zigzag and other layouts give a rank non-adjacent rows, which "
                "cuts the compression groups (4 and 128 consecutive tokens) and the sliding window across "
                "non-neighbouring ranks; use --cp-layout contiguous"
            )
        if self.tp != 1:
            raise ValueError(
                "--tp must be 1: DSv4 attention supports tensor parallelism 1 only (use DP/PP/EP)"
            )


@dataclass(frozen=True)
class PrecisionSection:
    """Number formats and reproducibility."""

    bf16: bool | None = field(
        default=None,
        metadata=option(
            "bf16 mixed precision as in megatron's training loop (bf16 params and activations, fp32 main params and "
            "gradient reduction; the keep-in-fp32 tensors - mHC, attention sinks, compressor ape, the router "
            "selection bias - stay fp32)",
            default_help="on with CUDA, off (fp32) on CPU",
        ),
    )
    deterministic: bool = field(
        default=False,
        metadata=option(
            "bitwise-reproducible steps: deterministic kernels everywhere (no atomics in the sparse-attention dkv / "
            "indexer dk), torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8; costs speed "
            "(dsv4-train README)"
        ),
    )
    fused_linear_ce: bool = field(
        default=True,
        metadata=option(
            "main and MTP head losses without materialising the [s, b, V] logits (vocab-chunked head GEMM + cross "
            "entropy); --no-fused-linear-ce: output-layer logits, then the fused cross entropy"
        ),
    )

    def __post_init__(self) -> None:
        check_types(self)


@dataclass(frozen=True)
class MemorySection:
    """Activation recompute (megatron's vocabulary plus upstream P2's mHC groups; :mod:`dsv4_train.recompute`)."""

    recompute_granularity: str | None = field(
        default=None,
        metadata=option(
            "activation recompute: selective (the --recompute-modules) or full (whole layers, "
            "--recompute-method/--recompute-num-layers); less memory for more compute, same gradients",
            choices=("selective", "full"),
        ),
    )
    recompute_modules: tuple[str, ...] = field(
        default=(),
        metadata=option(
            "selective: mhc (residual streams inside groups of --mhc-recompute-layer-num layers), layernorm "
            "(attn/ffn/q norm outputs), mla_up_proj (q up-projection + kv projection with norms and RoPE; q and kv "
            "themselves rebuilt), compressor, indexer, core_attn (top-k, sparse attention, indexer KL), moe_act "
            "(expert SwiGLU output), moe (whole MoE layer)",
            choices=SELECTIVE_MODULES,
            metavar="MODULE",
        ),
    )
    recompute_method: str | None = field(
        default=None,
        metadata=option(
            "full: uniform (checkpoint every chunk of --recompute-num-layers layers of a stage) or block (the first "
            "--recompute-num-layers layers of each stage)",
            choices=METHODS,
        ),
    )
    recompute_num_layers: int | None = field(
        default=None, metadata=option("full: layers per chunk (uniform) or per stage (block)")
    )
    mhc_recompute_layer_num: int | None = field(
        default=None,
        metadata=option(
            "selective mhc: layers per mHC recompute group (the group's input streams are kept, the streams inside "
            "it rebuilt in backward one group at a time); null = one group per stage"
        ),
    )

    def __post_init__(self) -> None:
        _tuple(self, "recompute_modules")
        check_types(self)


@dataclass(frozen=True)
class GraphsSection:
    """CUDA graphs of the training step (:mod:`dsv4_train.cuda_graph`)."""

    cuda_graph: bool = field(
        default=False,
        metadata=option(
            "one model-parallel rank (TP = PP = EP = CP = 1): capture each step's forward+backward in a CUDA graph "
            "(megatron's FullCudaGraphWrapper) and replay it; removes the kernel-launch overhead of short "
            "sequences. [B, S] batches at any DP size (with DP > 1 the gradient reduce-scatter runs eagerly after "
            "each replay, not overlapped with the backward); --packed batches on one process (device-side document "
            "boundaries, capacity --max-docs-per-pack)"
        ),
    )
    cuda_graph_warmup_steps: int = field(
        default=2, metadata=option("--cuda-graph: eager steps before the capture")
    )

    def __post_init__(self) -> None:
        check_types(self)
        at_least(self, 1, "cuda_graph_warmup_steps")


@dataclass(frozen=True)
class CheckpointSection:
    """The run directory, where the run starts from and what it saves (:mod:`dsv4_train.rundir`,
    :mod:`dsv4_train.checkpoint`)."""

    out: str = field(
        default="runs/dsv4",
        metadata=option("run directory (metrics.jsonl, loss.png, tb/, checkpoints/); must be writable"),
    )
    resume: bool | str = field(
        default=False,
        metadata=option(
            "continue from --out's checkpoints/latest (an error when there is none); '--resume auto' continues when "
            "there is a checkpoint and starts a new run otherwise (job requeues)",
            parse=parse_resume_mode,
            optional_value=True,
            metavar="auto",
            default_help="a new run",
        ),
    )
    overwrite: bool = field(
        default=False,
        metadata=option(
            "start a new run in an --out that holds one, deleting its metrics.jsonl, loss.png, tb/ and checkpoints/",
            default_help="refuse",
        ),
    )
    init_from: str | None = field(
        default=None,
        metadata=option(
            "new runs: initial weights from a dist checkpoint (iter_XXXXXXX or run dir), any layout"
        ),
    )
    save_interval: int = field(
        default=0, metadata=option("save every N steps; 0 = only at the end and on SIGINT/SIGTERM")
    )
    save_final: bool = field(
        default=True,
        metadata=option("save a checkpoint when the run finishes (--no-save-final for benchmark runs)"),
    )
    ckpt_format: str = field(
        default="dp_reshardable",
        metadata=option(
            "distributed-optimizer checkpoint format: dp_reshardable resumes at another DP size, fully_reshardable "
            "also at another PP size (gathers the optimizer state over DP to save)",
            choices=DISTOPT_FORMATS,
        ),
    )

    def __post_init__(self) -> None:
        check_types(self)
        at_least(self, 0, "save_interval")
        one_of(self, "ckpt_format")
        if self.resume not in (True, False, "auto"):
            raise ValueError(f"resume must be true, false or 'auto', got {self.resume!r}")
        if self.resume is True and self.init_from:
            raise ValueError(
                "--init-from starts a new run from other weights, --resume continues from this run's checkpoint: "
                "drop one (with --resume auto, --init-from applies when the run starts fresh)"
            )
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite contradict each other: continue the run or replace it")


@dataclass(frozen=True)
class EvalSection:
    """Evaluation (:mod:`dsv4_train.eval_data`, :mod:`dsv4_train.evaluation`)."""

    eval_interval: int = field(
        default=0,
        metadata=option(
            "evaluate every N steps and after the last (LM loss, perplexity, MTP loss: metrics.jsonl rows with "
            '"eval": true, TensorBoard eval/*, loss.png) under any parallel layout (DP, PP, VPP, EP, CP); 0 = never'
        ),
    )
    eval_iters: int = field(
        default=10, metadata=option("global batches per evaluation (the same ones each time)")
    )
    eval_data: tuple[str, ...] = field(
        default=(),
        metadata=option(
            "text sources to evaluate on (read like --data); [] = a held-out split of the training data, whole "
            "documents chosen by --seed, never trained on (mock data: a separate mock stream)",
            metavar="PATH",
        ),
    )

    def __post_init__(self) -> None:
        _tuple(self, "eval_data")
        check_types(self)
        at_least(self, 0, "eval_interval")
        at_least(self, 1, "eval_iters")
        if self.eval_data and not self.eval_interval:
            raise ValueError("--eval-data only applies with --eval-interval N (N > 0)")


@dataclass(frozen=True)
class LoggingSection:
    """What the run prints and how it counts MFU."""

    log_interval: int = field(
        default=10, metadata=option("when stdout is not a terminal: one progress line every N steps")
    )
    peak_tflops: float | None = field(
        default=None,
        metadata=option("peak TFLOP/s for MFU", default_help="989 on H100/H200, 312 on other GPUs, 1 on CPU"),
    )
    progress: bool = field(
        default=True,
        metadata=option(
            "no progress bar / progress lines (metrics.jsonl is written regardless)",
            flag="--no-progress",
            negative_only=True,
            default_help="progress on",
        ),
    )

    def __post_init__(self) -> None:
        check_types(self)
        at_least(self, 1, "log_interval")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"--peak-tflops must be > 0, got {self.peak_tflops}")
