"""``config.json`` of a Hugging Face / official DeepSeek-V4 checkpoint <-> :class:`~hybrid_model.config.DSv4ModelConfig`.

Accepted spellings (spec §9.1): transformers 5.x (``layer_types`` + ``compress_rates``, ``mlp_layer_types``,
``partial_rotary_factor``, ``rope_parameters = {main, compress}``), the released ``config.json`` (``compress_ratios``,
``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``) and the official inference ``ModelArgs`` names (``dim``,
``n_layers``, ``window_size``, ``rope_factor``, ...). Every architecture field is mapped; anything this model cannot
run (other ratios, grouped routing, quantization other than the released FP8 / FP4 format, mscale, tied embeddings, ...) raises ``ValueError`` saying
which key and what is supported. :func:`hf_config_from_model_config` writes the transformers 5.x form.
"""

from __future__ import annotations

import math
from typing import Any

from hybrid_model.config import DSv4ModelConfig, YarnScaling
from hybrid_model.hf.config_types import DIRECT_KEYS, MODEL_ARGS_KEYS, check_hf_config_types
from hybrid_model.hf.quant.formats import QuantConfig

#: official inference ``ModelArgs`` name -> HF name
_MODEL_ARGS_ALIASES = MODEL_ARGS_KEYS
_LAYER_TYPE_RATIO_KEYS = {
    "sliding_attention": None,
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
_SUPPORTED_RATIOS = {"csa": 4, "hca": 128}
_DIRECT = tuple(DIRECT_KEYS)  # one list: config_types holds the keys with their JSON types


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"unsupported DeepSeek-V4 config.json: {msg}")


def _check_unsupported(c: dict[str, Any]) -> None:
    _require(
        c.get("num_key_value_heads", 1) == 1,
        f"num_key_value_heads={c.get('num_key_value_heads')} (DSv4 is single-KV-head MQA: 1)",
    )
    _require(
        c.get("hidden_act", "silu") == "silu",
        f"hidden_act={c.get('hidden_act')!r} (only 'silu', the SwiGLU gate)",
    )
    _require(not c.get("attention_bias", False), "attention_bias=true (DSv4 linears have no bias)")
    _require(not c.get("mlp_bias", False), "mlp_bias=true (DSv4 experts have no bias)")
    _require(not c.get("tie_word_embeddings", False), "tie_word_embeddings=true (DSv4 has an untied head)")
    _require(
        c.get("norm_topk_prob", True) is True, "norm_topk_prob=false (DSv4 normalises the top-k weights)"
    )
    _require(
        c.get("topk_method", "noaux_tc") == "noaux_tc",
        f"topk_method={c.get('topk_method')!r} (only 'noaux_tc')",
    )
    _require(
        c.get("n_group", 1) in (1, None) and c.get("topk_group", 1) in (1, None),
        "group-limited routing (n_group/topk_group > 1) is not part of DSv4",
    )
    _require(
        not c.get("attention_dropout", 0.0),
        f"attention_dropout={c.get('attention_dropout')} (DSv4 attention has no dropout; set 0.0)",
    )
    _require(
        "sliding_window" not in c or c["sliding_window"] is not None,
        "sliding_window=null (every DSv4 attention layer has the window branch; give its size, e.g. 128)",
    )
    if c.get("quantization_config") is not None:  # the released FP8 / FP4 format (hybrid_model.hf.released)
        QuantConfig.from_hf(c["quantization_config"])


def _normalize_keys(config: dict[str, Any]) -> dict[str, Any]:
    c = dict(config)
    for old, new in _MODEL_ARGS_ALIASES.items():
        if old in c:
            if new in c and c[new] != c[old]:
                raise ValueError(f"config.json gives both {old}={c[old]} and {new}={c[new]}")
            c[new] = c.pop(old)
    return c


