"""Parameter counts of a DSv4 model: analytic (from the config, spec §2–§9) and from a built model.

Analytic per-layer counts (``d`` hidden, ``c`` head dim, ``n_h`` heads, ``d_c`` q rank, ``g``/``d_g`` output
groups/rank, ``n_I``/``c_I`` indexer heads/dim, ``n`` mHC streams, ``E``/``K`` experts/active, ``f`` expert width)::

    attention      = d_c·d + d_c + n_h·c·d_c + c·d + c + n_h + g·d_g·(n_h·c/g) + d·g·d_g
    CSA compressor = 2·(2c·d) + m·2c + c          HCA compressor = 2·(c·d) + m'·c + c
    indexer        = n_I·c_I·d_c + n_I·d + 2·(2c_I·d) + m·2c_I + c_I
    mHC (per sub-layer) = (2+n)·n·(n·d) + (2+n)·n + 3
    MoE            = E·d (gate) [+ E bias, learned layers] + E·3·d·f (routed) + 3·d·f (shared)
    dense MLP (-)  = 3·d·f + d (norm)          attention (*) = 4·d² + d (QKV, output; norm)
    MLA (+)        = d_c·d + n_h·c·d_c + c·d + n_h·(2c - r)·L + d·n_h·c (q down/up, kv down/up, output;
                     L = c - r the kv rank) + d_c + L (q / kv latent norms) + d (input norm)
    DSA (D)        = MLA + n_I·c_I·d_c + c_I·d + 2·c_I + n_I·d (indexer wq_b, wk, LayerNorm k-norm, weights)
    GDN (G)        = d·(2·Hk·dk + 2·Hv·dv + 2·Hv) + K·(2·Hk·dk + Hv·dv) + 2·Hv + dv + Hv·dv·d + d
                     (megatron's default sizes; :mod:`hybrid_model.gated_delta_net`)
    model          = 2·V·d (embedding, head; untied) + d (norm) + n·n·d + n + 1 (HyperHead)
    MTP            = 2·d² (e_proj, h_proj) + 3·d (enorm, hnorm, norm) + HyperHead + window block
    mHC off        : no mHC and no HyperHead terms (plain residual, one stream)

``activated`` replaces ``E`` by ``K`` routed experts per MoE layer (embedding and head included, as in §9.3).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from dsv4_attention import LayerKind
from hybrid_model.config import DSv4ModelConfig
from hybrid_model.gated_delta_net import GDNSizes, gdn_layer_params
from hybrid_model.symbols import ATTENTION, DSA, GDN, KIND_NAMES, MLA, MLP, MOE, attention_kind


@dataclass
class ParamCounts:
    """Parameter counts (plain integers).

    Attributes:
        main: main model incl. embedding and head (no MTP).
        mtp: all MTP depths (the output head and embedding are shared and counted in ``main``).
        activated: per-token activated parameters of the main model (``K`` of ``E`` routed experts).
        one_expert: parameters of one routed expert.
        attention: all attention parameters of the main model (projections, compressors, indexers, sinks).
        components: breakdown of ``main + mtp`` by component.
    """

    main: int
    mtp: int
    activated: int
    one_expert: int
    attention: int
    components: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.main + self.mtp

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total"] = self.total
        return d


def attention_params(cfg: DSv4ModelConfig, kind: LayerKind | int) -> dict[str, int]:
    """Per-layer attention parameter counts by part for a layer of ``kind`` (a :class:`LayerKind` or its ratio)."""
    kind = LayerKind.coerce(kind)
    d, c, nh, dc = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.q_lora_rank
    g, dg = cfg.o_groups, cfg.o_lora_rank
    out = {
        "attention.projections": dc * d + dc + nh * c * dc + c * d + c + g * dg * (nh * c // g) + d * g * dg,
        "attention.sinks": nh,
        "attention.compressor": 0,
        "attention.indexer": 0,
    }
    m = kind.compress_ratio
    if kind.has_indexer:  # CSA: overlapping compressors (two series) for the KV and the indexer keys
        nI, cI = cfg.index_n_heads, cfg.index_head_dim
        out["attention.compressor"] = 2 * (2 * c * d) + m * 2 * c + c
        out["attention.indexer"] = nI * cI * dc + nI * d + 2 * (2 * cI * d) + m * 2 * cI + cI
    elif kind.has_compressor:
        out["attention.compressor"] = 2 * c * d + m * c + c
    return out


def latent_dims(cfg: DSv4ModelConfig) -> tuple[int, int, int, int, int, int]:
    """``(d, c, r, nh, dc, rank)`` of a ``+``/``D`` layer: hidden, head dim, RoPE dims, heads, q LoRA rank and
    megatron's ``kv_lora_rank = c - r`` (= qk_head_dim, :class:`dsv4_attention.megatron.DSv4AttentionConfig`)."""
    d, c, r = cfg.hidden_size, cfg.head_dim, cfg.qk_rope_head_dim
    return d, c, r, cfg.num_attention_heads, cfg.q_lora_rank, c - r


