"""Streaming (token-by-token) form of the compressor: the decode / chunked-prefill state (oracle C1).

Keeps the raw rows ``(kv, score + ape)`` of the block being filled and, for the overlapping layout, the P-half of the
last completed block. When block ``w`` completes it pools exactly as :func:`compress_ref` does for that block:
overlap -> slots ``[previous block's P-half ; this block's Q-half]`` (empty previous half for ``w = 0``), softmax over
the slots per channel, weighted sum, RMSNorm, RoPE at position ``w * ratio``.
"""

from __future__ import annotations

import torch

from csa_kernels._checks import check_ratio, check_shape, compute_dtype
from dsv4_primitives import RopeConfig, apply_rope_ref, rms_norm_ref


class CompressorState:
    """Compressor state of ``batch`` sequences advancing in lockstep, one token per :meth:`step`.

    Args:
        wkv, wgate: ``[Dk, d]`` projections; ``ape`` ``[ratio, Dk]``; ``norm_weight`` ``[c]``.
        ratio, overlap, rope_cfg, eps: as in :func:`compress_ref`.
        batch: number of sequences ``B``.
    """

    def __init__(
        self,
        wkv: torch.Tensor,
        wgate: torch.Tensor,
        ape: torch.Tensor,
        norm_weight: torch.Tensor,
        ratio: int,
        overlap: bool,
        rope_cfg: RopeConfig,
        eps: float = 1e-6,
        batch: int = 1,
    ) -> None:
        check_ratio(ratio, overlap)
        check_shape(wgate, "wgate", tuple(wkv.shape))
        check_shape(ape, "ape", (ratio, wkv.shape[0]))
        self.c = wkv.shape[0] // 2 if overlap else wkv.shape[0]
        check_shape(norm_weight, "norm_weight", (self.c,))
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.dtype = compute_dtype(wkv, wgate, ape, norm_weight)
        self.wkv, self.wgate = wkv.to(self.dtype), wgate.to(self.dtype)
        self.ape, self.norm_weight = ape.to(self.dtype), norm_weight.to(self.dtype)
        self.ratio, self.overlap, self.rope_cfg, self.eps, self.batch = ratio, overlap, rope_cfg, eps, batch
        self.position = 0  # tokens consumed so far (per sequence)
        self._kv: list[torch.Tensor] = []  # rows of the block being filled, each [B, Dk]
        self._logit: list[torch.Tensor] = []
        self._prev: tuple[torch.Tensor, torch.Tensor] | None = None  # P-half of the last block, [B, m, c] x2

    def step(self, x_t: torch.Tensor) -> torch.Tensor | None:
        """Consume one token per sequence, ``x_t [B, d]``; return the new entries ``[B, c]`` (x.dtype) or ``None``."""
        check_shape(x_t, "x_t", (self.batch, self.wkv.shape[1]))
        xf = x_t.to(self.dtype)
        slot = self.position % self.ratio
        self._kv.append(xf @ self.wkv.T)  # [B, Dk]
        self._logit.append(xf @ self.wgate.T + self.ape[slot])  # [B, Dk]
        self.position += 1
        if len(self._kv) < self.ratio:
            return None
        kv_b = torch.stack(self._kv, 1)  # [B, m, Dk]
        logit_b = torch.stack(self._logit, 1)  # [B, m, Dk]
        self._kv, self._logit = [], []
        if self.overlap:
            c = self.c
            if self._prev is None:
                prev_kv = kv_b.new_zeros(self.batch, self.ratio, c)
                prev_logit = logit_b.new_full((self.batch, self.ratio, c), float("-inf"))
            else:
                prev_kv, prev_logit = self._prev
            self._prev = (kv_b[..., :c], logit_b[..., :c])
            kv_b = torch.cat((prev_kv, kv_b[..., c:]), 1)  # [B, 2m, c]
            logit_b = torch.cat((prev_logit, logit_b[..., c:]), 1)  # [B, 2m, c]
        pooled = (torch.softmax(logit_b, dim=1) * kv_b).sum(1)  # [B, c]
        w = self.position // self.ratio - 1
        pos = torch.full((self.batch,), w * self.ratio, dtype=torch.int64, device=x_t.device)
        entry = apply_rope_ref(rms_norm_ref(pooled, self.norm_weight, self.eps), pos, self.rope_cfg)
        return entry.to(x_t.dtype)
