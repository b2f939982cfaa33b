"""D9 FLOP formulas against a brute-force count of the matrix products the built tiny model runs.

A ``TorchDispatchMode`` sees every aten op of a training-mode forward (main model + MTP) and counts
``2·m·n·k`` for each ``mm``/``addmm``/``bmm``/``baddbmm``/``_grouped_mm`` (einsum and linear lower to these); module
hooks attribute each product to its module. Any other matmul-like op (SDPA, conv, matmul that did not lower)
fails the test, so the count is complete.

Exact agreement where the math is exact: projections, compressors, indexer linears, MoE (router, the routed
experts' actual rows = B·T·top-k, shared expert), mHC coefficient and combination products, HyperHeads, output
heads, MTP projections. Intended differences, asserted exactly:

* mHC stream collapse and post scaling (``2·n·d`` each per token per layer) and the HyperHead collapse
  (``2·n·d``) are elementwise multiply-adds, counted by the formula but not matrix products.
* Attention cores: the reference gathers a fixed number of key slots per query (window ``n_win`` + the top-``k``
  CSA entries, or every HCA entry of the longest prefix), masking the ones a query cannot see; the formula counts
  only the visible (query, key) pairs, the work of a sparse kernel. Both use ``4·n_h·c`` per pair.
* Indexer scores: the reference scores every (query, compressed entry) of the sequence then masks the future; the
  formula counts the causal pairs. Both use ``2·n_I·c_I + 2·n_I`` per pair.
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_model.flops import (
    forward_flops_sbhd,
    selected_entries_sum,
    visible_entries_sum,
    window_pairs,
)
from hybrid_model.mixers.dsa import dsa_core_per_pair
from hybrid_model.mixers.dsv4_kinds import core_per_pair, index_per_pair, projection_flops
from hybrid_model.presets import get_preset
from hybrid_model.symbols import CSA, HCA, WINDOW, parse_pattern

B, T = 2, 160  # T > 128: HCA entries exist; T > 4·top-k: CSA selects a strict subset (sparse)

_MATMULS = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._grouped_mm"}
_FORBIDDEN = ("matmul", "linear", "einsum", "dot", "mv", "conv", "scaled_dot_product", "addbmm")


def _mm_flops(name: str, args) -> int:
    if name in ("aten.addmm", "aten.baddbmm"):
        args = args[1:]  # (bias, a, b)
    a, b = args[0], args[1]
    if name == "aten._grouped_mm":
        offs = args[2] if len(args) > 2 else None
        if a.dim() == 2 and b.dim() == 3:  # [M, K] x [G, K, N], rows grouped by offs
            return 2 * a.shape[0] * a.shape[1] * b.shape[-1]
        raise AssertionError(f"unhandled _grouped_mm layout {a.shape} x {b.shape} (offs {offs})")
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


class MatmulCounter(TorchDispatchMode):
    """FLOPs of every matrix product, keyed by (module path, op, operand shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops: collections.Counter = collections.Counter()
        self.stack = ["<root>"]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in _MATMULS:
            shapes = tuple(tuple(x.shape) for x in args if isinstance(x, torch.Tensor))
            self.flops[(self.stack[-1], name, shapes)] += _mm_flops(name, args)
        elif any(f in name for f in _FORBIDDEN):
            raise AssertionError(f"uncounted matmul-like op {name} in {self.stack[-1]}")
        return func(*args, **(kwargs or {}))


def _component(path: str, shapes, cfg) -> str:
    """flops.py component of a matrix product from its module path (``core`` / ``index_scores`` by shape)."""
    prefix = "mtp." if path.startswith("mtp.") else ""
    leaf = path.rsplit(".", 1)[-1]
    if path in ("output_layer", "decoder.hyper_head", "mtp.hyper_head"):
        return "heads"  # main + MTP head share output_layer; split by call count below
    if path == "" and shapes[0][-1] == cfg.hidden_size and shapes[1][0] == cfg.hidden_size:
        return "heads"  # the fused head (DSv4Model.head_loss): the head GEMM over vocabulary chunks
    if path in ("mtp.e_proj", "mtp.h_proj"):
        return "mtp.projections"
    if ".core_attention.indexer." in path:
        return prefix + "attention.indexer"
    if ".core_attention.compressor." in path:
        return prefix + "attention.compressor"
    if leaf == "core_attention":
        a = shapes[0]
        is_core = a[-2] == cfg.num_attention_heads and cfg.head_dim in (a[-1], shapes[1][-1])
        return prefix + ("attention.core" if is_core else "attention.indexer_scores")
    if ".self_attention." in path:
        return prefix + "attention.projections"
    if ".mlp." in path:
        return prefix + "moe"
    if leaf in ("attn_hc", "mlp_hc") or path.split(".")[-1].isdigit():
        return prefix + "mhc"
    raise AssertionError(f"unattributed matrix product in {path}: {shapes}")


@pytest.fixture(scope="module")
def counted():
    from dsv4_testkit.megatron_cpu import megatron_cpu_context

    with megatron_cpu_context():
        from hybrid_model.model import build_model

        torch.manual_seed(0)
        cfg = get_preset("tiny")
        model = build_model(cfg).train()
        names = {m: n for n, m in model.named_modules()}
        counter = MatmulCounter()

        def enter(mod, *_):
            counter.stack.append(names[mod])

        def leave(mod, *_):
            counter.stack.pop()  # returns None: the module output is unchanged

        hooks = [
            h
            for m in model.modules()
            for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))
        ]
        ids = torch.randint(0, cfg.vocab_size, (B, T))
        pos = torch.arange(T)[None].expand(B, T)
        with torch.no_grad(), counter:
            loss = model(ids, pos, None, labels=torch.roll(ids, -1, 1))  # main + MTP forward
        for h in hooks:
            h.remove()
        assert loss.shape == (B, T) and model.last_mtp_loss is not None
    by_comp: collections.Counter = collections.Counter()
    for (path, _, shapes), f in counter.flops.items():
        by_comp[_component(path, shapes, cfg)] += f
    return cfg, by_comp, counter.flops


