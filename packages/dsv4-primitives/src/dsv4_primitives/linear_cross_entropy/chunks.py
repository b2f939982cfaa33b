"""Pieces shared by both modes of the fused head: chunk sizes, the fp32-output GEMM, the vocab-parallel row
statistics merge, and the recompute backward (the backward of the recompute mode, and the exact fallback of the
gradient-in-forward mode when the upstream gradient is not the declared one)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsv4_primitives.cross_entropy.apply import _IMPLS

VOCAB_CHUNK_ELEMENTS = 1 << 28  # recompute mode: logits elements of one vocabulary chunk (512 MiB in bf16)
TOKEN_CHUNK_ELEMENTS = 1 << 29  # gradient-in-forward mode: logits elements of one token chunk (1 GiB in bf16)
_ROW_ALIGN = 64


def vocab_chunk_rows(tokens: int, v_local: int, vocab_chunk: int | None) -> int:
    """Weight rows per vocabulary chunk of the recompute mode: ``vocab_chunk``, else ``2**28 / T`` rounded down to a
    multiple of 128 (at least 128), at most ``V_local``."""
    if vocab_chunk is not None:
        return min(vocab_chunk, v_local)
    c = max(128, VOCAB_CHUNK_ELEMENTS // max(tokens, 1))
    return min(v_local, c - c % 128 if c < v_local else v_local)


def token_chunk_rows(tokens: int, v_local: int, token_chunk: int | None) -> int:
    """Token rows per chunk of the gradient-in-forward mode: ``token_chunk``, else the fewest chunks of at most
    ``2**29 / V_local`` rows (rounded down to a multiple of 64, at least 64), balanced and rounded up to a multiple
    of 64: ``T = 4096..65536`` at ``V = 129280`` gives chunks of 4096 rows (1 GiB of bf16 logits, GEMMs of
    ``[4096, 4096] x [4096, 129280]``)."""
    if token_chunk is not None:
        return max(1, min(token_chunk, tokens))
    if tokens <= 0:
        return 1
    most = max(_ROW_ALIGN, TOKEN_CHUNK_ELEMENTS // max(v_local, 1) // _ROW_ALIGN * _ROW_ALIGN)
    n = -(-tokens // most)
    rows = -(-tokens // n)
    return min(tokens, -(-rows // _ROW_ALIGN) * _ROW_ALIGN)


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with fp32 output (fp32 accumulation) for low-precision ``a``, ``b``."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _finite_shift(m: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(m) & (m < 0), 0.0, m)


def tp_lse_loss(
    m: torch.Tensor,
    s: torch.Tensor,
    zt: torch.Tensor,
    t: torch.Tensor,
    vocab_start: int,
    v_local: int,
    tp_group,
    world: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse, loss)`` [R] fp32 from this shard's row statistics ``m`` (max), ``s`` (sum of ``exp(z - m)``) and raw
    target logit ``zt`` (0 where the shard does not own the target): megatron's vocab-parallel reductions over
    ``tp_group`` (all-reduce MAX of ``m``, one all-reduce SUM of the rescaled ``s`` and the shifted target logit;
    a target no shard owns gets ``loss = lse - max``)."""
    rows = m.numel()
    if world > 1 and rows:
        m_local = m.clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    m_ref = _finite_shift(m)
    if world > 1 and rows:
        s = s * torch.exp(_finite_shift(m_local) - m_ref)
    local = t.long() - vocab_start
    owned = (local >= 0) & (local < v_local)
    both = torch.stack([s, torch.where(owned, zt - m_ref, 0.0)])  # [2, R]
    if world > 1 and rows:
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=tp_group)
    log_s = torch.log(both[0])
    return m_ref + log_s, log_s - both[1]


def recompute_backward(hidden, weight, t, lse, g, tp_group, world, vocab_start, chunk, impl, need_h, need_w):
    """``(dh, dW)`` of the per-token loss for the upstream gradient ``g [T]`` (fp32, 0 on ignored rows), the logits
    recomputed per vocabulary chunk of ``chunk`` rows: ``dz_c = g (softmax - onehot)`` in place (the input dtype),
    ``dW_c = dz_c^T h`` (one GEMM over all tokens), ``dh += dz_c W_c`` in fp32, all-reduced over ``tp_group`` and
    cast to the input dtype once."""
    grad_fn = _IMPLS[impl][1]
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
            dh += mm_fp32(z, w_c)  # [T, d]
        del z
    if need_h and world > 1:
        dist.all_reduce(dh, group=tp_group)
    return (dh.to(hidden.dtype) if need_h else None), dw
