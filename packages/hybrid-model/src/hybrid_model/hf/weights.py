"""Official DeepSeek-V4 tensors (spec §9.2) <-> the state dict of :class:`~hybrid_model.model.DSv4Model`.

Block ``i`` of the main model is the attention layer ``decoder.layers.{a}`` (symbol ``W``/``C``/``H``) followed by
the MoE layer ``decoder.layers.{a+1}`` (``E``), each wrapped by mHC (``attn_hc`` / ``mlp_hc``); MTP depth ``j`` is
``mtp.block.0`` (window attention) + ``mtp.block.1`` (MoE) plus ``mtp.{e_proj,h_proj,enorm,hnorm,norm,hyper_head}``.

Routed experts: official ``ffn.experts.{e}.w1/w3/w2`` ``[F, d]``/``[F, d]``/``[d, F]`` <-> our fused
``experts.gate_up_proj [E, 2F, d]`` (``[w1; w3]`` per expert, HF layout) and ``experts.down_proj [E, d, F]``.
Hash tables ``ffn.gate.tid2eid`` are int64 in checkpoints and int32 in our router.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_model.hf.config_map import check_hf_representable
from hybrid_model.hf.names import FUSED_DOWN, FUSED_GATE_UP, canonical_name
from hybrid_model.symbols import MOE, WINDOW

#: official suffix -> our suffix, attention layer of a block
_ATTN = {
    "attn_norm.weight": "inner_layer.input_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "attn.wq_a.weight": "inner_layer.self_attention.linear_q_down_proj.weight",
    "attn.q_norm.weight": "inner_layer.self_attention.q_layernorm.weight",
    "attn.wq_b.weight": "inner_layer.self_attention.linear_q_up_proj.weight",
    "attn.wkv.weight": "inner_layer.self_attention.linear_kv_proj.weight",
    "attn.kv_norm.weight": "inner_layer.self_attention.kv_layernorm.weight",
    "attn.wo_a.weight": "inner_layer.self_attention.linear_o_group_proj.weight",
    "attn.wo_b.weight": "inner_layer.self_attention.linear_proj.weight",
    "attn.attn_sink": "inner_layer.self_attention.core_attention.attn_sink",
}
for _pre, _ours in (
    ("attn.compressor.", "inner_layer.self_attention.core_attention.compressor."),
    ("attn.indexer.compressor.", "inner_layer.self_attention.core_attention.indexer.compressor."),
):
    _ATTN.update(
        {
            f"{_pre}wkv.weight": f"{_ours}linear_wkv.weight",
            f"{_pre}wgate.weight": f"{_ours}linear_wgate.weight",
            f"{_pre}ape": f"{_ours}ape",
            f"{_pre}norm.weight": f"{_ours}norm.weight",
        }
    )
_ATTN["attn.indexer.wq_b.weight"] = "inner_layer.self_attention.core_attention.indexer.linear_wq_b.weight"
_ATTN["attn.indexer.weights_proj.weight"] = (
    "inner_layer.self_attention.core_attention.indexer.linear_weights_proj.weight"
)
#: official suffix -> our suffix, MoE layer of a block (routed experts handled separately)
_MOE = {
    "ffn_norm.weight": "inner_layer.pre_mlp_layernorm.weight",
    "hc_ffn_fn": "mlp_hc.fn",
    "hc_ffn_base": "mlp_hc.base",
    "hc_ffn_scale": "mlp_hc.scale",
    "ffn.gate.weight": "inner_layer.mlp.router.weight",
    "ffn.gate.bias": "inner_layer.mlp.router.e_score_correction_bias",
    "ffn.gate.tid2eid": "inner_layer.mlp.router.tid2eid",
    "ffn.shared_experts.w1.weight": "inner_layer.mlp.shared_experts.linear_gate.weight",
    "ffn.shared_experts.w3.weight": "inner_layer.mlp.shared_experts.linear_up.weight",
    "ffn.shared_experts.w2.weight": "inner_layer.mlp.shared_experts.linear_down.weight",
}
_GATE_UP = "inner_layer.mlp.experts.gate_up_proj"
_DOWN = "inner_layer.mlp.experts.down_proj"
_TOP = {
    "embed.weight": "embedding.word_embeddings.weight",
    "head.weight": "output_layer.weight",
    "norm.weight": "decoder.final_norm.weight",
    "hc_head_fn": "decoder.hyper_head.fn",
    "hc_head_base": "decoder.hyper_head.base",
    "hc_head_scale": "decoder.hyper_head.scale",
}
_MTP_TOP = {
    "e_proj.weight": "mtp.e_proj.weight",
    "h_proj.weight": "mtp.h_proj.weight",
    "enorm.weight": "mtp.enorm.weight",
    "hnorm.weight": "mtp.hnorm.weight",
    "norm.weight": "mtp.norm.weight",
    "hc_head_fn": "mtp.hyper_head.fn",
    "hc_head_base": "mtp.hyper_head.base",
    "hc_head_scale": "mtp.hyper_head.scale",
}


def _blocks(model_config) -> list[tuple[str, str, str]]:
    """``(official scope, our attention layer, our MoE layer)`` per block, main blocks then MTP depths."""

    check_hf_representable(model_config)
    p = model_config.parsed_pattern
    main = p.main
    out = []
    for a, sym in enumerate(main):
        if sym == MOE:
            continue
        if a + 1 >= len(main) or main[a + 1] != MOE:
            raise ValueError(
                f"pattern {model_config.layer_pattern!r}: attention layer {a} is not followed by E"
            )
        out.append((f"layers.{len(out)}", f"decoder.layers.{a}", f"decoder.layers.{a + 1}"))
    for j in range(p.mtp_num_depths):
        if p.mtp_pattern != WINDOW + MOE:
            raise ValueError(f"MTP depth pattern {p.mtp_pattern!r}: DSv4 MTP is one window block 'WE'")
        if j:
            raise ValueError("only one MTP depth (mtp.0) is supported")
        out.append((f"mtp.{j}", "mtp.block.0", "mtp.block.1"))
    return out


def official_to_ours_names(model_config, our_keys) -> dict[str, str]:
    """``official name -> our state-dict key`` for every non-expert tensor our model holds (``our_keys``)."""
    names = {off: ours for off, ours in _TOP.items()}
    mtp = model_config.parsed_pattern.mtp_num_depths
    if mtp:
        names.update({f"mtp.0.{off}": ours for off, ours in _MTP_TOP.items()})
    for scope, attn, moe in _blocks(model_config):
        names.update({f"{scope}.{off}": f"{attn}.{ours}" for off, ours in _ATTN.items()})
        names.update({f"{scope}.{off}": f"{moe}.{ours}" for off, ours in _MOE.items()})
    keys = set(our_keys)
    return {off: ours for off, ours in names.items() if ours in keys}


def _check_covered(model_config, our_keys, mapped: set[str]) -> None:
    expert_keys = {f"{moe}.{s}" for _, _, moe in _blocks(model_config) for s in (_GATE_UP, _DOWN)}
    left = sorted(
        k for k in our_keys if k not in mapped and k not in expert_keys and not k.endswith("_extra_state")
    )
    if left:
        raise AssertionError(f"model tensors without an official name: {left[:8]}")


def official_state_dict(model) -> dict[str, torch.Tensor]:
    """Our model's weights under their official names (experts split per expert, ``tid2eid`` int64, contiguous
    CPU copies)."""
    cfg = model.model_config
    sd = model.state_dict()
    names = official_to_ours_names(cfg, sd.keys())
    _check_covered(cfg, sd.keys(), set(names.values()))
    out: dict[str, torch.Tensor] = {}
    for off, ours in names.items():
        t = sd[ours].detach().cpu()
        out[off] = t.long() if off.endswith("tid2eid") else t.clone().contiguous()
    f = cfg.moe_intermediate_size
    for scope, _, moe in _blocks(cfg):
        gate_up, down = sd[f"{moe}.{_GATE_UP}"].detach().cpu(), sd[f"{moe}.{_DOWN}"].detach().cpu()
        for e in range(gate_up.shape[0]):
            out[f"{scope}.ffn.experts.{e}.w1.weight"] = gate_up[e, :f].clone().contiguous()
            out[f"{scope}.ffn.experts.{e}.w3.weight"] = gate_up[e, f:].clone().contiguous()
            out[f"{scope}.ffn.experts.{e}.w2.weight"] = down[e].clone().contiguous()
    return out


def canonicalize(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Rename checkpoint tensors (any accepted spelling, :mod:`hybrid_model.hf.names`) to official names and split
    fused HF expert tensors per expert. Returns ``(official tensors, names that are not model tensors)``."""
    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for name, t in tensors.items():
        off = canonical_name(name)
        if off is None:
            unknown.append(name)
            continue
        parts = []
        if off.endswith(FUSED_GATE_UP):
            scope = off[: -len(FUSED_GATE_UP) - 1]
            f = t.shape[1] // 2
            for e in range(t.shape[0]):
                parts += [
                    (f"{scope}.ffn.experts.{e}.w1.weight", t[e, :f]),
                    (f"{scope}.ffn.experts.{e}.w3.weight", t[e, f:]),
                ]
        elif off.endswith(FUSED_DOWN):
            scope = off[: -len(FUSED_DOWN) - 1]
            parts += [(f"{scope}.ffn.experts.{e}.w2.weight", t[e]) for e in range(t.shape[0])]
        else:
            parts.append((off, t))
        for k, v in parts:
            if k in out:
                raise ValueError(
                    f"checkpoint holds tensor {k!r} twice (under two spellings, one of them {name!r})"
                )
            out[k] = v
    return out, unknown


