"""The ``dsv4`` command: ``train``, ``inspect``, ``flops``, ``convert`` (:mod:`dsv4_train.convert_cli`).

``dsv4 train`` with no arguments trains the ``tiny`` preset on the embedded default corpus (CPU, or the GPU when
present); several processes through ``torchrun`` (gloo on CPU, NCCL on GPU) with ``--pp``/``--ep``.
"""

from __future__ import annotations

import argparse
import json
import sys

from hybrid_model.model_flags import add_model_flags


def _default(name: str) -> str:
    """``TrainConfig``'s default of field ``name`` for ``--help`` (flags default to ``None`` so that a ``--config``
    file's value is not overridden by a flag the user did not give)."""
    import dataclasses

    from dsv4_train.config import TrainConfig

    f = {f.name: f for f in dataclasses.fields(TrainConfig)}[name]
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return f"default: {json.dumps(value)}"


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of DSv4ModelConfig fields")
    return value


_NULL = "null"  # a flag explicitly set to None (argparse's None means "not given")


def _float_or_none(text: str) -> float | str:
    return _NULL if text.lower() in ("none", "null") else float(text)


def _resume_mode(text: str) -> bool | str:
    if text == "auto":
        return "auto"
    raise argparse.ArgumentTypeError("the only value --resume takes is 'auto'")


def _add_data_flags(p) -> None:
    """The data flags of ``dsv4 train``: what is read (reading rules: :mod:`dsv4_train.data`) and how
    it is batched."""
    d = lambda name, text: f"{text} ({_default(name)})"
    p.add_argument(
        "--data",
        nargs="+",
        action="extend",
        metavar="PATH",
        help=d(
            "data",
            "text sources, read in order (repeat the flag or list several): .jsonl/.json/.parquet/.txt/.md files "
            "or directories (read recursively, every supported format, extensions case-insensitive; other files "
            "are listed as ignored); [] = the embedded corpus. Or mock variable-length data (alone): "
            "'mock[:KEY=VALUE,...]', keys mean, sigma, min, max (lognormal lengths; defaults 3/4, 1.1, 1/2 and 1 x "
            "--seq-len), docs (1000000), seed (0), vocab (the preset's), lengths=CSV (lengths from a file, last "
            "key), e.g. mock:mean=96,sigma=0.5,docs=5000",
        ),
    )
    p.add_argument("--tokenizer", help=d("tokenizer", "HF tokenizers JSON file; null = byte-level"))
    p.add_argument(
        "--long-docs",
        choices=("split", "truncate"),
        help=d(
            "long_docs",
            "documents longer than --seq-len tokens: split into several sequences or truncate (the start "
            "summary counts what is cut)",
        ),
    )
    p.add_argument(
        "--skip-bad-records",
        action="store_true",
        default=None,
        help=d(
            "skip_bad_records",
            "skip bad records (invalid JSON, missing text, undecodable bytes, empty files) and count them in "
            "the start summary, instead of stopping at the first",
        ),
    )
    p.add_argument("--seq-len", type=int, help=d("seq_len", "tokens per sequence (THD: per pack)"))
    p.add_argument(
        "--global-batch-size", type=int, help=d("global_batch_size", "sequences per optimizer step")
    )
    p.add_argument("--micro-batch-size", type=int, help=d("micro_batch_size", "sequences per forward pass"))
    p.add_argument(
        "--packed",
        action="store_true",
        default=None,
        help=d("packed", "packed THD batches instead of [B, S]"),
    )
    max_docs_help = (
        "--packed: documents per pack at most (static cu_seqlens capacity); default: 31, with --cuda-graph"
    )
    max_docs_help += " min(seq_len, ceil(seq_len / shortest document))"
    p.add_argument("--max-docs-per-pack", type=int, help=d("max_docs_per_pack", max_docs_help))
    p.add_argument(
        "--eval-interval",
        type=int,
        help=d(
            "eval_interval",
            "evaluate every N steps and after the last (LM loss, perplexity, MTP loss: metrics.jsonl rows with "
            '"eval": true, TensorBoard eval/*, loss.png) under any parallel layout (DP, PP, VPP, EP, CP); 0 = never',
        ),
    )
    p.add_argument(
        "--eval-iters",
        type=int,
        help=d("eval_iters", "global batches per evaluation (the same ones each time)"),
    )
    p.add_argument(
        "--eval-data",
        nargs="+",
        action="extend",
        metavar="PATH",
        help=d(
            "eval_data",
            "text sources to evaluate on (read like --data); [] = a held-out split of the training data, whole "
            "documents chosen by --seed, never trained on (mock data: a separate mock stream)",
        ),
    )