def latent_attention_params(cfg: DSv4ModelConfig, symbol: str) -> dict[str, int]:
    """Attention parameters of a ``+`` (MLA) or ``D`` (DSA) layer by part (megatron's modules; see module doc)."""
    d, c, r, nh, dc, rank = latent_dims(cfg)
    out = {
        "attention.projections": dc * d + nh * c * dc + c * d + nh * (2 * c - r) * rank + d * nh * c,
        "attention.latent_norms": dc + rank,
    }
    if symbol == DSA:
        nI, cI = cfg.index_n_heads, cfg.index_head_dim
        out["attention.indexer"] = nI * cI * dc + cI * d + 2 * cI + nI * d
    return out


def mhc_params(cfg: DSv4ModelConfig) -> int:
    """One mHC instance (``fn``, ``base``, ``scale``) around one sub-layer (0 with mHC off)."""
    if not cfg.enable_mhc_connections:
        return 0
    n, d = cfg.hc_mult, cfg.hidden_size
    return (2 + n) * n * n * d + (2 + n) * n + 3


def hyper_head_params(cfg: DSv4ModelConfig) -> int:
    """The HyperHead collapsing the streams (0 with mHC off: one stream, no head)."""
    if not cfg.enable_mhc_connections:
        return 0
    n, d = cfg.hc_mult, cfg.hidden_size
    return n * n * d + n + 1


def one_expert_params(cfg: DSv4ModelConfig) -> int:
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def moe_params(cfg: DSv4ModelConfig, hashed: bool, active_only: bool = False) -> dict[str, int]:
    E, d = cfg.n_routed_experts, cfg.hidden_size
    n_exp = cfg.num_experts_per_tok if active_only else E
    return {
        "moe.router": E * d + (0 if hashed else E),
        "moe.routed_experts": n_exp * one_expert_params(cfg),
        "moe.shared_experts": cfg.n_shared_experts * one_expert_params(cfg),
    }


def analytic_param_counts(cfg: DSv4ModelConfig) -> ParamCounts:
    """Parameter counts from the config alone (spec §9.3)."""
    p = cfg.parsed_pattern
    d, V = cfg.hidden_size, cfg.vocab_size
    hashed = set(cfg.hash_layer_numbers)
    comp: dict[str, int] = {"embedding": V * d, "output_head": V * d, "final_norm+hyper_head": d}
    comp["final_norm+hyper_head"] += hyper_head_params(cfg)
    main = sum(comp.values())
    activated = main
    attention = 0

    def add(key: str, n: int) -> None:
        comp[key] = comp.get(key, 0) + n

    def layer(symbol: str, number: int, prefix: str) -> tuple[int, int, int]:
        """(params, activated params, attention params) of one hybrid layer."""
        total = act = att = 0
        kind = attention_kind(symbol)
        if kind is not None:
            parts = attention_params(cfg, kind)
            parts["norms"] = d  # attn_norm
            for k, v in parts.items():
                add(prefix + k, v)
            att = sum(v for k, v in parts.items() if k.startswith("attention"))
            total = act = sum(parts.values())
        elif symbol == MOE:
            parts = moe_params(cfg, number in hashed)
            parts["norms"] = d  # ffn_norm
            for k, v in parts.items():
                add(prefix + k, v)
            total = sum(parts.values())
            act = total - parts["moe.routed_experts"] + cfg.num_experts_per_tok * one_expert_params(cfg)
        elif symbol in (MLA, DSA):
            parts = latent_attention_params(cfg, symbol)
            parts["norms"] = d  # input_layernorm
            for k, v in parts.items():
                add(prefix + k, v)
            att = sum(v for k, v in parts.items() if k.startswith("attention"))
            total = act = sum(parts.values())
        elif symbol == GDN:
            n_gdn = gdn_layer_params(GDNSizes.for_hidden_size(d))
            add(prefix + "attention.gated_delta_net", n_gdn - d)
            add(prefix + "norms", d)  # input_layernorm (TE: fused into in_proj)
            att, total, act = n_gdn - d, n_gdn, n_gdn
        elif symbol in (MLP, ATTENTION):
            # -: SwiGLU MLP d -> 2f -> d; *: QKV d -> 3d and output d -> d (n_h heads of d/n_h dims), no biases
            key, n_lin = (
                ("mlp", one_expert_params(cfg)) if symbol == MLP else ("attention.projections", 4 * d * d)
            )
            add(prefix + key, n_lin)
            add(prefix + "norms", d)
            att = n_lin if symbol == ATTENTION else 0
            total = act = n_lin + d
        else:
            raise ValueError(
                f"parameter counting covers the symbols C H W E - * + D G ; {symbol!r} (megatron-core's "
                f"{KIND_NAMES[symbol]} layer) is not counted analytically: count a built model "
                "(count_model_params / build_meta_model)"
            )
        if cfg.enable_mhc_connections:
            add(prefix + "mhc", mhc_params(cfg))
        return total + mhc_params(cfg), act + mhc_params(cfg), att

    for i, s in enumerate(p.main):
        t, a, att = layer(s, i + 1, "")
        main += t
        activated += a
        attention += att
    mtp = 0
    for _ in range(p.mtp_num_depths):
        extra = 2 * d * d + 3 * d + hyper_head_params(cfg)
        add("mtp.projections+norms+hyper_head", extra)
        mtp += extra
        for j, s in enumerate(p.mtp_pattern):
            t, _, _ = layer(s, -(j + 1), "mtp.")
            mtp += t
    return ParamCounts(main, mtp, activated, one_expert_params(cfg), attention, comp)


