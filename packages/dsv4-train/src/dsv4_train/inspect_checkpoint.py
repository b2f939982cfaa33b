"""``dsv4 inspect --checkpoint DIR``: what a checkpoint directory holds (format, quantization, dtypes, tensor count
and bytes, layers, MTP, hash tables), from the file headers only (no tensor data is read)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from hybrid_model.hf.io import read_config
from hybrid_model.hf.names import canonical_name
from hybrid_model.hf.quant import QuantConfig
from hybrid_model.hf.released import pair_scales, quant_config_of, scan

_LAYER = re.compile(r"^(layers|mtp)\.(\d+)\.")


def checkpoint_report(path: str | Path) -> dict:
    """The inspect report of an HF / released directory or a megatron dist checkpoint."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"--checkpoint {p} is not a directory")
    if (p / "config.json").is_file():
        return _hf_report(p)
    if (p / "metadata.json").is_file():
        files = [f for f in p.rglob("*") if f.is_file()]
        meta = p / "dsv4_model_config.json"
        model = json.loads(meta.read_text()).get("model_config", {}) if meta.is_file() else {}
        return {
            "path": str(p),
            "format": "megatron dist checkpoint (layout-free: any PP/TP/EP/DP layout loads it with dsv4 train --init-from)",
            "files": len(files),
            "bytes": sum(f.stat().st_size for f in files),
            "model": {
                k: model[k] for k in ("name", "layer_pattern", "hidden_size", "num_experts") if k in model
            },
        }
    raise ValueError(
        f"--checkpoint {p}: neither config.json (HF / released) nor metadata.json (megatron) found"
    )


def _hf_report(p: Path) -> dict:
    config = read_config(p)
    quant = quant_config_of(config)
    stored, files = scan(p)
    pairs, problems = pair_scales(stored, quant or QuantConfig())
    scales = {x.scale for x in pairs.values()}
    nbytes = sum(f.nbytes(n) for f in files.values() for n in f.entries)
    layers, mtp, hashes = set(), set(), {}
    for name, s in stored.items():
        off = canonical_name(name) or ""
        m = _LAYER.match(off)
        if m:
            (layers if m.group(1) == "layers" else mtp).add(int(m.group(2)))
        if off.endswith("tid2eid"):
            hashes[name] = list(s.shape)
    return {
        "path": str(p),
        "format": "released (FP8 block-scaled + FP4 experts)" if quant else "HF safetensors (not quantized)",
        "quantization": quant.to_hf() if quant else None,
        "files": len(files),
        "tensors": len(stored) - len(scales),
        "scales": len(scales),
        "bytes": nbytes,
        "dtypes": dict(Counter(str(s.dtype).replace("torch.", "") for s in stored.values())),
        "quantized": dict(Counter(x.kind for x in pairs.values())),
        "layers": len(layers),
        "mtp_depths": sorted(mtp),
        "hash_tables": hashes,
        "problems": problems,
    }


def print_report(r: dict) -> None:
    print(f"{r['path']}: {r['format']}")
    print(f"  files {r['files']}, {r['bytes'] / 1e9:.3f} GB")
    if "tensors" not in r:
        print(f"  model {r['model']}")
        return
    print(f"  tensors {r['tensors']} (+ {r['scales']} scales); dtypes {r['dtypes']}")
    if r["quantization"]:
        print(f"  quantization {r['quantization']}; quantized weights {r['quantized']}")
    print(f"  layers {r['layers']}; MTP depths {r['mtp_depths'] or 'none'}")
    print(
        f"  hash tables {len(r['hash_tables'])}: "
        + ", ".join(f"{k} {v}" for k, v in list(r["hash_tables"].items())[:4])
    )
    for line in r["problems"]:
        print(f"  problem: {line}")