def _train_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a preset (default: tiny on the embedded corpus)",
        description="Train a DSv4 preset with megatron-core. Every flag maps onto a TrainConfig field; flags given "
        "on the command line win over a --config file. Exit codes: 0 completed; 130 / 143 interrupted by "
        "SIGINT / SIGTERM (a checkpoint of the last step is saved: continue with --resume); 1 failed (e.g. the "
        "run diverged); 2 invalid settings.",
    )
    d = lambda name, text: f"{text} ({_default(name)})"
    p.add_argument("--config", help="JSON file of TrainConfig fields (explicit flags win; default: none)")
    p.add_argument("--preset", help=d("preset", "tiny | v4-flash | v4-pro | flash-smoke"))
    p.add_argument(
        "--model-overrides",
        type=_json_object,
        help=d("model_overrides", "JSON object of DSv4ModelConfig fields changed on the preset"),
    )
    add_model_flags(p)
    p.add_argument("--steps", type=int, help=d("steps", "optimizer steps of the run"))
    _add_data_flags(p)
    p.add_argument(
        "--dense-steps", type=int, help=d("dense_steps", "dense-attention warm-up steps before sparse CSA")
    )
    p.add_argument("--lr", type=float, help=d("lr", "peak learning rate"))
    p.add_argument("--min-lr", type=float, help=d("min_lr", "learning rate at the end of the decay"))
    p.add_argument("--warmup-steps", type=int, help=d("warmup_steps", "linear LR warm-up steps"))
    p.add_argument(
        "--lr-decay-style",
        choices=("cosine", "wsd"),
        help=d("lr_decay_style", "cosine or warmup-stable-decay"),
    )
    p.add_argument(
        "--lr-wsd-decay-steps", type=int, help=d("lr_wsd_decay_steps", "wsd: length of the final anneal")
    )
    p.add_argument(
        "--mtp-loss-weight-decay",
        type=_float_or_none,
        help=d(
            "mtp_loss_weight_decay",
            "MTP loss weight from the start of the LR decay (spec; the preset's weight "
            "before); none keeps the preset's weight",
        ),
    )
    p.add_argument("--weight-decay", type=float, help=d("weight_decay", "AdamW weight decay"))
    p.add_argument("--clip-grad", type=float, help=d("clip_grad", "gradient-norm clipping; 0 = off"))
    p.add_argument(
        "--balance-loss-coeff", type=float, help=d("balance_loss_coeff", "MoE sequence balance loss")
    )
    p.add_argument("--indexer-loss-coeff", type=float, help=d("indexer_loss_coeff", "CSA indexer KL loss"))
    p.add_argument(
        "--max-nonfinite-steps",
        type=int,
        help=d(
            "max_nonfinite_steps",
            "steps with a non-finite loss or gradient are skipped; this many in a row stop the run (exit 1)",
        ),
    )
    p.add_argument("--seed", type=int, help=d("seed", "model init and data order"))
    p.add_argument("--tp", type=int, help=d("tp", "tensor parallel size (must be 1)"))
    p.add_argument("--pp", type=int, help=d("pp", "pipeline stages"))
    p.add_argument(
        "--vpp",
        type=int,
        help=d(
            "vpp",
            "virtual pipeline stages per pipeline rank (interleaved 1F1B; needs --pp >= 2 and pp*vpp <= blocks)",
        ),
    )
    p.add_argument("--ep", type=int, help=d("ep", "expert parallel size (DP is the rest of the world)"))
    p.add_argument(
        "--cp",
        type=int,
        help=d(
            "cp",
            "context parallel size: each CP rank holds seq_len/cp contiguous rows of every pack (seq_len must be a "
            "multiple of cp; [B, S] batches run as a THD pack of B documents); DP = world / (tp*pp*cp)",
        ),
    )
    p.add_argument(
        "--cp-layout",
        help=d(
            "cp_layout",
            "context-parallel row layout: only 'contiguous' (zigzag would split DSv4's compression groups and "
            "sliding windows)",
        ),
    )
    p.add_argument(
        "--out", help=d("out", "run directory (metrics.jsonl, loss.png, tb/, checkpoints/); must be writable")
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        type=_resume_mode,
        default=None,
        metavar="auto",
        help="continue from --out's checkpoints/latest (an error when there is none); '--resume auto' continues "
        "when there is a checkpoint and starts a new run otherwise (job requeues) (default: a new run)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        default=None,
        help="start a new run in an --out that holds one, deleting its metrics.jsonl, loss.png, tb/ and "
        "checkpoints/ (default: refuse)",
    )
    p.add_argument(
        "--init-from",
        help=d(
            "init_from",
            "new runs: initial weights from a dist checkpoint (iter_XXXXXXX or run dir), any layout",
        ),
    )
    p.add_argument(
        "--save-interval",
        type=int,
        help=d("save_interval", "save every N steps; 0 = only at the end and on SIGINT/SIGTERM"),
    )
    p.add_argument(
        "--save-final",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=d("save_final", "save a checkpoint when the run finishes (--no-save-final for benchmark runs)"),
    )
    p.add_argument(
        "--ckpt-format",
        choices=("dp_reshardable", "fully_reshardable"),
        help=d(
            "ckpt_format",
            "distributed-optimizer checkpoint format: dp_reshardable resumes at another DP size, "
            "fully_reshardable also at another PP size (gathers the optimizer state over DP to save)",
        ),
    )
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 mixed precision (keep-in-fp32 params stay fp32) (default: on with CUDA, off (fp32) on CPU)",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        default=None,
        help=d(
            "cuda_graph",
            "one model-parallel rank (TP = PP = EP = CP = 1): capture each step's forward+backward in a CUDA graph "
            "(megatron's FullCudaGraphWrapper) and replay it; removes the kernel-launch overhead of short "
            "sequences. [B, S] batches at any DP size (with DP > 1 the gradient reduce-scatter runs eagerly after "
            "each replay, not overlapped with the backward); --packed batches on one process (device-side document "
            "boundaries, capacity --max-docs-per-pack)",
        ),
    )
    p.add_argument(
        "--cuda-graph-warmup-steps",
        type=int,
        help=d("cuda_graph_warmup_steps", "--cuda-graph: eager steps before the capture"),
    )
    p.add_argument(
        "--dist-backend",
        choices=["nccl", "gloo"],
        help="torch.distributed backend of a torchrun run (default: nccl on CUDA, gloo on CPU); gloo on CUDA "
        "lets several ranks share one GPU (tests, e.g. two data-parallel ranks with --cuda-graph on one GPU; NCCL "
        "refuses two ranks on one device) and stages the distributed optimizer's collectives through host memory",
    )
    p.add_argument(
        "--optimizer-impl",
        choices=["auto", "fused", "foreach", "unfused"],
        help=d(
            "optimizer_impl",
            "kernel of megatron's torch AdamW: fused (one pass), foreach (multi-tensor), unfused (megatron's "
            "optimizer as built); auto = fused on CUDA, unfused on CPU; checkpoints are interchangeable",
        ),
    )
    p.add_argument(
        "--optimizer-cpu-offload",
        action="store_true",
        default=None,
        help=d(
            "optimizer_cpu_offload",
            "keep the fp32 master params and Adam moments in pinned host memory and run their AdamW step on "
            "the CPU (megatron-core's HybridDeviceOptimizer): 12 bytes/param less on the GPU, a host round trip "
            "of grads and params per step; CUDA only, checkpoints interchangeable with non-offloaded runs",
        ),
    )
    p.add_argument(
        "--optimizer-offload-fraction",
        type=float,
        help=d(
            "optimizer_offload_fraction",
            "with --optimizer-cpu-offload: the share of the params (by elements, in optimizer order) offloaded; "
            "the rest keeps its optimizer state on the GPU",
        ),
    )
    p.add_argument(
        "--fused-linear-ce",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=d(
            "fused_linear_ce",
            "main and MTP head losses without materialising the [s, b, V] logits (vocab-chunked head GEMM + "
            "cross entropy); --no-fused-linear-ce: output-layer logits, then the fused cross entropy",
        ),
    )
    from dsv4_train.recompute import add_recompute_flags

    add_recompute_flags(p, d)
    p.add_argument(
        "--deterministic",
        action="store_true",
        default=None,
        help=d(
            "deterministic",
            "bitwise-reproducible steps: deterministic kernels everywhere (no atomics in the sparse-attention "
            "dkv / indexer dk), torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8; costs "
            "speed (hybrid-model README)",
        ),
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        help="peak TFLOP/s for MFU (default: 989 on H100/H200, 312 on other GPUs, 1 on CPU)",
    )
    p.add_argument(
        "--log-interval",
        type=int,
        help=d("log_interval", "when stdout is not a terminal: one progress line every N steps"),
    )
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        default=None,
        help="no progress bar / progress lines (metrics.jsonl is written regardless) (default: progress on)",
    )


