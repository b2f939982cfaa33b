"""The README's support matrix, rendered from the support table (:mod:`dsv4_train.support`) and the pattern
symbols' records (:mod:`hybrid_model.mixers`); ``python3 packages/dsv4-train/tools/readme_tables.py`` writes it."""

from __future__ import annotations

from dsv4_train.support import FEATURES, RELATIONS
from hybrid_model.mixers.record import Layout
from hybrid_model.mixers.registry import REGISTRY


def _cell(verdicts: set[str]) -> str:
    if len(verdicts) == 1:
        return {"refused": "refused", "supported": "yes", "untested": "untested"}[next(iter(verdicts))]
    return "partly"


def render_matrix() -> str:
    """The README's support matrix (markdown): the pairwise grid, then every relation with its reason and test."""
    names = [n for n in FEATURES if n not in ("cpu", "fp32")]
    pairs: dict[frozenset, set[str]] = {}
    for rel in RELATIONS:
        if len(rel.features) <= 2 and not rel.without:
            key = frozenset(rel.features)
            pairs.setdefault(key, set()).add(rel.verdict)
    lines = [
        "Pairs of features (`yes`: run by a test; `refused`: stops before any work with the reason below; "
        "`untested`: accepted, no test runs it; blank: no test combines them yet). Generated from "
        "`dsv4_train.support` by `python3 packages/dsv4-train/tools/readme_tables.py`.",
        "",
        "| | " + " | ".join(f"`{n}`" for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for a in names:
        row = [_cell(pairs[frozenset({a, b})]) if frozenset({a, b}) in pairs else "" for b in names]
        lines.append(f"| `{a}` | " + " | ".join(row) + " |")
    lines += [
        "",
        "| features | flags | verdict | reason or what is checked | test |",
        "|---|---|---|---|---|",
    ]
    for rel in RELATIONS:
        feats = " + ".join(f"`{n}`" for n in rel.features) + "".join(f" without `{n}`" for n in rel.without)
        flags = ", ".join(FEATURES[n].flag for n in (*rel.features, *rel.without))
        reason = rel.reason.replace("|", "\\|")
        verdict = rel.verdict if rel.verdict == "untested" else f"{rel.verdict} ({rel.when})"
        lines.append(f"| {feats} | {flags} | {verdict} | {reason} | `{rel.tested_by}` |")
    return "\n".join(lines + ["", *render_symbol_tp()])


def render_symbol_tp() -> list[str]:
    """The pattern symbols under ``--tp > 1`` (markdown lines), from each symbol's record in hybrid-model
    (``hybrid_model.mixers``): refused with the record's reason (and its condition), or supported."""
    lines = [
        "Pattern symbols under `--tp > 1` (each symbol's record, `hybrid_model.mixers`; an unconditional refusal "
        "stops the run before any work, a conditional one when the layer is built):",
        "",
        "| symbol | layer | `--tp > 1` |",
        "|---|---|---|",
    ]
    for symbol, rec in REGISTRY.items():
        refusal = rec.refusal(Layout.TP)
        if refusal is None:
            verdict = "supported (sequence parallelism)"
        else:
            when = f" ({refusal.condition})" if refusal.condition else ""
            verdict = f"refused{when}: {refusal.reason}"
        lines.append(f"| `{symbol}` | {rec.layer} | {verdict.replace('|', chr(92) + '|')} |")
    return lines


__all__ = ["render_matrix", "render_symbol_tp"]
