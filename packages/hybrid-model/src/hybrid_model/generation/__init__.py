"""Cached generation from a DSv4 model (issue 37): exact prefill + decode over per-layer caches, plain PyTorch.

- :func:`generate`: ``generate(model, prompt_ids, max_new_tokens, temperature=0.0, top_p=1.0, seed=None, *,
  eos_token_id=None, on_token=None) -> list[list[int]]`` (the generated tokens of each prompt).
- :class:`CachedDecoder`: the step API under it (``extend(tokens per sequence) -> logits of the new rows``), for
  teacher forcing, scoring or custom loops.
- :class:`StaticDecodeStep`: a lockstep decode step on static shapes (device-side lengths), optionally captured in a
  CUDA graph (``generate(decode="static" | "graph")``).
- ``generate(..., speculative="mtp", stats=SpeculationStats())``: MTP speculative decoding
  (:mod:`~hybrid_model.generation.speculative`; :class:`MTPDrafter` drafts, the main model verifies, exact rollback);
  :class:`StaticSpeculativeStep`: its static-shape step (acceptance and rollback on the device, CUDA-graph
  capturable; ``generate(speculative="mtp", decode="static" | "graph")``).
- :class:`SamplingConfig`, :func:`next_tokens`: greedy / temperature / top-p choice.
- :func:`check_generation_support`: what is supported (DSv4 ``W``/``C``/``H`` attention and ``E`` MoE on one
  process; megatron's own symbols are refused); :func:`generation_cache_bytes`: the caches' size.
"""

from __future__ import annotations

from hybrid_model.generation.cache_size import generation_cache_bytes
from hybrid_model.generation.decoder import CachedDecoder
from hybrid_model.generation.generate import DECODE_MODES, generate
from hybrid_model.generation.mtp_draft import MTPDrafter
from hybrid_model.generation.sampling import SamplingConfig, next_tokens
from hybrid_model.generation.speculative import SPECULATIVE_MODES, SpeculationStats
from hybrid_model.generation.static_speculative import StaticSpeculativeStep
from hybrid_model.generation.static_step import StaticDecodeStep
from hybrid_model.generation.support import SUPPORTED_SYMBOLS, check_generation_support

__all__ = [
    "DECODE_MODES",
    "SPECULATIVE_MODES",
    "SUPPORTED_SYMBOLS",
    "CachedDecoder",
    "MTPDrafter",
    "SamplingConfig",
    "SpeculationStats",
    "StaticDecodeStep",
    "StaticSpeculativeStep",
    "check_generation_support",
    "generate",
    "generation_cache_bytes",
    "next_tokens",
]
