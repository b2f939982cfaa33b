"""Print the per-layer parameter table of DSv4 attention for V4-Flash and V4-Pro shapes (README table).

Every layer kind is built on the meta device (no memory) from its ModuleSpec and its parameters are counted; the
count is cross-checked with the analytic :func:`dsv4_attention.parameter_table`. Run from the repository root:
``python3 packages/dsv4-attention/scripts/parameter_table.py`` (CPU, a few seconds).
"""

from __future__ import annotations

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import build_module

from dsv4_attention import parameter_table
from dsv4_attention.megatron import DSv4AttentionConfig, get_dsv4_attention_spec
from dsv4_testkit import megatron_cpu_context

SHAPES = {
    "V4-Flash": dict(
        num_layers=43,
        hidden_size=4096,
        num_attention_heads=64,
        q_lora_rank=1024,
        output_projection_groups=8,
        dsa_indexer_topk=512,
        ratios=[0, 0] + [4, 128] * 20 + [4],
    ),
    "V4-Pro": dict(
        num_layers=61,
        hidden_size=7168,
        num_attention_heads=128,
        q_lora_rank=1536,
        output_projection_groups=16,
        dsa_indexer_topk=1024,
        ratios=[128, 128] + [4, 128] * 29 + [4],
    ),
}
KIND = {0: "window (W)", 4: "CSA (C)", 128: "HCA (H)"}


def main() -> None:
    rows = []
    with megatron_cpu_context():
        pg = ProcessGroupCollection.use_mpu_process_groups()
        for model, shape in SHAPES.items():
            ratios = shape.pop("ratios")
            cfg = DSv4AttentionConfig(**shape, use_cpu_initialization=True)
            table = parameter_table(cfg)
            total_main = 0
            for ratio in (0, 4, 128):
                with torch.device("meta"):
                    m = build_module(
                        get_dsv4_attention_spec(ratio), config=cfg, layer_number=1, pg_collection=pg
                    )
                built = sum(p.numel() for p in m.parameters())
                assert built == table[ratio]["total"], (model, ratio, built, table[ratio])
                n_layers = ratios.count(ratio)
                total_main += n_layers * built
                t = table[ratio]
                rows.append(
                    f"| {model} | {KIND[ratio]} | {n_layers} | {t['attention']:,} | {t['compressor']:,} | "
                    f"{t['indexer']:,} | {built:,} |"
                )
            rows.append(
                f"| {model} | all main layers | {len(ratios)} | | | | {total_main:,} ({total_main / 1e9:.2f} B) |"
            )
    print(
        "| model | layer kind | main layers | attention (q, kv, sink, wo_a, wo_b) | compressor | indexer | total |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
