"""``load_hf_checkpoint``: a Hugging Face / official DeepSeek-V4 checkpoint directory -> :class:`DSv4Model` (fp32,
eval), and the indexer tie rule for logit parity with transformers on CPU (spec §4.2 rule 1, oracle I6).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from dsv4_attention import LightningIndexer
from hybrid_model.hf.config_map import model_config_from_hf
from hybrid_model.hf.config_types import check_hf_config_types
from hybrid_model.hf.io import read_config, read_tensors
from hybrid_model.hf.released import read_released
from hybrid_model.hf.runtime import ensure_single_stage_parallel_state
from hybrid_model.hf.weights import canonicalize, load_official_state_dict
from hybrid_model.model import build_model


def read_official_checkpoint(path: str | Path, *, mtp: bool | None = None):
    """``(DSv4ModelConfig, official tensors)`` of a checkpoint directory.

    A released quantized checkpoint (``quantization_config``) is checked (:func:`~hybrid_model.hf.released.
    check_inventory`) and its FP8 / FP4 weights dequantized to fp32 (:func:`~hybrid_model.hf.released.read_released`).
    ``mtp``: ``None`` builds the MTP module iff the checkpoint holds ``mtp.*`` tensors (and ``config.json`` asks for
    one; transformers' ``save_pretrained`` never writes them), ``True`` requires them, ``False`` drops them.
    """
    config = read_config(path)
    source = str(Path(path) / "config.json")
    check_hf_config_types(config, source)  # before any value is used
    if config.get("quantization_config") is not None:  # the released FP8 / FP4 format: dequantized to fp32
        return read_released(path, mtp=mtp)
    official, unknown = canonicalize(read_tensors(path))
    if unknown:
        hint = (
            " (FP8/FP4 scale tensors, but config.json has no quantization_config: restore the released config.json "
            "or dequantize the checkpoint)"
            if any(u.endswith("scale") for u in unknown)
            else ""
        )
        raise ValueError(
            f"{path}: {len(unknown)} tensor(s) are not DeepSeek-V4 model tensors, e.g. {unknown[:6]}{hint}"
        )
    has_mtp = any(k.startswith("mtp.") for k in official)
    wants = int(config.get("num_nextn_predict_layers", config.get("n_mtp_layers", 1)) or 0) > 0
    if mtp is True and not (has_mtp and wants):
        raise ValueError(
            f"{path}: mtp=True but the checkpoint has {'no mtp.* tensors' if not has_mtp else 'num_nextn_predict_layers=0'}"
        )
    with_mtp = has_mtp and wants if mtp is None else bool(mtp)
    if not with_mtp:
        official = {k: v for k, v in official.items() if not k.startswith("mtp.")}
    return model_config_from_hf(config, with_mtp=with_mtp, name=Path(path).name, source=source), official


def build_empty_model(model_config, device: str | torch.device = "cpu"):
    """A :class:`DSv4Model` of ``model_config`` without weight initialisation (fp32, single stage)."""

    ensure_single_stage_parallel_state()
    model = build_model(model_config, perform_initialization=False)
    return model.to(device=device, dtype=torch.float32)


def load_hf_checkpoint(path: str | Path, device: str | torch.device = "cpu", *, mtp: bool | None = None):
    """Build our :class:`~hybrid_model.model.DSv4Model` from a DeepSeek-V4 checkpoint directory.

    Args:
        path: directory with ``config.json`` (transformers, released or official spelling) and safetensors
            (HF ``save_pretrained`` names, HF module names or official names; see :mod:`hybrid_model.hf.names`).
        device: where the returned model lives.
        mtp: MTP module policy (:func:`read_official_checkpoint`).
    Returns:
        the model, fp32, in eval mode; ``model.compute_logits(input_ids [B, T]) -> [B, T, V]``.
    Raises:
        ValueError: unsupported config fields, missing/extra/misshapen tensors, quantized weights, invalid hash
            tables.

    Creates a single-process megatron parallel state if none exists (:mod:`hybrid_model.hf.runtime`).
    """
    cfg, official = read_official_checkpoint(path, mtp=mtp)
    model = build_empty_model(cfg, device)
    load_official_state_dict(model, official)
    return model.eval()


@contextlib.contextmanager
def hf_cpu_topk_ties(model) -> Iterator[None]:
    """Inside the block, every CSA lightning indexer of ``model`` picks its top-k with CPU ``torch.topk`` over each
    query's full masked row (the indexer option ``tie_break="torch_topk"``, csa-kernels
    ``indexer_topk_ref(tie_break="torch_topk")``), which is how transformers (and the official code) break exact
    score ties on CPU. Use it only to reproduce logits computed by transformers on CPU (spec §4.2 rule 1);
    everywhere else ties go to the lower entry index (rule 2). Each indexer's previous rule is restored on exit."""

    indexers = [m for m in model.modules() if isinstance(m, LightningIndexer)]
    previous = [ix.cfg.tie_break for ix in indexers]
    for ix in indexers:
        ix.set_tie_break("torch_topk")
    try:
        yield
    finally:
        for ix, rule in zip(indexers, previous):
            ix.set_tie_break(rule)