def _rope_dim(c: dict[str, Any], head_dim: int) -> int:
    if "qk_rope_head_dim" in c and c["qk_rope_head_dim"] is not None:
        r = int(c["qk_rope_head_dim"])
    elif c.get("partial_rotary_factor") is not None:
        r = int(head_dim * float(c["partial_rotary_factor"]))
    else:
        r = 64
    prf = c.get("partial_rotary_factor")
    if prf is not None and int(head_dim * float(prf)) != r:
        raise ValueError(
            f"config.json: partial_rotary_factor={prf} * head_dim={head_dim} != qk_rope_head_dim={r}"
        )
    return r


def _compress_ratios(c: dict[str, Any], num_layers: int, n_mtp: int) -> tuple[int, ...]:
    rates = dict(_SUPPORTED_RATIOS)
    given = c.get("compress_rates") or {}
    for name, key in (("compressed_sparse_attention", "csa"), ("heavily_compressed_attention", "hca")):
        if name in given:
            rates[key] = int(given[name])
    if c.get("compress_rate_csa") is not None:
        rates["csa"] = int(c["compress_rate_csa"])
    if c.get("compress_rate_hca") is not None:
        rates["hca"] = int(c["compress_rate_hca"])
    _require(
        rates == _SUPPORTED_RATIOS,
        f"compress_rates {rates}: only CSA ratio 4 and HCA ratio 128 (the released ratios) are supported",
    )
    if c.get("compress_ratios") is not None:
        ratios = [int(r) for r in c["compress_ratios"]]
        bad = sorted({r for r in ratios if r not in (0, 4, 128)})
        _require(not bad, f"compress_ratios holds {bad}; each entry must be 0 (window), 4 (CSA) or 128 (HCA)")
    elif c.get("layer_types") is not None:
        ratios = []
        for i, t in enumerate(c["layer_types"]):
            _require(
                t in _LAYER_TYPE_RATIO_KEYS,
                f"layer_types[{i}]={t!r}; valid: {sorted(_LAYER_TYPE_RATIO_KEYS)}",
            )
            key = _LAYER_TYPE_RATIO_KEYS[t]
            ratios.append(0 if key is None else rates[key])
    else:
        raise ValueError(
            "config.json has neither compress_ratios nor layer_types: the layer schedule is unknown"
        )
    if len(ratios) == num_layers:
        ratios += [0] * n_mtp
    _require(
        len(ratios) >= num_layers + n_mtp,
        f"the layer schedule has {len(ratios)} entries, need num_hidden_layers={num_layers} (+ {n_mtp} MTP)",
    )
    ratios = ratios[: num_layers + n_mtp]
    _require(all(r == 0 for r in ratios[num_layers:]), "the MTP layers must be window-only (ratio 0)")
    return tuple(ratios)


def _num_hash_layers(c: dict[str, Any], num_layers: int) -> int:
    types = c.get("mlp_layer_types")
    if types is not None:
        types = list(types)[:num_layers]
        bad = [t for t in types if t not in ("hash_moe", "moe")]
        _require(not bad, f"mlp_layer_types holds {bad}; valid: 'hash_moe', 'moe'")
        k = sum(1 for t in types if t == "hash_moe")
        _require(
            types == ["hash_moe"] * k + ["moe"] * (len(types) - k),
            "mlp_layer_types: the hash_moe layers must be the first MoE layers",
        )
        return k
    return int(c.get("num_hash_layers", 3))