def test_linear_parts_match_exactly(counted):
    cfg, got, _ = counted
    br = forward_flops_sbhd(cfg, T, B)
    c = br.components
    tokens = B * T
    n, d = cfg.hc_mult, cfg.hidden_size
    for key in (
        "attention.projections",
        "attention.compressor",
        "attention.indexer",
        "moe",
        "mtp.projections",
        "mtp.attention.projections",
        "mtp.moe",
    ):
        assert got[key] == c[key], key
    # mHC: + collapse and post scaling, 2·n·d each, elementwise (per layer and token)
    p = parse_pattern(cfg.layer_pattern)
    for prefix, layers in (("", len(p.main)), ("mtp.", len(p.mtp_pattern) * p.mtp_num_depths)):
        assert got[prefix + "mhc"] + 4 * n * d * tokens * layers == c[prefix + "mhc"], prefix
    # heads: + HyperHead collapse 2·n·d per token (main and MTP)
    assert got["heads"] + 2 * (2 * n * d * tokens) == c["head"] + c["mtp.head"]


def test_attention_cores_and_indexer_scores(counted):
    cfg, got, _ = counted
    br = forward_flops_sbhd(cfg, T, B)
    c = br.components
    W, m, mh, k = cfg.sliding_window, cfg.csa_compress_ratio, cfg.hca_compress_ratio, cfg.index_topk
    p = parse_pattern(cfg.layer_pattern)
    assert T // mh >= 1 and T // m > k  # HCA entries exist, CSA selects a strict subset
    # what the reference computes: a fixed slot count per query and layer
    slots = {WINDOW: W, CSA: W + min(k, T // m), HCA: W + T // mh}
    visible = {
        WINDOW: window_pairs(T, W),
        CSA: window_pairs(T, W) + selected_entries_sum(T, m, k),
        HCA: window_pairs(T, W) + visible_entries_sum(T, mh),
    }
    for prefix, symbols in (("", p.main), ("mtp.", p.mtp_pattern * p.mtp_num_depths)):
        attn = [s for s in symbols if s in slots]
        assert got[prefix + "attention.core"] == core_per_pair(cfg) * B * T * sum(slots[s] for s in attn)
        formula = sum(c.get(prefix + f"attention.{x}_core", 0.0) for x in ("window", "csa", "hca"))
        assert formula == core_per_pair(cfg) * B * sum(visible[s] for s in attn)
        assert formula < got[prefix + "attention.core"]  # masked slots are not work
        n_csa = attn.count(CSA)
        assert got[prefix + "attention.indexer_scores"] == index_per_pair(cfg) * B * T * (T // m) * n_csa
        assert c.get(prefix + "attention.indexer_scores", 0.0) == (
            index_per_pair(cfg) * B * visible_entries_sum(T, m) * n_csa
        )


def test_forward_total_reconciles(counted):
    """Formula total = brute-force total + elementwise mHC/HyperHead terms - masked attention/indexer slots."""
    cfg, got, _ = counted
    br = forward_flops_sbhd(cfg, T, B)
    elementwise = br.forward - sum(br.components[k] for k in br.components if "core" in k or "scores" in k)
    matmul_part = sum(v for k, v in got.items() if "core" not in k and "scores" not in k)
    p = parse_pattern(cfg.layer_pattern)
    n_layers = len(p.main) + len(p.mtp_pattern) * p.mtp_num_depths
    n, d = cfg.hc_mult, cfg.hidden_size
    assert elementwise - matmul_part == B * T * (4 * n * d * n_layers + 2 * 2 * n * d)


# ------------------------------------------------------------------ '+' (MLA) and 'D' (DSA), local path
LATENT_PATTERN = "W+D-E/+E"  # MLA and DSA in the main part, MLA in the MTP depth


class _LatentCounter(MatmulCounter):
    """:class:`MatmulCounter` that also counts the MLA core's SDPA call (``CausalSoftmaxAttention``) as the dense
    product it is launched as: ``2·b·h·s_q·s_k·(d_qk + d_v)``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if "scaled_dot_product" in name:
            q, k, v = args[:3]  # [b, h, s, d]
            key = (self.stack[-1], "sdpa", tuple(tuple(x.shape) for x in (q, k, v)))
            self.flops[key] += (
                2 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * (q.shape[3] + v.shape[3])
            )
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_mla_and_dsa_match_the_brute_force_count():
    """``+``/``D`` (local modules): projections (DSA's absorbed ``q·W_UK`` / ``·W_UV`` einsums included) and the
    DSA indexer linears match exactly; the cores differ exactly by the masked work. The MLA core runs as one dense
    causal SDPA call (``4·n_h·c`` per (query, key) of the square), the formula counts the causal pairs; the DSA
    reference scores every key (``q·k`` over ``c``, ``p·v`` over ``L = c - r``) and masks all but the top-``k``
    causal ones, the formula counts ``Σ_t min(t+1, k)``; indexer scores: every (query, key) pair in the reference
    (``2·n_I·c_I``; the ReLU-weighted head sum ``2·n_I`` is elementwise), the causal pairs in the formula."""
    from dsv4_testkit.megatron_cpu import megatron_cpu_context

    b, t = 2, 40
    with megatron_cpu_context():
        from hybrid_model.model import build_model

        torch.manual_seed(0)
        cfg = get_preset("tiny").with_pattern(LATENT_PATTERN)
        model = build_model(cfg).train()
        names = {m: n for n, m in model.named_modules()}
        counter = _LatentCounter()

        def enter(mod, *_):
            counter.stack.append(names[mod])

        def leave(mod, *_):
            counter.stack.pop()

        hooks = [
            h
            for m in model.modules()
            for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))
        ]
        ids = torch.randint(0, cfg.vocab_size, (b, t))
        with torch.no_grad(), counter:
            model(ids, torch.arange(t)[None].expand(b, t), None, labels=torch.roll(ids, -1, 1))
        for h in hooks:
            h.remove()
    nh, c, r, k = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim, cfg.index_topk
    rank = c - r
    assert t > k  # DSA selects a strict subset of the causal keys
    got: collections.Counter = collections.Counter()
    for (path, op, shapes), f in counter.flops.items():
        prefix = "mtp." if path.startswith("mtp.") else ""
        is_dsa = path.startswith("decoder.layers.2.")  # 'D' is layer 3 of W+D-E
        if path.startswith("decoder.layers.0.") or ".self_attention" not in path:
            continue  # W (checked above), MoE / MLP / mHC / heads
        if ".core_attention.indexer." in path:
            part = "attention.indexer"
        elif op == "sdpa":
            part = "attention.causal_core"
        elif path.endswith(".core_attention") and shapes[1] == (
            nh,
            rank,
            c,
        ):  # ·W_UV, absorbed v up-projection
            part = "attention.projections"
        elif path.endswith(".core_attention"):
            part = "attention.indexer_scores" if shapes[0][-1] == cfg.index_head_dim else "attention.dsa_core"
        else:
            part = "attention.projections"
        got[prefix + part + (".dsa" if is_dsa and part == "attention.projections" else "")] += f
    br = forward_flops_sbhd(cfg, t, b)
    c_ = br.components
    per_latent = c_["mtp.attention.projections"]  # one '+' layer (the MTP depth has one)
    assert got["mtp.attention.projections"] == per_latent
    assert got["attention.projections"] == per_latent  # the main '+'
    assert got["attention.projections.dsa"] == per_latent  # 'D': absorbed einsums cost the same
    assert c_["attention.projections"] == 2 * per_latent + projection_flops(cfg) * b * t  # + W's projections
    assert got["attention.indexer"] == c_["attention.indexer"]
    causal, square = b * t * (t + 1) // 2, b * t * t
    assert got["attention.causal_core"] == core_per_pair(cfg) * square
    assert c_["attention.causal_core"] == core_per_pair(cfg) * causal
    assert got["mtp.attention.causal_core"] == core_per_pair(cfg) * square
    assert got["attention.dsa_core"] == dsa_core_per_pair(cfg) * square
    assert c_["attention.dsa_core"] == dsa_core_per_pair(cfg) * b * window_pairs(t, k)
    assert got["attention.indexer_scores"] == 2 * cfg.index_n_heads * cfg.index_head_dim * square
    assert c_["attention.indexer_scores"] == index_per_pair(cfg) * causal