# ---------------------------------------------------------------------------------------------- built model
def _is_routed_expert(name: str) -> bool:
    return ".experts." in name and "shared_experts" not in name


def count_model_params(model: torch.nn.Module, cfg: DSv4ModelConfig) -> ParamCounts:
    """Parameter counts of a built (possibly meta-device) :class:`~hybrid_model.model.DSv4Model`.

    Every ``nn.Parameter`` is counted once (shared tensors once); the learned routers' selection biases, which
    megatron-core keeps as buffers, are counted too because they are checkpoint tensors (§9.2). MTP = parameters
    under ``mtp.``; activated = main minus ``(E - K)/E`` of each MoE layer's routed-expert parameters.
    """
    seen: set[int] = set()
    main = mtp = routed_main = attention = 0
    comp: dict[str, int] = {}
    named = list(model.named_parameters())
    named += [(n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    for name, t in named:
        if id(t) in seen:
            continue
        seen.add(id(t))
        n = t.numel()
        is_mtp = name.startswith("mtp.") or ".mtp." in name
        if is_mtp:
            mtp += n
        else:
            main += n
            if _is_routed_expert(name):
                routed_main += n
            if ".self_attention." in name or ".attention." in name:
                attention += n
        key = _component_of(name)
        comp[key] = comp.get(key, 0) + n
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    activated = main - routed_main + routed_main * K // E
    return ParamCounts(main, mtp, activated, one_expert_params(cfg), attention, comp)


def _component_of(name: str) -> str:
    prefix = "mtp." if (name.startswith("mtp.") or ".mtp." in name) else ""
    for key, marker in [
        ("embedding", "embedding"),
        ("output_head", "output_layer"),
        ("mhc", "hc_"),
        ("mhc", "hyper_connection"),
        ("attention.indexer", "indexer"),
        ("attention.compressor", "compressor"),
        ("moe.shared_experts", "shared_experts"),
        ("moe.routed_experts", "experts"),
        ("moe.router", "router"),
        ("attention", "self_attention"),
    ]:
        if marker in name:
            return prefix + key
    return prefix + "other"


def format_billions(n: int) -> str:
    return f"{n / 1e9:.2f} B"


# ---------------------------------------------------------------------------------------------- meta builds
_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.randn, torch.rand, torch.empty_strided}


class _FloatTensorsOnMeta(TorchFunctionMode):
    """Allocate every floating-point factory tensor on the meta device, even with an explicit ``device=``.

    Modules that pass ``device=torch.cuda.current_device()`` or ``device="cpu"`` (megatron's linears, expert
    weight banks) then build without memory; integer tensors (hash tables, index buffers) keep their device so
    that value checks on them still run.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES:
            dtype = kwargs.get("dtype")
            if dtype is None or dtype.is_floating_point:
                kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_device():
    """Build modules without allocating their floating-point parameters (for counting V4-Flash / V4-Pro)."""
    with _FloatTensorsOnMeta():
        yield


def build_meta_model(cfg: DSv4ModelConfig, **config_kwargs):
    """The full single-stage :class:`~hybrid_model.model.DSv4Model` of ``cfg`` on the meta device.

    megatron-core's parallel state must be initialised (world size 1 is enough).
    """
    from hybrid_model.model import build_model

    with meta_device():
        return build_model(cfg, perform_initialization=False, **config_kwargs)
