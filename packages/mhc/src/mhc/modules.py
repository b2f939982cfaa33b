"""nn.Modules: one mHC instance (``ManifoldHyperConnection``), the final ``HyperHead`` and ``StreamExpansion``.

All ``hc_*`` parameters are fp32 and marked keep-in-FP32 (§6.5). Initialisation **[OUR CHOICE]** (§6.5):
``fn ~ N(0, init_std)``, ``base = 0``, ``scale = init_gating_factor``.

Shapes: streams ``x [..., N, D]`` (the megatron wrapper views ``[S, B, N·D]`` as ``[S, B, N, D]``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dsv4_primitives import KeepFP32Mixin, mark_keep_in_fp32
from dsv4_primitives.dispatch import resolve_backend
from mhc.config import MHCConfig
from mhc.functional import expand_streams, hyper_head, mhc_coefficients, mhc_collapse, mhc_post, mhc_pre


class _StreamProjection(KeepFP32Mixin, nn.Module):
    """The parameters shared by :class:`ManifoldHyperConnection` and :class:`HyperHead`: ``fn [rows, N·D]``,
    ``base [rows]``, ``scale [scales]``, fp32 and keep-in-FP32, initialised per §6.5; and the streams check."""

    def __init__(self, config: MHCConfig, rows: int, scales: int) -> None:
        super().__init__()
        self.config = config
        n, d = config.num_streams, config.hidden_size
        self.fn = nn.Parameter(torch.empty(rows, n * d, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(rows, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(scales, dtype=torch.float32))
        for p in (self.fn, self.base, self.scale):
            mark_keep_in_fp32(p)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.normal_(self.fn, std=self.config.init_std)
            self.base.zero_()
            self.scale.fill_(self.config.init_gating_factor)

    def _check(self, x: torch.Tensor) -> None:
        n, d = self.config.num_streams, self.config.hidden_size
        if x.dim() < 3 or x.shape[-2:] != (n, d):
            raise ValueError(f"streams must be [..., {n}, {d}] (N streams x hidden), got {tuple(x.shape)}")


class ManifoldHyperConnection(_StreamProjection):
    """One mHC instance around a sub-layer ``F`` (attention or FFN): ``X -> pre -> F -> post``.

    Parameters: ``fn [(2+N)·N, N·D]`` (rows ``[pre, post, comb]``), ``base [(2+N)·N]``, ``scale [3]``
    (HF ``attn_hc.fn/base/scale``; official ``hc_attn_fn/base/scale``).

    Usage::

        x_in, post, comb = hc(X)          # X [..., N, D] -> x_in [..., D]
        X = hc.post(F(x_in), X, post, comb)
    """

    def __init__(self, config: MHCConfig) -> None:
        super().__init__(config, rows=config.num_mixes, scales=3)

    def _kw(self) -> dict:
        c = self.config
        return dict(sinkhorn_iters=c.sinkhorn_iters, norm_eps=c.norm_eps, hc_eps=c.hc_eps, backend=c.backend)

    def coefficients(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pre [..., N], post [..., N], comb [..., N, N])`` in fp32 for streams ``x [..., N, D]``."""
        self._check(x)
        return mhc_coefficients(x, self.fn, self.scale, self.base, **self._kw())

    def forward(
        self, x: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``mhc_pre``: ``x [..., N, D]`` -> ``(x_in [..., D] in out_dtype or x.dtype, post, comb)``."""
        self._check(x)
        c = self.config
        backend = resolve_backend(c.backend, x, self.fn, op="mhc.ManifoldHyperConnection")
        if backend == "reference" and c.recompute_coefficients and torch.is_grad_enabled():
            # keep only the inputs: RMS, projection and the Sinkhorn iterates are recomputed in backward
            pre, post, comb = checkpoint(self.coefficients, x, use_reentrant=False)
            return mhc_collapse(x, pre, out_dtype=out_dtype, backend=backend), post, comb
        return mhc_pre(x, self.fn, self.scale, self.base, out_dtype=out_dtype, **self._kw())

    def post(self, f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """``X' = post ⊗ F + combᵀ X`` in ``x.dtype``; ``f [..., D]``, ``x [..., N, D]``."""
        return mhc_post(f, x, post, comb, backend=self.config.backend)

    def extra_repr(self) -> str:
        c = self.config
        return f"streams={c.num_streams}, hidden={c.hidden_size}, sinkhorn_iters={c.sinkhorn_iters}"


class HyperHead(_StreamProjection):
    """Learned collapse of the streams before the final norm (§6.4; official ``hc_head_fn/base/scale``).

    ``forward(x [..., N, D]) -> h [..., D]`` with ``h = Σ_i w_i X_i``, ``w = sigmoid(scale · RMS(X) @ fn.T + base)
    + hc_eps`` (no Sinkhorn). Parameters ``fn [N, N·D]``, ``base [N]``, ``scale [1]``.
    """

    def __init__(self, config: MHCConfig) -> None:
        super().__init__(config, rows=config.num_streams, scales=1)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        self._check(x)
        c = self.config
        return hyper_head(
            x, self.fn, self.scale, self.base, norm_eps=c.norm_eps, hc_eps=c.hc_eps, out_dtype=out_dtype,
            backend=c.backend,
        )  # fmt: skip


class StreamExpansion(nn.Module):
    """``h [..., D]`` -> ``[..., N, D]``: N identical copies in the configured stream dtype (no parameters)."""

    def __init__(self, config: MHCConfig) -> None:
        super().__init__()
        self.config = config

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[-1] != self.config.hidden_size:
            raise ValueError(f"expected hidden size {self.config.hidden_size}, got {tuple(h.shape)}")
        return expand_streams(h, self.config.num_streams, self.config.stream_dtype)
