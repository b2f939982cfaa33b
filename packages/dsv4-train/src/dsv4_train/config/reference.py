"""The config reference of the README, generated from the sections' field declarations: per section, each field's
flag, its ``--config`` key, its type, its default and what it does."""

from __future__ import annotations

import dataclasses
import json
import typing

from dsv4_train.config.fields import default_of, flag_of, option_of, type_name
from dsv4_train.config.train_config import SECTION_TYPES


def render_config_reference() -> str:
    """Markdown: one table per section of :class:`~dsv4_train.config.TrainConfig`."""
    lines = []
    for section, cls in SECTION_TYPES.items():
        doc = " ".join((cls.__doc__ or "").split()).replace(":mod:", "").replace(":class:", "")
        lines += [
            f"**`{section}`**: {doc}",
            "",
            "| flag | `--config` key | type | default | what |",
            "|---|---|---|---|---|",
        ]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            opt = option_of(f)
            default = opt.default_help or json.dumps(default_of(f))
            what = opt.help.replace("|", "\\|")
            lines.append(
                f"| `{flag_of(f)}` | `{section}.{f.name}` | {type_name(hints[f.name])} | {default} | {what} |"
            )
        lines.append("")
    return "\n".join(lines).rstrip()
