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
from megatron.core.transformer.module import MegatronModule


class GroupedOutputProjection(MegatronModule):
    """``wo_a``: ``[.., n_h*c] -> [.., g*d_g]`` with a block-diagonal weight stored as ``[g*d_g, n_h*c/g]``.

    Built by ``build_module(spec, in_features, groups, rank, config=..., init_method=...)``; returns ``(out, None)``
    like megatron linears.
    """

    def __init__(
        self, input_size: int, groups: int, rank: int, *, config, init_method=None, **_unused
    ) -> None:
        super().__init__(config=config)
        if groups <= 0 or input_size % groups:
            raise ValueError(f"input_size={input_size} must be divisible by groups={groups}")
        self.input_size, self.groups, self.rank = input_size, groups, rank
        self.group_in = input_size // groups
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        if torch.get_default_device().type == "meta":
            device = "meta"
        self.weight = torch.nn.Parameter(
            torch.empty(groups * rank, self.group_in, dtype=config.params_dtype, device=device)
        )
        init = init_method if init_method is not None else config.init_method
        if config.perform_initialization and device != "meta":
            init(self.weight)

    def dense_weight(self) -> torch.Tensor:
        """The equivalent block-diagonal ``[g*d_g, n_h*c]`` matrix (oracle A3)."""
        w = self.weight.view(self.groups, self.rank, self.group_in)
        return torch.block_diag(*w.unbind(0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        lead = x.shape[:-1]
        xg = x.reshape(-1, self.groups, self.group_in)  # [T, g, n_h*c/g]
        w = self.weight.view(self.groups, self.rank, self.group_in).to(x.dtype)  # [g, d_g, n_h*c/g]
        u = torch.einsum("tgi,gri->tgr", xg, w)  # [T, g, d_g]
        return u.reshape(*lead, self.groups * self.rank), None
