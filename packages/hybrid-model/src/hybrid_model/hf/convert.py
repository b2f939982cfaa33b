"""``dsv4 convert``: HF / official DeepSeek-V4 checkpoint directory <-> megatron dist checkpoint of our model.

HF -> megatron: ``read_official_checkpoint`` -> :class:`DSv4Model` -> ``dist_checkpointing.save({"model":
model.sharded_state_dict()})`` (the ``"model"`` entry of ``dsv4 train`` checkpoints) + ``dsv4_model_config.json``
(the :class:`DSv4ModelConfig` and the source's token ids).

megatron -> HF: ``dist_checkpointing.load`` of the ``"model"`` entry (a ``convert`` output, or a ``dsv4 train``
checkpoint / run directory with an explicit model config) -> official names -> the names transformers'
``save_pretrained`` writes + a transformers 5.x ``config.json`` (``DeepseekV4ForCausalLM.from_pretrained`` loads it;
``mtp.*`` tensors are kept, transformers ignores them).

Output safety: the output directory must be new or empty unless ``overwrite=True`` (``dsv4 convert --overwrite``),
which replaces it as a whole. The source is read and converted completely before anything is written, the output
is written to a temporary directory beside ``out_dir`` and renamed into place at the end: an error or an interrupted
run never leaves a half-written or mixed output directory (a leftover ``.NAME.partial-*`` directory of a killed run
may be deleted).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async
from torch.distributed.checkpoint.api import CheckpointException

from dsv4_primitives.megatron import cuda_as_cpu
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.dist_load import load_across_tp
from hybrid_model.hf.config_map import hf_config_from_model_config
from hybrid_model.hf.io import read_config, write_checkpoint
from hybrid_model.hf.loader import build_empty_model, read_official_checkpoint
from hybrid_model.hf.megatron_layout import TargetLayout
from hybrid_model.hf.names import FUSED_DOWN, FUSED_GATE_UP, canonical_name, hf_saved_name
from hybrid_model.hf.released import scan
from hybrid_model.hf.stream import StreamReport
from hybrid_model.hf.stream_megatron import MODEL_CONFIG_FILE, stream_to_megatron
from hybrid_model.hf.weights import load_official_state_dict, official_state_dict

#: non-architecture ``config.json`` keys carried from the source to the exported config
_CARRIED = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "use_cache",
    "output_router_logits",
    "router_aux_loss_coef",
    "router_jitter_noise",
)


def _dist_ckpt_context():
    """megatron's checkpoint writer synchronises CUDA streams; on CPU that is redirected (a no-op with CUDA)."""

    return cuda_as_cpu()


def check_output_dir(
    out_dir: str | Path, *, overwrite: bool = False, source: str | Path | None = None
) -> Path:
    """``out_dir`` as a ``Path`` if a conversion may write it: new, an empty directory, or (``overwrite``) a
    directory to replace; never the source, a directory inside it or one that holds it."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory; choose a directory path")
    if source is not None:
        src, dst = Path(source).resolve(), out.resolve()
        if src == dst or src.is_relative_to(dst) or dst.is_relative_to(src):
            raise ValueError(
                f"output directory {out} and source {source} overlap; write the conversion to a separate directory"
            )
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        held = sorted(q.name for q in out.iterdir())
        raise ValueError(
            f"output directory {out} is not empty (holds {held[:4]}); choose a new or empty directory, or pass "
            "--overwrite (overwrite=True) to replace it"
        )
    return out


@contextlib.contextmanager
def staged_output_dir(out_dir: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a new empty directory beside ``out_dir``; when the block succeeds it becomes ``out_dir`` (an existing
    ``out_dir`` is replaced only with ``overwrite``), when it raises it is deleted and ``out_dir`` is untouched."""
    out = check_output_dir(out_dir, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the output gets the usual permissions
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.rename(old / out.name)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)


