"""Hugging Face / official DeepSeek-V4 checkpoint interop (spec §9.1, §9.2, §10 P1).

``load_hf_checkpoint(path, device="cpu")`` builds our :class:`~hybrid_model.model.DSv4Model` from a checkpoint
directory; ``convert_hf_to_megatron`` / ``convert_megatron_to_hf`` back ``dsv4 convert``.
"""

from hybrid_model.hf.config_map import hf_config_from_model_config, model_config_from_hf
from hybrid_model.hf.convert import convert_hf_to_megatron, convert_megatron_to_hf, load_megatron_checkpoint
from hybrid_model.hf.loader import hf_cpu_topk_ties, load_hf_checkpoint, read_official_checkpoint
from hybrid_model.hf.names import canonical_name, hf_saved_name
from hybrid_model.hf.weights import canonicalize, load_official_state_dict, official_state_dict

__all__ = [
    "canonical_name",
    "canonicalize",
    "convert_hf_to_megatron",
    "convert_megatron_to_hf",
    "hf_config_from_model_config",
    "hf_cpu_topk_ties",
    "hf_saved_name",
    "load_hf_checkpoint",
    "load_megatron_checkpoint",
    "load_official_state_dict",
    "model_config_from_hf",
    "official_state_dict",
    "read_official_checkpoint",
]
