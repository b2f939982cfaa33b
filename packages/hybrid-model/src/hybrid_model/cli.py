"""The ``dsv4`` command: ``train``, ``inspect``, ``flops``, ``convert`` (:mod:`hybrid_model.hf.cli`).

``dsv4 train`` with no arguments trains the ``tiny`` preset on the embedded default corpus (CPU, or the GPU when
present); several processes through ``torchrun`` (gloo on CPU, NCCL on GPU) with ``--pp``/``--ep``.
"""

from __future__ import annotations

import argparse
import json
import sys


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a preset (default: tiny on the embedded corpus)")
    p.add_argument("--config", help="JSON file of TrainConfig fields (explicit flags win)")
    p.add_argument("--preset", help="tiny | v4-flash | v4-pro | flash-smoke")
    p.add_argument("--steps", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--global-batch-size", type=int)
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--packed", action="store_true", default=None, help="packed THD batches instead of [B, S]")
    p.add_argument("--dense-steps", type=int, help="dense-attention warm-up steps before sparse CSA")
    _add_data_flags(p)
    p.add_argument("--lr", type=float)
    p.add_argument(
        "--lr-decay-style", choices=("cosine", "wsd"), help="cosine (default) or warmup-stable-decay"
    )
    p.add_argument("--lr-wsd-decay-steps", type=int, help="wsd: length of the final cosine anneal")
    p.add_argument(
        "--mtp-loss-weight-decay",
        type=float,
        help="MTP loss weight from the start of the LR decay (default 0.1, spec; the preset's weight before)",
    )
    p.add_argument("--seed", type=int)
    p.add_argument("--tp", type=int)
    p.add_argument("--pp", type=int)
    p.add_argument("--ep", type=int)
    p.add_argument("--out", help="output directory (metrics.jsonl, loss.png, tb/, checkpoints/)")
    p.add_argument("--resume", action="store_true", default=None, help="continue from the latest checkpoint")
    p.add_argument(
        "--init-from", help="initial weights from a dist checkpoint (iter_XXXXXXX or run dir), any layout"
    )
    p.add_argument(
        "--save-interval",
        type=int,
        help="save every N steps (default 0: only at the end and on SIGINT/SIGTERM)",
    )
    p.add_argument(
        "--save-final",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="save a checkpoint when the run finishes (default on; --no-save-final for benchmark runs)",
    )
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 mixed precision (keep-in-fp32 params stay fp32); default: on with CUDA, off (fp32) on CPU",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        default=None,
        help="one GPU, [B, S] batches: capture each step's forward+backward in a CUDA graph (megatron's "
        "FullCudaGraphWrapper) and replay it; removes the kernel-launch overhead of short sequences",
    )
    p.add_argument("--cuda-graph-warmup-steps", type=int, help="eager steps before the capture (default 2)")
    p.add_argument(
        "--optimizer-impl",
        choices=["auto", "fused", "foreach", "unfused"],
        help="kernel of megatron's torch AdamW: fused (one pass), foreach (multi-tensor), unfused (megatron's "
        "optimizer as built); default auto = fused on CUDA, unfused on CPU; checkpoints are interchangeable",
    )
    p.add_argument(
        "--fused-linear-ce",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="main and MTP head losses without materialising the [s, b, V] logits (vocab-chunked head GEMM + "
        "cross entropy; default on); --no-fused-linear-ce: output-layer logits, then the fused cross entropy",
    )
    p.add_argument("--peak-tflops", type=float, help="peak FLOP/s (in TFLOP/s) for MFU")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None)


def _add_data_flags(p) -> None:
    """The data flags of ``dsv4 train`` (reading rules: :mod:`hybrid_model.training.data`)."""
    p.add_argument(
        "--data",
        nargs="+",
        action="extend",
        metavar="PATH",
        help="text sources, read in order (repeat the flag or list several): .jsonl/.json/.parquet/.txt/.md files "
        "or directories (read recursively, every supported format, extensions case-insensitive; other files are "
        "listed as ignored). Default: the embedded corpus",
    )
    p.add_argument("--tokenizer", help="HF tokenizers JSON file (default: byte-level)")
    p.add_argument(
        "--long-docs",
        choices=("split", "truncate"),
        help="documents longer than --seq-len tokens: split into several sequences (default) or truncate (the "
        "start summary counts what is cut)",
    )
    p.add_argument(
        "--skip-bad-records",
        action="store_true",
        default=None,
        help="skip bad records (invalid JSON, missing text, undecodable bytes, empty files) and count them in the "
        "start summary, instead of stopping at the first",
    )


def train_config_from_args(args):
    """The :class:`TrainConfig` of parsed ``dsv4 train`` arguments: the ``--config`` file (if any) with the flags
    given on the command line on top; flags left unset keep the file's or the dataclass's values."""
    from hybrid_model.training.config import TrainConfig

    flags = {k: v for k, v in vars(args).items() if k not in ("cmd", "config", "func") and v is not None}
    return TrainConfig.from_file(args.config, **flags) if args.config else TrainConfig(**flags)


def _cmd_train(args) -> int:
    from hybrid_model.training.trainer import loss_is_falling, train

    tc = train_config_from_args(args)
    metrics = train(tc)
    if metrics and "lm_loss" in metrics[-1]:
        first, last = metrics[0]["lm_loss"], metrics[-1]["lm_loss"]
        trend = "falling" if loss_is_falling(metrics) else "NOT falling"
        print(
            f"dsv4 train: {len(metrics)} steps, lm loss {first:.3f} -> {last:.3f} ({trend}); outputs in {tc.out}"
        )
    return 0


def _cmd_inspect(args) -> int:
    from hybrid_model.params import analytic_param_counts
    from hybrid_model.presets import get_preset

    cfg = get_preset(args.preset)
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
        extra = f" ratio {li['compress_ratio']}" if li["symbol"] in "CHW" else f" router {li['router']}"
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
    from hybrid_model.presets import get_preset

    cfg = get_preset(args.preset)
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
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("flops", help="FLOP breakdown of a preset at a sequence length")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--dense", action="store_true", help="dense-attention phase (CSA attends every visible entry)"
    )
    p.add_argument("--json", action="store_true")
    from hybrid_model.hf.cli import add_convert_parser

    add_convert_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    cmd = args.cmd or "train"
    if args.cmd is None:
        args = build_parser().parse_args(["train"])
    try:
        from hybrid_model.hf.cli import run_convert

        commands = {"train": _cmd_train, "inspect": _cmd_inspect, "flops": _cmd_flops, "convert": run_convert}
        return commands[cmd](args)
    except ValueError as e:
        print(f"dsv4 {cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
