"""Activation memory of one rank under static contiguous context parallelism (an estimate; README "Memory per rank
under CP"), for the busiest rank (a rank ``r >= 1`` whose first document started on an earlier rank).

    M_act ≈ L · (ℓ / P_pp) · a                                   the rank's own rows (L = T / N)
          + Σ_attn layers / P_pp of, per layer of kind κ (window, CSA, HCA; only for N > 1):
              h_κ · (d + 2c) · b                                  halo rows: input, KV projection + norm
              + (h_κ + m_κ - 1) · s_κ · b                         their pooling buffers, alignment rows included
              + G_κ(T) · b                                        gathered entries (kernels path only)

* ``h_κ = min(max(n_win - 1, d_comp), L·r)`` rows left of the slice (``d_comp`` 0 / 7 / 127): window and CSA layers
  need ``n_win - 1``, HCA ``127``; ``s_κ`` the compressors' per-row pooling buffers (``2·2c + 2·2c_I`` for the
  overlapping CSA compressor and its indexer's, ``2c`` for HCA, 0 for window layers), which also pool up to
  ``m - 1`` zero rows that align the clipped document's groups (the formula takes ``m - 1``, an upper bound);
* ``G_CSA = (T/4)·(c + c_I)``, ``G_HCA = (T/128)·c``: every rank keeps every compressed entry (and indexer key) of
  the pack in its key buffer. On the ``"reference"`` path (CPU) the sparse attention keeps the gathered candidate
  rows per query instead, which is per-token memory inside ``a``: ``G = 0`` there.

``a`` is the activation memory per token per hybrid layer without CP (0.365 MiB for V4-Flash layer shapes in bf16,
measured on one H200 with flash-smoke: 29.2 GiB more peak memory for 8192 more tokens over its 10 hybrid layers);
``b`` bytes per activation element (2 for bf16). Layers are spread evenly over the ``P_pp`` pipeline stages.
Checked against the bytes saved for backward by the tiny model at CP=1 and CP=2 (``tests/test_context_parallel.py``).
Not modelled: terms that do not depend on ``T`` (RoPE tables of the largest position, per-document index
vectors) and the dense warm-up phase (CSA attends every visible entry: an ``[L, T/4]`` index per layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybrid_model.config import DSv4ModelConfig
from hybrid_model.symbols import attention_kind

#: activation bytes per token per hybrid layer, V4-Flash layer shapes, bf16 eager (flash-smoke on one H200)
FLASH_BYTES_PER_TOKEN_LAYER = 0.365 * 2**20

PATHS = ("kernels", "reference")


@dataclass(frozen=True)
class CpActivationMemory:
    """Bytes per rank: ``own_rows`` (scales with ``1 / CP``), ``gathered`` (global compressed entries and indexer
    keys), ``halo`` (the extended rows: halo and alignment rows); ``total`` their sum."""

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
    path: Literal["kernels", "reference"] = "kernels",
) -> CpActivationMemory:
    """The module formula for a pack of ``seq_len`` tokens (``T``) over ``cp`` ranks and ``pp`` stages.

    ``path``: ``"kernels"`` (the Triton kernels: the key buffer keeps the gathered entries) or ``"reference"``
    (csa-kernels' CPU references: no gathered-entry term, see the module docstring)."""
    if seq_len < 1 or cp < 1 or pp < 1 or seq_len % cp:
        raise ValueError(f"need seq_len, cp, pp >= 1 and seq_len a multiple of cp, got {seq_len}, {cp}, {pp}")
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    p = cfg.parsed_pattern
    layers = [*p.main, *(s for _ in range(p.mtp_num_depths) for s in p.mtp_pattern)]
    kinds = [k for k in (attention_kind(s) for s in layers) if k is not None]
    local = seq_len // cp
    own = local * len(layers) / pp * bytes_per_token_layer
    if cp == 1:
        return CpActivationMemory(own, 0.0, 0.0)
    c, c_i, d, b = cfg.head_dim, cfg.index_head_dim, cfg.hidden_size, element_bytes
    gathered = halo = 0.0
    for kind in kinds:
        m = kind.compress_ratio
        d_comp = (2 * m - 1 if kind.overlap else m - 1) if m else 0
        h = min(max(cfg.sliding_window - 1, d_comp), local * (cp - 1))
        if m == 4:  # CSA: KV + indexer compressors, overlapping (2c / 2c_I channels, two buffers each)
            pool, entries = 4 * c + 4 * c_i, seq_len // 4 * (c + c_i)
        elif m:  # HCA
            pool, entries = 2 * c, seq_len // m * c
        else:
            pool, entries = 0, 0
        halo += (h * (d + 2 * c) + (h + max(m - 1, 0)) * pool) * b
        if path == "kernels":
            gathered += entries * b
    return CpActivationMemory(own, gathered / pp, halo / pp)


__all__ = ["FLASH_BYTES_PER_TOKEN_LAYER", "PATHS", "CpActivationMemory", "cp_activation_memory"]
