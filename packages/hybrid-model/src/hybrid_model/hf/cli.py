"""``dsv4 convert SRC OUT``: HF / official DeepSeek-V4 checkpoint directory <-> megatron dist checkpoint.

The direction follows ``SRC`` (``--to`` overrides): a directory with ``config.json`` + safetensors converts to a
megatron checkpoint; a megatron dist checkpoint (``metadata.json``; or a ``dsv4 train`` run directory, whose
``checkpoints/latest`` is used, with ``--preset``) converts to an HF checkpoint directory. ``OUT`` must be new or
empty unless ``--overwrite``; it is written in a temporary directory and renamed into place once complete.
"""

from __future__ import annotations

from pathlib import Path

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
        help="megatron -> HF: model preset of a dsv4 train checkpoint (convert outputs carry theirs)",
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


def run_convert(args) -> int:
    # the converters import megatron-core (seconds): only when converting, not for `dsv4 --help`
    from hybrid_model.hf.convert import convert_hf_to_megatron, convert_megatron_to_hf

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
    if args.max_shard_gb <= 0:
        raise ValueError(f"--max-shard-gb must be positive, got {args.max_shard_gb}")
    files = convert_megatron_to_hf(
        src, out, model_config=cfg, max_shard_bytes=int(args.max_shard_gb * 1024**3), overwrite=args.overwrite
    )
    print(f"dsv4 convert: {src} (megatron) -> {out} (HF, {len(files)} safetensors file(s))")
    return 0
