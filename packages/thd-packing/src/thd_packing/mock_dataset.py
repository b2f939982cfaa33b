"""Mock variable-length dataset (P8): document lengths from a lognormal distribution or from a CSV file, tokens
drawn deterministically per document.

Lognormal mode draws ``round(exp(N(mu, sigma)))`` with ``mu = ln(mean_len) - sigma^2 / 2`` (so the unclipped mean
is ``mean_len``), clipped to ``[min_len, max_len]``. Defaults follow upstream: ``min = seq_length / 2``,
``max = seq_length``, ``mean = 3 * seq_length / 4``, ``sigma = 1.1``, ``seed = 0``, ``num_samples = 1_000_000``.
CSV mode reads one positive integer length per line (optional header line; with several columns the header must
name a ``length`` column); lengths above ``seq_length`` are truncated to it.

Token ids are uniform in ``[0, vocab_size - 2)``; ``eod = vocab_size - 2``, ``pad_id = vocab_size - 1``.

``stream`` selects independent document streams of the same configuration: stream 0 (default) draws the lengths
from ``default_rng(seed)`` and document ``i``'s ids from ``default_rng([seed, i])``; stream ``k > 0`` uses numpy's
spawn keys, ``SeedSequence(seed, spawn_key=(k,))`` and ``SeedSequence([seed, i], spawn_key=(k,))``, which numpy
guarantees independent of stream 0 (held-out evaluation data that never coincide with the training documents).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from thd_packing.samples import DocumentSample


@dataclass(frozen=True)
class MockVarlenConfig:
    """Configuration of :class:`MockVarlenDataset` (``None`` fields take the upstream defaults)."""

    seq_length: int
    mode: Literal["lognormal", "file"] = "lognormal"
    min_len: int | None = None
    max_len: int | None = None
    mean_len: float | None = None
    sigma: float = 1.1
    seed: int = 0
    num_samples: int = 1_000_000
    lengths_csv: str | Path | None = None
    vocab_size: int = 258
    eod_mask_loss: bool = False
    stream: int = 0

    def __post_init__(self) -> None:
        if self.stream < 0:
            raise ValueError(f"MockVarlenConfig.stream must be >= 0, got {self.stream}")
        if self.seq_length < 1:
            raise ValueError(f"MockVarlenConfig.seq_length must be >= 1, got {self.seq_length}")
        if self.vocab_size < 3:
            raise ValueError(
                f"MockVarlenConfig.vocab_size must be >= 3 (tokens, EOD, pad), got {self.vocab_size}"
            )
        if self.mode not in ("lognormal", "file"):
            raise ValueError(f"MockVarlenConfig.mode must be 'lognormal' or 'file', got {self.mode!r}")
        if self.mode == "file" and self.lengths_csv is None:
            raise ValueError("MockVarlenConfig.mode='file' needs lengths_csv")
        if self.mode == "lognormal":
            lo, hi, mean = self.resolved_bounds()
            if not 1 <= lo <= mean <= hi <= self.seq_length:
                raise ValueError(
                    f"need 1 <= min_len ({lo}) <= mean_len ({mean}) <= max_len ({hi}) <= seq_length "
                    f"({self.seq_length})"
                )
            if self.sigma <= 0:
                raise ValueError(f"MockVarlenConfig.sigma must be > 0, got {self.sigma}")
            if self.num_samples < 1:
                raise ValueError(f"MockVarlenConfig.num_samples must be >= 1, got {self.num_samples}")

    def resolved_bounds(self) -> tuple[int, int, float]:
        lo = max(1, self.seq_length // 2) if self.min_len is None else self.min_len
        hi = self.seq_length if self.max_len is None else self.max_len
        mean = min(max(3 * self.seq_length / 4, lo), hi) if self.mean_len is None else self.mean_len
        return lo, hi, mean


def _seed_sequence(entropy: int | list[int], stream: int) -> np.random.SeedSequence | int | list[int]:
    """The seed of stream ``stream`` (0: ``entropy`` itself, the original stream; else a spawn key)."""
    return entropy if stream == 0 else np.random.SeedSequence(entropy, spawn_key=(stream,))


def lognormal_lengths(
    num: int, *, min_len: int, max_len: int, mean_len: float, sigma: float, seed: int, stream: int = 0
) -> np.ndarray:
    """``[num]`` int64 lengths, ``clip(round(exp(N(ln(mean) - sigma^2/2, sigma))), min, max)``."""
    rng = np.random.default_rng(_seed_sequence(seed, stream))
    mu = np.log(mean_len) - sigma**2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=num)), min_len, max_len).astype(np.int64)


def read_lengths_csv(path: str | Path) -> np.ndarray:
    """Lengths from a CSV file (see the module docstring); errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"lengths CSV {path} does not exist")
    try:
        rows = list(csv.reader(path.read_text(encoding="utf-8").splitlines()))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: undecodable UTF-8 bytes ({err.reason})") from err
    column, start = 0, 0
    if rows and rows[0] and not rows[0][0].strip().lstrip("-").isdigit():
        header = [h.strip() for h in rows[0]]
        if len(header) > 1:
            if "length" not in header:
                raise ValueError(f"{path}:1: header {header} has several columns but none named 'length'")
            column = header.index("length")
        start = 1
    lengths = []
    for lineno, row in enumerate(rows[start:], start=start + 1):
        if not row or not "".join(row).strip():
            continue
        if column >= len(row):
            raise ValueError(f"{path}:{lineno}: row has {len(row)} columns, expected a 'length' column")
        cell = row[column].strip()
        try:
            value = int(cell)
        except ValueError:
            raise ValueError(f"{path}:{lineno}: length {cell!r} is not an integer") from None
        if value < 1:
            raise ValueError(f"{path}:{lineno}: length {value} must be >= 1")
        lengths.append(value)
    if not lengths:
        raise ValueError(f"{path}: empty file (no lengths)")
    return np.asarray(lengths, dtype=np.int64)


class MockVarlenDataset:
    """Synthetic documents of variable length (``VarlenDataset``); sample ``i`` is the same on every call."""

    def __init__(self, config: MockVarlenConfig) -> None:
        self.config = config
        if config.mode == "file":
            lengths = np.minimum(read_lengths_csv(config.lengths_csv), config.seq_length)
        else:
            lo, hi, mean = config.resolved_bounds()
            lengths = lognormal_lengths(
                config.num_samples,
                min_len=lo,
                max_len=hi,
                mean_len=mean,
                sigma=config.sigma,
                seed=config.seed,
                stream=config.stream,
            )
        self._lengths = lengths

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    @property
    def eod(self) -> int:
        return self.config.vocab_size - 2

    @property
    def pad_id(self) -> int:
        return self.config.vocab_size - 1

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def __len__(self) -> int:
        return self._lengths.size

    def __getitem__(self, index: int) -> DocumentSample:
        if not -len(self) <= index < len(self):
            raise IndexError(f"document index {index} out of range for {len(self)} documents")
        index %= len(self)
        n = int(self._lengths[index])
        rng = np.random.default_rng(_seed_sequence([self.config.seed, index], self.config.stream))
        ids = np.empty(n + 1, dtype=np.int64)
        ids[:n] = rng.integers(0, self.eod, size=n)
        ids[n] = self.eod
        return DocumentSample.from_ids(ids, self.eod, eod_mask_loss=self.config.eod_mask_loss)
