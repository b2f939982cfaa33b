"""The datasets of a ``dsv4 train`` run: what it trains on and what it evaluates on (``--eval-interval`` > 0).

Evaluation data, in this order of precedence:

- ``--eval-data PATH...``: those text sources (read like ``--data``: same tokenizer, ``--long-docs``,
  ``--skip-bad-records``); the training data are untouched.
- ``--data mock[:...]``: a separate stream of the same mock configuration (thd-packing's ``MockVarlenConfig.stream
  = 1``: numpy spawn keys, independent of the training stream 0) with ``--eval-iters x --global-batch-size``
  documents; the training data are untouched.
- otherwise a **held-out split** of the training data (files or the default corpus), chosen before training and
  never trained on. The unit is the *document* (a record, or a default-corpus file), so the pieces of a split long
  document all land on the same side. Documents are taken in the order of
  ``numpy.random.default_rng([--seed, HELDOUT_SEED_TAG]).permutation(num_documents)`` until their samples number
  at least ``--eval-iters x --global-batch-size``; those documents are held out, the training iterator reads the
  remaining samples only (in their original order, shuffled per epoch by ``--seed`` as always). The split is a
  function of the data, ``--seq-len``, ``--seed``, ``--global-batch-size`` and ``--eval-iters`` alone, so a resumed
  run holds out the same documents; a resume that would change it is refused
  (:func:`heldout_conflict`). It must leave at least one global batch to train on.

Every evaluation reads the same batches: the first ``--eval-iters`` global batches of the evaluation dataset in the
``--seed`` order (thd-packing's batch iterator from iteration 0, the same ``[B, S]`` or ``--packed`` layout as
training, this rank's DP share). ``--eval-data`` must hold at least that many samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dsv4_train.config import TrainConfig, flat_settings
from dsv4_train.data import build_text_dataset, data_summary
from dsv4_train.mock_data import build_mock_dataset, check_mock_data, is_mock, mock_summary
from thd_packing import VarlenSubset

#: mixed with ``--seed`` into the generator that orders the documents of the held-out split ("eval" in ASCII)
HELDOUT_SEED_TAG = 0x6576616C
#: the mock stream of the evaluation documents (stream 0 is training)
EVAL_MOCK_STREAM = 1


def eval_enabled(tc: TrainConfig) -> bool:
    return tc.eval.eval_interval > 0


def eval_samples(tc: TrainConfig) -> int:
    """Samples one evaluation reads: ``--eval-iters x --global-batch-size``."""
    return tc.eval.eval_iters * tc.data.global_batch_size


def heldout_samples(settings: dict[str, Any]) -> int:
    """Samples the training data must hold out for ``settings`` (flat field names: ``TrainConfig.flat()`` or a
    checkpoint's saved config through ``flat_settings``): ``0`` unless evaluation is on and reads neither
    ``--eval-data`` nor mock data."""
    get = settings.get
    if get("eval_interval", 0) <= 0 or get("eval_data", []) or any(is_mock(s) for s in get("sources", [])):
        return 0
    return int(get("eval_iters", 0)) * int(get("global_batch_size", 0))


def heldout_conflict(tc: TrainConfig, saved: dict[str, Any]) -> str | None:
    """A line for the resume checks when ``tc`` would hold out other documents than the checkpoint's run ``saved``
    (its TrainConfig as a dict; older checkpoints have no eval settings: no evaluation)."""
    now, then = heldout_samples(tc.flat()), heldout_samples(flat_settings(saved))
    if now == then:
        return None
    what = lambda n: f"{n} samples" if n else "nothing"
    return (
        f"--eval-interval/--eval-iters/--eval-data: the run would hold out {what(now)} of the training data for "
        f"evaluation (checkpoint: {what(then)}; the split decides which documents are trained on). Keep the checkpoint's "
        "evaluation settings, or evaluate on --eval-data PATH, which leaves the training data as they are"
    )


def split_heldout(ds, num_samples: int, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(train_indices, heldout_indices, heldout_documents)`` of the held-out split of ``ds`` (module docstring);
    documents from ``ds.sample_documents`` when the dataset has them, else each sample is a document."""
    n = len(ds)
    docs = getattr(ds, "sample_documents", None)
    docs = np.arange(n, dtype=np.int64) if docs is None else np.asarray(docs, dtype=np.int64)
    num_docs = int(docs.max()) + 1 if n else 0
    per_doc = np.bincount(docs, minlength=num_docs)  # [num_docs] samples of each document
    order = np.random.default_rng([seed, HELDOUT_SEED_TAG]).permutation(num_docs)
    taken = int(np.searchsorted(np.cumsum(per_doc[order]), num_samples)) + 1  # documents until >= num_samples
    held = np.zeros(num_docs, dtype=bool)
    held[order[:taken]] = True
    mask = held[docs]  # [n] sample is held out
    return np.flatnonzero(~mask), np.flatnonzero(mask), min(taken, num_docs)


@dataclass
class RunData:
    """``train``: the dataset the training iterator reads; ``eval``: the evaluation dataset (``None`` without
    evaluation); ``summary``: the start summary lines."""

    train: Any
    eval: Any
    summary: str


def _heldout_summary(tc: TrainConfig, ds, heldout: np.ndarray, docs: int) -> str:
    tokens, total = int(ds.lengths[heldout].sum()), int(ds.lengths.sum())
    return (
        f"held-out split of the training data: {docs:,} documents, {heldout.size:,} samples, {tokens:,} tokens "
        f"({100 * tokens / max(total, 1):.2f} % of the tokens; never trained on; --seed {tc.schedule.seed})"
    )


def trained_on(tc: TrainConfig) -> list[str]:
    """The ``--eval-data`` sources that are ``--data`` sources too (compared as resolved paths)."""
    train = {Path(s).resolve() for s in tc.data.sources}
    return [s for s in tc.eval.eval_data if Path(s).resolve() in train]


def build_run_data(tc: TrainConfig, vocab_size: int) -> RunData:
    """The training and evaluation datasets of ``tc`` for a model of ``vocab_size`` ids (``ValueError`` with one
    message for unreadable data, too little held-out data or too small ``--eval-data``)."""

    spec = check_mock_data(tc)
    if spec is not None:
        ds = build_mock_dataset(spec, tc.data.seq_len, vocab_size)
        lines = [mock_summary(spec, ds, tc.data.seq_len)]
    else:
        ds = build_text_dataset(tc)
        lines = [data_summary(ds, tc)]
    if not eval_enabled(tc):
        return RunData(ds, None, "\n".join(lines))
    need = eval_samples(tc)
    train = ds
    if tc.eval.eval_data:
        eval_ds = build_text_dataset(tc, sources=tc.eval.eval_data)
        if len(eval_ds) < need:
            raise ValueError(
                f"--eval-data {' '.join(tc.eval.eval_data)} makes {len(eval_ds):,} samples at --seq-len {tc.data.seq_len}; "
                f"one evaluation reads --eval-iters {tc.eval.eval_iters} x --global-batch-size {tc.data.global_batch_size} = "
                f"{need:,}: lower --eval-iters or add evaluation data"
            )
        what = f"--eval-data ({len(eval_ds):,} samples, {int(eval_ds.lengths.sum()):,} tokens)"
        trained = trained_on(tc)
        if trained:
            lines.append(
                f"  note: --eval-data {' '.join(trained)} is also a --data source: the evaluation measures text the "
                "run trains on (drop --eval-data for a held-out split of the training data)"
            )
    elif spec is not None:
        eval_ds = build_mock_dataset(
            spec.with_docs(need), tc.data.seq_len, vocab_size, stream=EVAL_MOCK_STREAM
        )
        if len(eval_ds) < need:
            raise ValueError(
                f"--data {spec.text}: the lengths file has {len(eval_ds):,} documents; one evaluation reads "
                f"--eval-iters {tc.eval.eval_iters} x --global-batch-size {tc.data.global_batch_size} = {need:,}: lower "
                "--eval-iters"
            )
        what = (
            f"mock stream {EVAL_MOCK_STREAM} of the same configuration ({len(eval_ds):,} documents, independent "
            "of the training stream)"
        )
    else:
        keep, heldout, docs = split_heldout(ds, need, tc.schedule.seed)
        if keep.size < tc.data.global_batch_size:
            raise ValueError(
                f"the held-out split for evaluation (--eval-iters {tc.eval.eval_iters} x --global-batch-size "
                f"{tc.data.global_batch_size} = {need:,} samples, whole documents) leaves {keep.size:,} of {len(ds):,} "
                "samples to train on, less than one global batch: lower --eval-iters, add data, or evaluate on "
                "--eval-data PATH"
            )
        train, eval_ds = VarlenSubset(ds, keep), VarlenSubset(ds, heldout)
        what = _heldout_summary(tc, ds, heldout, docs)
    lines.append(
        f"dsv4 train: evaluation every {tc.eval.eval_interval} steps and at the end, {tc.eval.eval_iters} global batches "
        f"({need:,} samples) of the {what}"
    )
    return RunData(train, eval_ds, "\n".join(lines))


__all__ = [
    "EVAL_MOCK_STREAM",
    "HELDOUT_SEED_TAG",
    "RunData",
    "build_run_data",
    "eval_enabled",
    "eval_samples",
    "heldout_conflict",
    "heldout_samples",
    "split_heldout",
]