def train_config_from_args(args):
    """The :class:`TrainConfig` of parsed ``dsv4 train`` arguments: the ``--config`` file (if any) with the flags
    given on the command line on top; flags left unset keep the file's or the dataclass's values. Flags that only
    apply in another mode are refused (``ValueError``) instead of being ignored."""
    from dsv4_train.config import TrainConfig
    from hybrid_model.model_flags import overrides_from_args

    model_flags = overrides_from_args(args)  # --pattern / --no-mhc: model_overrides entries
    flags = {k: v for k, v in vars(args).items() if k not in ("cmd", "config", "func") and v is not None}
    if model_flags:
        flags["model_overrides"] = {**flags.get("model_overrides", {}), **model_flags}
    flags = {k: None if v is _NULL else v for k, v in flags.items()}
    tc = TrainConfig.from_file(args.config, **flags) if args.config else TrainConfig(**flags)
    if "hybrid_layer_pattern" in tc.model_overrides:  # the pattern against --pp, before any process starts
        from dsv4_train.setup import model_config_for

        model_config_for(tc)
    if "cuda_graph_warmup_steps" in flags and not tc.cuda_graph:
        raise ValueError("--cuda-graph-warmup-steps only applies with --cuda-graph")
    if "optimizer_offload_fraction" in flags and not tc.optimizer_cpu_offload:
        raise ValueError("--optimizer-offload-fraction only applies with --optimizer-cpu-offload")
    if "eval_iters" in flags and not tc.eval_interval:
        raise ValueError("--eval-iters only applies with --eval-interval N (N > 0)")
    if "micro_batch_size" in flags and tc.packed:
        raise ValueError(
            "--micro-batch-size only applies to [B, S] batches: a --packed (THD) micro-batch is one pack of --seq-len "
            "tokens; drop --micro-batch-size"
        )
    return tc


