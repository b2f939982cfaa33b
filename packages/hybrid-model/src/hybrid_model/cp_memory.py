"""Activation memory of one rank under static contiguous context parallelism (an estimate; README "Memory per rank
under CP").

    M_act ≈ L · (ℓ / P_pp) · a                                   the rank's own rows (L = T / N)
          + (ℓ_CSA / P_pp) · (T / 4) · (c + c_I) · b            gathered CSA entries + indexer keys (global T)
          + (ℓ_HCA / P_pp) · (T / 128) · c · b                  gathered HCA entries (global T)
          + (ℓ_attn / P_pp) · h · d · b                         halo rows, h = max(n_win - 1, 127)

``a`` is the activation memory per token per hybrid layer without CP (0.365 MiB for V4-Flash layer shapes in bf16,
measured on one H200 with flash-smoke: 29.2 GiB more peak memory for 8192 more tokens over its 10 hybrid layers);
``b`` bytes per activation element (2 for bf16). Layers are spread evenly over the ``P_pp`` pipeline stages.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_model.config import DSv4ModelConfig
from hybrid_model.symbols import attention_kind

#: activation bytes per token per hybrid layer, V4-Flash layer shapes, bf16 eager (flash-smoke on one H200)
FLASH_BYTES_PER_TOKEN_LAYER = 0.365 * 2**20


@dataclass(frozen=True)
class CpActivationMemory:
    """Bytes per rank: ``own_rows`` (scales with ``1 / CP``), ``gathered`` (global compressed entries and indexer
    keys), ``halo`` (boundary rows); ``total`` their sum."""

    own_rows: float
    gathered: float
    halo: float

    @property
    def total(self) -> float:
        return self.own_rows + self.gathered + self.halo


def cp_activation_memory(
    cfg: DSv4ModelConfig,
    seq_len: int,
    cp: int,
    *,
    pp: int = 1,
    bytes_per_token_layer: float = FLASH_BYTES_PER_TOKEN_LAYER,
    element_bytes: int = 2,
) -> CpActivationMemory:
    """The module formula for a pack of ``seq_len`` tokens (``T``) over ``cp`` ranks and ``pp`` stages."""
    if seq_len < 1 or cp < 1 or pp < 1 or seq_len % cp:
        raise ValueError(f"need seq_len, cp, pp >= 1 and seq_len a multiple of cp, got {seq_len}, {cp}, {pp}")
    p = cfg.parsed_pattern
    layers = [*p.main, *(s for _ in range(p.mtp_num_depths) for s in p.mtp_pattern)]
    kinds = [attention_kind(s) for s in layers]
    attn = [k for k in kinds if k is not None]
    csa = sum(1 for k in attn if k.compress_ratio == 4)
    hca = sum(1 for k in attn if k.compress_ratio == 128)
    local = seq_len // cp
    own = local * len(layers) / pp * bytes_per_token_layer
    c, c_i, b = cfg.head_dim, cfg.index_head_dim, element_bytes
    gathered = (csa * seq_len / 4 * (c + c_i) + hca * seq_len / 128 * c) * b / pp if cp > 1 else 0.0
    halo_rows = min(max(cfg.sliding_window - 1, 127), local) if cp > 1 else 0
    halo = len(attn) * halo_rows * cfg.hidden_size * b / pp
    return CpActivationMemory(own, gathered, halo)


__all__ = ["FLASH_BYTES_PER_TOKEN_LAYER", "CpActivationMemory", "cp_activation_memory"]
