"""fp32 reference cross entropy over one vocabulary shard (the whole vocabulary when not tensor-parallel).

For one row of logits ``z [V]`` (shard ``[vocab_start, vocab_start + V)`` of a ``K``-token vocabulary, ``K = V``
without tensor parallelism), integer target ``t`` and label smoothing ``a`` (``0 <= a < 1``):

    m    = max_j z_j,   lse = m + log(sum_j exp(z_j - m))            # fp32 (fp64 for fp64 logits)
    z_t  = z[t - vocab_start]  if vocab_start <= t < vocab_start + V  else m    (m as a constant, see below)
    e    = a * K / (K - 1)                                            # megatron's ``smoothing``; e = 0 when a = 0
    loss = (1 - e) * (lse - z_t) - e * mean_j(z_j - lse)
         = lse - (1 - e) * z_t - (e / K) * sum_j z_j

Gradient (what the fused backward writes, in the logits dtype; ``g`` = incoming gradient of the row's loss):

    dz_j = g * (p_j - (1 - e) * [j == t - vocab_start] - e / K),      p_j = exp(z_j - lse)

A target outside the vocabulary is not an ignore index: megatron-core's ``vocab_parallel_cross_entropy`` zeroes the
max-shifted target logit ``z_t - m`` of such rows, so their loss is ``lse - m`` (``log(sum_j exp(z_j - m))``,
with smoothing ``lse - (1 - e) m - (e / K) sum_j z_j``), and its backward has no one-hot term for them (``m`` is
a constant: ``m.detach()`` below). This module reproduces both. With ``a = 0`` and in-range targets this is
``torch.nn.functional.cross_entropy(z.float(), t, reduction="none")``; with ``a > 0`` it is torch's label
smoothing with ``e`` in place of ``a`` (``1 - e`` on the target, ``e / K`` on every token).
"""

from __future__ import annotations

import torch


def vocab_parallel_cross_entropy_ref(
    logits: torch.Tensor, target: torch.Tensor, *, vocab_start: int = 0, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Reference per-token cross entropy of ``logits [*, V]`` against integer ``target [*]`` (math in the module doc).

    ``vocab_start`` shifts the token ids owned by the logits (the default ``0``: ``logits`` hold the whole
    vocabulary, ``K = V``); targets outside ``[vocab_start, vocab_start + V)`` take megatron's no-target value. Computed in fp32 (fp64 for fp64 logits, so it
    can be gradchecked) through plain autograd; returns ``loss [*]`` in that dtype.
    """
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} must be logits.shape[:-1] {tuple(logits.shape[:-1])}"
        )
    ct = torch.promote_types(logits.dtype, torch.float32)
    z = logits.to(ct)  # [*, V]
    v = z.shape[-1]
    lse = torch.logsumexp(z, dim=-1)  # [*]
    local = target.long() - vocab_start
    owned = (local >= 0) & (local < v)
    z_t = z.gather(-1, torch.where(owned, local, 0).unsqueeze(-1)).squeeze(-1)
    z_t = torch.where(
        owned, z_t, z.detach().amax(-1)
    )  # [*] megatron: the row max for a target outside the shard
    if label_smoothing == 0.0:
        return lse - z_t
    e = label_smoothing * v / (v - 1)
    return lse - (1.0 - e) * z_t - (e / v) * z.sum(-1)
