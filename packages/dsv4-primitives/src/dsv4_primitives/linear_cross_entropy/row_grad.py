"""Row loss and in-place logits gradient of a token chunk holding the WHOLE vocabulary (one fused Triton kernel).

For a chunk of rows of logits ``z [R, V]`` (``hidden_chunk @ W.T``, the input dtype), integer targets ``t [R]``
(``-1``, or any id outside ``[0, V)``, for a row without a target logit) and per-row gradient weights ``w [R]``
(fp32, 0 on ignored rows), per row (fp32 arithmetic):

    m    = max_j z_j,   s = sum_j exp(z_j - m),   lse = m + log(s)
    z_t  = z[t]          if 0 <= t < V  else m         (megatron's value for a target outside the vocabulary)
    loss = lse - z_t
    dz_j = w * (exp(z_j - lse) - [j == t])             written over z, in z's dtype (the logits are consumed)

``loss`` and ``lse`` come back in fp32. :func:`row_loss_grad_ref` is the eager fp32 reference (same math, same
in-place contract); :func:`row_loss_grad` dispatches to the kernel ``lce_row_grad_kernel``: one program per row
streams the row twice, the online ``(m, s)`` pass then the gradient pass (the row, 2 bytes x V, is read from HBM
once; its second read mostly hits L2), so the elementwise part of the head costs ~6 bytes per logit instead of the
unfused head's fp32 copies. This is the tensor-parallel-free path; with a vocabulary split over ranks the row
statistics need an all-reduce between the two passes and the two kernels of :mod:`dsv4_primitives.cross_entropy`
run instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_V_CUDA = 4096
_BLOCK_V_INTERPRET = 1 << 14


@triton.jit
def lce_row_grad_kernel(
    z_ptr,
    tgt_ptr,
    w_ptr,
    loss_ptr,
    lse_ptr,
    V,
    stride_r,
    BLOCK_V: tl.constexpr,
    RTNE_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride_r
    cols0 = tl.arange(0, BLOCK_V)
    m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros([BLOCK_V], dtype=tl.float32), axis=0)
    for c0 in range(0, V, BLOCK_V):  # pass 1: online max / sum of exponentials
        cols = c0 + cols0
        z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    t = tl.load(tgt_ptr + row).to(tl.int64)
    own = (t >= 0) & (t < V)
    zt = tl.load(base + tl.where(own, t, 0)).to(tl.float32)
    zt = tl.where(own, zt, m)
    lse = m + tl.log(s)
    tl.store(loss_ptr + row, lse - zt)
    tl.store(lse_ptr + row, lse)
    w = tl.load(w_ptr + row)
    for c0 in range(0, V, BLOCK_V):  # pass 2: dz = w (softmax - onehot), in place
        cols = c0 + cols0
        msk = cols < V
        z = tl.load(base + cols, mask=msk, other=0.0).to(tl.float32)
        dz = (tl.exp(z - lse) - tl.where(cols.to(tl.int64) == t, 1.0, 0.0)) * w
        if RTNE_BF16:  # the interpreter's fp32 -> bf16 cast truncates: round to nearest even as the GPU does
            bits = dz.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            dz = bits.to(tl.float32, bitcast=True)
        tl.store(base + cols, dz.to(z_ptr.dtype.element_ty), mask=msk)


def row_loss_grad_ref(z: torch.Tensor, t: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager fp32 reference (module doc; fp64 for fp64 ``z``): returns ``(loss [R], lse [R])`` and overwrites
    ``z [R, V]`` with ``dz``."""
    ct = torch.promote_types(z.dtype, torch.float32)
    zf = z.to(ct)  # [R, V]
    v = zf.shape[1]
    m = zf.amax(-1) if zf.shape[0] else zf.new_empty(0)
    lse = m + torch.log(torch.exp(zf - m[:, None]).sum(-1))  # [R]
    tl_ = t.long()
    own = (tl_ >= 0) & (tl_ < v)
    idx = torch.where(own, tl_, 0)[:, None]
    zt = torch.where(own, zf.gather(-1, idx).squeeze(-1), m)
    dz = torch.exp(zf - lse[:, None])
    dz.scatter_add_(-1, idx, torch.where(own, -1.0, 0.0).to(ct)[:, None])
    z.copy_(dz * w.to(ct)[:, None])
    return lse - zt, lse


def row_loss_grad(
    z: torch.Tensor, t: torch.Tensor, w: torch.Tensor, impl: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss [R], lse [R])`` fp32 of the rows of ``z [R, V]`` (row-contiguous), ``z`` overwritten with ``dz``;
    ``impl`` ``"triton"`` (the fused kernel) or ``"torch"`` (:func:`row_loss_grad_ref`)."""
    if impl != "triton":
        return row_loss_grad_ref(z, t, w)
    rows, v = z.shape
    loss = torch.empty(rows, dtype=torch.float32, device=z.device)
    lse = torch.empty(rows, dtype=torch.float32, device=z.device)
    if rows:
        block_v = min(_BLOCK_V_CUDA if z.is_cuda else _BLOCK_V_INTERPRET, triton.next_power_of_2(v))
        lce_row_grad_kernel[(rows,)](
            z,
            t,
            w,
            loss,
            lse,
            v,
            z.stride(0),
            BLOCK_V=block_v,
            RTNE_BF16=(not z.is_cuda) and z.dtype == torch.bfloat16,
            num_warps=8 if z.is_cuda else 1,
        )
    return loss, lse
