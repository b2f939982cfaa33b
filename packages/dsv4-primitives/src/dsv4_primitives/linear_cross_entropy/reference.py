"""fp32 reference of the fused output head + cross entropy (``linear_cross_entropy``), through plain autograd.

For hidden states ``h [T, d]``, the output-head weight ``W [V, d]`` (the whole vocabulary) and targets ``y [T]``:

    z_t    = h_t W^T                                       # [V] logits of token t (fp32 here)
    loss_t = logsumexp(z_t) - z_t[y_t]                     # = lse_t - z_t[y_t]
    loss_t = 0                  where y_t == ignore_index  # no gradient either

Gradients (``g_t`` = incoming gradient of ``loss_t``; ``p_t = softmax(z_t)``; ``onehot_t`` = one-hot of ``y_t``):

    dz_t = g_t (p_t - onehot_t)                            # [V]
    dh   = dz W                                            # [T, d]
    dW   = sum_t dz_t^T h_t  = dz^T h                      # [V, d]

A target outside ``[0, V)`` that is not ``ignore_index`` follows megatron's vocab-parallel cross entropy (and
:func:`dsv4_primitives.vocab_parallel_cross_entropy`): no target logit, loss ``lse_t - max_j z_tj`` and no one-hot.
"""

from __future__ import annotations

import torch

from dsv4_primitives.cross_entropy.reference import vocab_parallel_cross_entropy_ref


def linear_cross_entropy_ref(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100
) -> torch.Tensor:
    """Reference per-token loss ``[*]`` of ``hidden [*, d]``, ``weight [V, d]``, integer ``target [*]`` (module doc).

    Computed in fp32 (fp64 for fp64 inputs, so it can be gradchecked): materialises the ``[*, V]`` logits.
    """
    if target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} must be hidden.shape[:-1] {tuple(hidden.shape[:-1])}"
        )
    ct = torch.promote_types(hidden.dtype, torch.float32)
    z = hidden.to(ct) @ weight.to(ct).t()  # [*, V]
    ignored = target == ignore_index
    loss = vocab_parallel_cross_entropy_ref(z, torch.where(ignored, 0, target))
    return torch.where(ignored, 0.0, loss)
