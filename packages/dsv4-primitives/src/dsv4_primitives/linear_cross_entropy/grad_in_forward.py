"""Gradient-in-forward mode of the fused head: both gradients are computed inside the forward's token-chunk loop.

Same math as :func:`dsv4_primitives.linear_cross_entropy.reference.linear_cross_entropy_ref`. The tokens are
walked in chunks of ``Tc`` rows (default :func:`~dsv4_primitives.linear_cross_entropy.chunks.token_chunk_rows`:
4096 rows at ``V = 129280``); each chunk holds its rows' logits over this rank's WHOLE vocabulary shard, so the
softmax normaliser is complete inside the chunk and the gradient can be formed at once:

    z_c  = h_c W^T                               [Tc, V_local]  GEMM 1 (input dtype, fp32 accumulation)
    dz_c = w_c (softmax(z_c) - onehot)            in place over z_c  (one fused Triton kernel without TP;
                                                  stats kernel, all-reduces, gradient kernel with TP)
    dh_c = dz_c W                                [Tc, d]        GEMM 2 (all-reduced over tp_group in fp32)
    dW  += dz_c^T h_c                            [V_local, d]   GEMM 3 (first chunk writes, later ones add)

Three head GEMMs of ``2 T V d`` FLOPs instead of the recompute mode's four. ``w`` are the gradient weights the
caller declares (``grad_weight``; default 1; 0 on ``ignore_index`` rows): the mode is exact when the upstream
gradient ``G`` of the per-token loss is ``c * w`` for one scalar ``c`` (``loss.sum()``, ``loss.mean()``, a masked
sum or mean with the declared mask, the context-parallel partial of :mod:`dsv4_primitives.cp_partial_loss`). The
backward then only scales: ``c = <G, w> / <w, w>`` (on the device), ``dh *= c``, ``dW *= c`` (in place).

When ``G`` is not proportional to ``w`` the result would be wrong, so the backward checks it
(``max |G - c w| <= 1e-5 max |G|``, ignored rows excluded, agreed over ``tp_group``): eagerly (one host sync)
a failed check falls back to the recompute backward (exact for any ``G``; ``hidden`` and ``weight`` are kept);
while a CUDA graph is being captured no sync is possible and a failed check makes ``c`` NaN, so the gradients are
NaN (loud) instead of silently wrong.

Precision: ``dh`` rows are one GEMM over the whole local vocabulary (as the unfused head), then one rounding of
the scale by ``c``. ``dW`` is accumulated in the weight dtype (bf16 in training): every chunk's GEMM accumulates
in fp32 and adds the bf16 running sum in its epilogue (``addmm`` with ``beta = 1``), so ``dW`` is rounded once per
token chunk (once in all for ``T <= Tc``, 16 times at ``T = 64K``), plus the scale. An fp32 ``[V, d]`` accumulator
(2 GiB at ``V = 129280``) would not fit next to the logits chunk under the memory target (liger-kernel + 1 GiB).

Memory held from the forward to the backward: ``dh`` ``[T, d]`` and ``dW`` ``[V_local, d]`` in the input dtype
(they become the returned gradients, so nothing is allocated in the backward); the peak adds one logits chunk
``[Tc, V_local]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from dsv4_primitives.cross_entropy.apply import _IMPLS
from dsv4_primitives.linear_cross_entropy.chunks import mm_fp32, recompute_backward, tp_lse_loss
from dsv4_primitives.linear_cross_entropy.row_grad import row_loss_grad

_PROPORTIONAL_RTOL = 1e-5


def _chunk_loss_grad(z, t_c, w_c, tp_group, world, vocab_start, impl):
    """``(loss, lse)`` of the rows of ``z [Tc, V_local]``; ``z`` overwritten with ``w (softmax - onehot)``."""
    if world == 1 and vocab_start == 0:
        return row_loss_grad(z, t_c, w_c, impl)
    stats_fn, grad_fn = _IMPLS[impl]
    layout = (1, z.shape[1], 0)
    st = stats_fn(z, layout, t_c, vocab_start, False)  # [3, Tc] m, s, z_t
    lse, loss = tp_lse_loss(st[0], st[1], st[2], t_c, vocab_start, z.shape[1], tp_group, world)
    grad_fn(z, layout, z, layout[1:], t_c, lse, w_c, vocab_start, 1.0, 0.0)  # z <- dz in place
    return loss, lse


def _upstream_scale(g, w, tp_group, world):
    """``(c, ok)``: the least-squares scalar ``c`` of ``g ~ c w`` (fp64, 0 when ``w`` is all zero) and whether
    ``g`` is ``c w`` to ``1e-5`` of ``max |g|`` (a bool tensor, agreed over ``tp_group``); no host sync."""
    g64, w64 = g.double(), w.double()
    den = (w64 * w64).sum()
    c = torch.where(den > 0, (g64 * w64).sum() / den.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    resid = (g64 - c * w64).abs().amax() if g.numel() else g64.new_zeros(())
    ok = (resid <= _PROPORTIONAL_RTOL * (g64.abs().amax() if g.numel() else 0.0)).to(torch.int32)
    if world > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=tp_group)
    return c, ok.bool()


class LinearCrossEntropyGradInForward(torch.autograd.Function):
    """The gradient-in-forward autograd Function (module doc); called by :func:`linear_cross_entropy`."""

    @staticmethod
    def forward(
        ctx, hidden, weight, target, grad_weight, tp_group, world, vocab_start, ignore_index, chunks, impl
    ):
        token_chunk, vocab_chunk = chunks
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        tokens = hidden.shape[0]
        ignored = target == ignore_index
        t = torch.where(ignored, -1, target).contiguous()  # [T] ignored rows own no target anywhere
        w = torch.where(ignored, 0.0, grad_weight.to(torch.float32)).contiguous()  # [T] declared dz weights
        loss = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(loss)
        dh = torch.empty_like(hidden) if need_h else None
        dw = (torch.empty_like(weight) if tokens else torch.zeros_like(weight)) if need_w else None
        for r0 in range(0, tokens, token_chunk):
            r1 = min(tokens, r0 + token_chunk)
            h_c = hidden[r0:r1]  # [Tc, d]
            z = h_c @ weight.t()  # [Tc, V_local] input dtype, fp32 accumulation
            loss[r0:r1], lse[r0:r1] = _chunk_loss_grad(
                z, t[r0:r1], w[r0:r1], tp_group, world, vocab_start, impl
            )
            if need_h:
                if world == 1:
                    torch.mm(z, weight, out=dh[r0:r1])  # [Tc, d]
                else:
                    part = mm_fp32(z, weight)  # [Tc, d] fp32 partial over this vocabulary shard
                    dist.all_reduce(part, group=tp_group)
                    dh[r0:r1].copy_(part)
            if need_w:
                if r0 == 0:
                    torch.mm(z.t(), h_c, out=dw)  # [V_local, d]
                else:
                    dw.addmm_(z.t(), h_c)  # fp32 accumulation inside, one rounding of the running sum
            del z
        loss = torch.where(ignored, 0.0, loss)
        ctx.save_for_backward(hidden, weight, t, lse, w, ignored)
        ctx.grads = (dh, dw)
        ctx.meta = (tp_group, world, vocab_start, vocab_chunk, impl)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        hidden, weight, t, lse, w, ignored = ctx.saved_tensors
        tp_group, world, vocab_start, vocab_chunk, impl = ctx.meta
        dh, dw = ctx.grads
        ctx.grads = (None, None)
        g = torch.where(ignored, 0.0, grad_loss.reshape(-1).to(torch.float32)).contiguous()  # [T]
        c, ok = _upstream_scale(g, w, tp_group, world)
        capturing = hidden.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and not bool(ok):  # not the declared reduction: exact recompute backward
            del dh, dw
            dh, dw = recompute_backward(
                hidden,
                weight,
                t,
                lse,
                g,
                tp_group,
                world,
                vocab_start,
                vocab_chunk,
                impl,
                ctx.needs_input_grad[0],
                ctx.needs_input_grad[1],
            )
        else:
            c = torch.where(ok, c, float("nan")).to(torch.float32)  # under capture: NaN, never silently wrong
            if dh is not None:
                dh.mul_(c)
            if dw is not None:
                dw.mul_(c)
        return dh, dw, None, None, None, None, None, None, None, None
