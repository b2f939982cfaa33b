"""Activation bytes per token of a DSv4 model from its layer shapes: what each layer saves for the backward
(issue 33, ``dsv4 memory``; the per-rank totals with recompute, pipeline and offload are
:mod:`dsv4_train.memory_model`).

Per token, with ``d`` hidden, ``n`` mHC streams, ``c`` head dim, ``n_h`` heads, ``d_c`` q rank, ``g·d_g`` output
rank, ``n_I``/``c_I`` indexer heads/dim, ``k`` top-k, ``W`` window, ``m``/``m'`` CSA/HCA ratios, ``E``/``K``
experts/active, ``f`` expert width (``f_s`` shared), ``S`` the sequence length, bf16 ``b = 2`` bytes (fp32 runs:
``b = 4``); the fused Triton kernels' saved tensors (the ``"kernels"`` path, CUDA)::

    mHC (every layer)  4·n·d (fp32 input streams) + b·d (layer output) + 4·((2+n)·n + n² + 2n + 1) (mixes)
    attention W/C/H    b·(2d + 4·n_h·c + 2c + g·d_g + 2·d_c) + 16·n_h + 20 (norms' inputs and rstd, q before
                       RoPE and norm, kv, core q / out / lse, o-group input, o-LoRA input, positions)
                       + 4·I (sparse indices, I per query)
    window W           I = W
    CSA C              I = W + k; + b·(n_I·c_I + n_I + 2·2c + 2·2c_I + (c + c_I)/m) + 4·(n_I + 2k) + 4·k + 2k
                       (indexer q / weights, both compressors' kv and gates, compressed entries, top-k, scores)
                       + 4·(c + c_I + 2)/m (the compressors' fp32 norm inputs)
    HCA H              I = W + S/m' (every visible entry); + b·(2c + c/m') + 4·(c + 1)/m'
    MoE E              b·(d + 2·K·d + 2·K·f·… ) : b·d (norm input) + 4 + b·2·K·d (permuted tokens, expert input)
                       + b·3·K·f (fc1 output 2f, activation f) + 4·K + 5·E + 4·3·E + 12·K + 9 (routing)
                       + b·(d + 3·f_s) (shared expert)
    embedding          2·b·d + 13        final head  b·d + 4 + 4·n·d + 8·n + 4 (HyperHead) + b·d (loss input)
    MTP depth          its layers + b·(3·d + n·d) + 4·n + 8 + HyperHead (as the final head)

The CPU ``"reference"`` path (eager PyTorch, what the tests run) saves more: fp32 norm inputs, the Sinkhorn
iterations of every mHC (``2·T_s·(n² + n)`` fp32, ``T_s`` iterations) and the gathered key rows of the sparse
attention (``c·I``); :func:`layer_activation_bytes` adds those terms with ``path="reference"``.

Tensor parallelism with sequence parallelism over ``P`` ranks (``tp``): a rank's bytes per token of its TP group's
``T`` rows are ``split / P + full``. Split: everything on the rank's sequence rows ``T / P`` (mHC, norms, the
q / KV down-projections and their norms, compressors, the whole lightning indexer, the router and routed experts,
the embedding output, the HyperHead) and everything of the rank's ``n_h / P`` heads or ``g / P`` output groups
over all ``T`` rows (q, core q / out / lse, o-group input, o-LoRA input; the shared expert's column shards).
Full (every rank, all ``T`` rows): DSv4 attention's gathered q latent and KV ``b·(d_c + c)``, the gathered
compressed entries ``b·(c + c_I)/m`` (CSA) / ``b·c/m'`` (HCA), the gathered top-k ids ``4·k``, the sparse
indices ``4·I`` and positions (``20``), on the reference path the gathered key rows ``4·c·I + 8·I``; the head's
gathered loss input ``b·d``. ``tp = 1`` gives the formulas above unchanged.

Checked against the bytes saved for backward (``torch.autograd.graph.saved_tensors_hooks``, distinct storages)
of the tiny model on CPU (``packages/dsv4-train/tests/test_memory_model.py``) and against the flash-smoke peaks
measured on one H200 (dsv4-train README, "Memory model").
"""

from __future__ import annotations

from typing import Literal

from hybrid_model.config import DSv4ModelConfig

PATHS = ("kernels", "reference")
Path = Literal["kernels", "reference"]


def _mhc(cfg: DSv4ModelConfig, b: int, path: str) -> float:
    n, d = cfg.num_streams, cfg.hidden_size
    if not cfg.enable_mhc_connections:
        return b * d  # plain residual: the layer output
    small = (2 + n) * n + n * n + 2 * n + 1
    out = 4 * n * d + b * d + 4 * small
    if path == "reference":  # eager Sinkhorn: every iteration's [n, n] and [n] tensors, fp32 layer output
        out += 2 * cfg.hc_sinkhorn_iters * (n * n + n) * 4 + 4 * n * n + (4 - b) * d
    return out


