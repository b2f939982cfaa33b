"""Released (quantized) DeepSeek-V4 checkpoint directories: scan, scale pairing, inventory check, dequantized read.

A released directory holds ``config.json`` with a ``quantization_config`` (:class:`~hybrid_model.hf.quant.QuantConfig`)
and safetensors shards listed in ``model.safetensors.index.json``. A weight ``X.weight`` is quantized iff a scale
``X.scale`` (the release's spelling) or ``X.weight_scale_inv`` (transformers') is stored beside it (in any shard):
``float8_e4m3fn`` -> FP8 block-scaled, ``int8`` / ``uint8`` / ``float4_e2m1fn_x2`` -> FP4 (routed experts only).
Every other tensor (norms, embeddings, the head, router weights and biases, ``tid2eid`` hash tables, mHC tensors,
compressor / indexer projections the release keeps in BF16, ``mtp.*``) is read as stored.

:func:`check_inventory` validates a directory against its ``config.json`` before anything is written: it lists every
missing, extra, misshapen or wrongly typed tensor and every missing or orphan scale, one line each, in one
``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid_model.hf.config_map import model_config_from_hf
from hybrid_model.hf.io import read_config, safetensors_files
from hybrid_model.hf.names import FUSED_DOWN, FUSED_GATE_UP, canonical_name
from hybrid_model.hf.quant.formats import (
    FP4_STORAGE,
    SCALE_STORAGE,
    QuantConfig,
    fp4_scale_shape,
    fp8_scale_shape,
)
from hybrid_model.hf.quant.ops import dequantize_fp4, dequantize_fp8
from hybrid_model.hf.runtime import ensure_single_stage_parallel_state
from hybrid_model.hf.safetensors_io import SafetensorsFile
from hybrid_model.hf.weights import official_shapes
from hybrid_model.model import build_model

SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INTS = (torch.int64, torch.int32)
_MAX_LISTED = 40


@dataclass(frozen=True)
class Stored:
    """One stored tensor: its file, dtype and stored shape."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Quantized:
    """A quantized weight: its scale's stored name and the format (``"fp8"`` / ``"fp4"``)."""

    scale: str
    kind: str


def quant_config_of(config: dict, where: str = "config.json") -> QuantConfig | None:
    """The :class:`QuantConfig` of a ``config.json`` (``None`` when not quantized); a top-level ``expert_dtype``
    (how the V4 release may give it) is folded in, as transformers does."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if isinstance(q, dict) and "expert_dtype" not in q and config.get("expert_dtype") is not None:
        q = {**q, "expert_dtype": config["expert_dtype"]}
    return QuantConfig.from_hf(q, where=where)


def scan(path: str | Path) -> tuple[dict[str, Stored], dict[Path, SafetensorsFile]]:
    """Every stored tensor of a checkpoint directory (headers only) and the parsed files."""
    files = {f: SafetensorsFile(f) for f in safetensors_files(path)}
    out: dict[str, Stored] = {}
    for f, sf in files.items():
        for name, (dtype, shape, _, _) in sf.entries.items():
            if name in out:
                raise ValueError(f"tensor {name!r} is stored twice ({out[name].file.name} and {f.name})")
            out[name] = Stored(f, dtype, shape)
    return out, files


def is_scale(name: str, stored: dict[str, Stored]) -> bool:
    """Whether ``name`` is the block scale of a stored ``X.weight``."""
    return any(name.endswith(s) and name[: -len(s)] + ".weight" in stored for s in SCALE_SUFFIXES)


def logical_shape(s: Stored, kind: str | None) -> tuple[int, ...]:
    """The weight's ``[out, in]`` shape (FP4 stores two inputs per byte)."""
    return (s.shape[0], 2 * s.shape[1]) if kind == "fp4" else s.shape


