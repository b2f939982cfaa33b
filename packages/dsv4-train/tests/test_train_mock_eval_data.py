"""``dsv4 train --data mock:...`` and the evaluation data, without a model: the mock syntax and its one-message
errors, the held-out split (whole documents, deterministic by seed, never in a training batch), the separate mock
stream, the evaluation flags' validation and the resume check of the held-out split."""

import json
import re

import numpy as np
import pytest

from dsv4_train.checkpoint import resume_conflicts
from dsv4_train.cli import build_parser, main, train_config_from_args
from dsv4_train.config import TrainConfig, flat_settings
from dsv4_train.data import build_batches
from dsv4_train.eval_data import (
    EVAL_MOCK_STREAM,
    build_run_data,
    heldout_conflict,
    heldout_samples,
    split_heldout,
)
from dsv4_train.mock_data import parse_mock_spec


def _tc(*argv: str) -> TrainConfig:
    return train_config_from_args(build_parser().parse_args(["train", *argv]))


def test_mock_spec_defaults_keys_and_lengths_path(tmp_path):
    spec = parse_mock_spec("mock", 256)
    cfg = spec.to_config(256, 512)
    assert (cfg.mode, cfg.resolved_bounds(), cfg.sigma, cfg.num_samples, cfg.seed) == (
        "lognormal",
        (128, 256, 192.0),
        1.1,
        1_000_000,
        0,
    )
    assert cfg.vocab_size == 512  # the model's vocabulary unless vocab= is given
    spec = parse_mock_spec("mock:mean=40,sigma=0.5,min=8,max=64,docs=100,seed=3,vocab=300", 64)
    cfg = spec.to_config(64, 512)
    assert (cfg.resolved_bounds(), cfg.sigma, cfg.num_samples, cfg.seed, cfg.vocab_size) == (
        (8, 64, 40.0),
        0.5,
        100,
        3,
        300,
    )
    csv = tmp_path / "a,b.csv"  # a path may hold commas: lengths= takes the rest of the source
    csv.write_text("length\n5\n500\n7\n")
    spec = parse_mock_spec(f"mock:seed=1,lengths={csv}", 64)
    cfg = spec.to_config(64, 512)
    assert (cfg.mode, str(cfg.lengths_csv), cfg.seed) == ("file", str(csv), 1)


