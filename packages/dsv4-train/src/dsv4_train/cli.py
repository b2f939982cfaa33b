"""The ``dsv4`` command: ``train``, ``inspect``, ``flops``, ``memory`` (:mod:`dsv4_train.memory_cli`), ``convert`` (:mod:`dsv4_train.convert_cli`), ``generate``
(:mod:`dsv4_train.generate_cli`). The console
script and ``python -m dsv4_train`` enter through :mod:`dsv4_train.__main__`, which installs the warning filters
(:mod:`dsv4_train.quiet`) before this module imports megatron-core.

``dsv4 train`` with no arguments trains the ``tiny`` preset on the embedded default corpus (CPU, or the GPU when
present); several processes through ``torchrun`` (gloo on CPU, NCCL on GPU) with ``--pp``/``--ep``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from dsv4_train.atomic_save import CheckpointSaveError
from dsv4_train.config import TrainConfig
from dsv4_train.convert_cli import add_convert_parser, run_convert
from dsv4_train.flags import add_config_flags, config_from_flags, given_flags
from dsv4_train.generate_cli import add_generate_parser, run_generate
from dsv4_train.inspect_checkpoint import checkpoint_report, print_report
from dsv4_train.loss_trend import loss_trend
from dsv4_train.lost_rank import RankLost
from dsv4_train.memory_cli import add_memory_parser, run_memory
from dsv4_train.model_config import model_config_for
from dsv4_train.quiet import quiet_known_warnings
from dsv4_train.rundir import first_missing, remove_created
from dsv4_train.setup import check_run
from dsv4_train.trainer import Trainer, TrainingDiverged
from hybrid_model.flops import forward_flops_sbhd, summarize_by_kind
from hybrid_model.mixers.registry import require_symbol_dependencies
from hybrid_model.model_flags import add_model_flags, apply_model_overrides, overrides_from_args
from hybrid_model.params import analytic_param_counts
from hybrid_model.presets import get_preset
from hybrid_model.symbols import parse_pattern


def _train_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a preset (default: tiny on the embedded corpus)",
        description="Train a DSv4 preset with megatron-core. Every flag maps onto a field of a TrainConfig section; "
        "flags given on the command line win over a --config file. Exit codes: 0 completed; 130 / 143 interrupted "
        "by SIGINT / SIGTERM (a checkpoint of the last step is saved: continue with --resume); 1 failed (e.g. the "
        "run diverged, a checkpoint could not be saved, a rank was lost); 2 invalid settings or a damaged checkpoint.",
    )
    p.add_argument(
        "--config",
        help='JSON file of TrainConfig sections ({"data": {"seq_len": 512}, ...}; a flat object of field '
        "names is read too); explicit flags win (default: none)",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective config (JSON, by section: what the run would train with) and exit",
    )
    add_model_flags(p)
    add_config_flags(p)


def train_config_from_args(args) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``dsv4 train`` arguments: the ``--config`` file (if any) with the flags
    given on the command line on top; flags left unset keep the file's or the sections' values. Flags that only
    apply in another mode are refused (``ValueError``) instead of being ignored."""
    model_flags = overrides_from_args(args)  # --pattern / --no-mhc: model_overrides entries
    flags = given_flags(args)
    if model_flags:
        flags["model_overrides"] = {**flags.get("model_overrides", {}), **model_flags}
    tc = config_from_flags(flags, args.config)
    if (
        "hybrid_layer_pattern" in tc.model.model_overrides
    ):  # the pattern against --pp, before any process starts
        pattern = model_config_for(tc).layer_pattern
        try:  # a symbol whose optional packages are missing (M, G): one line, rc 2, before any process starts
            require_symbol_dependencies(pattern)
        except ImportError as e:
            raise ValueError(f"--pattern {pattern}: {e}") from e
    if "cuda_graph_warmup_steps" in flags and not tc.graphs.cuda_graph:
        raise ValueError("--cuda-graph-warmup-steps only applies with --cuda-graph")
    if "optimizer_offload_fraction" in flags and not tc.optimizer.optimizer_cpu_offload:
        raise ValueError("--optimizer-offload-fraction only applies with --optimizer-cpu-offload")
    if "eval_iters" in flags and not tc.eval.eval_interval:
        raise ValueError("--eval-iters only applies with --eval-interval N (N > 0)")
    if "micro_batch_size" in flags and tc.data.packed:
        raise ValueError(
            "--micro-batch-size only applies to [B, S] batches: a --packed (THD) micro-batch is one pack of --seq-len "
            "tokens; drop --micro-batch-size"
        )
    return tc


