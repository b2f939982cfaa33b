"""The ``dsv4 train`` flags, generated from the config sections' field declarations
(:func:`dsv4_train.config.fields.option`): one flag per field, its help with the default appended, its choices, and
how its text is read, derived from the field's type:

==================================  ===========================================================================
field type (default)                flag
==================================  ===========================================================================
``bool`` (False)                    ``--flag`` (``store_true``)
``bool`` (True)                     ``--flag`` / ``--no-flag``; with ``negative_only`` just ``--no-flag``
``bool | None``                     ``--flag`` / ``--no-flag`` (unset: resolved when the run starts)
``tuple[str, ...]``                 ``--flag A [B ...]``, repeatable (values accumulate)
``int`` / ``float`` / ``str``       ``--flag VALUE`` (``X | None``: the same; ``parse`` may accept ``null``)
``optional_value`` set              ``--flag`` alone means that value, ``--flag TEXT`` passes ``parse(TEXT)``
==================================  ===========================================================================

Every flag defaults to ``None`` ("not given"), so a ``--config`` file's value is only overridden by a flag the
user gave. The parsed flags become a config with :func:`config_from_flags`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from typing import Any

from dsv4_train.config import SECTION_TYPES, TrainConfig
from dsv4_train.config.fields import NULL, default_of, flag_of, option_of


def _help(f: dataclasses.Field) -> str:
    opt = option_of(f)
    default = opt.default_help if opt.default_help is not None else json.dumps(default_of(f))
    return f"{opt.help} (default: {default})"


def add_field_flag(p: argparse.ArgumentParser, f: dataclasses.Field, hint: Any) -> None:
    """Add the flag of config field ``f`` (annotation ``hint``) to ``p``; its ``dest`` is the field name."""
    opt, flag = option_of(f), flag_of(f)
    kw: dict[str, Any] = {"dest": f.name, "default": None, "help": _help(f)}
    args = typing.get_args(hint)
    base = (
        hint if not args or typing.get_origin(hint) is tuple else next(a for a in args if a is not type(None))
    )
    if opt.optional_value is not None:
        kw.update(nargs="?", const=opt.optional_value, type=opt.parse, metavar=opt.metavar)
    elif base is bool and opt.negative_only:
        kw.update(action="store_false")
    elif base is bool and (default_of(f) is not False):
        kw.update(action=argparse.BooleanOptionalAction)
    elif base is bool:
        kw.update(action="store_true")
    elif typing.get_origin(hint) is tuple:
        kw.update(nargs="+", action="extend", metavar=opt.metavar or "VALUE")
        if opt.choices is not None:
            kw.update(choices=opt.choices)
    else:
        kw.update(type=opt.parse or (base if base in (int, float) else str))
        if opt.choices is not None:
            kw.update(choices=opt.choices)
        if opt.metavar:
            kw.update(metavar=opt.metavar)
    p.add_argument(flag, **kw)


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per field of every :class:`TrainConfig` section, in section order."""
    for cls in SECTION_TYPES.values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            add_field_flag(p, f, hints[f.name])


def given_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields the user set on the command line (flat names; ``null`` flags as ``None``)."""
    names = {f.name for cls in SECTION_TYPES.values() for f in dataclasses.fields(cls)}
    return {k: (None if v is NULL else v) for k, v in vars(args).items() if k in names and v is not None}


def config_from_flags(flags: dict[str, Any], config_file: str | None = None) -> TrainConfig:
    """The config of the given flags on top of ``config_file`` (a JSON file, nested by section or flat)."""
    if config_file:
        return TrainConfig.from_file(config_file, **flags)
    return TrainConfig.from_flat(**flags)
