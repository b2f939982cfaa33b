"""``dsv4 train --data mock[:KEY=VALUE,...]``: thd-packing's mock variable-length dataset (P8) from the command line,
for benchmarks and functional tests without a corpus.

Syntax (one ``--data`` source, not mixed with files; a file called ``mock`` is ``./mock``)::

    mock                                    lognormal lengths, upstream defaults
    mock:KEY=VALUE[,KEY=VALUE...]           keys below, each at most once, comma separated

=============  ======================================================  ============================
key            meaning                                                 default
=============  ======================================================  ============================
``mean``       lognormal mean length (tokens, before clipping), > 0    ``3 * seq_len / 4``
``sigma``      lognormal sigma, > 0                                    ``1.1``
``min``        shortest document (tokens), >= 1                        ``seq_len / 2``
``max``        longest document (tokens), ``min <= max <= seq_len``   ``seq_len``
``docs``       number of documents                                     ``1000000``
``lengths``    CSV file of document lengths (one per line, optional    (lognormal)
               header; a ``length`` column when there are several);
               replaces the lognormal keys; lengths above ``--seq-len``
               are cut to it
``seed``       lengths and token ids, >= 0 (``--seed`` still orders    ``0``
               the documents)
``vocab``      token ids are uniform in ``[0, vocab - 2)``, EOD is     the preset's ``vocab_size``
               ``vocab - 2``; ``3 <= vocab <= `` the preset's
=============  ======================================================  ============================

Lognormal lengths are ``clip(round(exp(N(ln(mean) - sigma^2 / 2, sigma))), min, max)`` (thd-packing's
:func:`~thd_packing.lognormal_lengths`); document ``i``'s tokens come from its own generator, so the data are the
same at every DP size and on resume. ``lengths=`` takes the rest of the source (a path may contain commas) and must
therefore be the last key. Every error names the key, the value and the rule (``ValueError``, exit code 2).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from thd_packing import MockVarlenConfig, MockVarlenDataset

#: a ``--data`` source that selects the mock dataset: exactly this, or this followed by ``:KEY=VALUE,...``
MOCK = "mock"
MOCK_KEYS = ("mean", "sigma", "min", "max", "docs", "seed", "vocab", "lengths")
_LOGNORMAL_KEYS = ("mean", "sigma", "min", "max", "docs")
DEFAULT_DOCS = 1_000_000
_SYNTAX = "mock[:KEY=VALUE,...] with keys " + ", ".join(MOCK_KEYS)


def is_mock(source: str) -> bool:
    """Whether the ``--data`` source ``source`` names the mock dataset (``mock`` or ``mock:...``)."""
    return source == MOCK or source.startswith(MOCK + ":")


@dataclass(frozen=True)
class MockDataSpec:
    """A parsed ``--data mock:...`` source (``None``: the default of the table in the module docstring)."""

    text: str
    mean: float | None = None
    sigma: float = 1.1
    min: int | None = None
    max: int | None = None
    docs: int = DEFAULT_DOCS
    seed: int = 0
    vocab: int | None = None
    lengths: str | None = None

    def to_config(self, seq_len: int, vocab_size: int, *, stream: int = 0):
        """thd-packing's :class:`~thd_packing.MockVarlenConfig` of this spec at ``--seq-len`` ``seq_len`` for a
        model of ``vocab_size`` ids; ``stream`` > 0 is an independent stream of documents (held-out evaluation)."""

        vocab = vocab_size if self.vocab is None else self.vocab
        if vocab > vocab_size:
            raise ValueError(f"--data {self.text}: vocab={vocab} exceeds the model's vocab_size {vocab_size}")
        return MockVarlenConfig(
            seq_length=seq_len,
            mode="file" if self.lengths else "lognormal",
            min_len=self.min,
            max_len=self.max,
            mean_len=self.mean,
            sigma=self.sigma,
            seed=self.seed,
            num_samples=self.docs,
            lengths_csv=self.lengths,
            vocab_size=vocab,
            stream=stream,
        )

    def with_docs(self, docs: int) -> MockDataSpec:
        """The same spec with ``docs`` documents (lognormal; a lengths CSV keeps its own count)."""
        return self if self.lengths else dataclasses.replace(self, docs=docs)

    def describe(self, seq_len: int) -> str:
        """What the spec draws, with the defaults resolved (the start summary)."""
        if self.lengths:
            return f"lengths from {self.lengths} (cut to {seq_len}), seed {self.seed}"
        lo = max(1, seq_len // 2) if self.min is None else self.min
        hi = seq_len if self.max is None else self.max
        mean = min(max(3 * seq_len / 4, lo), hi) if self.mean is None else self.mean
        return (
            f"lognormal lengths (mean {mean:g}, sigma {self.sigma:g}, clipped to [{lo}, {hi}]), {self.docs:,} "
            f"documents, seed {self.seed}"
        )


def _number(text: str, key: str, value: str, kind: type) -> int | float:
    try:
        number = kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"--data {text}: {key}={value!r} is not {what}") from None
    if not math.isfinite(number):
        raise ValueError(f"--data {text}: {key}={value!r} must be finite")
    return number


def parse_mock_spec(text: str, seq_len: int) -> MockDataSpec:
    """Parse and validate the ``--data`` source ``text`` (``mock`` or ``mock:KEY=VALUE,...``) for ``--seq-len``
    ``seq_len``; ``ValueError`` naming the key, the value and the rule (module docstring)."""
    if not is_mock(text):
        raise ValueError(f"--data {text!r} is not a mock source ({_SYNTAX})")
    body = text[len(MOCK) + 1 :]
    if text != MOCK and not body:
        raise ValueError(f"--data {text}: '' is not KEY=VALUE ({_SYNTAX}; plain 'mock' takes the defaults)")
    values: dict[str, str] = {}
    rest = body
    while rest:
        item, _, tail = rest.partition(",")
        key, eq, value = item.partition("=")
        key = key.strip()
        if key == "lengths" and eq:  # a path: the rest of the source
            value, tail = rest.partition("=")[2], ""
        if not eq or not key or not value.strip():
            raise ValueError(f"--data {text}: {item!r} is not KEY=VALUE ({_SYNTAX})")
        if key not in MOCK_KEYS:
            raise ValueError(f"--data {text}: unknown key {key!r}; keys: {', '.join(MOCK_KEYS)}")
        if key in values:
            raise ValueError(f"--data {text}: key {key!r} given twice")
        values[key] = value.strip()
        rest = tail
    if "lengths" in values:
        clash = [k for k in _LOGNORMAL_KEYS if k in values]
        if clash:
            raise ValueError(
                f"--data {text}: lengths= (a CSV of lengths) replaces the lognormal keys; drop {', '.join(clash)}"
            )
        if not Path(values["lengths"]).is_file():
            raise ValueError(f"--data {text}: lengths file {values['lengths']} does not exist")
    kw: dict = {}
    for key in ("mean", "sigma"):
        if key in values:
            kw[key] = float(_number(text, key, values[key], float))
            if kw[key] <= 0:
                raise ValueError(f"--data {text}: {key}={values[key]} must be > 0")
    for key, low in (("min", 1), ("max", 1), ("docs", 1), ("seed", 0), ("vocab", 3)):
        if key in values:
            kw[key] = int(_number(text, key, values[key], int))
            if kw[key] < low:
                raise ValueError(f"--data {text}: {key}={values[key]} must be >= {low}")
    spec = MockDataSpec(text=text, lengths=values.get("lengths"), **kw)
    lo = max(1, seq_len // 2) if spec.min is None else spec.min
    hi = seq_len if spec.max is None else spec.max
    if hi > seq_len:
        raise ValueError(
            f"--data {text}: max={hi} exceeds --seq-len {seq_len} (a document is at most one sequence)"
        )
    if lo > hi:
        raise ValueError(f"--data {text}: min={lo} exceeds max={hi}")
    if spec.mean is not None and not lo <= spec.mean <= hi:
        raise ValueError(f"--data {text}: mean={spec.mean:g} must lie in [min, max] = [{lo}, {hi}]")
    return spec


def check_mock_data(tc) -> MockDataSpec | None:
    """The parsed mock source of the :class:`~dsv4_train.config.TrainConfig` ``tc`` (``None`` when its
    data are files or the default corpus); ``ValueError`` for a bad spec or settings that only apply to text."""
    mocks = [s for s in tc.data.sources if is_mock(s)]
    if not mocks:
        return None
    if len(tc.data.sources) > 1:
        raise ValueError(
            f"--data {mocks[0]} is the mock dataset and cannot be mixed with other sources ({len(tc.data.sources)} given); "
            "write ./mock for a file called 'mock'"
        )
    spec = parse_mock_spec(mocks[0], tc.data.seq_len)
    for flag, value, default in (
        ("--tokenizer", tc.data.tokenizer, None),
        ("--long-docs", tc.data.long_docs, "split"),
        ("--skip-bad-records", tc.data.skip_bad_records, False),
    ):
        if value != default:
            raise ValueError(f"{flag} applies to text data; --data {spec.text} makes its own token ids")
    return spec


def build_mock_dataset(spec: MockDataSpec, seq_len: int, vocab_size: int, *, stream: int = 0):
    """thd-packing's :class:`~thd_packing.MockVarlenDataset` of ``spec`` (``stream``: see
    :meth:`MockDataSpec.to_config`)."""

    return MockVarlenDataset(spec.to_config(seq_len, vocab_size, stream=stream))


def mock_summary(spec: MockDataSpec, ds, seq_len: int) -> str:
    """The start summary of a mock run: what is drawn, documents and tokens."""
    return (
        f"dsv4 train: data (--seq-len {seq_len}): mock, {spec.describe(seq_len)}, vocab {ds.vocab_size}: "
        f"{len(ds):,} documents, {int(ds.lengths.sum()):,} tokens"
    )


__all__ = [
    "MOCK",
    "MOCK_KEYS",
    "MockDataSpec",
    "build_mock_dataset",
    "check_mock_data",
    "is_mock",
    "mock_summary",
    "parse_mock_spec",
]
