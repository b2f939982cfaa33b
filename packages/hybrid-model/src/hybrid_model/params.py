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

Each layer's count is its record's (``params`` of :mod:`hybrid_model.mixers`, one module per symbol); this module
adds the mHC of every sub-layer, the embedding, head, HyperHead and MTP projections.
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

from hybrid_model.config import DSv4ModelConfig
from hybrid_model.mixers.moe import one_expert_params
from hybrid_model.mixers.registry import REGISTRY, counted_symbols
from hybrid_model.model import build_model
from hybrid_model.symbols import KIND_NAMES


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
        counts = REGISTRY[symbol].params
        if counts is None:
            raise ValueError(
                f"parameter counting covers the symbols {counted_symbols('params')} ; {symbol!r} (megatron-core's "
                f"{KIND_NAMES[symbol]} layer) is not counted analytically: count a built model "
                "(count_model_params / build_meta_model)"
            )
        lp = counts(cfg, number in hashed)
        for k, v in lp.parts.items():
            add(prefix + k, v)
        total, act, att = lp.total, lp.total - lp.inactive, lp.attention
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
    with meta_device():
        return build_model(cfg, perform_initialization=False, **config_kwargs)
