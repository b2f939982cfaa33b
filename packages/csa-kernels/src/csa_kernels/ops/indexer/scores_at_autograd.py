"""Autograd bindings of the fused index scores at given entries (:mod:`.scores_at_triton`).

- :class:`IndexerScoresAtFunction`: ``indexer_scores_at`` on the Triton backend (fused forward, fused backward).
- :func:`attach_scores_at_grad`: the gradient path of ``indexer_topk``'s scores. The selection pass already
  produced the forward values, so this Function does no forward work at all: it returns the given values and its
  backward runs the fused backward kernel at the selected entries (formerly a chunked fp32 reference recomputation,
  ~30 ms per flash-smoke step on the H200).

``deterministic`` (``None``: :func:`csa_kernels.deterministic_default`, ``True`` unless set otherwise, or
``torch.are_deterministic_algorithms_enabled()``; resolved when the backward runs): ``dk`` without atomics, bitwise
reproducible (the key-major pass, or per-pair rows summed per key over an inverted index:
``scores_at_config.DETERMINISTIC_DK``; :func:`.scores_at_triton.scores_at_bwd`); otherwise the row kernel adds
``dk`` with fp32 atomics, whose summation order varies between runs. (Before 0.3 the deterministic mode ran the
fp32 reference.)
"""

from __future__ import annotations

import torch

from csa_kernels._triton_utils import resolve_deterministic
from csa_kernels.ops.indexer.scores_at_triton import scores_at_bwd, scores_at_fwd


def _backward(q_idx, k_idx, weights, indices, grad, needs, deterministic):
    """``(dq, dk, dw)`` (``None`` where ``needs`` is False) of the scores at ``indices`` for upstream ``grad``."""
    dq, dk, dw = scores_at_bwd(
        q_idx,
        k_idx,
        weights,
        indices,
        grad,
        deterministic=resolve_deterministic(deterministic),
    )
    return tuple(g if n else None for g, n in zip((dq, dk, dw), needs))


class IndexerScoresAtFunction(torch.autograd.Function):
    """``score [T, K] fp32 = indexer_scores_at(q_idx, k_idx, weights, indices)``: fused forward and backward."""

    @staticmethod
    def forward(ctx, q_idx, k_idx, weights, indices, deterministic):
        ctx.save_for_backward(q_idx, k_idx, weights, indices)
        ctx.deterministic = deterministic
        return scores_at_fwd(q_idx, k_idx, weights, indices)

    @staticmethod
    def backward(ctx, grad):
        q_idx, k_idx, weights, indices = ctx.saved_tensors
        grads = _backward(q_idx, k_idx, weights, indices, grad, ctx.needs_input_grad[:3], ctx.deterministic)
        return (*grads, None, None)


class _ScoresAtGradFunction(torch.autograd.Function):
    """Returns ``values`` unchanged; backward = the gradient of ``indexer_scores_at(q_idx, k_idx, weights,
    indices)`` (zero at ``-1`` slots). ``values`` itself gets no gradient."""

    @staticmethod
    def forward(ctx, values, q_idx, k_idx, weights, indices, deterministic):
        ctx.save_for_backward(q_idx, k_idx, weights, indices)
        ctx.deterministic = deterministic
        return values

    @staticmethod
    def backward(ctx, grad):
        q_idx, k_idx, weights, indices = ctx.saved_tensors
        grads = _backward(q_idx, k_idx, weights, indices, grad, ctx.needs_input_grad[1:4], ctx.deterministic)
        return (None, *grads, None, None)


def attach_scores_at_grad(
    values: torch.Tensor,  # [T, K] fp32, the selection pass's scores (-inf at -1)
    q_idx: torch.Tensor,  # [T, HI, DI]
    k_idx: torch.Tensor,  # [Tc, DI]
    weights: torch.Tensor,  # [T, HI]
    indices: torch.Tensor,  # [T, K] int32, -1 = empty
    deterministic: bool | None = None,
) -> torch.Tensor:
    """``values`` (same tensor values, no recomputation) with the gradient of the scores at ``indices`` attached,
    when grad mode is on and any of ``q_idx``, ``k_idx``, ``weights`` requires grad; else ``values`` itself.

    Equivalent to ``values + (live - live.detach())`` with ``live = where(indices >= 0, indexer_scores_at(...), 0)``.
    """
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q_idx, k_idx, weights)):
        return _ScoresAtGradFunction.apply(values.detach(), q_idx, k_idx, weights, indices, deterministic)
    return values


def indexer_scores_at_triton(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    deterministic: bool | None = None,
) -> torch.Tensor:
    """Differentiable fused ``indexer_scores_at`` (inputs validated by the caller); ``[T, K]`` fp32.
    ``deterministic``: module docstring."""
    return IndexerScoresAtFunction.apply(q_idx, k_idx, weights, indices, deterministic)