def pair_scales(stored: dict[str, Stored], quant: QuantConfig) -> tuple[dict[str, Quantized], list[str]]:
    """``weight name -> Quantized`` for every weight with a scale, and the problems found (one line each)."""
    pairs: dict[str, Quantized] = {}
    problems: list[str] = []
    for name, s in stored.items():
        if not name.endswith(".weight"):
            orphan = any(name.endswith(x) for x in SCALE_SUFFIXES) and not is_scale(name, stored)
            if orphan and canonical_name(name) is None:
                problems.append(f"orphan scale {name!r} ({s.file.name}): no {name.rsplit('.', 1)[0]}.weight")
            continue
        base = name[: -len(".weight")]
        scales = [base + x for x in SCALE_SUFFIXES if base + x in stored]
        quantized_dtype = s.dtype == torch.float8_e4m3fn or s.dtype in FP4_STORAGE
        if not scales:
            if quantized_dtype:
                problems.append(
                    f"missing scale: {name!r} ({s.file.name}) is {s.dtype} but neither {base}.scale nor "
                    f"{base}.weight_scale_inv is stored"
                )
            continue
        if len(scales) > 1:
            problems.append(f"{name!r} has two scales {scales}; keep one")
            continue
        off = canonical_name(name) or name
        kind = "fp8" if s.dtype == torch.float8_e4m3fn else "fp4" if s.dtype in FP4_STORAGE else None
        sc = stored[scales[0]]
        if kind is None:
            problems.append(
                f"unexpected dtype: {name!r} has a scale but is {s.dtype} (FP8 e4m3 or packed FP4)"
            )
            continue
        if kind == "fp4" and (quant.expert_dtype != "fp4" or ".experts." not in off):
            problems.append(
                f"unexpected dtype: {name!r} is packed FP4; only routed experts are FP4 (expert_dtype fp4)"
            )
            continue
        if len(s.shape) != 2:
            problems.append(f"misshapen: quantized {name!r} has shape {list(s.shape)}, expected [out, in]")
            continue
        want = (
            fp8_scale_shape(s.shape, quant.fp8_block)
            if kind == "fp8"
            else fp4_scale_shape(s.shape, quant.fp4_block)
        )
        if tuple(sc.shape) != want:
            problems.append(
                f"misshapen: scale {scales[0]!r} is {list(sc.shape)}, {name!r} {list(s.shape)} needs {list(want)}"
            )
        if sc.dtype not in SCALE_STORAGE[quant.scale_fmt]:
            problems.append(
                f"unexpected dtype: scale {scales[0]!r} is {sc.dtype}, scale_fmt {quant.scale_fmt!r} stores "
                f"{[str(d) for d in SCALE_STORAGE[quant.scale_fmt]]}"
            )
        pairs[name] = Quantized(scales[0], kind)
    return pairs, problems


def expected_shapes(model_config) -> dict[str, tuple[int, ...]]:
    """Official name -> shape of every tensor a model of ``model_config`` loads (built on the meta device)."""
    ensure_single_stage_parallel_state()
    with torch.device("meta"):
        model = build_model(model_config, perform_initialization=False)
    return official_shapes(model_config, model.state_dict())


def _listing(title: str, lines: list[str]) -> str:
    more = f"\n  ... and {len(lines) - _MAX_LISTED} more" if len(lines) > _MAX_LISTED else ""
    return f"{title}:\n  " + "\n  ".join(lines[:_MAX_LISTED]) + more