def load_official_state_dict(model, official: dict[str, torch.Tensor], *, strict_extra: bool = True) -> None:
    """Load official-named tensors into ``model`` (every model tensor must be given; dtypes converted to the
    model's; shapes checked). ``strict_extra``: tensors the model has no place for raise ``ValueError`` too."""
    cfg = model.model_config
    sd = model.state_dict()
    names = official_to_ours_names(cfg, sd.keys())
    _check_covered(cfg, sd.keys(), set(names.values()))
    new = dict(sd)
    used: set[str] = set()
    missing: list[str] = []

    def put(ours: str, off: str, t: torch.Tensor) -> None:
        ref = sd[ours]
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(
                f"tensor {off!r} has shape {tuple(t.shape)}, the model expects {tuple(ref.shape)} ({ours})"
            )
        if t.dtype.is_floating_point and t.element_size() == 1:
            raise ValueError(
                f"tensor {off!r} is {t.dtype}: quantized checkpoints are not loaded; dequantize first"
            )
        new[ours] = (
            t.to(device=ref.device, dtype=ref.dtype) if not off.endswith("tid2eid") else t.to(ref.device)
        )

    for off, ours in names.items():
        if off not in official:
            missing.append(off)
            continue
        put(ours, off, official[off])
        used.add(off)
    f = cfg.moe_intermediate_size
    for scope, _, moe in _blocks(cfg):
        gate_up, down = sd[f"{moe}.{_GATE_UP}"], sd[f"{moe}.{_DOWN}"]
        gu, dn = torch.empty_like(gate_up), torch.empty_like(down)
        for e in range(gate_up.shape[0]):
            keys = [f"{scope}.ffn.experts.{e}.{w}.weight" for w in ("w1", "w3", "w2")]
            absent = [k for k in keys if k not in official]
            if absent:
                missing += absent
                continue
            w1, w3, w2 = (official[k] for k in keys)
            if w1.shape != (f, gate_up.shape[2]) or w3.shape != w1.shape or w2.shape != down.shape[1:]:
                raise ValueError(
                    f"expert {scope}.ffn.experts.{e}: w1/w3/w2 shapes {tuple(w1.shape)}/{tuple(w3.shape)}/"
                    f"{tuple(w2.shape)}, expected {(f, gate_up.shape[2])}/{(f, gate_up.shape[2])}/{tuple(down.shape[1:])}"
                )
            gu[e] = torch.cat([w1, w3], 0).to(gu.dtype)
            dn[e] = w2.to(dn.dtype)
            used.update(keys)
        new[f"{moe}.{_GATE_UP}"], new[f"{moe}.{_DOWN}"] = gu, dn
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:6]}")
    extra = sorted(set(official) - used)
    if extra and strict_extra:
        raise ValueError(
            f"checkpoint holds {len(extra)} tensor(s) this model configuration has no place for, e.g. {extra[:6]} "
            "(config.json and weights disagree?)"
        )
    model.load_state_dict(new, strict=True)


