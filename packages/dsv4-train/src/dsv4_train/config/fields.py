"""Field metadata of the config sections: what a field's command-line flag is (name, help, choices, how its value
is read) and the type check shared by the flags, ``--config`` files and Python callers.

A section field is declared with :func:`option` (``field(default=..., metadata=option(...))``); the ``dsv4 train``
parser is generated from these declarations (:mod:`dsv4_train.flags`), so adding a field adds its flag and its help.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: the key of a field's :class:`Option` in ``dataclasses.Field.metadata``
OPTION = "dsv4_option"


@dataclass(frozen=True)
class Option:
    """How a config field appears on the command line.

    ``help``: one sentence, without the default (the parser appends ``default: ...``). ``flag``: the flag
    (default ``--field-name``). ``choices``: the accepted values. ``parse``: converts the flag's text
    (``argparse``'s ``type``). ``negative_only``: a boolean that is on by default and has only its negative flag
    (``--no-progress``). ``optional_value``: the value of the flag given without one (``--resume`` means
    ``True``, ``--resume auto`` passes ``parse("auto")``). ``default_help``: the default as the help states it
    when the dataclass default is resolved later (``None`` meaning "on CUDA: ...").
    """

    help: str
    flag: str | None = None
    choices: tuple[Any, ...] | None = None
    parse: Callable[[str], Any] | None = None
    negative_only: bool = False
    optional_value: Any = None
    metavar: str | None = None
    default_help: str | None = None


def option(help: str, **kw: Any) -> dict[str, Option]:
    """``metadata`` of a config field: ``field(default=..., metadata=option("what it does", ...))``."""
    return {OPTION: Option(help=help, **kw)}


def option_of(f: dataclasses.Field) -> Option:
    opt = f.metadata.get(OPTION)
    if opt is None:
        raise TypeError(f"config field {f.name!r} has no option(...) metadata")
    return opt


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of field ``f`` (``--seq-len`` for ``seq_len``)."""
    return option_of(f).flag or "--" + f.name.replace("_", "-")


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def has_type(value: Any, hint: Any) -> bool:
    """Whether the JSON-like ``value`` fits the annotation ``hint`` (ints are floats; bools are not numbers; numbers
    must be finite; tuples are lists)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(has_type(value, h) for h in typing.get_args(hint))
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(hint))
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple):
        item = typing.get_args(hint)[0]
        return isinstance(value, list | tuple) and all(has_type(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    return isinstance(value, hint)


def type_name(hint: Any) -> str:
    """``hint`` in words, for error messages (``"an integer or null"``)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(h) for h in typing.get_args(hint))
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(hint))
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a finite number",
        str: "a string",
        type(None): "null",
    }
    if hint in names:
        return names[hint]
    if origin in (list, tuple):
        return f"a list of {type_name(typing.get_args(hint)[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return "an object"
    return getattr(hint, "__name__", str(hint))


def check_types(section: Any) -> None:
    """``ValueError`` naming the flag, the field, the expected type and the value for the first field of the
    dataclass instance ``section`` whose value has the wrong type (or is a non-finite number)."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if not has_type(value, hints[f.name]):
            raise ValueError(f"{flag_of(f)} ({f.name}) must be {type_name(hints[f.name])}, got {value!r}")


def at_least(section: Any, minimum: float, *names: str) -> None:
    """``ValueError`` naming the flag when one of the fields ``names`` of ``section`` is below ``minimum``."""
    fields = {f.name: f for f in dataclasses.fields(section)}
    for name in names:
        value = getattr(section, name)
        if value is not None and value < minimum:
            raise ValueError(f"{flag_of(fields[name])} must be >= {minimum:g}, got {value}")


def one_of(section: Any, name: str) -> None:
    """``ValueError`` naming the flag when field ``name`` is not one of its option's ``choices``."""
    f = {f.name: f for f in dataclasses.fields(section)}[name]
    choices = option_of(f).choices
    value = getattr(section, name)
    values = value if isinstance(value, list | tuple) else (value,)
    if choices is not None and any(v is not None and v not in choices for v in values):
        raise ValueError(f"{flag_of(f)} must be one of {list(choices)}, got {value!r}")


#: a flag explicitly set to null on the command line (``argparse``'s ``None`` means "not given")
NULL = "null"


def parse_json_object(text: str) -> dict:
    """``--model-overrides '{"num_layers": 4}'``: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of DSv4ModelConfig fields")
    return value


def parse_float_or_null(text: str) -> float | str:
    """A number, or ``none`` / ``null`` (:data:`NULL`)."""
    return NULL if text.lower() in ("none", "null") else float(text)


def parse_resume_mode(text: str) -> str:
    """The value ``--resume`` takes: only ``auto``."""
    if text == "auto":
        return "auto"
    raise argparse.ArgumentTypeError("the only value --resume takes is 'auto'")


def store_tuples(section: Any, *names: str) -> None:
    """Store list fields as tuples (a frozen section holds no mutable lists); a single string is one item."""
    for name in names:
        value = getattr(section, name)
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            object.__setattr__(section, name, tuple(value))
