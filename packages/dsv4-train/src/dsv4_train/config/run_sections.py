"""The sections of a ``dsv4 train`` configuration that say how the run executes: its parallel layout, precision,
memory (recompute), CUDA graphs, run directory and checkpoints, evaluation and logging (the sections of what is
trained are in :mod:`dsv4_train.config.sections`). Frozen, each validating its own fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv4_primitives.recompute import METHODS, SELECTIVE_MODULES
from dsv4_train.config.fields import at_least, check_types, one_of, option, parse_resume_mode, store_tuples

#: the distributed optimizer's checkpoint formats (megatron's ``distrib_optim_sharding_type``)
DISTOPT_FORMATS = ("dp_reshardable", "fully_reshardable")
#: ``torch.distributed`` backends of a multi-process run
DIST_BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class ParallelSection:
    """The parallel layout (DP is the rest of the world) and the process-group backend."""

    tp: int = field(
        default=1,
        metadata=option(
            "tensor parallel size, with sequence parallelism ([B, S] micro-batches run as a THD pack) (DSv4 attention "
            "W/C/H splits its heads, megatron's '*' / '-' and 'E' their linears; the combinations the support table "
            "refuses need 1); must divide the model's o_groups, vocabulary and MLP width (tiny: --tp 1 or 2; for "
            '--tp 4 give model_overrides {"o_groups": 4} in a --config file)'
        ),
    )
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

    dist_timeout: float = field(
        default=600.0,
        metadata=option(
            "seconds a collective may wait for the other ranks before the run stops (the process groups' timeout); "
            "the survivors of a lost rank stop at once with gloo (its connection closes) and after this with NCCL "
            "or a rank that hangs, naming the lost rank (dsv4-train README, Faults and integrity)"
        ),
    )

    def __post_init__(self) -> None:
        check_types(self)
        at_least(self, 1, "tp", "pp", "vpp", "ep", "cp")
        if self.dist_timeout <= 0:
            raise ValueError(f"--dist-timeout must be > 0 seconds, got {self.dist_timeout}")
        one_of(self, "dist_backend")
        if self.cp_layout != "contiguous":
            raise ValueError(
                f"--cp-layout {self.cp_layout!r} is not supported: DSv4 needs the contiguous layout (CP rank r holds "
                "rows [r*L, (r+1)*L) of the pack). Zigzag and other layouts give a rank non-adjacent rows, which "
                "cuts the compression groups (4 and 128 consecutive tokens) and the sliding window across "
                "non-neighbouring ranks; use --cp-layout contiguous"
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
    deterministic: bool | None = field(
        default=None,
        metadata=option(
            "bitwise-reproducible steps: deterministic kernels everywhere (no atomics in the sparse-attention dkv / "
            "indexer dk), torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8; --no-deterministic: "
            "csa-kernels' fp32-atomic dkv / dk (faster, not bitwise reproducible; dsv4-train README)",
            default_help="on with CUDA; off on CPU, whose runs use PyTorch's deterministic kernels anyway",
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
    """Activation recompute (megatron's vocabulary plus upstream P2's mHC groups; :mod:`dsv4_train.recompute`) and
    activation offload (:mod:`dsv4_train.activation_offload`)."""

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

    offload_activations: bool = field(
        default=False,
        metadata=option(
            "keep what the forward saves for backward in pinned host memory, copied back when backward reads it "
            "(with --recompute-granularity full: each checkpointed layer's input streams, 0.5 GiB per 1K tokens on "
            "flash-smoke); exact; CUDA only; costs PCIe copies on the compute stream (dsv4_train.activation_offload)"
        ),
    )

    def __post_init__(self) -> None:
        store_tuples(self, "recompute_modules")
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
            "also at another PP or TP size (gathers the optimizer state over DP to save)",
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
        store_tuples(self, "eval_data")
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
