"""KV compressor module (spec §3): CSA (ratio 4, overlapping "two series") and HCA (ratio 128, plain blocks).

Per document of a pack (``cu_seqlens``), from the block input ``x`` (after ``attn_norm``, NOT the query latent):

    kv    = linear_wkv(x)                       # [T, coff*c]   coff = 2 for ratio 4 (overlap), 1 for ratio 128
    score = linear_wgate(x)                     # [T, coff*c]   gate logits; ape [ratio, coff*c] (fp32) is added
    P     = csa_kernels.compressor_pool(kv, score, ape, ratio, overlap, cu_seqlens)   # [Tc, c] fp32 softmax pooling
    C     = RoPE(norm(P), pos = w * ratio)      # [Tc, c]   weighted RMSNorm, rotation at the block's first token

Only complete blocks are compressed (a document of length ``L`` gives ``floor(L / ratio)`` entries). The projections
come from the spec's linear provider; the pooling numerics from csa-kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from dsv4_attention._kernels import compressed_cu_seqlens_host, compressed_positions, compressor_pool
from dsv4_attention._linears import column_parallel_kwargs
from dsv4_attention._rope import rope
from dsv4_primitives import KeepFP32Mixin, RopeConfig, mark_keep_in_fp32


@dataclass
class CompressorSubmodules:
    """Submodules of :class:`Compressor`: two column-parallel linears and a weighted RMSNorm."""

    linear_wkv: Any = None
    linear_wgate: Any = None
    norm: Any = None


class Compressor(KeepFP32Mixin, MegatronModule):
    """Softmax-gated block compressor producing one ``head_dim``-wide entry per complete block.

    Args:
        config: :class:`~dsv4_attention.config.DSv4AttentionConfig`.
        submodules: :class:`CompressorSubmodules`.
        compress_ratio: block size (4 overlapping, 128 plain).
        head_dim: entry width ``c`` (512 for the main KV, ``c_I`` = 128 for the indexer keys).
        rope_cfg: the layer's rotary table.
        pg_collection: explicit process groups (``tp`` is used by the linears).
    """

    def __init__(
        self,
        config,
        submodules: CompressorSubmodules,
        compress_ratio: int,
        head_dim: int,
        rope_cfg: RopeConfig,
        pg_collection,
    ) -> None:
        super().__init__(config=config)
        if compress_ratio not in (4, 128):
            raise ValueError(f"Compressor needs compress_ratio 4 (CSA) or 128 (HCA), got {compress_ratio}")
        if pg_collection is None:
            raise ValueError("Compressor needs an explicit ProcessGroupCollection (pg_collection)")
        self.compress_ratio = compress_ratio
        self.overlap = compress_ratio == 4
        self.head_dim = head_dim
        self.rope_cfg = rope_cfg
        coff = 2 if self.overlap else 1
        width = coff * head_dim
        common = column_parallel_kwargs(config, pg_collection.tp)
        self.linear_wkv = build_module(
            submodules.linear_wkv,
            config.hidden_size,
            width,
            tp_comm_buffer_name="csa_compressor_wkv",
            **common,
        )
        self.linear_wgate = build_module(
            submodules.linear_wgate,
            config.hidden_size,
            width,
            tp_comm_buffer_name="csa_compressor_wgate",
            **common,
        )
        self.norm = build_module(
            submodules.norm, config=config, hidden_size=head_dim, eps=config.layernorm_epsilon
        )
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        if torch.get_default_device().type == "meta":
            device = "meta"
        self.ape = torch.nn.Parameter(torch.empty(compress_ratio, width, dtype=torch.float32, device=device))
        if config.perform_initialization and device != "meta":
            config.init_method(self.ape)
        mark_keep_in_fp32(self.ape)

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor,
        backend: str = "auto",
        position_offset: int = 0,
        max_position: int | None = None,
        cu_seqlens_host: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, d]`` -> ``(entries [Tc, c] in x.dtype, cu_seqlens_c int32 [N+1])``.

        Entry ``w`` of a document is rotated at ``w * ratio + position_offset``. ``max_position``: host bound of
        those positions (:attr:`~dsv4_attention.layout.TokenLayout.max_rope_position`; avoids a device sync).
        ``cu_seqlens_host``: host copy of ``cu_seqlens`` (:attr:`~dsv4_attention.layout.TokenLayout.bounds_host`;
        with it and ``max_position`` the compressor does no device-to-host synchronisation).
        """
        kv, _ = self.linear_wkv(x)  # [T, coff*c]
        score, _ = self.linear_wgate(x)  # [T, coff*c]
        pooled, cu_c = compressor_pool(
            kv,
            score,
            self.ape,
            self.compress_ratio,
            self.overlap,
            cu_seqlens,
            backend=backend,
            cu_seqlens_host=cu_seqlens_host,
        )  # [Tc, c] fp32
        normed = self.norm(pooled)  # [Tc, c] fp32 math
        cu_c_host = None
        if cu_seqlens_host is not None:
            cu_c_host = compressed_cu_seqlens_host(cu_seqlens_host, self.compress_ratio)
        pos = compressed_positions(cu_c, self.compress_ratio, cu_seqlens_c_host=cu_c_host)  # [Tc]
        pos = pos + position_offset
        return rope(normed, pos, self.rope_cfg, max_position=max_position).to(x.dtype), cu_c