# What every default run printed that a user can do nothing about, matched exactly by message (anything else still
# shows): megatron-core without Transformer Engine / apex (torch kernels by design), its experimental-API and
# deprecated-default notices, the DDP layout hint and the non-leaf ``.grad`` probe inside its optimizer's
# zero_grad, the deprecation of the async saver (our saves are synchronous), invalid escape sequences in its docstrings, and torch's CUDA_HOME note on a machine without a GPU.
QUIET_WARNINGS = (
    (UserWarning, r"Transformer Engine and Apex are not installed"),
    (UserWarning, r"Apex is not installed\. Falling back to Torch Norm"),
    (UserWarning, r"full scope is deprecated\. Use empty cuda_graph_modules"),
    (UserWarning, r"MimoModelConfig is experimental"),
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed"),
    (SyntaxWarning, r"invalid escape sequence"),
)
QUIET_LOG_RECORDS = (
    (
        "megatron.core.distributed.distributed_data_parallel",
        "DistributedDataParallel: full_param_layout not provided",
    ),
    ("torch.utils.cpp_extension", "No CUDA runtime is found"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated"),
)


class _DropMessages:
    """``logging`` filter dropping the records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes

    def filter(self, record) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def _quiet_known_warnings() -> None:
    import logging
    import warnings

    for category, message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, prefix in QUIET_LOG_RECORDS:
        logging.getLogger(name).addFilter(_DropMessages((prefix,)))


def _cmd_train(args) -> int:
    from dsv4_train.trainer import Trainer, TrainingDiverged, loss_is_falling

    tc = train_config_from_args(args)
    trainer = Trainer(tc)
    try:
        metrics = trainer.run()
    except TrainingDiverged as e:
        print(f"dsv4 train: error: {e}", file=sys.stderr)
        return 1
    finally:
        trainer.close()
    if trainer.interrupted_by is not None:
        if trainer.is_logger:
            print(
                f"dsv4 train: interrupted at step {trainer.step} of {tc.steps}; its checkpoint is saved in "
                f"{tc.out}/checkpoints: continue with --resume"
            )
        return 128 + int(trainer.interrupted_by)
    lm = [m for m in metrics if m.get("lm_loss") is not None]
    if lm and trainer.is_logger:
        first, last = lm[0]["lm_loss"], lm[-1]["lm_loss"]
        trend = "falling" if loss_is_falling(metrics) else "NOT falling"
        skipped = f", {trainer.nonfinite_steps} non-finite steps skipped" if trainer.nonfinite_steps else ""
        print(
            f"dsv4 train: {len(metrics)} steps, lm loss {first:.3f} -> {last:.3f} ({trend}{skipped}); "
            f"outputs in {tc.out}"
        )
    return 0


def _model_config(args):
    """The preset of ``dsv4 inspect|flops`` with ``--pattern`` / ``--no-mhc`` applied (the pattern's cuts decide
    the pipeline stages)."""
    from hybrid_model.model_flags import apply_model_overrides, overrides_from_args
    from hybrid_model.presets import get_preset
    from hybrid_model.symbols import parse_pattern

    overrides = overrides_from_args(args)
    pattern = overrides.get("hybrid_layer_pattern")
    pp = len(parse_pattern(pattern).segments) if pattern else 1
    return apply_model_overrides(get_preset(args.preset), overrides, pp=pp)


def _cmd_inspect(args) -> int:
    from hybrid_model.params import analytic_param_counts

    cfg = _model_config(args)
    counts = analytic_param_counts(cfg)
    layers = [
        {
            "index": li.index,
            "symbol": li.symbol,
            "kind": li.kind,
            "compress_ratio": li.compress_ratio,
            "stage": li.stage,
            "mtp_depth": li.mtp_depth,
            "router": li.router,
        }
        for li in cfg.layers()
    ]
    report = {"preset": cfg.name, "pattern": cfg.layer_pattern, "layers": layers, "params": counts.to_dict()}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"preset {cfg.name}: pattern {cfg.layer_pattern}")
    for li in layers:
        extra = (
            f" ratio {li['compress_ratio']}"
            if li["symbol"] in "CHW"
            else f" router {li['router']}"
            if li["router"]
            else ""
        )
        where = f"mtp depth {li['mtp_depth']}" if li["mtp_depth"] else f"stage {li['stage']}"
        print(f"  {li['index']:3d} {li['symbol']} {li['kind']:<7}{extra:<14} {where}")
    b = lambda n: f"{n / 1e9:,.4f} B"
    print(
        f"parameters: main {b(counts.main)} | MTP {b(counts.mtp)} | total {b(counts.total)} | "
        f"activated {b(counts.activated)} | one expert {counts.one_expert / 1e6:.2f} M"
    )
    for k, v in sorted(counts.components.items()):
        print(f"  {k:<36} {b(v)}")
    return 0


def _cmd_flops(args) -> int:
    from hybrid_model.flops import forward_flops_sbhd, summarize_by_kind

    cfg = _model_config(args)
    br = forward_flops_sbhd(cfg, args.seq_len, args.batch, dense=args.dense)
    report = {
        "preset": cfg.name,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "tokens": br.tokens,
        "forward": br.forward,
        "training": br.training,
        "by_kind": summarize_by_kind(br),
        "components": br.components,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"preset {cfg.name}, {args.batch} x {args.seq_len} tokens: forward {br.forward:.4e} FLOPs, "
        f"training {br.training:.4e} ({br.training / br.tokens:.4e} per token)"
    )
    for k, v in sorted(br.components.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<32} {v:.4e}  {100 * v / br.forward:5.1f}%")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4 on megatron-core")
    sub = parser.add_subparsers(dest="cmd")
    _train_parser(sub)
    p = sub.add_parser("inspect", help="layer pattern, per-layer kinds and parameter counts of a preset")
    p.add_argument("--preset", default="tiny")
    add_model_flags(p)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("flops", help="FLOP breakdown of a preset at a sequence length")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    add_model_flags(p)
    p.add_argument(
        "--dense", action="store_true", help="dense-attention phase (CSA attends every visible entry)"
    )
    p.add_argument("--json", action="store_true")
    from dsv4_train.convert_cli import add_convert_parser

    add_convert_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``dsv4``: exit status 0 on success, 2 for invalid settings or files (one message), 1 when training failed,
    128 + signal number when ``dsv4 train`` was interrupted (after saving a checkpoint)."""
    _quiet_known_warnings()
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    cmd = args.cmd or "train"
    if args.cmd is None:
        args = build_parser().parse_args(["train"])
    try:
        from dsv4_train.convert_cli import run_convert

        commands = {"train": _cmd_train, "inspect": _cmd_inspect, "flops": _cmd_flops, "convert": run_convert}
        return commands[cmd](args)
    except ValueError as e:
        print(f"dsv4 {cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
