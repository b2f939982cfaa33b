"""Analytic parameter counts of one DSv4 attention layer per kind (spec §2.1, §3.1, §4.1).

With ``d`` hidden, ``n_h`` heads, ``c`` head dim, ``d_c`` query rank, ``g x d_g`` output groups, ``n_I x c_I`` indexer:

    attention  = d_c*d + d_c + n_h*c*d_c + c*d + c + n_h + g*d_g*(n_h*c/g) + d*g*d_g
    compressor = 2 * (coff*c*d) + ratio*coff*c + c            coff = 2 (ratio 4) / 1 (ratio 128)
    indexer    = n_I*c_I*d_c + n_I*d + 2 * (2*c_I*d) + 4*2*c_I + c_I   (ratio 4 only)

The tests check these numbers against modules built on the meta device.
"""

from __future__ import annotations


def parameter_table(config) -> dict[int, dict[str, int]]:
    """``{ratio: {"attention", "compressor", "indexer", "total"}}`` for ratios 0, 4 and 128."""
    d, nh, c = config.hidden_size, config.num_attention_heads, config.v_head_dim
    dc = config.q_lora_rank
    g, dg = config.output_projection_groups, config.output_projection_lora_rank
    ni, ci = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
    attention = dc * d + dc + nh * c * dc + c * d + c + nh + g * dg * (nh * c // g) + d * g * dg

    def compressor(ratio: int, width: int) -> int:
        coff = 2 if ratio == 4 else 1
        return 2 * coff * width * d + ratio * coff * width + width

    indexer = ni * ci * dc + ni * d + compressor(4, ci)
    table = {
        0: {"attention": attention, "compressor": 0, "indexer": 0},
        4: {"attention": attention, "compressor": compressor(4, c), "indexer": indexer},
        128: {"attention": attention, "compressor": compressor(128, c), "indexer": 0},
    }
    for row in table.values():
        row["total"] = row["attention"] + row["compressor"] + row["indexer"]
    return table
