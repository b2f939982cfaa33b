"""Checkpoint tensor names: the three spellings of a DeepSeek-V4 checkpoint and the official one we normalise to.

Spec §9.2 / §11 item 19. A tensor may be named

* officially (DeepSeek inference code): ``embed.weight``, ``layers.{i}.attn.wq_a.weight``,
  ``layers.{i}.attn.kv_norm.weight``, ``layers.{i}.ffn.experts.{e}.w1.weight``, ``hc_head_fn``, ``head.weight``,
  ``mtp.{j}.e_proj.weight``, ...;
* as HF ``save_pretrained`` writes it (transformers 5.x): ``model.`` + the official name, except
  ``model.embed_tokens.weight``, ``model.norm.weight``, ``model.hc_head.hc_fn/hc_base/hc_scale``, ``head.weight``,
  and ``model.layers.{i}.attn.norm.weight`` for the official ``attn.kv_norm.weight``;
* by HF module path (``model.state_dict()``): ``model.layers.{i}.self_attn.q_a_proj.weight``,
  ``model.layers.{i}.mlp.experts.gate_up_proj`` (fused ``[E, 2F, d]``), ``lm_head.weight``, ...

:func:`canonical_name` maps any of them to the official name (fused expert tensors to a marker handled by the
weight mapper); :func:`hf_saved_name` maps an official name to what ``save_pretrained`` writes (what transformers
loads back).
"""

from __future__ import annotations

import re

#: official suffix (inside ``layers.{i}.`` / ``mtp.{j}.``) <- the other spellings of it
_LAYER_ALIASES: dict[str, tuple[str, ...]] = {
    "attn_norm.weight": ("input_layernorm.weight",),
    "ffn_norm.weight": ("post_attention_layernorm.weight",),
    "hc_attn_fn": ("attn_hc.fn",),
    "hc_attn_base": ("attn_hc.base",),
    "hc_attn_scale": ("attn_hc.scale",),
    "hc_ffn_fn": ("ffn_hc.fn",),
    "hc_ffn_base": ("ffn_hc.base",),
    "hc_ffn_scale": ("ffn_hc.scale",),
    "attn.wq_a.weight": ("self_attn.q_a_proj.weight",),
    "attn.q_norm.weight": ("self_attn.q_a_norm.weight",),
    "attn.wq_b.weight": ("self_attn.q_b_proj.weight",),
    "attn.wkv.weight": ("self_attn.kv_proj.weight",),
    "attn.kv_norm.weight": ("self_attn.kv_norm.weight", "attn.norm.weight"),
    "attn.wo_a.weight": ("self_attn.o_a_proj.weight",),
    "attn.wo_b.weight": ("self_attn.o_b_proj.weight",),
    "attn.attn_sink": ("self_attn.sinks",),
    "attn.compressor.wkv.weight": ("self_attn.compressor.kv_proj.weight",),
    "attn.compressor.wgate.weight": ("self_attn.compressor.gate_proj.weight",),
    "attn.compressor.ape": ("self_attn.compressor.position_bias",),
    "attn.compressor.norm.weight": ("self_attn.compressor.kv_norm.weight",),
    "attn.indexer.wq_b.weight": ("self_attn.compressor.indexer.q_b_proj.weight",),
    "attn.indexer.weights_proj.weight": ("self_attn.compressor.indexer.scorer.weights_proj.weight",),
    "attn.indexer.compressor.wkv.weight": ("self_attn.compressor.indexer.kv_proj.weight",),
    "attn.indexer.compressor.wgate.weight": ("self_attn.compressor.indexer.gate_proj.weight",),
    "attn.indexer.compressor.ape": ("self_attn.compressor.indexer.position_bias",),
    "attn.indexer.compressor.norm.weight": ("self_attn.compressor.indexer.kv_norm.weight",),
    "ffn.gate.weight": ("mlp.gate.weight",),
    "ffn.gate.bias": ("mlp.gate.e_score_correction_bias", "ffn.gate.e_score_correction_bias"),
    "ffn.gate.tid2eid": ("mlp.gate.tid2eid",),
    "ffn.shared_experts.w1.weight": ("mlp.shared_experts.gate_proj.weight",),
    "ffn.shared_experts.w2.weight": ("mlp.shared_experts.down_proj.weight",),
    "ffn.shared_experts.w3.weight": ("mlp.shared_experts.up_proj.weight",),
    # MTP-only tensors (official names inside mtp.{j}.)
    "e_proj.weight": (),
    "h_proj.weight": (),
    "enorm.weight": (),
    "hnorm.weight": (),
    "norm.weight": (),
    "hc_head_fn": ("hc_head.hc_fn",),
    "hc_head_base": ("hc_head.hc_base",),
    "hc_head_scale": ("hc_head.hc_scale",),
}

