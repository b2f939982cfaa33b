"""Fused output head + cross entropy: ``linear_cross_entropy(hidden, weight, target)`` (autograd), vocab-chunked.

Same math as :func:`dsv4_primitives.linear_cross_entropy.reference.linear_cross_entropy_ref` (see its docstring);
the ``[T, V]`` logits are never materialised. The vocabulary (this rank's shard ``weight [V_local, d]``) is walked
in chunks of ``C`` rows of ``weight``; each chunk's logits ``z_c = h W_c^T`` ``[T, C]`` live only inside its step.

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

_CHUNK_ELEMENTS = 1 << 28  # logits elements of one vocabulary chunk (512 MiB in bf16)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _chunk_rows(tokens: int, v_local: int, vocab_chunk: int | None) -> int:
    if vocab_chunk is not None:
        return min(vocab_chunk, v_local)
    c = max(128, _CHUNK_ELEMENTS // max(tokens, 1))
    return min(v_local, c - c % 128 if c < v_local else v_local)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with fp32 output (fp32 accumulation) for low-precision ``a``, ``b``."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _combine(m, s, m_c, s_c):
    """Online merge of two ``(max, sum exp(z - max))`` row statistics (``-inf`` maxima shift by 0)."""
    m_new = torch.maximum(m, m_c)
    ref = torch.where(torch.isinf(m_new) & (m_new < 0), 0.0, m_new)
    m_ref = torch.where(torch.isinf(m) & (m < 0), 0.0, m)
    mc_ref = torch.where(torch.isinf(m_c) & (m_c < 0), 0.0, m_c)
    return m_new, s * torch.exp(m_ref - ref) + s_c * torch.exp(mc_ref - ref)


class _LinearCrossEntropy(torch.autograd.Function):
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
        if world > 1 and tokens:
            m_local = m.clone()
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
        m_ref = torch.where(torch.isinf(m) & (m < 0), 0.0, m)
        if world > 1 and tokens:
            s = s * torch.exp(torch.where(torch.isinf(m_local) & (m_local < 0), 0.0, m_local) - m_ref)
        local = t.long() - vocab_start
        owned = (local >= 0) & (local < v_local)
        both = torch.stack([s, torch.where(owned, zt - m_ref, 0.0)])  # [2, T]
        if world > 1 and tokens:
            dist.all_reduce(both, op=dist.ReduceOp.SUM, group=tp_group)
        log_s = torch.log(both[0])
        lse = m_ref + log_s  # [T]
        loss = torch.where(ignored, 0.0, log_s - both[1])
        ctx.save_for_backward(hidden, weight, t, lse, ignored)
        ctx.meta = (tp_group, world, vocab_start, chunk, impl)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        hidden, weight, t, lse, ignored = ctx.saved_tensors
        tp_group, world, vocab_start, chunk, impl = ctx.meta
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_fn = _IMPLS[impl][1]
        g = torch.where(ignored, 0.0, grad_loss.to(torch.float32)).contiguous()  # [T]
        v_local = weight.shape[0]
        dh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        dw = torch.empty_like(weight) if need_w else None
        for c0 in range(0, v_local, chunk):
            w_c = weight[c0 : c0 + chunk]  # [C, d]
            z = hidden @ w_c.t()  # [T, C] recomputed logits
            layout = (1, z.shape[1], 0)
            grad_fn(z, layout, z, layout[1:], t, lse, g, vocab_start + c0, 1.0, 0.0)  # z <- dz in place
            if need_w:
                torch.mm(z.t(), hidden, out=dw[c0 : c0 + chunk])  # [C, d]
            if need_h:
                dh += _mm_fp32(z, w_c)  # [T, d]
            del z
        if need_h and world > 1:
            dist.all_reduce(dh, group=tp_group)
        return (
            dh.to(hidden.dtype) if need_h else None,
            dw,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def _check_inputs(hidden, weight, target, tp_group, vocab_start, ignore_index, vocab_chunk):
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
    if vocab_chunk is not None and (
        isinstance(vocab_chunk, bool) or not isinstance(vocab_chunk, int) or vocab_chunk < 1
    ):
        raise ValueError(f"vocab_chunk must be a positive int or None, got {vocab_chunk!r}")
    return vocab_shard(tp_group, weight.shape[0], vocab_start)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    ignore_index: int = -100,
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
        vocab_chunk: weight rows per chunk; default: ``2**28 / T`` rounded down to a multiple of 128 (at least 128),
            i.e. at most 512 MiB of bf16 logits per chunk.
        backend: the cross-entropy kernels per chunk (:mod:`dsv4_primitives.dispatch`): ``"auto"`` (Triton on
            CUDA, eager PyTorch otherwise; ``DSV4_PRIMITIVES_BACKEND`` / ``DSV4_BACKEND`` override), ``"triton"``,
            ``"reference"`` (eager PyTorch statistics and gradient per chunk; the GEMMs are the same).
    Returns:
        ``loss [*]`` fp32; gradients flow to ``hidden`` and ``weight`` in their dtype.
    """
    world, start = _check_inputs(hidden, weight, target, tp_group, vocab_start, ignore_index, vocab_chunk)
    chosen = resolve_backend(backend, hidden, weight, op="dsv4_primitives.linear_cross_entropy")
    impl = "triton" if chosen == "triton" else "torch"
    h = hidden.reshape(-1, hidden.shape[-1]).contiguous()  # [T, d]
    t = target.reshape(-1)  # [T]
    chunk = _chunk_rows(h.shape[0], weight.shape[0], vocab_chunk)
    loss = _LinearCrossEntropy.apply(h, weight, t, tp_group, world, start, ignore_index, chunk, impl)
    return loss.view(target.shape)
