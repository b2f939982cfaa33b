"""The embedded default corpus: real text that needs no download, so ``dsv4 train`` works out of the box.

The corpus is the Python standard library's own source files of the running interpreter
(``sysconfig.get_path("stdlib")``), which every CPython installation ships. Selection is deterministic:

- every ``*.py`` file below the stdlib directory, sorted by its relative POSIX path;
- except files inside ``site-packages``, ``dist-packages``, ``__pycache__``, ``test``, ``tests`` and
  ``idle_test`` directories (third-party code and deliberately malformed test inputs);
- files that are not valid UTF-8 are left out (counted in :class:`DefaultCorpusInfo`);
- files are taken in that order while the running total stays within ``max_bytes``
  (:data:`DEFAULT_CORPUS_MAX_BYTES` = 4 MiB by default, about 4.2 M byte-level tokens); the first file that would
  exceed the cap ends the corpus.

The same interpreter version gives the same corpus on every machine. The text is Python Software Foundation code
under the PSF license.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from thd_packing.text_dataset import RawTextDataset, TextDatasetConfig
from thd_packing.text_sources import ReadReport, SourceReport
from thd_packing.tokenizer import Tokenizer

DEFAULT_CORPUS_MAX_BYTES = 4 * 2**20
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


@dataclass(frozen=True)
class DefaultCorpusInfo:
    """Provenance of the default corpus."""

    python_version: str
    stdlib_dir: str
    files: tuple[str, ...]
    num_bytes: int
    num_undecodable: int


def _stdlib_dir() -> Path:
    root = Path(sysconfig.get_path("stdlib"))
    if not (root / "os.py").is_file():
        raise RuntimeError(
            f"the Python standard library sources are not at {root} (no os.py); this interpreter ships no stdlib "
            "sources, so pass a data path instead of using the default corpus"
        )
    return root


@functools.cache
def _candidate_files() -> tuple[Path, tuple[Path, ...]]:
    """Every ``*.py`` file below the stdlib directory outside the excluded directories, sorted by relative POSIX
    path. The walk prunes the excluded directories instead of listing them (``site-packages`` and the stdlib's
    ``test`` packages hold most of the tree): every process of a run lists the corpus."""
    root = _stdlib_dir()
    found: list[tuple[str, Path]] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS]
        base = Path(folder)
        rel = base.relative_to(root).as_posix()
        prefix = "" if rel == "." else f"{rel}/"
        found += [(prefix + name, base / name) for name in names if name.endswith(".py")]
    return root, tuple(path for _, path in sorted(found))


def default_corpus(max_bytes: int = DEFAULT_CORPUS_MAX_BYTES) -> tuple[list[str], DefaultCorpusInfo]:
    """The default corpus documents (one per source file) and their provenance (module docstring)."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    root, candidates = _candidate_files()
    docs: list[str] = []
    names: list[str] = []
    total = undecodable = 0
    for path in candidates:
        data = path.read_bytes()
        if total + len(data) > max_bytes:
            break
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            undecodable += 1
            continue
        docs.append(text)
        names.append(path.relative_to(root).as_posix())
        total += len(data)
    if not docs:
        raise ValueError(f"max_bytes={max_bytes} is smaller than the first stdlib file; raise it")
    info = DefaultCorpusInfo(
        python_version=".".join(map(str, sys.version_info[:3])),
        stdlib_dir=str(root),
        files=tuple(names),
        num_bytes=total,
        num_undecodable=undecodable,
    )
    return docs, info


def default_corpus_documents(max_bytes: int = DEFAULT_CORPUS_MAX_BYTES) -> list[str]:
    """The default corpus as a list of documents (one stdlib source file each, in sorted path order)."""
    return default_corpus(max_bytes)[0]


def default_corpus_dataset(
    seq_capacity: int,
    *,
    tokenizer: Tokenizer | str | Path | None = None,
    eod_mask_loss: bool = False,
    max_bytes: int = DEFAULT_CORPUS_MAX_BYTES,
) -> RawTextDataset:
    """A :class:`RawTextDataset` over :func:`default_corpus_documents` (byte-level tokenizer by default).

    Source files longer than ``seq_capacity`` tokens are split into consecutive samples
    (``long_documents='split'``), so the whole corpus is used. ``dataset.corpus_info`` holds the
    :class:`DefaultCorpusInfo`; ``dataset.source_stats()`` names the corpus as one source.
    """
    docs, info = default_corpus(max_bytes)
    config = TextDatasetConfig(seq_capacity, eod_mask_loss=eod_mask_loss, long_documents="split")
    name = f"default corpus (Python {info.python_version} standard library, {info.stdlib_dir})"
    n = len(info.files)
    report = ReadReport(files=n, records=n, sources=[SourceReport(name, files=n, records=n)])
    ds = RawTextDataset(docs, config, tokenizer, report=report)
    ds.corpus_info = info
    return ds