def check_inventory(path: str | Path, *, mtp: bool | None = None):
    """Validate a (released or plain) checkpoint directory against its ``config.json`` before any work.

    Returns ``(model config, quant config or None, stored tensors, scale pairs, official -> stored name)``.
    Raises one ``ValueError`` listing every problem (one line each) if there is any.
    """
    config = read_config(path)
    quant = quant_config_of(config, where=f"{Path(path) / 'config.json'}")
    stored, _ = scan(path)
    pairs, problems = pair_scales(stored, quant or QuantConfig())
    if quant is None and pairs:
        problems.insert(0, f"{len(pairs)} weight(s) carry scales but config.json has no quantization_config")
    scales = {p.scale for p in pairs.values()}
    official: dict[str, str] = {}
    for name in stored:
        if name in scales:
            continue
        off = canonical_name(name)
        if off is None:
            problems.append(f"extra: {name!r} ({stored[name].file.name}) is not a DeepSeek-V4 model tensor")
        elif off.endswith((FUSED_GATE_UP, FUSED_DOWN)):
            problems.append(
                f"{name!r}: fused expert tensors are read by read_official_checkpoint, not streamed"
            )
        elif off in official:
            problems.append(f"{name!r} and {official[off]!r} are the same tensor {off!r} under two spellings")
        else:
            official[off] = name
    has_mtp = any(k.startswith("mtp.") for k in official)
    wants = int(config.get("num_nextn_predict_layers", config.get("n_mtp_layers", 1)) or 0) > 0
    with_mtp = (has_mtp and wants) if mtp is None else bool(mtp)
    if mtp and not (has_mtp and wants):
        problems.append(
            f"mtp requested but the checkpoint has {'no mtp.* tensors' if not has_mtp else 'num_nextn_predict_layers=0'}"
        )
    if not with_mtp:
        official = {k: v for k, v in official.items() if not k.startswith("mtp.")}
    cfg = model_config_from_hf(
        {k: v for k, v in config.items() if k != "quantization_config"},
        with_mtp=with_mtp,
        name=Path(path).name,
    )
    want = expected_shapes(cfg)
    for off in sorted(set(want) - set(official)):
        problems.append(f"missing: {off!r} {list(want[off])}")
    for off in sorted(set(official) - set(want)):
        problems.append(
            f"extra: {official[off]!r} has no place in this model configuration (config.json and weights disagree?)"
        )
    for off in sorted(set(official) & set(want)):
        name = official[off]
        s = stored[name]
        kind = pairs[name].kind if name in pairs else None
        if logical_shape(s, kind) != want[off]:
            problems.append(
                f"misshapen: {name!r} is {list(logical_shape(s, kind))}, the model expects {list(want[off])}"
            )
        if kind is None and off.endswith("tid2eid") and s.dtype not in _INTS:
            problems.append(f"unexpected dtype: hash table {name!r} is {s.dtype}, expected int64/int32")
        elif kind is None and not off.endswith("tid2eid") and s.dtype not in _FLOATS:
            problems.append(
                f"unexpected dtype: {name!r} is {s.dtype}, expected a float dtype (or a quantized weight with its scale)"
            )
    if problems:
        raise ValueError(
            _listing(
                f"{path}: the checkpoint does not match its config.json ({len(problems)} problem(s))",
                problems,
            )
        )
    return cfg, quant, stored, pairs, official


def dequantize_stored(
    files: dict[Path, SafetensorsFile],
    stored: dict[str, Stored],
    name: str,
    pair: Quantized | None,
    quant: QuantConfig | None,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    backend: str = "auto",
) -> torch.Tensor:
    """Stored tensor ``name``: dequantized to ``dtype`` when it has a scale, else as stored."""
    t = files[stored[name].file].read(name)
    if pair is None:
        return t
    s = files[stored[pair.scale].file].read(pair.scale).to(device)
    t = t.to(device)
    if pair.kind == "fp8":
        return dequantize_fp8(t, s, quant.fp8_block, dtype, backend=backend)
    return dequantize_fp4(t, s, quant.fp4_block, dtype, backend=backend)


def read_released(path: str | Path, *, mtp: bool | None = None, dtype: torch.dtype = torch.float32):
    """``(model config, official tensors)`` of a checkpoint directory, quantized weights dequantized to ``dtype``
    one at a time (on the GPU when there is one); the inventory is checked first."""
    cfg, quant, stored, pairs, official = check_inventory(path, mtp=mtp)
    files = {f: SafetensorsFile(f) for f in {s.file for s in stored.values()}}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {
        off: dequantize_stored(files, stored, name, pairs.get(name), quant, dtype, device).cpu()
        for off, name in official.items()
    }
    return cfg, out