def save_megatron_checkpoint(
    model, out_dir: str | Path, *, extra: dict | None = None, common: dict | None = None
) -> Path:
    """Save ``model`` as a megatron dist checkpoint ``{"model": sharded_state_dict}`` in the empty or new
    directory ``out_dir``, plus ``dsv4_model_config.json``."""

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; choose a new output directory")
    out.mkdir(parents=True, exist_ok=True)
    if getattr(filesystem_async, "_results_queue", None) is None:  # a synchronous single-process save
        filesystem_async._results_queue = queue.Queue()
    with _dist_ckpt_context():
        dist_checkpointing.save({"model": model.sharded_state_dict(), **(common or {})}, str(out))
    meta = {"model_config": model.model_config.to_dict(), **(extra or {})}
    (out / MODEL_CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def hf_config_extra(src_config: dict, cfg: DSv4ModelConfig) -> dict:
    """The non-architecture ``config.json`` entries a megatron checkpoint carries for the export back to HF."""
    carried = {k: src_config[k] for k in _CARRIED if k in src_config}
    if not cfg.num_nextn_predict_layers and src_config.get("num_nextn_predict_layers"):
        carried["num_nextn_predict_layers"] = src_config[
            "num_nextn_predict_layers"
        ]  # the source model has MTP
    return carried


def has_fused_experts(hf_dir: str | Path) -> bool:
    """Whether the checkpoint stores routed experts fused (``mlp.experts.gate_up_proj``, HF module names)."""
    stored, _ = scan(hf_dir)
    return any((canonical_name(n) or "").endswith((FUSED_GATE_UP, FUSED_DOWN)) for n in stored)


def convert_hf_to_megatron(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    mtp: bool | None = None,
    overwrite: bool = False,
    layout: TargetLayout | None = None,
    workers: int = 1,
    common: dict | None = None,
    finalize=None,
    progress=None,
) -> StreamReport | None:
    """HF / official / released checkpoint directory -> megatron dist checkpoint of :class:`DSv4Model` in
    ``out_dir`` (new or empty, or replaced with ``overwrite``; written whole or not at all), streamed into the
    files of ``layout`` (:func:`~hybrid_model.hf.stream_megatron.stream_to_megatron`: bounded memory, resumable,
    ``common`` / ``finalize`` / ``progress`` as there); returns its report.

    Checkpoints with fused expert tensors (HF module names, ``mlp.experts.gate_up_proj``) cannot be streamed per
    expert: they are read whole into one process (layout PP = VPP = EP = 1 only; returns ``None``)."""
    layout = layout or TargetLayout()
    src = read_config(hf_dir)
    if not has_fused_experts(hf_dir):
        return stream_to_megatron(
            hf_dir,
            out_dir,
            layout,
            mtp=mtp,
            common=common,
            extra_config=lambda cfg: {"hf_config_extra": hf_config_extra(src, cfg)},
            workers=workers,
            overwrite=overwrite,
            finalize=finalize,
            progress=progress,
        )
    if layout != TargetLayout():
        raise ValueError(
            f"{hf_dir} stores routed experts fused (mlp.experts.gate_up_proj): it is converted in one process, "
            "into the one-rank layout only; convert without --tp/--pp/--vpp/--ep (dsv4 train --init-from reshards it)"
        )
    out = check_output_dir(out_dir, overwrite=overwrite, source=hf_dir)
    cfg, official = read_official_checkpoint(hf_dir, mtp=mtp)
    model = build_empty_model(cfg, "cpu")
    load_official_state_dict(model, official)
    with staged_output_dir(out, overwrite=overwrite) as tmp:
        save_megatron_checkpoint(
            model, tmp, extra={"hf_config_extra": hf_config_extra(src, cfg)}, common=common
        )
        if finalize is not None:
            finalize(tmp)
    return None


def _resolve_checkpoint_dir(path: Path) -> Path:
    """A run directory / its ``checkpoints/`` folder -> the checkpoint named by ``latest``."""
    for base in (path, path / "checkpoints"):
        latest = base / "latest"
        if latest.is_file():
            return base / latest.read_text().strip()
    return path


#: the longest load-error description kept in a message (a mismatch lists every key of the model)
MAX_ERROR_CHARS = 400


def describe_load_error(err: BaseException) -> str:
    """A one-line description of a load error (torch's ``CheckpointException`` wraps each rank's exception with its
    whole traceback: name the wrapped exceptions instead), at most :data:`MAX_ERROR_CHARS` characters."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        text = "; ".join(f"{type(x).__name__}: {x}".rstrip(": ") for x in inner)
    else:
        text = f"{type(err).__name__}: {err}".rstrip(": ")
    text = " ".join(text.split())  # one line
    if len(text) > MAX_ERROR_CHARS:
        text = f"{text[:MAX_ERROR_CHARS]}... ({len(text) - MAX_ERROR_CHARS:,} more characters)"
    return text


def load_megatron_checkpoint(
    ckpt_dir: str | Path, device: str | torch.device = "cpu", *, model_config: DSv4ModelConfig | None = None
):
    """Our model from a megatron dist checkpoint (``convert`` output, or a ``dsv4 train`` checkpoint / run directory
    when ``model_config`` is given); fp32, eval mode, single stage."""

    path = _resolve_checkpoint_dir(Path(ckpt_dir))
    if not (path / "metadata.json").is_file():
        raise ValueError(f"{path} is not a megatron dist checkpoint (no metadata.json)")
    meta_file = path / MODEL_CONFIG_FILE
    meta = {}
    if meta_file.is_file():
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(
                f"{meta_file} is unreadable or not valid JSON ({e}); restore it from the conversion that wrote it, or "
                "delete it and pass the model configuration (dsv4 convert --preset NAME)"
            ) from e
        if not isinstance(meta, dict):
            raise ValueError(f"{meta_file} must hold a JSON object; delete it and pass --preset NAME")
    if model_config is None:
        if "model_config" not in meta:
            raise ValueError(
                f"{path} has no {MODEL_CONFIG_FILE}: pass the model configuration (dsv4 convert --preset NAME)"
            )
        model_config = DSv4ModelConfig.from_dict(meta["model_config"])
    if model_config.hybrid_layer_pattern is not None:  # one stage: the same layers without the '|' cuts
        model_config = model_config.replace(
            pipeline_stages=1, hybrid_layer_pattern=model_config.hybrid_layer_pattern.replace("|", "")
        )
    elif model_config.pipeline_stages != 1:
        model_config = model_config.replace(pipeline_stages=1)

    model = build_empty_model(model_config, "cpu")
    try:
        with _dist_ckpt_context():
            state = load_across_tp({"model": model.sharded_state_dict()}, str(path))
    except (
        Exception,
        CheckpointException,
    ) as e:  # many types for bad files; CheckpointException is a BaseException
        raise ValueError(
            f"{path}: cannot load the megatron dist checkpoint ({describe_load_error(e)}); its files are incomplete or corrupt, "
            "or it holds another model (pass the --preset it was trained with)"
        ) from e
    model.load_state_dict(state["model"])
    model.hf_config_extra = meta.get("hf_config_extra", {})
    return model.to(device).eval()


def export_hf_checkpoint(
    model, out_dir: str | Path, *, max_shard_bytes: int = 5 * 1024**3, overwrite: bool = False
) -> list[Path]:
    """Write ``model`` as a transformers-loadable DeepSeek-V4 checkpoint directory (``save_pretrained`` names);
    ``out_dir`` new or empty (or replaced with ``overwrite``), written whole or not at all."""
    out = check_output_dir(out_dir, overwrite=overwrite)
    tensors = {hf_saved_name(k): v for k, v in official_state_dict(model).items()}
    config = hf_config_from_model_config(model.model_config, **getattr(model, "hf_config_extra", {}))
    with staged_output_dir(out, overwrite=overwrite) as tmp:
        files = write_checkpoint(tmp, tensors, config, max_shard_bytes=max_shard_bytes)
    return [out / f.name for f in files]


def convert_megatron_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    model_config: DSv4ModelConfig | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    overwrite: bool = False,
) -> list[Path]:
    """Megatron dist checkpoint of our model -> HF checkpoint directory ``out_dir`` (returns the weight files);
    ``out_dir`` new or empty (or replaced with ``overwrite``), written whole or not at all."""
    check_output_dir(out_dir, overwrite=overwrite, source=ckpt_dir)
    model = load_megatron_checkpoint(ckpt_dir, model_config=model_config)
    return export_hf_checkpoint(model, out_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite)
