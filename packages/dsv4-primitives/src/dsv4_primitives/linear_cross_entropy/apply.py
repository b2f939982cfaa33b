"""Fused output head + cross entropy: ``linear_cross_entropy(hidden, weight, target)`` (autograd), two modes.

Same math as :func:`dsv4_primitives.linear_cross_entropy.reference.linear_cross_entropy_ref` (see its docstring);
the ``[T, V]`` logits are never materialised.

Mode choice (``mode="auto"``, the default): when autograd will ask for a gradient (grad mode on and ``hidden`` or
``weight`` requires grad) the **gradient-in-forward** mode runs
(:mod:`dsv4_primitives.linear_cross_entropy.grad_in_forward`: token chunks over the whole local vocabulary, both
gradients formed in the forward, 3 head GEMMs; the backward scales them by the upstream gradient, which must be
proportional to the declared ``grad_weight`` (default: ones, i.e. ``loss.sum()`` / ``loss.mean()``); otherwise an
exact recompute backward runs eagerly, NaN under CUDA-graph capture). Without a gradient (evaluation, no-grad
forward of activation checkpointing) the forward of the **recompute** mode below runs: one GEMM per vocabulary chunk
and the row statistics. ``mode="recompute"`` forces the recompute mode (4 head GEMMs, nothing but the inputs held
from the forward to the backward: the choice when memory is short). Neither mode is twice differentiable.

Recompute mode: the vocabulary (this rank's shard ``weight [V_local, d]``) is walked in chunks of ``C`` rows of
``weight``; each chunk's logits ``z_c = h W_c^T`` ``[T, C]`` live only inside its step.

Forward, per chunk: one GEMM ``z_c = h W_c^T`` in the input dtype (bf16 operands, fp32 accumulation: the logits the
unfused output layer would produce), then the fused cross-entropy statistics kernel of
:mod:`dsv4_primitives.cross_entropy` gives ``(m_c, s_c, z_t)`` per row (row max, sum of ``exp(z - m_c)``, target
logit when the target falls in the chunk). Chunks are combined online like tensor-parallel shards
(``m = max(m, m_c)``, ``s = s exp(m_old - m) + s_c exp(m_c - m)``), then over ``tp_group`` (all-reduce MAX of ``m``,
one all-reduce SUM of the rescaled ``s`` and the shifted target logit: megatron's vocab-parallel reductions).
Saved for the backward: ``hidden``, ``weight``, the targets and ``lse [T]`` (fp32): nothing of size ``T x V``.

Backward, per chunk: the logits are recomputed (``z_c = h W_c^T``), the cross-entropy backward kernel turns them in
place into ``dz_c = g (softmax - onehot)`` (input dtype, softmax against the global ``lse``), then
``dW_c = dz_c^T h`` (one GEMM over all tokens, written into its rows of ``dW``, as the unfused path's single weight-
gradient GEMM) and ``dh += dz_c W_c`` accumulated in fp32 (``torch.mm(..., out_dtype=float32)`` on CUDA, fp32
operands elsewhere), all-reduced over ``tp_group`` (the hidden states are replicated over it: megatron's
``copy_to_tensor_model_parallel_region``) and cast to the input dtype once. Cost: the forward GEMM runs twice (4
head GEMMs instead of 3); memory: one ``[T, C]`` chunk plus an fp32 ``[T, d]`` accumulator.

Rows whose target is ``ignore_index`` get loss 0 and no gradient (their incoming gradient is treated as 0).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from dsv4_primitives.cross_entropy.apply import _IMPLS, vocab_shard
from dsv4_primitives.dispatch import resolve_backend
from dsv4_primitives.linear_cross_entropy.chunks import (
    recompute_backward,
    token_chunk_rows,
    tp_lse_loss,
    vocab_chunk_rows,
)
from dsv4_primitives.linear_cross_entropy.grad_in_forward import LinearCrossEntropyGradInForward

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MODES = ("auto", "grad_in_forward", "recompute")


def _combine(m, s, m_c, s_c):
    """Online merge of two ``(max, sum exp(z - max))`` row statistics (``-inf`` maxima shift by 0)."""
    m_new = torch.maximum(m, m_c)
    ref = torch.where(torch.isinf(m_new) & (m_new < 0), 0.0, m_new)
    m_ref = torch.where(torch.isinf(m) & (m < 0), 0.0, m)
    mc_ref = torch.where(torch.isinf(m_c) & (m_c < 0), 0.0, m_c)
    return m_new, s * torch.exp(m_ref - ref) + s_c * torch.exp(mc_ref - ref)


class _LinearCrossEntropy(torch.autograd.Function):
    """The recompute mode (module doc); also the forward-only path."""

    @staticmethod
    def forward(ctx, hidden, weight, target, tp_group, world, vocab_start, ignore_index, chunk, impl):
        tokens, v_local = hidden.shape[0], weight.shape[0]
        stats_fn = _IMPLS[impl][0]
        ignored = target == ignore_index
        t = torch.where(ignored, -1, target).contiguous()  # [T] ignored rows own no target anywhere
        m = torch.full((tokens,), float("-inf"), dtype=torch.float32, device=hidden.device)
        s = torch.zeros_like(m)
        zt = torch.zeros_like(m)  # raw target logit (0 where this rank does not own the target)
        for c0 in range(0, v_local, chunk):
            z = hidden @ weight[c0 : c0 + chunk].t()  # [T, C] input dtype, fp32 accumulation
            st = stats_fn(z, (1, z.shape[1], 0), t, vocab_start + c0, False)  # [3, T] m_c, s_c, z_t
            m, s = _combine(m, s, st[0], st[1])
            zt += st[2]
            del z
        lse, loss = tp_lse_loss(m, s, zt, t, vocab_start, v_local, tp_group, world)
        loss = torch.where(ignored, 0.0, loss)
        ctx.save_for_backward(hidden, weight, t, lse, ignored)
        ctx.meta = (tp_group, world, vocab_start, chunk, impl)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        hidden, weight, t, lse, ignored = ctx.saved_tensors
        tp_group, world, vocab_start, chunk, impl = ctx.meta
        g = torch.where(ignored, 0.0, grad_loss.to(torch.float32)).contiguous()  # [T]
        dh, dw = recompute_backward(
            hidden,
            weight,
            t,
            lse,
            g,
            tp_group,
            world,
            vocab_start,
            chunk,
            impl,
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
        )
        return dh, dw, None, None, None, None, None, None, None


def _positive_or_none(name, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def _check_inputs(hidden, weight, target, tp_group, vocab_start, ignore_index, chunks, grad_weight, mode):
    if not isinstance(hidden, torch.Tensor) or hidden.dtype not in _DTYPES:
        raise ValueError(
            f"linear_cross_entropy needs hidden of dtype bf16/fp16/fp32, got {getattr(hidden, 'dtype', hidden)}"
        )
    if not isinstance(weight, torch.Tensor) or weight.dtype != hidden.dtype:
        raise ValueError(
            f"weight must be a tensor of the hidden states' dtype {hidden.dtype}, got {getattr(weight, 'dtype', weight)}"
        )
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] < 1:
        raise ValueError(
            f"need hidden [*, d] and weight [V_local, d] with V_local >= 1, got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if not isinstance(target, torch.Tensor) or target.dtype.is_floating_point or target.dtype == torch.bool:
        raise ValueError(
            f"target must be an integer tensor of token ids, got {getattr(target, 'dtype', target)}"
        )
    if target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal hidden.shape[:-1] {tuple(hidden.shape[:-1])}"
        )
    if target.device != hidden.device or weight.device != hidden.device:
        raise ValueError(
            f"hidden ({hidden.device}), weight ({weight.device}) and target ({target.device}) must share a device"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    for name, value in zip(("vocab_chunk", "token_chunk"), chunks, strict=True):
        _positive_or_none(name, value)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if grad_weight is not None:
        if not isinstance(grad_weight, torch.Tensor) or not grad_weight.dtype.is_floating_point:
            raise ValueError(
                "grad_weight must be a floating tensor of per-token gradient weights (e.g. the loss mask), got "
                f"{getattr(grad_weight, 'dtype', grad_weight)!r}"
            )
        if grad_weight.shape != target.shape or grad_weight.device != target.device:
            raise ValueError(
                f"grad_weight must have the target's shape {tuple(target.shape)} and device {target.device}, got "
                f"{tuple(grad_weight.shape)} on {grad_weight.device}"
            )
    return vocab_shard(tp_group, weight.shape[0], vocab_start)


def resolve_mode(mode: str, hidden: torch.Tensor, weight: torch.Tensor) -> str:
    """The mode a call runs (module doc): ``"auto"`` is ``"grad_in_forward"`` when autograd will ask for a gradient
    (grad mode on and ``hidden`` or ``weight`` requires grad) and ``"recompute"`` otherwise (its forward alone:
    one GEMM per vocabulary chunk and the row statistics, nothing of size ``T x V`` kept)."""
    if mode != "auto":
        return mode
    wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return "grad_in_forward" if wants_grad else "recompute"


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    ignore_index: int = -100,
    grad_weight: torch.Tensor | None = None,
    mode: str = "auto",
    token_chunk: int | None = None,
    vocab_chunk: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Per-token cross entropy of the output head ``hidden @ weight.T`` without materialising the logits.

    Args:
        hidden: ``[*, d]`` bf16 / fp16 / fp32 hidden states (replicated over ``tp_group``; zero tokens allowed).
        weight: ``[V_local, d]`` output-head weight of this rank's vocabulary shard, ``hidden``'s dtype.
        target: integer ``[*]`` token ids of the whole vocabulary; ``ignore_index`` rows get loss 0 and no
            gradient; other ids outside the vocabulary follow megatron (reference module doc).
        tp_group: the tensor-parallel group the vocabulary is split over, or ``None`` (whole vocabulary).
        vocab_start: first token id of this shard; default ``rank * V_local`` (megatron's equal shards).
        ignore_index: target id of rows without a loss (default ``-100``, torch's).
        grad_weight: ``[*]`` per-token weights the caller reduces the returned loss with, up to one scalar (the
            loss mask of a masked mean; ``None``: all ones, i.e. ``loss.sum()`` / ``loss.mean()``). Only the
            gradient-in-forward mode reads it; a backward whose upstream gradient is not proportional to it is
            still exact eagerly (recompute fallback) and NaN under CUDA-graph capture (module doc).
        mode: ``"auto"`` (gradient-in-forward when a gradient will be asked for, else the forward alone),
            ``"grad_in_forward"`` (3 head GEMMs, gradients held from the forward to the backward), ``"recompute"``
            (4 head GEMMs, the logits recomputed in the backward; nothing but the inputs held).
        token_chunk: gradient-in-forward: token rows per chunk; default ``2**29 / V_local`` rows, balanced, a
            multiple of 64 (4096 at ``V = 129280``: at most 1 GiB of bf16 logits).
        vocab_chunk: recompute: weight rows per chunk; default ``2**28 / T`` rounded down to a multiple of 128 (at
            least 128), i.e. at most 512 MiB of bf16 logits per chunk.
        backend: the cross-entropy kernels per chunk (:mod:`dsv4_primitives.dispatch`): ``"auto"`` (Triton on
            CUDA, eager PyTorch otherwise; ``DSV4_PRIMITIVES_BACKEND`` / ``DSV4_BACKEND`` override), ``"triton"``,
            ``"reference"`` (eager PyTorch statistics and gradient per chunk; the GEMMs are the same).
    Returns:
        ``loss [*]`` fp32; gradients flow to ``hidden`` and ``weight`` in their dtype (not twice differentiable).
    """
    world, start = _check_inputs(
        hidden,
        weight,
        target,
        tp_group,
        vocab_start,
        ignore_index,
        (vocab_chunk, token_chunk),
        grad_weight,
        mode,
    )
    chosen = resolve_backend(backend, hidden, weight, op="dsv4_primitives.linear_cross_entropy")
    impl = "triton" if chosen == "triton" else "torch"
    h = hidden.reshape(-1, hidden.shape[-1]).contiguous()  # [T, d]
    t = target.reshape(-1)  # [T]
    tokens, v_local = h.shape[0], weight.shape[0]
    v_chunk = vocab_chunk_rows(tokens, v_local, vocab_chunk)
    if resolve_mode(mode, hidden, weight) == "recompute":
        loss = _LinearCrossEntropy.apply(h, weight, t, tp_group, world, start, ignore_index, v_chunk, impl)
    else:
        gw = torch.ones_like(t, dtype=torch.float32) if grad_weight is None else grad_weight.reshape(-1)
        chunks = (token_chunk_rows(tokens, v_local, token_chunk), v_chunk)
        loss = LinearCrossEntropyGradInForward.apply(
            h, weight, t, gw, tp_group, world, start, ignore_index, chunks, impl
        )
    return loss.view(target.shape)