def official_shapes(model_config, state_dict) -> dict[str, tuple[int, ...]]:
    """``official name -> shape`` of every tensor a model of ``model_config`` loads (``state_dict`` may live on the
    meta device: only shapes are read)."""
    names = official_to_ours_names(model_config, state_dict.keys())
    out = {off: tuple(state_dict[ours].shape) for off, ours in names.items()}
    for scope, _, moe in _blocks(model_config):
        e, f2, d = state_dict[f"{moe}.{_GATE_UP}"].shape
        for i in range(e):
            out[f"{scope}.ffn.experts.{i}.w1.weight"] = (f2 // 2, d)
            out[f"{scope}.ffn.experts.{i}.w3.weight"] = (f2 // 2, d)
            out[f"{scope}.ffn.experts.{i}.w2.weight"] = (d, f2 // 2)
    return out


@dataclass(frozen=True)
class Placement:
    """Where one official tensor lands in our single-stage state: the box ``[offset, offset + shape)`` of the
    tensor ``key`` (routed experts: one expert's ``w1`` / ``w3`` / ``w2`` inside the fused ``[E, 2F, d]`` /
    ``[E, d, F]`` bank, ``expert`` its index; every other tensor: the whole of ``key``, ``expert`` ``None``)."""

    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    expert: int | None = None


def official_placements(model_config, global_shapes: dict[str, tuple[int, ...]]) -> dict[str, Placement]:
    """``official name -> Placement`` of every tensor a model of ``model_config`` loads; ``global_shapes``: our
    state-dict key -> shape (e.g. of a meta-device model). The boxes of one key tile it exactly."""
    out = {
        off: Placement(ours, (0,) * len(global_shapes[ours]), tuple(global_shapes[ours]))
        for off, ours in official_to_ours_names(model_config, global_shapes.keys()).items()
    }
    for scope, _, moe in _blocks(model_config):
        e_count, f2, d = global_shapes[f"{moe}.{_GATE_UP}"]
        f = f2 // 2
        for e in range(e_count):
            gate_up, down = f"{moe}.{_GATE_UP}", f"{moe}.{_DOWN}"
            out[f"{scope}.ffn.experts.{e}.w1.weight"] = Placement(gate_up, (e, 0, 0), (1, f, d), e)
            out[f"{scope}.ffn.experts.{e}.w3.weight"] = Placement(gate_up, (e, f, 0), (1, f, d), e)
            out[f"{scope}.ffn.experts.{e}.w2.weight"] = Placement(down, (e, 0, 0), (1, d, f), e)
    return out
