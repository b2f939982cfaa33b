"""A tiny released-format DeepSeek-V4 checkpoint (FP8 block scales with partial edge blocks, FP4 experts, MTP,
hash tables) built from a random ``tiny``-preset model with MTP, for the released-format tests."""

from __future__ import annotations

import torch

from dsv4_testkit.megatron_cpu import megatron_cpu_context
from hybrid_model.hf.config_map import hf_config_from_model_config
from hybrid_model.hf.io import write_checkpoint
from hybrid_model.hf.quant import QuantConfig
from hybrid_model.hf.stream import quantize_checkpoint
from hybrid_model.hf.weights import official_state_dict
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset

#: FP8 blocks that leave partial edge blocks on every tiny weight; FP4 groups of 32 (partial at F = 16)
QUANT = QuantConfig(fp8_block=(16, 24), fp4_block=32, scale_fmt="ue8m0", expert_dtype="fp4")


def tiny_model_config():
    """The ``tiny`` preset (every structural feature, one MTP depth)."""
    return get_preset("tiny")


def write_plain_and_released(root, *, max_shard_bytes: int = 40_000):
    """``(plain dir, released dir)``: the model's official fp32 tensors, and the same quantized (several shards)."""
    torch.manual_seed(0)
    cfg = tiny_model_config()
    with megatron_cpu_context():
        model = build_model(cfg)
    tensors = official_state_dict(model)
    config = hf_config_from_model_config(cfg)
    plain = root / "plain"
    write_checkpoint(plain, tensors, config, max_shard_bytes=max_shard_bytes)
    released = root / "released"
    with megatron_cpu_context():  # the inventory check builds the model on the meta device
        quantize_checkpoint(plain, released, quant=QUANT, max_shard_bytes=max_shard_bytes)
    return plain, released
