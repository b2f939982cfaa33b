"""Print the host syncs / uploads / aten ops of one eager decode step of the ``tiny`` preset at batch 1 and 4, per
layer kind (:func:`hybrid_model.generation.step_count.format_table`; the hybrid-model README's "decode step"
table), then every sync / upload call site of the batch-1 step. On CPU, one process (gloo):

    python3 -m uv run --locked python packages/hybrid-model/tools/decode_step_counts.py
"""

from __future__ import annotations

import torch

from dsv4_testkit.megatron_cpu import megatron_cpu_context
from hybrid_model.generation.step_count import decode_step_counts, format_table
from hybrid_model.model import build_model
from hybrid_model.presets import get_preset


def main() -> None:
    with megatron_cpu_context():
        torch.manual_seed(0)
        tiny = build_model(get_preset("tiny")).eval()
        print(format_table(tiny))
        for batch in (1, 4):
            for name, counts in sorted(decode_step_counts(tiny, batch).items()):
                for site, n in sorted(counts.sites.items()):
                    print(f"b{batch} {name}: {site} x{n}")


if __name__ == "__main__":
    main()
