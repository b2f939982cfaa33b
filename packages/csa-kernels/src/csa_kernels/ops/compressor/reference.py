"""fp32 reference of the DSv4 KV compressors (dsv4-architecture.md §3.2, §3.3, §3.5).

Non-overlapping (HCA, ``ratio = m' = 128``; any ``ratio`` with ``overlap=False``), per document, block ``w`` covers the
document-relative tokens ``J_w = [w*m, (w+1)*m - 1]``; ``Dk = c`` channels:

    S[j, :]  = softmax_{j in J_w}( score[j, :] + ape[j - w*m, :] )          # per channel, over the m slots
    P_w      = sum_{j in J_w} S[j, :] * kv[j, :]                             # [c]

Overlapping (CSA / indexer, ``ratio = m = 4``, ``overlap=True``), ``Dk = 2c`` channels; entry ``w`` pools ``2m`` slots:

    slots 0 .. m-1  : tokens (w-1)m .. wm-1   with kv[:, 0:c],  score[:, 0:c]  + ape[slot, 0:c]     (P-half)
    slots m .. 2m-1 : tokens wm .. (w+1)m-1   with kv[:, c:2c], score[:, c:2c] + ape[slot-m, c:2c]  (Q-half)
    entry 0 of every document: the first m slots are empty (kv = 0, logit = -inf -> weight 0)
    P_w = sum_slots softmax_over_2m_slots(logit)[slot, :] * kv[slot, :]

Full compressor (``compress_ref``): ``kv = x @ wkv.T``, ``score = x @ wgate.T`` (``x`` = the block input after
``attn_norm``), pool, ``RMSNorm_{norm_weight}``, RoPE (last ``rope_cfg.rope_dim`` channels, interleaved pairs) at the
document-relative position ``w * ratio`` of the block's first token. Only complete blocks are compressed: a
document of length ``L`` yields ``floor(L / ratio)`` entries; trailing tokens are dropped.

dtype policy: math in fp32 (fp64 when any input is fp64); ``compressor_pool_ref`` returns the compute dtype,
``compress_ref`` returns ``x.dtype``.
"""

from __future__ import annotations

import itertools

import torch

from csa_kernels._checks import check_bounds, check_ratio, compute_dtype
from csa_kernels.ops.compressor.checks import check_compress_inputs as _check_compress_inputs
from csa_kernels.ops.compressor.checks import check_pool_inputs as _check_pool_inputs
from dsv4_primitives import RopeConfig, apply_rope, apply_rope_ref, rms_norm_ref
from dsv4_primitives.varlen import SeqBoundaries


def _empty_half(kv_b: torch.Tensor, logit_b: torch.Tensor, lead: int, ratio: int, c: int):
    """The empty previous half of entry 0 (overlap): ``kv = 0``, ``logit = -inf`` (weight 0), each ``[lead, m, c]``."""
    return kv_b.new_zeros(lead, ratio, c), logit_b.new_full((lead, ratio, c), float("-inf"))


def _pool_slots(kv_b: torch.Tensor, logit_b: torch.Tensor, prev_kv=None, prev_logit=None) -> torch.Tensor:
    """Softmax-gated pooling over the slots (dim 1) of ``kv_b, logit_b [n, m, Dk]`` -> ``[n, c]``.

    Overlap (``prev_*`` given, ``[n, m, c]``): slots ``[previous block's P-half ; this block's Q-half]``.
    """
    if prev_kv is not None:
        c = prev_kv.shape[-1]
        kv_b = torch.cat((prev_kv, kv_b[..., c:]), 1)  # [n, 2m, c]
        logit_b = torch.cat((prev_logit, logit_b[..., c:]), 1)  # [n, 2m, c]
    return (torch.softmax(logit_b, dim=1) * kv_b).sum(1)  # [n, c]


def _pool_document(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool):
    """Pool one document's complete blocks. ``kv, score [n*ratio, Dk]`` (compute dtype) -> ``[n, c]``."""
    n = kv.shape[0] // ratio
    dk = kv.shape[1]
    kv_b = kv.view(n, ratio, dk)  # [n, m, Dk]
    logit_b = score.view(n, ratio, dk) + ape  # [n, m, Dk]
    if not overlap:
        return _pool_slots(kv_b, logit_b)
    c = dk // 2
    # previous block's P-half; entry 0 gets empty slots
    empty_kv, empty_logit = _empty_half(kv_b, logit_b, 1, ratio, c)
    prev_kv = torch.cat((empty_kv, kv_b[:-1, :, :c]), 0)  # [n, m, c]
    prev_logit = torch.cat((empty_logit, logit_b[:-1, :, :c]), 0)
    return _pool_slots(kv_b, logit_b, prev_kv, prev_logit)


def _norm_rope(pooled, norm_weight, eps, positions, rope_cfg) -> torch.Tensor:
    """Entry epilogue: ``RMSNorm_{norm_weight}`` of the pooled rows, then RoPE at ``positions`` (compute dtype)."""
    normed = rms_norm_ref(pooled, norm_weight.to(pooled.dtype), eps)
    return apply_rope_ref(normed, positions, rope_cfg)


