"""``dsv4 convert SRC OUT``: HF / official DeepSeek-V4 checkpoint directory <-> megatron dist checkpoint.

The direction follows ``SRC`` (``--to`` overrides): a directory with ``config.json`` + safetensors converts to a
megatron checkpoint; a megatron dist checkpoint (``metadata.json``; or a ``dsv4 train`` run directory, whose
``checkpoints/latest`` is used) converts to an HF checkpoint directory. The model of a ``dsv4 train`` checkpoint is
the one its saved run config names (preset + overrides); ``--preset`` replaces it. ``OUT`` must be new or
empty unless ``--overwrite``; it is written in a temporary directory and renamed into place once complete.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dsv4_train.checkpoint import TRAIN_CONFIG_FILE
from dsv4_train.ckpt_integrity import verify_loaded
from dsv4_train.config import TrainConfig
from dsv4_train.model_config import model_config_for
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.hf.convert import convert_hf_to_megatron, convert_megatron_to_hf
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
    p.add_argument("--to", choices=("megatron", "hf"), help="target format (default: the other one)")
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


def run_convert(args) -> int:
    src, out = Path(args.src), Path(args.out)
    if not src.is_dir():
        raise ValueError(f"{src} is not a directory")
    to = args.to or _direction(src)
    if to == "megatron":
        mtp = {"auto": None, "yes": True, "no": False}[args.mtp]
        path = convert_hf_to_megatron(src, out, mtp=mtp, overwrite=args.overwrite)
        print(f"dsv4 convert: {src} (HF) -> {path} (megatron dist checkpoint)")
        return 0
    cfg = None
    if args.preset:
        cfg = get_preset(args.preset)
    else:
        cfg = run_model_config(src)
    if args.max_shard_gb <= 0:
        raise ValueError(f"--max-shard-gb must be positive, got {args.max_shard_gb}")
    verify_train_checkpoint(src, f"dsv4 convert {src}", "convert")
    files = convert_megatron_to_hf(
        src, out, model_config=cfg, max_shard_bytes=int(args.max_shard_gb * 1024**3), overwrite=args.overwrite
    )
    print(f"dsv4 convert: {src} (megatron) -> {out} (HF, {len(files)} safetensors file(s))")
    return 0
