"""Write the generated tables of the dsv4-train README between their markers: the support matrix
(``dsv4_train.support``), the config reference (``dsv4_train.config.reference``) and the memory model's tables
(``dsv4_train.memory_tables``); with ``--check`` exit 1 when
the README differs from them instead.

    python3 -m uv run --locked python packages/dsv4-train/tools/readme_tables.py [--check]
"""

from __future__ import annotations

import sys
from pathlib import Path

from dsv4_train.config.reference import render_config_reference
from dsv4_train.memory_tables import render_measured, render_presets, render_tp
from dsv4_train.support_render import render_matrix

README = Path(__file__).resolve().parents[1] / "README.md"
TABLES = {
    "support-matrix": render_matrix,
    "config-reference": render_config_reference,
    "memory-measured": render_measured,
    "memory-presets": render_presets,
    "memory-tp": render_tp,
}


def with_tables(text: str) -> str:
    """``text`` with the part between each table's markers replaced by the rendered table."""
    for name, render in TABLES.items():
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{start}\n{render()}\n{end}{tail}"
    return text


def main(argv: list[str]) -> int:
    text = README.read_text()
    new = with_tables(text)
    if "--check" in argv:
        if new != text:
            print(f"{README}: generated tables are out of date; run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
