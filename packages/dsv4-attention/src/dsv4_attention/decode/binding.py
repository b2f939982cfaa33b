"""``bind_decode_step``: route a megatron DSv4 attention layer's forward through its decode cache for a while.

megatron's ``TransformerLayer`` (and the mHC wrapper around it) call ``self_attention(hidden_states, ...)``; inside
:func:`bind_decode_step` the :class:`~dsv4_attention.megatron.DSv4HybridAttention` hook (``decode_step``) answers
that call with :meth:`AttentionCache.extend <dsv4_attention.decode.cache.AttentionCache.extend>` on the call's rows
instead of the training forward, so a whole megatron model runs a cached prefill / decode step unchanged. The input
is a THD pack ``[R, 1, d]`` whose documents are the plan's new rows per sequence (sequence-major).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from dsv4_attention.decode.cache import AttentionCache
from dsv4_attention.decode.plan import ExtendPlan
from dsv4_attention.decode.step_indices import StepIndices
from dsv4_attention.decode.verify import PairIndices


def _check_unbound(layer: torch.nn.Module) -> None:
    if not hasattr(type(layer), "decode_step"):
        raise ValueError(
            f"{type(layer).__name__} has no decode_step hook: bind a dsv4_attention.megatron.DSv4HybridAttention "
            "(a core DSv4Attention is decoded by calling AttentionCache.extend directly)"
        )
    if layer.decode_step is not None:
        raise ValueError(
            f"{type(layer).__name__} (layer {getattr(layer, 'layer_number', '?')}) is already bound"
        )


def _rows(hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
        raise ValueError(
            f"a bound decode step takes the THD rows [R, 1, d] of its plan, got {tuple(hidden_states.shape)}"
        )
    return hidden_states[:, 0]


@contextlib.contextmanager
def bind_decode_step(
    layer: torch.nn.Module,
    cache: AttentionCache,
    plan: Callable[[], ExtendPlan],
    *,
    undo: bool = False,
) -> Iterator[None]:
    """Inside the block, ``layer``'s forward extends ``cache`` with its input rows.

    Args:
        layer: a module with the ``decode_step`` hook (``DSv4HybridAttention``).
        cache: the layer's :class:`AttentionCache`.
        plan: returns the :class:`ExtendPlan` of the current call (read at every forward, so one binding serves a
            whole generation); the CSA phase is the layer's own (``dense_attention``).
        undo: every call keeps what :meth:`AttentionCache.rollback` needs (speculative decoding's verify step).
    """
    _check_unbound(layer)

    def step(attn: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        dense = bool(getattr(attn, "dense_attention", False))
        y = cache.extend(attn, _rows(hidden_states), plan(), dense=dense, undo=undo)  # [R, d]
        return y.unsqueeze(1)  # [R, 1, d]

    layer.decode_step = step
    try:
        yield
    finally:
        del layer.decode_step  # back to the class default (None): the training forward


@contextlib.contextmanager
def bind_static_decode_step(
    layer: torch.nn.Module,
    cache: AttentionCache,
    lengths: torch.Tensor,
    indices: Callable[[], StepIndices | None] | None = None,
) -> Iterator[None]:
    """Inside the block, ``layer``'s forward on ``[B, 1, d]`` (one row per sequence) is the static-shape step
    :meth:`AttentionCache.extend_static` at the device positions ``lengths [B]`` (read when the forward runs, so
    a captured CUDA graph replays with the values the buffer holds then). ``indices``: returns the current step's
    :class:`~dsv4_attention.decode.step_indices.StepIndices` of ``lengths``, shared by every layer of the step
    (read at every forward; ``None``: each layer builds its own)."""
    _check_unbound(layer)

    def step(attn: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        dense = bool(getattr(attn, "dense_attention", False))
        shared = None if indices is None else indices()
        y = cache.extend_static(attn, _rows(hidden_states), lengths, dense=dense, indices=shared)
        return y.unsqueeze(1)  # [B, 1, d]

    layer.decode_step = step
    try:
        yield
    finally:
        del layer.decode_step


@contextlib.contextmanager
def bind_static_verify_step(
    layer: torch.nn.Module, cache: AttentionCache, indices: Callable[[], PairIndices]
) -> Iterator[None]:
    """Inside the block, ``layer``'s forward on ``[2B, 1, d]`` (each sequence's row at ``n``, then each sequence's
    row at ``n + 1``) is the static speculative verify step :meth:`AttentionCache.extend_static_pair`;
    ``indices``: returns the step's :class:`~dsv4_attention.decode.verify.PairIndices` (read at every forward,
    shared by every layer of the step)."""
    _check_unbound(layer)

    def step(attn: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        dense = bool(getattr(attn, "dense_attention", False))
        y = cache.extend_static_pair(attn, _rows(hidden_states), dense=dense, indices=indices())
        return y.unsqueeze(1)  # [2B, 1, d]

    layer.decode_step = step
    try:
        yield
    finally:
        del layer.decode_step
