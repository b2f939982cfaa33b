"""``dsv4 convert``: HF / official DeepSeek-V4 checkpoint directory <-> megatron dist checkpoint of our model.

HF -> megatron: ``read_official_checkpoint`` -> :class:`DSv4Model` -> ``dist_checkpointing.save({"model":
model.sharded_state_dict()})`` (the ``"model"`` entry of ``dsv4 train`` checkpoints) + ``dsv4_model_config.json``
(the :class:`DSv4ModelConfig` and the source's token ids).

megatron -> HF: ``dist_checkpointing.load`` of the ``"model"`` entry (a ``convert`` output, or a ``dsv4 train``
checkpoint / run directory with an explicit model config) -> official names -> the names transformers'
``save_pretrained`` writes + a transformers 5.x ``config.json`` (``DeepseekV4ForCausalLM.from_pretrained`` loads it;
``mtp.*`` tensors are kept, transformers ignores them).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybrid_model.config import DSv4ModelConfig
from hybrid_model.hf.config_map import hf_config_from_model_config
from hybrid_model.hf.io import read_config, write_checkpoint
from hybrid_model.hf.loader import build_empty_model, read_official_checkpoint
from hybrid_model.hf.names import hf_saved_name
from hybrid_model.hf.weights import load_official_state_dict, official_state_dict

MODEL_CONFIG_FILE = "dsv4_model_config.json"
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
    from dsv4_primitives.megatron import cuda_as_cpu

    return cuda_as_cpu()


def save_megatron_checkpoint(model, out_dir: str | Path, *, extra: dict | None = None) -> Path:
    """Save ``model`` as a megatron dist checkpoint ``{"model": sharded_state_dict}`` in the empty or new
    directory ``out_dir``, plus ``dsv4_model_config.json``."""
    import queue

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; choose a new output directory")
    out.mkdir(parents=True, exist_ok=True)
    if getattr(filesystem_async, "_results_queue", None) is None:  # a synchronous single-process save
        filesystem_async._results_queue = queue.Queue()
    with _dist_ckpt_context():
        dist_checkpointing.save({"model": model.sharded_state_dict()}, str(out))
    meta = {"model_config": model.model_config.to_dict(), **(extra or {})}
    (out / MODEL_CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def convert_hf_to_megatron(hf_dir: str | Path, out_dir: str | Path, *, mtp: bool | None = None) -> Path:
    """HF / official checkpoint directory -> megatron dist checkpoint of :class:`DSv4Model` in ``out_dir``."""
    cfg, official = read_official_checkpoint(hf_dir, mtp=mtp)
    model = build_empty_model(cfg, "cpu")
    load_official_state_dict(model, official)
    src = read_config(hf_dir)
    carried = {k: src[k] for k in _CARRIED if k in src}
    if not cfg.num_nextn_predict_layers and src.get("num_nextn_predict_layers"):
        carried["num_nextn_predict_layers"] = src["num_nextn_predict_layers"]  # the source model has MTP
    return save_megatron_checkpoint(model, out_dir, extra={"hf_config_extra": carried})


def _resolve_checkpoint_dir(path: Path) -> Path:
    """A run directory / its ``checkpoints/`` folder -> the checkpoint named by ``latest``."""
    for base in (path, path / "checkpoints"):
        latest = base / "latest"
        if latest.is_file():
            return base / latest.read_text().strip()
    return path


def load_megatron_checkpoint(
    ckpt_dir: str | Path, device: str | torch.device = "cpu", *, model_config: DSv4ModelConfig | None = None
):
    """Our model from a megatron dist checkpoint (``convert`` output, or a ``dsv4 train`` checkpoint / run directory
    when ``model_config`` is given); fp32, eval mode, single stage."""
    from megatron.core import dist_checkpointing

    path = _resolve_checkpoint_dir(Path(ckpt_dir))
    if not (path / "metadata.json").is_file():
        raise ValueError(f"{path} is not a megatron dist checkpoint (no metadata.json)")
    meta_file = path / MODEL_CONFIG_FILE
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    if model_config is None:
        if "model_config" not in meta:
            raise ValueError(
                f"{path} has no {MODEL_CONFIG_FILE}: pass the model configuration (dsv4 convert --preset NAME)"
            )
        model_config = DSv4ModelConfig.from_dict(meta["model_config"])
    if model_config.pipeline_stages != 1 or model_config.hybrid_layer_pattern is not None:
        model_config = model_config.replace(pipeline_stages=1, hybrid_layer_pattern=None)
    model = build_empty_model(model_config, "cpu")
    with _dist_ckpt_context():
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(path))
    model.load_state_dict(state["model"])
    model.hf_config_extra = meta.get("hf_config_extra", {})
    return model.to(device).eval()


def export_hf_checkpoint(model, out_dir: str | Path, *, max_shard_bytes: int = 5 * 1024**3) -> list[Path]:
    """Write ``model`` as a transformers-loadable DeepSeek-V4 checkpoint directory (``save_pretrained`` names)."""
    tensors = {hf_saved_name(k): v for k, v in official_state_dict(model).items()}
    config = hf_config_from_model_config(model.model_config, **getattr(model, "hf_config_extra", {}))
    return write_checkpoint(out_dir, tensors, config, max_shard_bytes=max_shard_bytes)


def convert_megatron_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    model_config: DSv4ModelConfig | None = None,
    max_shard_bytes: int = 5 * 1024**3,
) -> list[Path]:
    """Megatron dist checkpoint of our model -> HF checkpoint directory ``out_dir`` (returns the weight files)."""
    model = load_megatron_checkpoint(ckpt_dir, model_config=model_config)
    return export_hf_checkpoint(model, out_dir, max_shard_bytes=max_shard_bytes)
