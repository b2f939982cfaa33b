"""Reading raw-text documents from JSONL / JSON / Parquet / plain-text files and directories of them (P8).

Every record must carry a string ``text`` field (the key is configurable). Bad input is never silently dropped:
with ``errors='raise'`` (default) the first problem raises :class:`TextRecordError` naming the file and line (or
Parquet row); with ``errors='skip'`` the record is skipped and logged in a :class:`ReadReport`. Problems detected:
empty file, undecodable UTF-8 bytes, invalid JSON, a record that is not an object, a missing or non-string ``text``
(null included), an unreadable Parquet file or a non-string ``text`` column.

Formats (by file extension, case-insensitive: ``a.TXT`` is a text file):

- ``.jsonl``: one JSON object per line; blank lines are not records and are ignored.
- ``.json``: one top-level array of objects (or a single object); line numbers point at each element's start.
- ``.parquet``: a text column ``text`` of Arrow type ``string``, ``large_string`` or ``string_view``, or
  dictionary-encoded with values of one of these (decoded; each row group may have its own dictionary).
- ``.txt`` / ``.md``: the whole file is one document.
- a directory: every file of a supported format below it (recursively), sorted by relative path. Everything else
  below it is *ignored and listed* in :attr:`ReadReport.ignored` with the reason: files of other types, hidden
  files and directories (name starting with ``.``, e.g. ``.git``), symbolic links to directories (not followed).
  A directory without any supported file is an error.

Each path argument is one *source*; :attr:`ReadReport.sources` counts files, records, skipped records and ignored
entries per source, and :attr:`TextRecord.source` is the index of the source a record came from. A file reached
twice (named twice, or named and inside a named directory) is an error: it would be trained on twice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt", ".md")


@dataclass(frozen=True)
class TextRecord:
    """One document's text and where it came from (``line`` is a Parquet row number for Parquet files;
    ``source`` the index of the path argument that named the file or its directory)."""

    text: str
    path: str
    line: int
    source: int = 0


@dataclass(frozen=True)
class IgnoredPath:
    """A file or directory below a data directory that was not read, and why."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass(frozen=True)
class SkippedRecord:
    path: str
    line: int | None
    reason: str
    unit: str = "line"

    def __str__(self) -> str:
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        if self.unit == "row" and self.line is not None:
            where = f"{self.path} row {self.line}"
        return f"{where}: {self.reason}"


@dataclass
class SourceReport:
    """Counts of one source (one path argument): files read, records kept, records skipped, entries ignored."""

    path: str
    files: int = 0
    records: int = 0
    skipped: int = 0
    ignored: list[IgnoredPath] = field(default_factory=list)


@dataclass
class ReadReport:
    """Counts of one read: files, records kept, every skipped record with its reason, every ignored entry of a data
    directory with its reason, and the same counts per source (``sources[i]`` for path argument ``i``)."""

    files: int = 0
    records: int = 0
    skipped: list[SkippedRecord] = field(default_factory=list)
    sources: list[SourceReport] = field(default_factory=list)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    @property
    def ignored(self) -> list[IgnoredPath]:
        """Entries of the data directories that were not read (every source's)."""
        return [i for s in self.sources for i in s.ignored]

    def summary(self, limit: int = 5) -> str:
        ignored = self.ignored
        head = f"{self.records} records from {self.files} files, {self.num_skipped} skipped"
        if ignored:
            head += f", {len(ignored)} directory entries ignored"
        lines = [f"  {s}" for s in self.skipped[:limit]]
        if self.num_skipped > limit:
            lines.append(f"  ... and {self.num_skipped - limit} more skipped")
        lines += [f"  ignored {i}" for i in ignored[:limit]]
        if len(ignored) > limit:
            lines.append(f"  ... and {len(ignored) - limit} more ignored")
        return "\n".join([head, *lines])


class TextRecordError(ValueError):
    """A bad record or file; ``str(err)`` starts with ``path:line``.

    ``skip_hint`` names the switch that skips bad records where the error is shown (a command-line tool re-raises
    with its own flag, e.g. ``TextRecordError(err.record, skip_hint="pass --skip-bad-records")``).
    """

    def __init__(self, record: SkippedRecord, skip_hint: str = "read with errors='skip'") -> None:
        super().__init__(f"{record}. Fix the record, or {skip_hint} to skip bad records and count them.")
        self.record = record
        self.skip_hint = skip_hint


