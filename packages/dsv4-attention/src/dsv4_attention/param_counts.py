"""Analytic parameter counts of one DSv4 attention layer per kind (spec §2.1, §3.1, §4.1).

With ``d`` hidden, ``n_h`` heads, ``c`` head dim, ``d_c`` query rank, ``g x d_g`` output groups, ``n_I x c_I`` indexer,
``m`` the kind's compress ratio and ``coff`` = 2 for an overlapping (CSA) compressor, 1 otherwise:

    attention  = d_c*d + d_c + n_h*c*d_c + c*d + c + n_h + g*d_g*(n_h*c/g) + d*g*d_g
    compressor = 2 * (coff*c*d) + m*coff*c + c                   (CSA, HCA)
    indexer    = n_I*c_I*d_c + n_I*d + 2 * (2*c_I*d) + 4*2*c_I + c_I   (CSA only: its own overlapping compressor)

The tests check these numbers against modules built on the meta device.
"""

from __future__ import annotations

from dsv4_attention.kind import LayerKind


def compressor_params(kind: LayerKind, hidden_size: int, width: int) -> int:
    """Parameters of one compressor of ``kind`` with entries of ``width`` (``wkv``, ``wgate``, ``ape``, norm)."""
    coff = 2 if kind.overlap else 1
    return 2 * coff * width * hidden_size + kind.compress_ratio * coff * width + width


def kind_parameter_counts(config, kind: LayerKind) -> dict[str, int]:
    """``{"attention", "compressor", "indexer", "total"}`` of one layer of ``kind`` (megatron field names)."""
    d, nh, c = config.hidden_size, config.num_attention_heads, config.v_head_dim
    dc = config.q_lora_rank
    g, dg = config.output_projection_groups, config.output_projection_lora_rank
    ni, ci = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
    row = {
        "attention": dc * d + dc + nh * c * dc + c * d + c + nh + g * dg * (nh * c // g) + d * g * dg,
        "compressor": compressor_params(kind, d, c) if kind.has_compressor else 0,
        "indexer": ni * ci * dc + ni * d + compressor_params(LayerKind.CSA, d, ci) if kind.has_indexer else 0,
    }
    row["total"] = row["attention"] + row["compressor"] + row["indexer"]
    return row


def parameter_table(config) -> dict[int, dict[str, int]]:
    """``{ratio: {"attention", "compressor", "indexer", "total"}}`` for ratios 0, 4 and 128 (one per kind)."""
    return {kind.compress_ratio: kind_parameter_counts(config, kind) for kind in LayerKind}