@pytest.mark.parametrize(
    "source, match",
    [
        ("mock:", "'' is not KEY=VALUE"),
        ("mock:mean", "'mean' is not KEY=VALUE"),
        ("mock:mu=3", "unknown key 'mu'; keys: mean, sigma"),
        ("mock:docs=3,docs=4", "key 'docs' given twice"),
        ("mock:docs=1.5", "docs='1.5' is not an integer"),
        ("mock:sigma=abc", "sigma='abc' is not a number"),
        ("mock:sigma=inf", "sigma='inf' must be finite"),
        ("mock:sigma=0", "sigma=0 must be > 0"),
        ("mock:min=0", "min=0 must be >= 1"),
        ("mock:seed=-1", "seed=-1 must be >= 0"),
        ("mock:vocab=2", "vocab=2 must be >= 3"),
        ("mock:max=65", "max=65 exceeds --seq-len 64"),
        ("mock:min=40,max=20", "min=40 exceeds max=20"),
        ("mock:mean=10", r"mean=10 must lie in \[min, max\] = \[32, 64\]"),
        ("mock:lengths=/no/such.csv", "lengths file /no/such.csv does not exist"),
    ],
)
def test_bad_mock_specs_exit_2_with_one_message(source, match, capsys, tmp_path):
    assert (
        main(["train", "--steps", "1", "--seq-len", "64", "--data", source, "--out", str(tmp_path / "run")])
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith(f"dsv4 train: error: --data {source}: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(match, err), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--data", "mock", "a.jsonl"], "cannot be mixed with other sources"),
        (["--data", "mock", "--tokenizer", "t.json"], "--tokenizer applies to text data"),
        (["--data", "mock", "--long-docs", "truncate"], "--long-docs applies to text data"),
        (["--data", "mock:lengths=x.csv,docs=3"], "does not exist"),
        (["--eval-interval", "-1"], "--eval-interval must be >= 0"),
        (["--eval-interval", "2", "--eval-iters", "0"], "--eval-iters must be >= 1"),
        (["--eval-iters", "3"], "--eval-iters only applies with --eval-interval"),
        (["--eval-data", "a.jsonl"], "--eval-data only applies with --eval-interval"),
        (["--eval-interval", "2", "--eval-data", "mock"], "--eval-data takes text sources"),
    ],
)
def test_eval_and_mock_flag_errors(flags, match, capsys, tmp_path):
    assert main(["train", "--steps", "1", "--out", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4 train: error: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(match, err), err


def test_lengths_key_replaces_the_lognormal_keys(tmp_path):
    csv = tmp_path / "l.csv"
    csv.write_text("5\n")
    with pytest.raises(ValueError, match="replaces the lognormal keys; drop mean, docs"):
        parse_mock_spec(f"mock:mean=3,docs=2,lengths={csv}", 64)


def _text_config(tmp_path, **kw) -> TrainConfig:
    """40 documents of 10..300 bytes (the long ones split into several 64-token samples)."""
    rng = np.random.default_rng(0)
    path = tmp_path / "docs.jsonl"
    path.write_text(
        "".join(json.dumps({"text": f"{i}:" + "a" * int(rng.integers(10, 300))}) + "\n" for i in range(40))
    )
    base = dict(
        data=[str(path)], seq_len=64, global_batch_size=4, micro_batch_size=2, out=str(tmp_path / "r")
    )
    return TrainConfig.from_flat(**(base | kw))


def test_heldout_split_is_whole_documents_by_seed_and_never_trained_on(tmp_path):
    tc = _text_config(tmp_path, eval_interval=5, eval_iters=3)
    data = build_run_data(tc, vocab_size=512)
    full = data.train.dataset
    docs = full.sample_documents
    assert docs.size == len(full) and np.all(np.diff(docs) >= 0)
    train_idx, held_idx = data.train.indices, data.eval.indices
    assert held_idx.size >= 3 * 4 and np.intersect1d(train_idx, held_idx).size == 0
    assert np.union1d(train_idx, held_idx).size == len(full)
    assert not set(docs[train_idx]) & set(docs[held_idx])  # a split document is on one side only
    again = build_run_data(tc, vocab_size=512)  # e.g. the resumed run: the same documents
    assert np.array_equal(again.eval.indices, held_idx)
    other = build_run_data(_text_config(tmp_path, eval_interval=5, eval_iters=3, seed=7), vocab_size=512)
    assert not np.array_equal(other.eval.indices, held_idx)
    assert "held-out split of the training data" in data.summary and "never trained on" in data.summary
    # the training iterator reads the other samples only, epoch after epoch
    batches = build_batches(data.train, tc, vocab_size=512, dp_size=1, dp_rank=0)
    seen = set()
    for _ in range(40):
        for mb in next(batches).microbatches:
            seen |= {int(train_idx[p.doc]) for p in mb.pieces if p is not None}
    assert seen == set(train_idx.tolist())


def test_heldout_split_leaves_a_global_batch_and_eval_data_is_large_enough(tmp_path):
    with pytest.raises(ValueError, match=r"leaves .* samples to train on, less than one global batch"):
        build_run_data(_text_config(tmp_path, eval_interval=1, eval_iters=1000), vocab_size=512)
    small = tmp_path / "small.txt"
    small.write_text("tiny")
    with pytest.raises(ValueError, match=r"--eval-data .* makes 1 samples .* = 8: lower --eval-iters"):
        build_run_data(_text_config(tmp_path, eval_interval=1, eval_iters=2, eval_data=[str(small)]), 512)


def test_split_counts_samples_of_whole_documents():
    class Docs:  # 5 documents of 1, 3, 1, 2, 1 samples
        sample_documents = np.array([0, 1, 1, 1, 2, 3, 3, 4])

        def __len__(self):
            return 8

    for need in (1, 3, 5):
        keep, held, ndocs = split_heldout(Docs(), need, seed=0)
        assert held.size >= need and keep.size + held.size == 8
        order = np.random.default_rng([0, 0x6576616C]).permutation(5)
        assert set(Docs.sample_documents[held]) == set(
            order[:ndocs].tolist()
        )  # the first documents of the order


def test_mock_eval_is_a_separate_stream_and_training_is_unchanged():
    tc = TrainConfig.from_flat(
        data=["mock:docs=50,seed=2"], seq_len=64, global_batch_size=4, eval_interval=3, eval_iters=2
    )
    data = build_run_data(tc, vocab_size=512)
    assert len(data.train) == 50 and len(data.eval) == 8  # eval_iters x global batch
    assert data.eval.config.stream == EVAL_MOCK_STREAM and data.train.config.stream == 0
    plain = build_run_data(
        TrainConfig.from_flat(data=["mock:docs=50,seed=2"], seq_len=64), vocab_size=512
    ).train
    assert np.array_equal(plain.lengths, data.train.lengths)
    for i in range(8):
        assert not np.array_equal(data.eval[i].tokens[:8], data.train[i].tokens[:8])
    assert "mock stream 1" in data.summary


def test_resume_refuses_a_changed_heldout_split():
    saved = TrainConfig.from_flat(eval_interval=10, eval_iters=4).to_dict()
    assert heldout_samples(flat_settings(saved)) == 4 * 8
    assert (
        heldout_conflict(TrainConfig.from_flat(eval_interval=20, eval_iters=4), saved) is None
    )  # interval: same split
    assert heldout_conflict(TrainConfig.from_flat(eval_interval=10, eval_iters=4, eval_data=["e.txt"]), saved)
    line = heldout_conflict(TrainConfig.from_flat(), saved)
    assert "hold out nothing of the training data for evaluation (checkpoint: 32 samples" in line
    old = {
        k: v for k, v in TrainConfig.from_flat().to_dict().items() if not k.startswith("eval")
    }  # before evaluation
    assert heldout_conflict(TrainConfig.from_flat(eval_interval=5, eval_data=["e.txt"]), old) is None
    lines = resume_conflicts(TrainConfig.from_flat(eval_interval=5, eval_iters=2), old, {})
    assert len(lines) == 1 and "would hold out 16 samples of the training data" in lines[0]
    mock = TrainConfig.from_flat(data=["mock"], eval_interval=5).to_dict()
    assert heldout_samples(flat_settings(mock)) == 0  # mock evaluation holds nothing out