class _Sink:
    def __init__(self, errors: str, report: ReadReport) -> None:
        if errors not in ("raise", "skip"):
            raise ValueError(f"errors must be 'raise' or 'skip', got {errors!r}")
        self.errors, self.report = errors, report
        self.source: SourceReport | None = None

    def problem(self, path: Path, line: int | None, reason: str, unit: str = "line") -> None:
        rec = SkippedRecord(str(path), line, reason, unit)
        if self.errors == "raise":
            raise TextRecordError(rec)
        self.report.skipped.append(rec)
        if self.source is not None:
            self.source.skipped += 1


def _suffix(path: Path) -> str:
    return path.suffix.lower()


def _walk_directory(root: Path, ignored: list[IgnoredPath]) -> list[Path]:
    """Supported files below ``root`` sorted by relative POSIX path; everything else goes to ``ignored``."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        keep = []
        for name in sorted(dirnames):
            d = here / name
            if name.startswith("."):
                ignored.append(IgnoredPath(str(d), "hidden directory, not read"))
            elif d.is_symlink():
                ignored.append(IgnoredPath(str(d), "symbolic link to a directory, not followed"))
            else:
                keep.append(name)
        dirnames[:] = keep
        for name in sorted(filenames):
            f = here / name
            if name.startswith("."):
                ignored.append(IgnoredPath(str(f), "hidden file, not read"))
            elif _suffix(f) not in SUPPORTED_SUFFIXES:
                kind = f"type {_suffix(f)!r}" if _suffix(f) else "no extension"
                ignored.append(
                    IgnoredPath(
                        str(f), f"unsupported file ({kind}; supported: {', '.join(SUPPORTED_SUFFIXES)})"
                    )
                )
            elif not f.is_file():
                ignored.append(IgnoredPath(str(f), "not a regular file"))
            else:
                found.append(f)
    found.sort(key=lambda q: q.relative_to(root).as_posix())
    ignored.sort(key=lambda i: Path(i.path).relative_to(root).as_posix())
    return found


def resolve_text_sources(
    paths: str | Path | Sequence[str | Path],
) -> list[tuple[SourceReport, list[Path]]]:
    """Expand each path argument (a source) into its ordered files to read; each source's
    :class:`SourceReport` lists the directory entries it ignores (module docstring)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise ValueError(
            "no data paths given; pass JSONL/JSON/Parquet/.txt/.md files or directories holding them"
        )
    out: list[tuple[SourceReport, list[Path]]] = []
    seen: dict[Path, Path] = {}
    for p in map(Path, paths):
        source = SourceReport(str(p))
        if p.is_dir():
            files = _walk_directory(p, source.ignored)
            if not files:
                listed = "".join(f"\n  ignored {i}" for i in source.ignored[:5])
                raise ValueError(
                    f"directory {p} holds no files of a supported type ({', '.join(SUPPORTED_SUFFIXES)}, "
                    f"searched recursively){listed}"
                )
        elif p.is_file():
            if _suffix(p) not in SUPPORTED_SUFFIXES:
                raise ValueError(
                    f"{p}: unsupported file type {p.suffix!r}; expected one of {SUPPORTED_SUFFIXES} "
                    "(case-insensitive)"
                )
            files = [p]
        else:
            raise ValueError(f"data path {p} does not exist")
        for f in files:
            key = f.resolve()
            if key in seen:
                raise ValueError(
                    f"data file {f} is read twice (through {seen[key]} and {p}); pass every file once"
                )
            seen[key] = p
        out.append((source, files))
    return out


