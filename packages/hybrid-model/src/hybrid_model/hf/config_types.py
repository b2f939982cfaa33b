"""JSON types of the ``config.json`` keys that :func:`~hybrid_model.hf.config_map.model_config_from_hf` reads,
checked at the boundary: a wrongly typed value (``"num_hidden_layers": "4"``, a list where an integer belongs)
raises one ``ValueError`` naming the file, the key (nested keys as ``rope_parameters.compress.factor``), the
expected and the found JSON type, instead of a bare ``TypeError`` deep in the model or a silent coercion.

Types are JSON's: an *integer* is a JSON number without fraction (``true``/``false`` are not integers), a *number*
is any JSON number, a *string*, a *boolean*, an *array of T*, an *object*. Keys marked nullable may be ``null``
(the mapping then uses its default or says what is unsupported); keys not listed here are not read and not checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JsonType:
    """An expected JSON type: ``kind`` one of ``integer``, ``number``, ``string``, ``boolean``, ``object``,
    ``array``; ``item`` the type of an array's entries or an object's values; ``nullable``: ``null`` allowed."""

    kind: str
    item: JsonType | None = None
    nullable: bool = False

    def __str__(self) -> str:
        nouns = {"integer": "integer", "number": "number", "string": "string", "boolean": "boolean"}
        text = {
            "integer": "an integer",
            "number": "a number",
            "string": "a string",
            "boolean": "a boolean (true/false)",
            "object": "an object",
            "array": "an array",
        }[self.kind]
        if self.item is not None:
            noun = nouns.get(self.item.kind, self.item.kind)
            text += f" of {noun}s" if self.kind == "array" else f" of {noun} values"
        return text + (" or null" if self.nullable else "")


INT, NUM, STR, BOOL = JsonType("integer"), JsonType("number"), JsonType("string"), JsonType("boolean")
INT_OR_NULL, NUM_OR_NULL = JsonType("integer", nullable=True), JsonType("number", nullable=True)
STR_OR_NULL, BOOL_OR_NULL = JsonType("string", nullable=True), JsonType("boolean", nullable=True)
OBJ_OR_NULL = JsonType("object", nullable=True)

#: the keys of a RoPE parameters object (``rope_parameters``, its ``main`` / ``compress``, ``rope_scaling``)
ROPE_KEYS: dict[str, JsonType] = {
    "rope_type": STR_OR_NULL,
    "type": STR_OR_NULL,
    "rope_theta": NUM_OR_NULL,
    "partial_rotary_factor": NUM_OR_NULL,
    "factor": NUM_OR_NULL,
    "original_max_position_embeddings": INT_OR_NULL,
    "beta_fast": NUM_OR_NULL,
    "beta_slow": NUM_OR_NULL,
    "attention_factor": NUM_OR_NULL,
    "mscale": NUM_OR_NULL,
    "mscale_all_dim": NUM_OR_NULL,
    "truncate": BOOL_OR_NULL,
}

#: keys that map one to one onto a ``DSv4ModelConfig`` field of the same name (``config_map`` copies them)
DIRECT_KEYS: dict[str, JsonType] = {
    **{
        k: INT_OR_NULL
        for k in (
            "vocab_size",
            "hidden_size",
            "num_attention_heads",
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "sliding_window",
            "max_position_embeddings",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "hc_mult",
            "hc_sinkhorn_iters",
            "n_routed_experts",
            "n_shared_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
        )
    },
    **{k: NUM_OR_NULL for k in ("hc_eps", "rms_norm_eps", "routed_scaling_factor", "swiglu_limit")},
    "scoring_func": STR_OR_NULL,
}

#: top-level keys (HF spelling; the official ``ModelArgs`` aliases are checked under their own names)
CONFIG_KEYS: dict[str, JsonType] = {
    "model_type": STR_OR_NULL,
    "num_hidden_layers": INT,
    "head_dim": INT,
    "num_hash_layers": INT,
    "num_nextn_predict_layers": INT_OR_NULL,
    "qk_rope_head_dim": INT_OR_NULL,
    "partial_rotary_factor": NUM_OR_NULL,
    **DIRECT_KEYS,
    **{
        k: INT_OR_NULL
        for k in (
            "num_key_value_heads",
            "n_group",
            "topk_group",
            "compress_rate_csa",
            "compress_rate_hca",
            "original_seq_len",
        )
    },
    **{
        k: NUM_OR_NULL
        for k in (
            "attention_dropout",
            "rope_factor",
            "beta_fast",
            "beta_slow",
        )
    },
    "rope_theta": NUM,
    "compress_rope_theta": NUM,
    "hidden_act": STR_OR_NULL,
    "topk_method": STR_OR_NULL,
    **{k: BOOL_OR_NULL for k in ("attention_bias", "mlp_bias", "tie_word_embeddings", "norm_topk_prob")},
    "compress_ratios": JsonType("array", INT, nullable=True),
    "layer_types": JsonType("array", STR, nullable=True),
    "mlp_layer_types": JsonType("array", STR, nullable=True),
    "compress_rates": JsonType("object", INT, nullable=True),
    "rope_parameters": OBJ_OR_NULL,
    "rope_scaling": OBJ_OR_NULL,
}

#: official inference ``ModelArgs`` names of HF keys (``dim`` = ``hidden_size``, ...): checked like the HF key
MODEL_ARGS_KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "rope_head_dim": "qk_rope_head_dim",
    "window_size": "sliding_window",
    "n_activated_experts": "num_experts_per_tok",
    "moe_inter_dim": "moe_intermediate_size",
    "n_hash_layers": "num_hash_layers",
    "n_mtp_layers": "num_nextn_predict_layers",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "norm_eps": "rms_norm_eps",
}


def json_kind(value: Any) -> str:
    """The JSON type of a parsed value, as a phrase (``a string``, ``an array``, ``null``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return (
            "a number with a fraction" if not value.is_integer() else "a number written with a fraction (.0)"
        )
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _matches(value: Any, t: JsonType) -> bool:
    if value is None:
        return t.nullable
    kind = t.kind
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        return isinstance(value, list)
    return isinstance(value, dict)


def _check(value: Any, t: JsonType, key: str, where: str) -> None:
    if not _matches(value, t):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ValueError(f"{where}: key {key!r} must be {t}, found {json_kind(value)} ({shown})")
    if t.item is not None and value is not None:
        items = enumerate(value) if t.kind == "array" else value.items()
        for k, v in items:
            _check(v, t.item, f"{key}[{k}]" if t.kind == "array" else f"{key}.{k}", where)


def check_hf_config_types(config: dict[str, Any], where: str = "config.json") -> None:
    """``ValueError`` naming ``where`` (the file), the key, the expected and the found type for the first value of
    ``config`` whose JSON type is not the one the mapping reads (module docstring)."""
    for key, value in config.items():
        t = CONFIG_KEYS.get(MODEL_ARGS_KEYS.get(key, key))
        if t is None:
            continue
        _check(value, t, key, where)
    for key in ("rope_parameters", "rope_scaling"):
        rope = config.get(key)
        if not isinstance(rope, dict):
            continue
        for name, value in rope.items():
            if name in ("main", "compress") and key == "rope_parameters":
                _check(value, OBJ_OR_NULL, f"{key}.{name}", where)
                for sub, v in (value or {}).items():
                    if sub in ROPE_KEYS:
                        _check(v, ROPE_KEYS[sub], f"{key}.{name}.{sub}", where)
            elif name in ROPE_KEYS:
                _check(value, ROPE_KEYS[name], f"{key}.{name}", where)


__all__ = ["CONFIG_KEYS", "ROPE_KEYS", "JsonType", "check_hf_config_types", "json_kind"]