#: official top-level name <- other spellings (after an optional ``model.`` prefix is removed)
_TOP_ALIASES: dict[str, tuple[str, ...]] = {
    "embed.weight": ("embed_tokens.weight",),
    "head.weight": ("lm_head.weight",),
    "norm.weight": (),
    "hc_head_fn": ("hc_head.hc_fn",),
    "hc_head_base": ("hc_head.hc_base",),
    "hc_head_scale": ("hc_head.hc_scale",),
}

#: fused HF expert tensors (module-path spelling): handled by the weight mapper
FUSED_GATE_UP = "ffn.experts.gate_up_proj"
FUSED_DOWN = "ffn.experts.down_proj"

_MTP_ONLY = {"e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight"} | {
    f"hc_head_{p}" for p in ("fn", "base", "scale")
}
_LAYER_LOOKUP = {alias: off for off, aliases in _LAYER_ALIASES.items() for alias in (off, *aliases)}
_TOP_LOOKUP = {alias: off for off, aliases in _TOP_ALIASES.items() for alias in (off, *aliases)}
_SCOPE = re.compile(r"^(layers|mtp)\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(?:ffn|mlp)\.experts\.(\d+)\.(w[123])\.weight$")
_FUSED = {"mlp.experts.gate_up_proj": FUSED_GATE_UP, "mlp.experts.down_proj": FUSED_DOWN}
_FUSED.update({v: v for v in _FUSED.values()})


def canonical_name(name: str) -> str | None:
    """The official name of a checkpoint tensor in any accepted spelling (``None`` if it is not a model tensor).

    Fused HF expert tensors map to ``layers.{i}.ffn.experts.gate_up_proj`` / ``...down_proj`` (no official
    counterpart: the mapper splits them per expert).
    """
    n = name[len("model.") :] if name.startswith("model.") else name
    m = _SCOPE.match(n)
    if m is None:
        return _TOP_LOOKUP.get(n)
    scope, idx, suffix = m.groups()
    if (e := _EXPERT.match(suffix)) is not None:
        return f"{scope}.{idx}.ffn.experts.{e.group(1)}.{e.group(2)}.weight"
    if suffix in _FUSED:
        return f"{scope}.{idx}.{_FUSED[suffix]}"
    official = _LAYER_LOOKUP.get(suffix)
    if official is None or (scope == "layers" and official in _MTP_ONLY):
        return None
    return f"{scope}.{idx}.{official}"


def hf_saved_name(official: str) -> str:
    """The name HF ``save_pretrained`` (transformers 5.x) writes for an official tensor name."""
    top = {
        "embed.weight": "model.embed_tokens.weight",
        "head.weight": "head.weight",
        "norm.weight": "model.norm.weight",
        "hc_head_fn": "model.hc_head.hc_fn",
        "hc_head_base": "model.hc_head.hc_base",
        "hc_head_scale": "model.hc_head.hc_scale",
    }
    if official in top:
        return top[official]
    m = _SCOPE.match(official)
    if m is None:
        raise ValueError(f"{official!r} is not an official DeepSeek-V4 tensor name")
    scope, idx, suffix = m.groups()
    if scope == "mtp":
        return official  # transformers ignores mtp.* (never instantiated); keep the official spelling
    if suffix == "attn.kv_norm.weight":
        suffix = "attn.norm.weight"
    return f"model.{scope}.{idx}.{suffix}"
