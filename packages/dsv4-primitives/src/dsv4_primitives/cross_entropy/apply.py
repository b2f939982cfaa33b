"""Public, dispatching vocab-parallel cross entropy: ``vocab_parallel_cross_entropy`` (autograd).

Same math as :func:`dsv4_primitives.cross_entropy.reference.vocab_parallel_cross_entropy_ref` (see its docstring)
and the same semantics as megatron-core 0.19.2's ``tensor_parallel.vocab_parallel_cross_entropy``: the logits are
this rank's vocabulary shard, the row max is all-reduced (MAX), the target logit comes from the rank owning the
target, the sum of exponentials is all-reduced (SUM). The process group is passed explicitly.

Forward: per row ``(max, sum_exp, target_logit[, sum_logits])`` in fp32, computed in one read of the logits (Triton
kernel, or eager PyTorch for ``backend="reference"``); with a tensor-parallel group the local sums are rescaled to the
global max and summed in one all-reduce (two collectives in all). Saved for the backward: the logits tensor itself
(no copy unless it had to be made contiguous), the targets and ``lse`` (fp32, 4 bytes per row); no fp32 ``[*, V]``
tensor lives between forward and backward.

Backward: one pass writing ``grad_logits = g * (softmax - (1 - e) * onehot - e / K)`` in the logits dtype, into a
new contiguous tensor by default. ``inplace_backward=True`` writes it into the saved logits buffer instead (what
megatron does with its private fp32 copy), saving one logits-sized allocation; it is safe when nothing reads the
logits after the backward: autograd users are protected (the logits' version counter is bumped, so another op
that saved them raises at its backward instead of reading gradients), leaf tensors and views of leaves are
refused, and a private contiguous copy (made for non-viewable input layouts) is always written in place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from dsv4_primitives.cross_entropy.kernel import ce_bwd_kernel, ce_fwd_stats_kernel
from dsv4_primitives.dispatch import resolve_backend

_TILE_FWD_CUDA = 8192  # elements of one forward program's [BLOCK_R, BLOCK_V] chunk
_TILE_BWD_CUDA = 8192  # elements of one backward program's tile
_MAX_BLOCK_V_CUDA = 8192
_TILE_INTERPRET = 1 << 16  # interpreter: few, large programs
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def vocab_shard(
    tp_group: dist.ProcessGroup | None, shard_size: int, vocab_start: int | None
) -> tuple[int, int]:
    """``(tp world size, first token id of this rank's shard)`` for a vocabulary split over ``tp_group``
    (``None``: one shard); ``vocab_start`` defaults to megatron's VocabUtility rule (equal shards in rank order).
    ``ValueError`` for a group this process cannot use or a bad ``vocab_start``."""
    world, rank = 1, 0
    if tp_group is not None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("tp_group was given but torch.distributed is not initialised")
        world, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        if rank < 0:
            raise ValueError(
                "this process is not a member of tp_group; pass the tensor-parallel group it belongs to"
            )
    if vocab_start is None:
        vocab_start = rank * shard_size  # megatron's VocabUtility: equal shards in rank order
    elif isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
        raise ValueError(
            f"vocab_start must be a non-negative int (first token id of this shard), got {vocab_start!r}"
        )
    return world, int(vocab_start)


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------------- layouts


def _row_layout(x: torch.Tensor) -> tuple[int, int, int] | None:
    """``(B, stride_o, stride_i)`` addressing the rows of ``x [*, V]`` in place (see kernel.py), or None."""
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        return None
    try:
        x2 = x.view(-1, x.shape[-1])  # [R, V]
        return 1, (x2.stride(0) if x2.shape[0] > 1 else x.shape[-1]), 0
    except RuntimeError:
        pass
    if x.dim() == 3:  # [S, B, V] with unmergeable S, B strides
        return x.shape[1], x.stride(0), x.stride(1)
    return None


def _contiguous_layout(x: torch.Tensor, b: int) -> tuple[int, int]:
    """``(stride_o, stride_i)`` of a contiguous tensor shaped like ``x`` under the row grouping ``b``."""
    v = x.shape[-1]
    return (v, 0) if b == 1 else (b * v, v)


# ----------------------------------------------------------------------------------------- backend kernels


def _launch_cfg(rows: int, v: int, is_cuda: bool, tile: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_V, num_warps)`` for ``rows`` rows of ``v`` logits."""
    if is_cuda:
        block_v = min(_MAX_BLOCK_V_CUDA, _next_pow2(v))
        block_r = max(1, min(_next_pow2(max(rows, 1)), tile // block_v))
        num_warps = min(16, max(4, block_r * block_v // 512))  # ~16 fp32 values per thread
        return block_r, block_v, num_warps
    block_v = min(_TILE_INTERPRET, _next_pow2(v))
    return max(1, min(_next_pow2(max(rows, 1)), _TILE_INTERPRET // block_v)), block_v, 1


def _stats_triton(x, layout, t, vocab_start, need_sum):
    rows, v = t.numel(), x.shape[-1]
    stats = torch.empty((4 if need_sum else 3, rows), dtype=torch.float32, device=x.device)  # m, s, z_t, zsum
    if rows:
        b, so, si = layout
        block_r, block_v, num_warps = _launch_cfg(rows, v, x.is_cuda, _TILE_FWD_CUDA)
        ce_fwd_stats_kernel[(_cdiv(rows, block_r),)](
            x,
            t,
            stats[0],
            stats[1],
            stats[2],
            stats[3] if need_sum else stats[0],  # dummy pointer, never written without NEED_SUM
            rows,
            v,
            b,
            so,
            si,
            vocab_start,
            NEED_SUM=need_sum,
            BLOCK_R=block_r,
            BLOCK_V=block_v,
            num_warps=num_warps,
        )
    return stats


def _stats_torch(x, layout, t, vocab_start, need_sum):
    v = x.shape[-1]
    z = x.reshape(-1, v).to(torch.promote_types(x.dtype, torch.float32))  # [R, V]
    m = z.amax(-1) if z.shape[0] else z.new_empty(0)
    m_ref = torch.where(torch.isinf(m) & (m < 0), 0.0, m)
    s = torch.exp(z - m_ref[:, None]).sum(-1)
    local = t.long() - vocab_start
    owned = (local >= 0) & (local < v)
    zt = torch.where(owned, z.gather(-1, torch.where(owned, local, 0)[:, None]).squeeze(-1), 0.0)
    parts = [m, s, zt] + ([z.sum(-1)] if need_sum else [])
    return torch.stack(parts)


def _grad_triton(x, layout, out, out_layout, t, lse, g, vocab_start, target_coef, uniform):
    rows, v = t.numel(), x.shape[-1]
    if rows == 0:
        return
    b, sxo, sxi = layout
    soo, soi = out_layout
    block_r, block_v, num_warps = _launch_cfg(rows, v, x.is_cuda, _TILE_BWD_CUDA)
    ce_bwd_kernel[(_cdiv(rows, block_r), _cdiv(v, block_v))](
        x,
        out,
        t,
        lse,
        g,
        rows,
        v,
        b,
        sxo,
        sxi,
        soo,
        soi,
        vocab_start,
        float(target_coef),
        float(uniform),
        BLOCK_R=block_r,
        BLOCK_V=block_v,
        num_warps=num_warps,
    )


def _grad_torch(x, layout, out, out_layout, t, lse, g, vocab_start, target_coef, uniform):
    v = x.shape[-1]
    ct = torch.promote_types(x.dtype, torch.float32)
    dz = torch.exp(x.reshape(-1, v).to(ct) - lse[:, None].to(ct))  # [R, V]
    if uniform:
        dz -= uniform
    local = t.long() - vocab_start
    owned = (local >= 0) & (local < v)
    rows = torch.arange(dz.shape[0], device=dz.device)
    dz[rows[owned], local[owned]] -= target_coef
    dz *= g[:, None].to(ct)
    out.copy_(dz.view(out.shape))


_IMPLS = {"triton": (_stats_triton, _grad_triton), "torch": (_stats_torch, _grad_torch)}


# ------------------------------------------------------------------------------------------------ autograd


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group, world, vocab_start, label_smoothing, inplace_backward, impl):
        v = logits.shape[-1]
        layout = _row_layout(logits) if impl == "triton" else (1, v, 0)
        x, private = logits, False
        if layout is None:  # not addressable in place: one contiguous copy (then ours to overwrite)
            x, private = logits.contiguous(), True
            layout = _row_layout(x)
        t = target.reshape(-1).contiguous()  # [R]
        rows = t.numel()
        need_sum = label_smoothing > 0.0
        stats_fn, _ = _IMPLS[impl]
        stats = stats_fn(x, layout, t, vocab_start, need_sum)  # [3 or 4, R] m, s, z_t[, zsum]
        m, s, zt = stats[0], stats[1], stats[2]
        if world > 1 and rows:
            m_local = m.clone()
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)  # global row max
        m_ref = torch.where(torch.isinf(m) & (m < 0), 0.0, m)  # finite shift
        if world > 1 and rows:
            s.mul_(torch.exp(m_local - m_ref))  # local sum rescaled to the global max
        local = t.long() - vocab_start
        owned = (local >= 0) & (local < v)
        # megatron's target term: the max-shifted target logit on the owning rank, 0 elsewhere (summed over ranks)
        zt.copy_(torch.where(owned, zt - m_ref, 0.0))
        if world > 1 and rows:
            dist.all_reduce(stats[1:], op=dist.ReduceOp.SUM, group=tp_group)  # s, z_t - m[, zsum]
        log_s = torch.log(s)
        lse = m_ref + log_s  # [R]
        vocab = v * world  # K: megatron's equal shards
        e = label_smoothing * vocab / (vocab - 1) if need_sum else 0.0
        if need_sum:
            loss = log_s - (1.0 - e) * zt - e * (stats[3] / vocab - m_ref)
        else:
            loss = log_s - zt
        ctx.save_for_backward(x, t, lse)
        ctx.meta = (layout, vocab_start, 1.0 - e, e / vocab, impl, inplace_backward or private, private)
        ctx.logits_shape = logits.shape
        return loss.view(target.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        if not ctx.needs_input_grad[0]:
            return (None,) * 8
        x, t, lse = ctx.saved_tensors
        layout, vocab_start, target_coef, uniform, impl, inplace, private = ctx.meta
        g = grad_loss.reshape(-1).to(lse.dtype).contiguous()  # [R]
        if inplace:
            out, out_layout = x, layout[1:]
        else:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            out_layout = _contiguous_layout(x, layout[0])
        _IMPLS[impl][1](x, layout, out, out_layout, t, lse, g, vocab_start, target_coef, uniform)
        if inplace and not private:
            torch.autograd.graph.increment_version(x)  # other savers of the logits now fail loudly
        return out.view(ctx.logits_shape), None, None, None, None, None, None, None


# ------------------------------------------------------------------------------------------------ public API


def _check_inputs(
    logits, target, tp_group, vocab_start, label_smoothing, inplace_backward
) -> tuple[int, int]:
    """Validate the public arguments; return ``(world, vocab_start)``."""
    if not isinstance(logits, torch.Tensor) or logits.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"vocab_parallel_cross_entropy needs logits of dtype bf16/fp16/fp32/fp64, got "
            f"{getattr(logits, 'dtype', type(logits).__name__)}"
        )
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be [*, V_local] with V_local >= 1, got shape {tuple(logits.shape)}")
    if (
        not isinstance(target, torch.Tensor)
        or target.dtype.is_floating_point
        or target.is_complex()
        or target.dtype == torch.bool
    ):
        raise ValueError(
            f"target must be an integer tensor of token ids, got {getattr(target, 'dtype', type(target).__name__)}"
        )
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal logits.shape[:-1] {tuple(logits.shape[:-1])} "
            "(e.g. target [S, B] for logits [S, B, V/tp])"
        )
    if target.device != logits.device:
        raise ValueError(
            f"target is on {target.device} but logits are on {logits.device}; move it to the logits"
        )
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise ValueError(f"label_smoothing must be a float in [0, 1), got {label_smoothing!r}")
    if not 0.0 <= float(label_smoothing) < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1) (megatron's range), got {label_smoothing}")
    if not isinstance(inplace_backward, bool):
        raise ValueError(f"inplace_backward must be a bool, got {inplace_backward!r}")
    v = logits.shape[-1]
    world, vocab_start = vocab_shard(tp_group, v, vocab_start)
    if label_smoothing > 0 and v * world < 2:
        raise ValueError("label_smoothing > 0 needs a vocabulary of at least 2 tokens (it divides by K - 1)")
    if inplace_backward and logits.requires_grad:
        base = logits._base if logits._base is not None else logits
        if base.is_leaf and base.requires_grad:
            raise ValueError(
                "inplace_backward=True would overwrite a leaf tensor that requires grad (or a view of one) with its "
                "own gradient; pass the non-leaf logits of the output layer, or use inplace_backward=False"
            )
        overlapping = torch._debug_has_internal_overlap(logits) == 1 or any(
            st == 0 and n > 1 for st, n in zip(logits.stride(), logits.shape)
        )
        if overlapping:
            raise ValueError(
                "inplace_backward=True needs logits whose rows do not share memory (got an expanded / overlapping "
                f"view with strides {tuple(logits.stride())}); pass .contiguous() logits or use inplace_backward=False"
            )
    return world, int(vocab_start)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    label_smoothing: float = 0.0,
    inplace_backward: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Per-token cross entropy with the vocabulary split across ``tp_group`` (fused; differentiable w.r.t. logits).

    Same results as megatron-core's ``tensor_parallel.vocab_parallel_cross_entropy(logits, target,
    label_smoothing, tp_group)``, computed in fp32 without fp32 copies of the logits.

    Args:
        logits: ``[*, V_local]`` bf16 / fp16 / fp32 (fp64 runs the eager path in fp64), this rank's vocabulary
            shard (``[S, B, V/tp]`` from megatron's output layer); any strides (rows not addressable in place are
            copied to a contiguous buffer once); zero rows allowed.
        target: integer ``[*]`` token ids of the whole vocabulary (``logits.shape[:-1]``); its logit comes from
            the owning rank. There is no ignore index: a target outside the whole vocabulary gets megatron's value
            (loss ``lse - max``, no one-hot gradient; reference module doc).
        tp_group: the tensor-parallel process group the vocabulary is split over, or ``None`` when ``logits`` hold
            the whole vocabulary (no communication; unlike megatron, ``None`` never means a global group).
        vocab_start: first token id of this shard; default ``rank * V_local`` (megatron's equal shards).
        label_smoothing: ``a`` in ``[0, 1)``: megatron's smoothing, ``e = a K / (K - 1)``, ``K = V_local * tp``
            (the whole vocabulary; megatron-core 0.19.2 uses the local shard for ``K`` and the mean log-prob,
            which is the same for ``tp = 1``).
        inplace_backward: write the logits gradient into the logits buffer (saves one logits-sized allocation;
            only when nothing reads the logits after the backward; leaves are refused). Module doc: safety rules.
        backend: ``"auto"`` (Triton for CUDA tensors, eager PyTorch otherwise; the environment variable
            ``DSV4_PRIMITIVES_BACKEND`` overrides it), ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``),
            ``"reference"`` (eager PyTorch with fp32 temporaries, same autograd Function).
    Returns:
        ``loss [*]`` fp32 (fp64 for fp64 logits); the logits gradient comes back in the logits dtype.
    """
    world, start = _check_inputs(logits, target, tp_group, vocab_start, label_smoothing, inplace_backward)
    impl = (
        "triton"
        if resolve_backend(backend, logits, op="dsv4_primitives.vocab_parallel_cross_entropy") == "triton"
        else "torch"
    )
    if logits.dtype == torch.float64:
        impl = "torch"
    return _VocabParallelCrossEntropy.apply(
        logits, target, tp_group, world, start, float(label_smoothing), inplace_backward, impl
    )