def _yarn(c: dict[str, Any]) -> tuple[float, float, YarnScaling | None]:
    """``(rope_theta, compress_rope_theta, yarn)`` from ``rope_parameters`` / ``rope_scaling`` / ``ModelArgs``."""
    rope_theta = float(c.get("rope_theta", 10000.0))
    compress_theta = float(c.get("compress_rope_theta", 160000.0))
    rp = c.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp["main"], rp["compress"]
        _require(
            main.get("rope_type", "default") == "default",
            f"rope_parameters.main.rope_type={main.get('rope_type')!r} (window layers use plain RoPE)",
        )
        rope_theta = float(main.get("rope_theta", rope_theta))
        compress_theta = float(comp.get("rope_theta", compress_theta))
        scaling = comp
    elif isinstance(rp, dict) and rp:
        scaling = rp
    elif isinstance(c.get("rope_scaling"), dict):
        scaling = c["rope_scaling"]
    elif c.get("rope_factor") is not None:
        scaling = {
            "rope_type": "yarn" if float(c["rope_factor"]) > 1 else "default",
            "factor": c["rope_factor"],
            "original_max_position_embeddings": c.get("original_seq_len", 65536),
            "beta_fast": c.get("beta_fast", 32),
            "beta_slow": c.get("beta_slow", 1),
        }
    else:
        scaling = {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    _require(kind in ("default", "yarn"), f"compressed-layer rope_type={kind!r} (only 'default' or 'yarn')")
    if kind == "default":
        return rope_theta, compress_theta, None
    af = scaling.get("attention_factor")
    _require(af is None or float(af) == 1.0, f"YaRN attention_factor={af} (DSv4 uses no YaRN mscale: 1.0)")
    for k in ("mscale", "mscale_all_dim"):
        _require(not scaling.get(k), f"YaRN {k}={scaling.get(k)} (DSv4 uses no YaRN mscale)")
    _require(scaling.get("truncate", True) is True, "YaRN truncate=false (DSv4 floors/ceils the ramp bounds)")
    for k in ("factor", "original_max_position_embeddings"):
        _require(scaling.get(k) is not None, f"YaRN rope parameters lack {k!r}")
    yarn = YarnScaling(
        factor=float(scaling["factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
    )
    return rope_theta, compress_theta, yarn


def model_config_from_hf(
    config: dict[str, Any], *, with_mtp: bool = True, name: str = "hf", source: str = "config.json"
) -> DSv4ModelConfig:
    """The :class:`DSv4ModelConfig` of a DeepSeek-V4 ``config.json`` (any accepted spelling, module docstring).

    ``with_mtp=False`` builds the main model only (``num_nextn_predict_layers = 0``), e.g. for checkpoints saved by
    transformers, which never hold MTP weights. ``source`` names the file in the messages; a value of the wrong JSON
    type raises ``ValueError`` naming the file, the key, the expected and the found type
    (:mod:`hybrid_model.hf.config_types`).
    """
    if not isinstance(config, dict):
        raise ValueError(f"{source} must hold a JSON object, got {type(config).__name__}")
    check_hf_config_types(config, source)
    mt = config.get("model_type")
    if mt is not None and mt != "deepseek_v4":
        raise ValueError(f"config.json model_type={mt!r}; expected 'deepseek_v4'")
    c = _normalize_keys(config)
    _check_unsupported(c)
    num_layers = int(c.get("num_hidden_layers", 43))
    head_dim = int(c.get("head_dim", 512))
    n_mtp = int(c.get("num_nextn_predict_layers", 1) or 0) if with_mtp else 0
    rope_theta, compress_theta, yarn = _yarn(c)
    kw: dict[str, Any] = {k: c[k] for k in _DIRECT if k in c and c[k] is not None}
    if "swiglu_limit" in kw:
        kw["swiglu_limit"] = float(kw["swiglu_limit"])
    for k in ("hc_eps", "rms_norm_eps", "routed_scaling_factor"):
        if k in kw:
            kw[k] = float(kw[k])
    return DSv4ModelConfig(
        name=name,
        num_layers=num_layers,
        head_dim=head_dim,
        qk_rope_head_dim=_rope_dim(c, head_dim),
        compress_ratios=_compress_ratios(c, num_layers, n_mtp),
        csa_compress_ratio=4,
        hca_compress_ratio=128,
        rope_theta=rope_theta,
        compress_rope_theta=compress_theta,
        yarn=yarn,
        num_hash_layers=_num_hash_layers(c, num_layers),
        num_nextn_predict_layers=n_mtp,
        **kw,
    )


_LAYER_TYPE_OF_RATIO = {
    0: "sliding_attention",
    4: "compressed_sparse_attention",
    128: "heavily_compressed_attention",
}


def check_hf_representable(cfg: DSv4ModelConfig) -> None:
    """``ValueError`` unless the released DeepSeek-V4 checkpoint format (and transformers' ``DeepseekV4``) can hold
    ``cfg``: mHC on, blocks of one C/H/W attention layer followed by one ``E`` MoE layer, at most one MTP depth of
    ``WE``. Pipeline cuts do not matter (a checkpoint has none)."""
    fix = "train with the DSv4 layout to export, or keep the Megatron checkpoint"
    if not cfg.enable_mhc_connections:
        raise ValueError(
            "enable_mhc_connections=False (--no-mhc): Hugging Face DeepSeek-V4 checkpoints always have mHC "
            f"(hc_mult residual streams), so a plain-residual model has no HF form; {fix}"
        )
    p = cfg.parsed_pattern
    blocks = "".join(p.segments)
    if len(blocks) % 2 or any(
        a not in "CHW" or e != "E" for a, e in zip(blocks[::2], blocks[1::2], strict=True)
    ):
        raise ValueError(
            f"pattern {cfg.layer_pattern!r}: Hugging Face DeepSeek-V4 holds only blocks of one C/H/W attention layer "
            f"followed by one E MoE layer (e.g. 'WECEHE/WE'); {fix}"
        )
    if p.mtp_num_depths > 1 or (p.mtp_num_depths and p.mtp_pattern != "WE"):
        raise ValueError(
            f"pattern {cfg.layer_pattern!r} has {p.mtp_num_depths} MTP depth(s) of {p.mtp_pattern!r}: the DeepSeek-V4 "
            "checkpoint format holds at most one MTP depth of one window block ('/WE', tensors mtp.0.*); "
            "keep the Megatron checkpoint, or train with one MTP depth to export"
        )


def hf_config_from_model_config(cfg: DSv4ModelConfig, **extra: Any) -> dict[str, Any]:
    """A transformers 5.x ``config.json`` dict (``DeepseekV4ForCausalLM``) for ``cfg``; ``extra`` keys are added
    (e.g. token ids carried over from the source checkpoint). Refuses what the format cannot hold
    (:func:`check_hf_representable`)."""
    check_hf_representable(cfg)
    n = cfg.num_layers
    moe_layers = n  # every DSv4 block has an MoE
    prf = cfg.qk_rope_head_dim / cfg.head_dim
    main = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": prf}
    comp: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": cfg.compress_rope_theta,
        "partial_rotary_factor": prf,
    }
    if cfg.yarn is not None:
        comp.update(
            rope_type="yarn",
            factor=cfg.yarn.factor,
            original_max_position_embeddings=cfg.yarn.original_max_position_embeddings,
            beta_fast=cfg.yarn.beta_fast,
            beta_slow=cfg.yarn.beta_slow,
            attention_factor=1.0,
        )
    out: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": n,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": 1,
        "head_dim": cfg.head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "partial_rotary_factor": prf,
        "q_lora_rank": cfg.q_lora_rank,
        "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank,
        "sliding_window": cfg.sliding_window,
        "layer_types": [_LAYER_TYPE_OF_RATIO[r] for r in cfg.compress_ratios[:n]],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "mlp_layer_types": ["hash_moe"] * min(cfg.num_hash_layers, moe_layers)
        + ["moe"] * max(0, moe_layers - cfg.num_hash_layers),
        "rope_theta": cfg.rope_theta,
        "compress_rope_theta": cfg.compress_rope_theta,
        "rope_parameters": {"main": main, "compress": comp},
        "max_position_embeddings": cfg.max_position_embeddings,
        "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk,
        "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "hc_eps": cfg.hc_eps,
        "rms_norm_eps": cfg.rms_norm_eps,
        "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "scoring_func": cfg.scoring_func,
        "norm_topk_prob": True,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "swiglu_limit": cfg.swiglu_limit,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "dtype": "float32",
    }
    out.update(extra)
    assert math.isclose(out["partial_rotary_factor"] * cfg.head_dim, cfg.qk_rope_head_dim)
    return out
