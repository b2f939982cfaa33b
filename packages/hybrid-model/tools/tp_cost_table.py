"""Write the "TP cost decision" table of packages/dsv4-attention/README.md from :mod:`hybrid_model.tp_comm` (what a
TP rank holds of one DSv4 attention layer and the bytes it moves per micro-batch, V4-Flash and V4-Pro shapes),
between its markers; with ``--check`` exit 1 when the README differs instead (``tests/test_tp_comm.py`` runs the
check). dsv4-attention cannot import hybrid-model (the dependency goes the other way), so the table lives here.

    python3 -m uv run --locked python packages/hybrid-model/tools/tp_cost_table.py [--check]
"""

from __future__ import annotations

import sys
from pathlib import Path

from hybrid_model.presets import get_preset
from hybrid_model.tp_comm import attention_collectives, head_split_params, replicated_params, total_bytes

README = Path(__file__).resolve().parents[2] / "dsv4-attention" / "README.md"
MARKERS = ("<!-- tp-cost:start -->", "<!-- tp-cost:end -->")
PRESETS = ("v4-flash", "v4-pro")
KINDS = {"W": "window", "C": "CSA", "H": "HCA"}
TPS = (2, 4, 8)
SEQ_LENS = (4096, 65536)
MIB = 2**20


def render() -> str:
    """Two markdown tables: parameters per rank (split / replicated) and TP bytes per rank per layer."""
    rows = [
        "| preset | layer | split params (all ranks, M) | per rank at TP 2 / 4 / 8 (M) | replicated per rank, mHC included (M) |",
        "|---|---|---:|---:|---:|",
    ]
    for preset in PRESETS:
        cfg = get_preset(preset)
        for symbol, kind in KINDS.items():
            split = head_split_params(cfg, symbol)
            rep = replicated_params(cfg, symbol)
            per = " / ".join(f"{split / tp / 1e6:.1f}" for tp in TPS)
            rows.append(f"| {preset} | {kind} `{symbol}` | {split / 1e6:.1f} | {per} | {rep / 1e6:.1f} |")
    rows += [
        "",
        "| preset | layer | S | MiB per rank per layer (forward + backward), TP 2 / 4 / 8 | of which forward |",
        "|---|---|---:|---:|---:|",
    ]
    for preset in PRESETS:
        cfg = get_preset(preset)
        for symbol, kind in KINDS.items():
            for s in SEQ_LENS:
                coll = {tp: attention_collectives(cfg, symbol, s, tp) for tp in TPS}
                both = " / ".join(f"{total_bytes(coll[tp], tp) / MIB:.1f}" for tp in TPS)
                fwd = " / ".join(f"{total_bytes(coll[tp], tp, 'forward') / MIB:.1f}" for tp in TPS)
                rows.append(f"| {preset} | {kind} `{symbol}` | {s // 1024}K | {both} | {fwd} |")
    return "\n".join(rows)


def with_table(text: str) -> str:
    start, end = MARKERS
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{render()}\n{end}{tail}"


def main(argv: list[str]) -> int:
    text = README.read_text()
    new = with_table(text)
    if "--check" in argv:
        if new != text:
            print(f"{README}: the TP cost table is out of date; run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
