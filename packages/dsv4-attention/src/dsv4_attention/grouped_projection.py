"""Grouped (block-diagonal) low-rank output projection ``wo_a`` (spec §2.2, oracle A3).

Heads are grouped contiguously: group ``i`` holds heads ``[i*n_h/g, (i+1)*n_h/g)``. With ``o [T, n_h*c]``:

    o_g = o.view(T, g, n_h*c/g)                            # [T, g, n_h*c/g]
    W   = weight.view(g, d_g, n_h*c/g)                     # [g, d_g, n_h*c/g]
    u   = einsum('tgi,gri->tgr', o_g, W).reshape(T, g*d_g) # [T, g*d_g]

which equals ``o @ blockdiag(W_0, ..., W_{g-1}).T``; ``weight`` is the compact ``[g*d_g, n_h*c/g]`` storage of the
checkpoint tensor ``attn.wo_a`` (HF ``o_a_proj``).
"""

from __future__ import annotations

import torch


class GroupedOutputProjection(torch.nn.Module):
    """``wo_a``: ``[.., n_h*c] -> [.., g*d_g]`` with a block-diagonal weight stored as ``[g*d_g, n_h*c/g]``.

    ``GroupedOutputProjection(input_size, groups, rank, device=..., dtype=..., init_method=...)``; returns
    ``(out, None)`` like megatron linears (the megatron adapter builds it from a spec with megatron's keywords).
    """

    def __init__(
        self,
        input_size: int,
        groups: int,
        rank: int,
        *,
        device=None,
        dtype: torch.dtype | None = None,
        init_method=None,
    ) -> None:
        super().__init__()
        self._init_projection(input_size, groups, rank, device, dtype, init_method)

    def _init_projection(self, input_size, groups, rank, device, dtype, init_method) -> None:
        if groups <= 0 or input_size % groups:
            raise ValueError(f"input_size={input_size} must be divisible by groups={groups}")
        self.input_size, self.groups, self.rank = input_size, groups, rank
        self.group_in = input_size // groups
        self.weight = torch.nn.Parameter(
            torch.empty(groups * rank, self.group_in, dtype=dtype, device=device)
        )
        if init_method is None:
            torch.nn.init.kaiming_uniform_(self.weight, a=5**0.5)  # nn.Linear's default, per group block
        elif self.weight.device.type != "meta":
            init_method(self.weight)

    def dense_weight(self) -> torch.Tensor:
        """The equivalent block-diagonal ``[g*d_g, n_h*c]`` matrix (oracle A3)."""
        w = self.weight.view(self.groups, self.rank, self.group_in)
        return torch.block_diag(*w.unbind(0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        lead = x.shape[:-1]
        w = self.weight.view(self.groups, self.rank, self.group_in).to(x.dtype)  # [g, d_g, n_h*c/g]
        u = grouped_projection(x.reshape(-1, self.input_size), w)  # [T, g*d_g]
        return u.reshape(*lead, self.groups * self.rank), None


def grouped_projection_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reference: ``u[t, g*d_g + r] = Σ_i x[t, g*n_in + i] · w[g, r, i]`` (``x [T, g*n_in]``, ``w [g, d_g, n_in]``)."""
    g, r, i = w.shape
    return torch.einsum("tgi,gri->tgr", x.reshape(-1, g, i), w).reshape(-1, g * r)


def grouped_projection(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_projection_ref` as three strided batched GEMMs and no layout copies.

    ``einsum`` moves the group axis to the front: a copy of ``x`` ([T, g, n_in] -> [g, T, n_in]) and of the result
    back, and two more of the gradients in the backward (V4-Flash at T = 4096: 256 MiB and 64 MiB per layer and
    direction). Here every GEMM reads and writes the ``[T, g, ·]`` layout in place: group ``g``'s rows are a matrix
    with leading dimension ``g·n_in`` (``g·d_g`` for the output), which cuBLAS takes as a strided batch.
    """
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[0] * w.shape[2]:
        raise ValueError(
            f"expected x [T, g*n_in] and w [g, d_g, n_in], got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    return _GroupedProjection.apply(x.contiguous(), w)


class _GroupedProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        t, (g, r, i) = x.shape[0], w.shape
        u = x.new_empty(t, g, r)  # [T, g, d_g]
        torch.bmm(x.view(t, g, i).transpose(0, 1), w.transpose(1, 2), out=u.transpose(0, 1))
        ctx.save_for_backward(x, w)
        return u.view(t, g * r)

    @staticmethod
    def backward(ctx, grad_u: torch.Tensor):
        x, w = ctx.saved_tensors
        t, (g, r, i) = x.shape[0], w.shape
        gu = grad_u.contiguous().view(t, g, r).transpose(0, 1)  # [g, T, d_g] (strided)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = x.new_empty(t, g, i)
            torch.bmm(gu, w, out=dx.transpose(0, 1))  # [g, T, n_in] into the [T, g, n_in] layout
            dx = dx.view(t, g * i)
        if ctx.needs_input_grad[1]:
            dw = torch.bmm(gu.transpose(1, 2), x.view(t, g, i).transpose(0, 1))  # [g, d_g, n_in]
        return dx, dw