def _attention(cfg: DSv4ModelConfig, symbol: str, seq_len: int, b: int, path: str) -> tuple[float, float]:
    """(split, full) bytes per token of one attention layer (module doc: split divides by TP, full does not)."""
    d, c, nh = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    dc, g, dg, W = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.sliding_window
    split = b * (2 * d + 4 * nh * c + c + g * dg + dc) + 16 * nh
    full = b * (c + dc) + 20  # the gathered q latent and KV, positions
    if symbol == "W":
        idx = W
    elif symbol == "C":
        m, k, ni, ci = cfg.csa_compress_ratio, cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim
        idx = W + k
        split += b * (ni * ci + ni + 2 * 2 * c + 2 * 2 * ci) + 4 * (ni + 2 * k) + 2 * k + 4 * (c + ci + 2) / m
        full += b * (c + ci) / m + 4 * k  # gathered entries + indexer keys, gathered top-k ids
    else:  # H
        mh = cfg.hca_compress_ratio
        idx = W + seq_len / mh
        split += b * 2 * c + 4 * (c + 1) / mh
        full += b * c / mh  # gathered entries
    full += 4 * idx
    if path == "reference":  # gathered key rows per query, fp32 norm inputs and probabilities
        full += 4 * c * idx + 8 * idx
        split += 4 * nh * (idx + 1) + 2 * 4 * (d + c + dc) - b * (d + c + dc)
    return split, full


def _moe(cfg: DSv4ModelConfig, b: int) -> float:
    d, E, K, f = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    fs = f * cfg.n_shared_experts
    out = b * d + 4 + b * 2 * K * d + b * 3 * K * f + 4 * K + 5 * E + 12 * E + 12 * K + 9
    return out + b * (d + 3 * fs)


def _check_tp(tp: int) -> None:
    if tp < 1:
        raise ValueError(f"the tensor-parallel size must be >= 1, got {tp}")


def layer_activation_bytes(
    cfg: DSv4ModelConfig, symbol: str, seq_len: int, *, bf16: bool = True, path: Path = "kernels", tp: int = 1
) -> float:
    """Bytes saved for backward per token by one layer of ``symbol`` (``W``, ``C``, ``H``, ``E``), its mHC
    included, in a sequence of ``seq_len`` tokens (module formula); under ``tp`` ranks the bytes of one rank per
    token of its TP group (``split / tp + full``)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    _check_tp(tp)
    b = 2 if bf16 else 4
    if symbol in "WCH":
        split, full = _attention(cfg, symbol, seq_len, b, path)
    elif symbol == "E":
        split, full = _moe(cfg, b), 0.0
    else:
        raise ValueError(
            f"the memory model covers the DSv4 symbols W, C, H and E; {symbol!r} is not modelled: use a pattern "
            "of those"
        )
    return (split + _mhc(cfg, b, path)) / tp + full


def hyper_head_bytes(cfg: DSv4ModelConfig, b: int, tp: int = 1) -> float:
    """The final norm, HyperHead and loss input of one head, per token (``tp``: one rank's, the loss input
    gathered)."""
    _check_tp(tp)
    n, d = cfg.num_streams, cfg.hidden_size
    hh = 4 * n * d + 8 * n + 4 if cfg.enable_mhc_connections else 0
    return (b * d + 4 + hh) / tp + b * d


def embedding_bytes(cfg: DSv4ModelConfig, b: int, tp: int = 1) -> float:
    _check_tp(tp)
    return (2 * b * cfg.hidden_size + 13) / tp


def mtp_extra_bytes(cfg: DSv4ModelConfig, b: int, tp: int = 1) -> float:
    """One MTP depth besides its layers: e/h projections' inputs, its norms and head."""
    _check_tp(tp)
    n, d = cfg.num_streams, cfg.hidden_size
    return (b * (3 * d + n * d) + 4 * n + 8) / tp + hyper_head_bytes(cfg, b, tp)


def checkpoint_bytes(cfg: DSv4ModelConfig, b: int, tp: int = 1) -> float:
    """What a fully recomputed chunk keeps per token: its input streams (fp32 with mHC) and the token ids (one
    rank's sequence rows under ``tp``)."""
    _check_tp(tp)
    n, d = cfg.num_streams, cfg.hidden_size
    return ((4 * n * d if cfg.enable_mhc_connections else b * d) + 8) / tp


__all__ = [
    "PATHS",
    "checkpoint_bytes",
    "embedding_bytes",
    "hyper_head_bytes",
    "layer_activation_bytes",
    "mtp_extra_bytes",
]
