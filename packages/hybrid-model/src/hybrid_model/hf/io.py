"""Reading and writing Hugging Face style checkpoint directories (``config.json`` + safetensors).

A directory holds ``model.safetensors`` or shards listed in ``model.safetensors.index.json`` (any other
``*.safetensors`` files are read too when there is no index). Writing produces the same layout as
``save_pretrained``: one ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` shards + the index.

Every read that fails (missing, unreadable, truncated or corrupt ``config.json``, index or safetensors file) raises
a ``ValueError`` naming the file and what to do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

INDEX = "model.safetensors.index.json"
_REFETCH = "re-download or re-export the checkpoint"


def _read_json(f: Path, what: str) -> Any:
    """The JSON value of ``f`` (``what`` names the file's role in messages)."""
    try:
        text = f.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(
            f"{f}: cannot read the {what} ({e.strerror or e}); check the file's permissions"
        ) from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{f}: the {what} is not UTF-8 text ({e.reason}); {_REFETCH}") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{f} is not valid JSON ({e}); the {what} is truncated or corrupt: {_REFETCH}"
        ) from e


def _require_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise ValueError(
            f"{p} is not a directory (expected a checkpoint directory with config.json + *.safetensors)"
        )
    return p


def read_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint directory."""
    f = _require_dir(path) / "config.json"
    if not f.is_file():
        raise ValueError(f"{f} does not exist: a DeepSeek-V4 checkpoint directory needs its config.json")
    config = _read_json(f, "model config")
    if not isinstance(config, dict):
        raise ValueError(
            f"{f} holds a JSON {type(config).__name__}, not an object of config fields; {_REFETCH}"
        )
    return config


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (from the index when there is one)."""
    p = _require_dir(path)
    idx = p / INDEX
    if idx.is_file():
        index = _read_json(idx, "safetensors index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{idx} has no 'weight_map' object of tensor name -> file name; {_REFETCH}")
        out = [p / f for f in sorted(set(weight_map.values()))]
        lost = [str(f) for f in out if not f.is_file()]
        if lost:
            raise ValueError(f"{idx} lists missing shard files {lost[:4]}; {_REFETCH} (every shard)")
        return out
    out = sorted(p.glob("*.safetensors"))
    if not out:
        raise ValueError(f"{p} holds no *.safetensors files")
    return out


def read_safetensors_file(f: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (CPU); a truncated, corrupt or unreadable file raises a ``ValueError``
    naming it."""

    try:
        return load_file(str(f), device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(
            f"{f}: not a readable safetensors file ({e}); it is truncated or corrupt (an interrupted download or "
            f"copy?): {_REFETCH}"
        ) from e


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, by its stored name (CPU)."""
    out: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        for k, v in read_safetensors_file(f).items():
            if k in out:
                raise ValueError(f"tensor {k!r} is stored twice (second copy in {f.name})")
            out[k] = v
    return out


def write_checkpoint(
    path: str | Path,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    *,
    max_shard_bytes: int = 5 * 1024**3,
) -> list[Path]:
    """Write ``tensors`` (names as given) + ``config.json`` to the directory ``path`` (created; must be new or
    empty: nothing in it is ever overwritten). Returns the written weight files."""

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    held = sorted(q.name for q in p.iterdir())
    if held:
        raise ValueError(f"{p} already holds files {held[:4]}; choose a new or empty output directory")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    meta = {"format": "pt"}
    files: list[Path] = []
    if len(shards) == 1:
        files.append(p / "model.safetensors")
        save_file(shards[0], str(files[0]), metadata=meta)
    else:
        weight_map = {}
        total = 0
        for i, shard in enumerate(shards):
            f = p / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(f), metadata=meta)
            files.append(f)
            for k, t in shard.items():
                weight_map[k] = f.name
                total += t.numel() * t.element_size()
        (p / INDEX).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    (p / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return files