def _cmd_train(args) -> int:
    tc = train_config_from_args(args)
    if args.print_config:
        print(json.dumps(check_run(tc).to_dict(), indent=1))
        return 0
    tc = check_run(tc)  # refused before --out is created
    out = Path(tc.checkpoint.out)
    created = first_missing(out)  # what a run that fails before writing anything removes again
    try:
        trainer = Trainer(tc)
    except BaseException:
        remove_created(out, created)
        raise
    try:
        try:
            trainer.run()
        finally:
            trainer.close()
    except (TrainingDiverged, CheckpointSaveError) as e:
        print(f"dsv4 train: error: {e}", file=sys.stderr)
        return 1
    except RankLost:  # printed by the rank that found it (dsv4_train.lost_rank)
        return 1
    except BaseException:  # e.g. --init-from weights of another model: no empty --out left behind
        remove_created(out, created)
        raise
    if trainer.interrupted_by is not None:
        if trainer.is_logger:
            print(
                f"dsv4 train: interrupted at step {trainer.step} of {tc.schedule.steps}; its checkpoint is saved in "
                f"{tc.checkpoint.out}/checkpoints: continue with --resume"
            )
        return 128 + int(trainer.interrupted_by)
    lm = [x for x in trainer.lm_losses if math.isfinite(x)]  # every step's (metrics keeps the newest only)
    if lm and trainer.is_logger:
        first, last = lm[0], lm[-1]
        trend = loss_trend([{"lm_loss": x} for x in lm])
        skipped = f", {trainer.nonfinite_steps} non-finite steps skipped" if trainer.nonfinite_steps else ""
        print(
            f"dsv4 train: {len(trainer.lm_losses)} step{'' if len(trainer.lm_losses) == 1 else 's'}, lm loss {first:.3f} -> {last:.3f} ({trend}{skipped}); "
            f"outputs in {tc.checkpoint.out}"
        )
    return 0


def _model_config(args):
    """The preset of ``dsv4 inspect|flops`` with ``--pattern`` / ``--no-mhc`` applied (the pattern's cuts decide
    the pipeline stages)."""
    overrides = overrides_from_args(args)
    pattern = overrides.get("hybrid_layer_pattern")
    pp = len(parse_pattern(pattern).segments) if pattern else 1
    return apply_model_overrides(get_preset(args.preset), overrides, pp=pp)


def _cmd_inspect(args) -> int:
    if args.checkpoint:
        report = checkpoint_report(args.checkpoint)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print_report(report)
        return 0
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
    presets = "tiny | v4-flash | v4-pro | flash-smoke"
    p = sub.add_parser(
        "inspect",
        help="layer pattern, per-layer kinds and parameter counts of a preset, or what a checkpoint holds",
    )
    p.add_argument(
        "--checkpoint",
        help="report on this checkpoint directory instead (HF, released FP8/FP4, or megatron dist): format, "
        "quantization, dtypes, tensor count and bytes, layers, MTP, hash tables",
    )
    p.add_argument("--preset", default="tiny", help=f"{presets} (default: tiny)")
    add_model_flags(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p = sub.add_parser("flops", help="FLOP breakdown of a preset at a sequence length")
    p.add_argument("--preset", default="tiny", help=f"{presets} (default: tiny)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default: 4096)")
    p.add_argument("--batch", type=int, default=1, help="sequences (default: 1)")
    add_model_flags(p)
    p.add_argument(
        "--dense", action="store_true", help="dense-attention phase (CSA attends every visible entry)"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_memory_parser(sub, add_train_flags=lambda p: (add_model_flags(p), add_config_flags(p)))
    add_convert_parser(sub)
    add_generate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``dsv4``: exit status 0 on success, 2 for invalid settings or files (one message), 1 when training failed,
    128 + signal number when ``dsv4 train`` was interrupted (after saving a checkpoint)."""
    quiet_known_warnings()
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    cmd = args.cmd or "train"
    if args.cmd is None:
        args = build_parser().parse_args(["train"])
    try:
        commands = {
            "train": _cmd_train,
            "inspect": _cmd_inspect,
            "flops": _cmd_flops,
            "memory": lambda a: run_memory(a, train_config_from_args),
            "convert": run_convert,
            "generate": run_generate,
        }
        return commands[cmd](args)
    except ValueError as e:
        print(f"dsv4 {cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
