"""``dsv4 convert SRC OUT``: HF / official DeepSeek-V4 checkpoint directory <-> megatron dist checkpoint.

The direction follows ``SRC`` (``--to`` overrides): a directory with ``config.json`` + safetensors converts to a
megatron checkpoint; a megatron dist checkpoint (``metadata.json``; or a ``dsv4 train`` run directory, whose
``checkpoints/latest`` is used) converts to an HF checkpoint directory. The model of a ``dsv4 train`` checkpoint is
the one its saved run config names (preset + overrides); ``--preset`` replaces it. ``OUT`` must be new or
empty unless ``--overwrite``; it is written in a temporary directory and renamed into place once complete.

HF -> megatron (plain or released FP8 / FP4 sources) is streamed into the files of a target layout ``--tp T --pp P
[--vpp V] --ep E`` (default one rank): one source tensor in memory at a time, ``--workers`` rank files at once,
resumable (rerun the same command), published atomically with its manifest of checksums
(:mod:`hybrid_model.hf.stream_megatron`); ``dsv4 train --init-from OUT --tp T --pp P --ep E`` then reads its own
rank's file (and its stage's replicas). Each TP-split tensor is cut along the partition axis that the model of
``dsv4 train --tp T`` marks (:mod:`hybrid_model.hf.megatron_tp`); a ``--tp`` the model cannot split is refused
in one line (which size, which ``--tp`` values fit), as are the layouts ``dsv4 train`` refuses.

Released FP8 / FP4 checkpoints (``quantization_config`` in ``config.json``): ``--to megatron`` (the default)
dequantizes them tensor by tensor; ``--to hf-bf16`` streams them to a plain bf16 (``--dtype fp32``) directory shard by
shard (bounded memory, ``--workers``, resumable: rerun the same command after an interruption);
``--to released`` streams a plain HF directory (or a megatron checkpoint, exported first) back to the released
format, ``--like RELEASED_DIR`` taking that checkpoint's layout and scales so an unchanged model reproduces its
bytes (:mod:`hybrid_model.hf.stream`).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from dsv4_train.checkpoint import TRAIN_CONFIG_FILE
from dsv4_train.ckpt_integrity import (
    MANIFEST_MARKER,
    checkpoint_files,
    file_entries,
    verify_loaded,
    write_manifest,
)
from dsv4_train.config import TrainConfig
from dsv4_train.model_config import model_config_for
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.hf.convert import check_output_dir, convert_hf_to_megatron, convert_megatron_to_hf
from hybrid_model.hf.megatron_layout import TargetLayout
from hybrid_model.hf.stream import dequantize_checkpoint, quantize_checkpoint
from hybrid_model.presets import get_preset


def add_convert_parser(sub) -> None:
    p = sub.add_parser(
        "convert", help="HF DeepSeek-V4 checkpoint (config.json + safetensors) <-> megatron dist checkpoint"
    )
    p.add_argument(
        "src", help="HF checkpoint directory, or megatron dist checkpoint / dsv4 train run directory"
    )
    p.add_argument("out", help="output directory (new or empty; see --overwrite)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty output directory (as a whole, once the conversion has succeeded)",
    )
    p.add_argument(
        "--to",
        choices=("megatron", "hf", "hf-bf16", "released"),
        help="target format (default: the other one); hf-bf16: a released FP8/FP4 checkpoint dequantized, streamed; "
        "released: the FP8/FP4 released format, streamed",
    )
    p.add_argument("--like", help="--to released: copy the layout and scales of this released checkpoint")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="hf-bf16 / released: shards converted at once; megatron: rank files written at once (threads)",
    )
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="hf-bf16: dequantized dtype")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="HF -> megatron: tensor parallel size of the target layout (each rank's file holds its TP shards; "
        "must divide the model's heads' output groups and every TP-split size, e.g. the vocabulary)",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        help="HF -> megatron: pipeline ranks of the target layout (each rank's file holds its stages' tensors; "
        "dsv4 train --init-from reads any layout, its own one file by file)",
    )
    p.add_argument("--vpp", type=int, default=1, help="HF -> megatron: virtual pipeline chunks per --pp rank")
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="HF -> megatron: expert ranks of the target layout (divides the experts)",
    )
    p.add_argument(
        "--mtp",
        choices=("auto", "yes", "no"),
        default="auto",
        help="HF -> megatron: build the MTP module (auto: iff the checkpoint holds mtp.* tensors)",
    )
    p.add_argument(
        "--preset",
        help="megatron -> HF: model preset of the checkpoint (default: the preset and overrides its dsv4 train run "
        "saved; convert outputs carry their model config)",
    )
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="megatron -> HF: safetensors shard size")


def _direction(src: Path) -> str:
    if (src / "config.json").is_file():
        return "megatron"
    for d in (src, src / "checkpoints"):
        if (d / "metadata.json").is_file() or (d / "latest").is_file():
            return "hf"
    raise ValueError(
        f"{src} is neither an HF checkpoint (config.json) nor a megatron dist checkpoint (metadata.json); "
        "pass --to to choose"
    )


def train_checkpoint(src: Path) -> Path | None:
    """The checkpoint directory of a ``dsv4 train`` run directory or ``iter_XXXXXXX`` ``src`` (``checkpoints/latest``
    followed); ``None`` when ``src`` is no train checkpoint (e.g. a ``dsv4 convert`` output)."""
    for latest in (src / "checkpoints" / "latest", src / "latest"):
        if latest.is_file():
            src = latest.parent / latest.read_text().strip()
            break
    return src if (src / TRAIN_CONFIG_FILE).is_file() else None


def verify_train_checkpoint(src: Path, what: str, command: str) -> None:
    """The checksums of the ``dsv4 train`` checkpoint that ``src`` names, before ``what`` loads it (``ValueError``
    naming a damaged file; a note on stderr for a checkpoint saved without checksums)."""
    ckpt = train_checkpoint(src)
    if ckpt is not None:
        verify_loaded(
            ckpt, what=what, note=lambda line: print(f"dsv4 {command}: note: {line}", file=sys.stderr)
        )


def run_model_config(src: Path) -> DSv4ModelConfig | None:
    """The model of a ``dsv4 train`` run directory or checkpoint ``src`` from the run config saved with the
    checkpoint (``None`` when it holds none: a convert output carries its own model config)."""
    for latest in (src / "checkpoints" / "latest", src / "latest"):
        if latest.is_file():
            src = latest.parent / latest.read_text().strip()
            break
    saved = src / TRAIN_CONFIG_FILE
    if not saved.is_file():
        return None
    try:
        tc = TrainConfig.from_dict(json.loads(saved.read_text()), where=str(saved))
    except json.JSONDecodeError as e:
        raise ValueError(f"{saved} is not valid JSON ({e}); pass --preset") from e
    return model_config_for(tc)


def _progress(line: str) -> None:
    print(f"dsv4 convert: {line}", file=sys.stderr, flush=True)


def run_convert(args) -> int:
    src, out = Path(args.src), Path(args.out)
    if not src.is_dir():
        raise ValueError(f"{src} is not a directory")
    to = args.to or _direction(src)
    if args.like and to != "released":
        raise ValueError("--like applies to --to released only")
    layout = _target_layout(args)
    if to != "megatron" and layout != TargetLayout():
        raise ValueError(
            "--tp/--pp/--vpp/--ep choose the layout of a megatron checkpoint: use them with --to megatron"
        )
    if to == "hf-bf16":
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        check_output_dir(out, overwrite=True, source=src)  # overlap only: the stream resumes or refuses
        rep = dequantize_checkpoint(
            src, out, dtype=dtype, workers=args.workers, overwrite=args.overwrite, progress=_progress
        )
        print(
            f"dsv4 convert: {src} (released) -> {out} ({args.dtype}, {rep.files} file(s), {rep.gb_per_s:.3f} GB/s)"
        )
        return 0
    if to == "released":
        return _to_released(src, out, args)
    if to == "megatron":
        return _to_megatron(src, out, layout, args)
    cfg = _megatron_model_config(src, args)
    if args.max_shard_gb <= 0:
        raise ValueError(f"--max-shard-gb must be positive, got {args.max_shard_gb}")
    verify_train_checkpoint(src, f"dsv4 convert {src}", "convert")
    files = convert_megatron_to_hf(
        src, out, model_config=cfg, max_shard_bytes=int(args.max_shard_gb * 1024**3), overwrite=args.overwrite
    )
    print(f"dsv4 convert: {src} (megatron) -> {out} (HF, {len(files)} safetensors file(s))")
    return 0


def _target_layout(args) -> TargetLayout:
    """The layout of ``--tp/--pp/--vpp/--ep``, refused as ``dsv4 train`` refuses it (the support table's reasons,
    :mod:`dsv4_train.support`), then by what the writer builds (:class:`TargetLayout`)."""
    TrainConfig.from_flat(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep)
    return TargetLayout(pp=args.pp, vpp=args.vpp, ep=args.ep, tp=args.tp)


def _manifest(directory: Path) -> None:
    """The checksums of every file (:mod:`dsv4_train.ckpt_integrity`), written last, as ``dsv4 train`` saves do."""
    write_manifest(directory, file_entries(directory, checkpoint_files(directory)))


def _to_megatron(src: Path, out: Path, layout: TargetLayout, args) -> int:
    """HF / released -> megatron dist checkpoint of ``layout``, streamed (:mod:`hybrid_model.hf.stream_megatron`),
    with its manifest of checksums (loads checked like a ``dsv4 train`` checkpoint)."""
    mtp = {"auto": None, "yes": True, "no": False}[args.mtp]
    rep = convert_hf_to_megatron(
        src,
        out,
        mtp=mtp,
        overwrite=args.overwrite,
        layout=layout,
        workers=args.workers,
        common={MANIFEST_MARKER: True},
        finalize=_manifest,
        progress=_progress,
    )
    speed = f", {rep.gb_per_s:.3f} GB/s" if rep is not None else ""
    print(f"dsv4 convert: {src} (HF) -> {out} (megatron dist checkpoint, {layout.describe()}{speed})")
    return 0


def _megatron_model_config(src: Path, args) -> DSv4ModelConfig | None:
    if args.preset:
        return get_preset(args.preset)
    return run_model_config(src)


def _to_released(src: Path, out: Path, args) -> int:
    """HF plain directory (or megatron checkpoint, exported to a temporary HF directory first) -> released format."""
    check_output_dir(out, overwrite=True, source=src)  # overlap only: the stream resumes or refuses
    shard = int(args.max_shard_gb * 1024**3)
    kw = dict(
        like=args.like,
        max_shard_bytes=shard,
        workers=args.workers,
        overwrite=args.overwrite,
        progress=_progress,
    )
    if (src / "config.json").is_file():
        rep = quantize_checkpoint(src, out, **kw)
    else:
        with tempfile.TemporaryDirectory(
            prefix=f".{out.name}.hf-", dir=out.parent if out.parent.is_dir() else None
        ) as tmp:
            convert_megatron_to_hf(src, Path(tmp) / "hf", model_config=_megatron_model_config(src, args))
            rep = quantize_checkpoint(Path(tmp) / "hf", out, **kw)
    print(f"dsv4 convert: {src} -> {out} (released FP8/FP4, {rep.files} file(s), {rep.gb_per_s:.3f} GB/s)")
    return 0