def _norm_rope_cached(pooled, norm_weight, eps, positions, rope_cfg, max_position: int) -> torch.Tensor:
    """:func:`_norm_rope` for fp32 ``pooled`` without a device sync: RoPE from ``dsv4_primitives``' cached
    ``cos``/``sin`` tables (the same float64-computed values as the reference's angles, uploaded once per table
    size; ``apply_rope_ref`` uploads its inverse frequencies on every call) with the host-known ``max_position``."""
    normed = rms_norm_ref(pooled, norm_weight.to(pooled.dtype), eps)
    return apply_rope(normed, positions, rope_cfg, backend="reference", max_position=max_position)


def max_entry_position(bounds: SeqBoundaries, ratio: int) -> int:
    """Host bound of every entry's RoPE position: ``(entries of the longest document - 1) * ratio`` (0 if none;
    static boundaries: from the entry capacity)."""
    return max(0, bounds.max_entries(ratio) - 1) * ratio


def compressor_pool_ref(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    ratio: int,
    overlap: bool,
    bounds: SeqBoundaries,
) -> tuple[torch.Tensor, SeqBoundaries]:
    """Softmax-gated pooling of complete blocks, per document (the formula in the module docstring).

    Args:
        kv: ``[T, Dk]`` projected values (``Dk = 2c`` if ``overlap`` else ``c``).
        score: ``[T, Dk]`` gate logits BEFORE adding ``ape``.
        ape: ``[ratio, Dk]`` learned position bias over the slots of a block (fp32 parameter).
        ratio: block size ``m`` (4 for CSA / indexer, 128 for HCA).
        overlap: two-series overlapping layout (CSA) or plain blocks (HCA).
        bounds: the documents of the ``T`` rows (:class:`~dsv4_primitives.varlen.SeqBoundaries`; static ones are
            read back, one sync, and the output is padded with zero rows to the entry capacity ``T // ratio``).
    Returns:
        ``pooled [Tc, c]`` in the compute dtype (fp32, or fp64 for fp64 inputs) and the compressed boundaries
        ``bounds.compressed(ratio)``.
    """
    _check_pool_inputs(kv, score, ape, ratio, overlap, bounds)
    cu = bounds.exact().host
    dt = compute_dtype(kv, score, ape)
    kv, score, ape = kv.to(dt), score.to(dt), ape.to(dt)
    c = kv.shape[1] // 2 if overlap else kv.shape[1]
    parts = []
    for start, end in itertools.pairwise(cu):
        n = (end - start) // ratio
        if n:
            stop = start + n * ratio
            parts.append(_pool_document(kv[start:stop], score[start:stop], ape, ratio, overlap))
    if parts:
        pooled = torch.cat(parts)
    else:
        # no complete block anywhere: an empty result that stays connected to every input's graph
        pooled = kv.new_zeros(0, c) + 0 * (kv.sum() + score.sum() + ape.sum())
    bounds_c = bounds.compressed(ratio)
    pad = bounds_c.total - pooled.shape[0]  # static boundaries: zero rows up to the entry capacity
    return (torch.nn.functional.pad(pooled, (0, 0, 0, pad)) if pad else pooled), bounds_c


def compressed_positions(bounds: SeqBoundaries, ratio: int) -> torch.Tensor:
    """``[Tc]`` int64 document-relative position ``w * ratio`` of each entry's first token (its RoPE position).

    ``bounds``: the TOKEN boundaries (the entries are those of ``bounds.compressed(ratio)``; static boundaries: the
    entry capacity ``T // ratio``, padding entries continue counting from the start of the last document). No
    device -> host sync.
    """
    check_ratio(ratio)
    return check_bounds(bounds).compressed(ratio).positions() * ratio


def compress_ref(
    x: torch.Tensor,
    wkv: torch.Tensor,
    wgate: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    ratio: int,
    overlap: bool,
    rope_cfg: RopeConfig,
    bounds: SeqBoundaries,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, SeqBoundaries]:
    """Full compressor: projections, pooling, RMSNorm, RoPE at ``w * ratio`` (module docstring).

    Args:
        x: ``[T, d]`` block input (after ``attn_norm``).
        wkv, wgate: ``[Dk, d]`` projection weights (``Dk = 2c`` if ``overlap`` else ``c``), no bias.
        ape: ``[ratio, Dk]`` fp32 slot position bias (added to the gate logits).
        norm_weight: ``[c]`` RMSNorm weight.
        ratio, overlap: see :func:`compressor_pool_ref`.
        rope_cfg: rotary config of the layer (rotates the last ``rope_cfg.rope_dim`` of the ``c`` channels).
        bounds: the documents of the ``T`` rows (see :func:`compressor_pool_ref`).
        eps: RMSNorm epsilon.
    Returns:
        ``entries [Tc, c]`` in ``x.dtype`` and the compressed boundaries ``bounds.compressed(ratio)``.
    """
    _check_compress_inputs(x, wkv, wgate, ape, norm_weight, ratio, overlap, rope_cfg)
    dt = compute_dtype(x, wkv, wgate, ape, norm_weight)
    xf = x.to(dt)
    kv = xf @ wkv.to(dt).T  # [T, Dk]
    score = xf @ wgate.to(dt).T  # [T, Dk]
    check_bounds(bounds, x.shape[0], "x")
    pooled, bounds_c = compressor_pool_ref(kv, score, ape, ratio, overlap, bounds)  # [Tc, c]
    rotated = _norm_rope(pooled, norm_weight, eps, compressed_positions(bounds, ratio), rope_cfg)
    return rotated.to(x.dtype), bounds_c