def resolve_text_files(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    """Expand files and directories into the ordered list of files to read (see the module docstring)."""
    return [f for _, files in resolve_text_sources(paths) for f in files]


def _text_of(obj, path: Path, line: int, text_key: str, sink: _Sink, unit: str = "line") -> str | None:
    if not isinstance(obj, dict):
        sink.problem(path, line, f"record is a JSON {type(obj).__name__}, expected an object", unit)
        return None
    if text_key not in obj:
        sink.problem(path, line, f"record has no {text_key!r} field (keys: {sorted(obj)[:8]})", unit)
        return None
    text = obj[text_key]
    if not isinstance(text, str):
        kind = "null" if text is None else type(text).__name__
        sink.problem(path, line, f"field {text_key!r} is {kind}, expected a string", unit)
        return None
    return text


def _decode(data: bytes, path: Path, sink: _Sink, line_offset: int = 0) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = line_offset + data.count(b"\n", 0, err.start) + 1
        col = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        sink.problem(path, line, f"undecodable UTF-8 bytes at column {col} ({err.reason})")
        return None


def _read_jsonl(path: Path, text_key: str, sink: _Sink) -> Iterator[TextRecord]:
    data = path.read_bytes()
    if not data.strip():
        sink.problem(path, None, "empty file (no JSON lines)")
        return
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        s = _decode(raw, path, sink, lineno - 1)
        if s is None:
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as err:
            sink.problem(path, lineno, f"invalid JSON: {err.msg} at column {err.colno}")
            continue
        text = _text_of(obj, path, lineno, text_key, sink)
        if text is not None:
            yield TextRecord(text, str(path), lineno)


def _json_elements(s: str) -> Iterator[tuple[int, object]]:
    """``(char offset, element)`` of a top-level JSON array (or of a single top-level value)."""
    dec = json.JSONDecoder()
    n = len(s)

    def ws(i: int) -> int:
        while i < n and s[i] in " \t\r\n":
            i += 1
        return i

    i = ws(0)
    if s[i] != "[":
        obj, i = dec.raw_decode(s, i)
        yield 0, obj
    else:
        i = ws(i + 1)
        if i < n and s[i] == "]":
            i += 1
        else:
            while True:
                start = i
                obj, i = dec.raw_decode(s, i)
                yield start, obj
                i = ws(i)
                if i < n and s[i] == ",":
                    i = ws(i + 1)
                elif i < n and s[i] == "]":
                    i += 1
                    break
                else:
                    raise json.JSONDecodeError("expected ',' or ']' after an array element", s, i)
    i = ws(i)
    if i < n:
        raise json.JSONDecodeError("extra data after the top-level value", s, i)


def _read_json(path: Path, text_key: str, sink: _Sink) -> Iterator[TextRecord]:
    data = path.read_bytes()
    if not data.strip():
        sink.problem(path, None, "empty file (no JSON value)")
        return
    s = _decode(data, path, sink)
    if s is None:
        return
    line, pos = 1, 0
    try:
        for start, obj in _json_elements(s):
            line += s.count("\n", pos, start)
            pos = start
            text = _text_of(obj, path, line, text_key, sink)
            if text is not None:
                yield TextRecord(text, str(path), line)
    except json.JSONDecodeError as err:
        sink.problem(
            path, err.lineno, f"invalid JSON: {err.msg} at column {err.colno}; rest of the file not read"
        )


def _is_text_type(pa, kind) -> bool:
    """Whether a Parquet column of Arrow type ``kind`` holds text: ``string``, ``large_string``, ``string_view``
    or a dictionary whose values are one of them (what ``use_dictionary`` / categorical columns read back as)."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _read_parquet(path: Path, text_key: str, sink: _Sink) -> Iterator[TextRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as err:  # pyarrow raises ArrowInvalid/OSError subclasses for corrupt files
        sink.problem(path, None, f"not a readable Parquet file ({err})")
        return
    if text_key not in schema.names:
        sink.problem(path, None, f"no {text_key!r} column (columns: {schema.names})")
        return
    kind = schema.field(text_key).type
    if not _is_text_type(pa, kind):
        sink.problem(
            path,
            None,
            f"column {text_key!r} has type {kind}, expected text: string, large_string, string_view or a "
            "dictionary of them",
        )
        return
    # dictionary-encoded chunks (each row group may have its own dictionary) decode to their values here
    column = pq.read_table(path, columns=[text_key]).column(text_key).to_pylist()
    if not column:
        sink.problem(path, None, "empty file (no rows)")
        return
    for row, text in enumerate(column):
        if text is None:
            sink.problem(path, row, f"field {text_key!r} is null, expected a string", "row")
            continue
        yield TextRecord(text, str(path), row)


def _read_txt(path: Path, text_key: str, sink: _Sink) -> Iterator[TextRecord]:
    data = path.read_bytes()
    if not data:
        sink.problem(path, None, "empty file")
        return
    s = _decode(data, path, sink)
    if s is not None:
        yield TextRecord(s, str(path), 1)


_READERS = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".parquet": _read_parquet,
    ".txt": _read_txt,
    ".md": _read_txt,
}


def read_text_records(
    paths: str | Path | Sequence[str | Path],
    *,
    text_key: str = "text",
    errors: Literal["raise", "skip"] = "raise",
    report: ReadReport | None = None,
) -> Iterator[TextRecord]:
    """Yield every document of ``paths`` in order (files as given, directories sorted).

    ``report`` (optional) is filled with file/record counts, skipped records and ignored directory entries (in
    total and per source) as the iterator advances; the paths are resolved (and checked) on the first ``next``.
    """
    report = ReadReport() if report is None else report
    sink = _Sink(errors, report)
    sources = resolve_text_sources(paths)
    report.sources += [source for source, _ in sources]
    for index, (source, files) in enumerate(sources):
        sink.source = source
        for path in files:
            report.files += 1
            source.files += 1
            for rec in _READERS[_suffix(path)](path, text_key, sink):
                report.records += 1
                source.records += 1
                yield TextRecord(rec.text, rec.path, rec.line, index)
