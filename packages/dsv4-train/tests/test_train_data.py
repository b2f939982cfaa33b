"""``dsv4 train`` data flags: repeated --data accumulates, directories read every format, long documents are split
(or truncated when asked, counted), bad records stop the run naming --skip-bad-records or are skipped and counted,
and the run prints a per-source summary at the start."""

import json
import os
import subprocess
import sys

import pytest

from dsv4_train.cli import build_parser, train_config_from_args
from dsv4_train.config import TrainConfig
from dsv4_train.data import build_batches, build_text_dataset, data_summary


def _tc(*argv: str) -> TrainConfig:
    return train_config_from_args(build_parser().parse_args(["train", *argv]))


def _sources(tmp_path):
    """A JSONL file (a 1000-byte document, a bad record, a short one) and a directory of mixed formats."""
    a = tmp_path / "a.jsonl"
    a.write_text(
        json.dumps({"text": "x" * 1000})
        + "\n"
        + '{"body": "no text field"}\n'
        + json.dumps({"text": "hi"})
        + "\n"
    )
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "README.TXT").write_text("y" * 150)
    (d / "sub" / "notes.md").write_text("markdown")
    (d / "sub" / "more.jsonl").write_text(json.dumps({"text": "z" * 70}) + "\n")
    (d / "logo.png").write_bytes(b"\x89PNG")
    return a, d


def test_data_flags_accumulate_and_default():
    tc = _tc("--data", "a.jsonl", "--data", "dir/", "c.txt", "--long-docs", "truncate", "--skip-bad-records")
    assert (tc.data.sources, tc.data.long_docs, tc.data.skip_bad_records) == (
        ("a.jsonl", "dir/", "c.txt"),
        "truncate",
        True,
    )
    tc = _tc()
    assert (tc.data.sources, tc.data.long_docs, tc.data.skip_bad_records) == ((), "split", False)
    with pytest.raises(ValueError, match=r"--long-docs must be one of \['split', 'truncate'\]"):
        TrainConfig.from_flat(long_docs="drop")
    assert TrainConfig.from_flat(data="one.jsonl").data.sources == (
        "one.jsonl",
    )  # a config file's single path


def test_every_source_is_read_split_and_summarised(tmp_path):
    a, d = _sources(tmp_path)
    tc = _tc("--data", str(a), "--data", str(d), "--seq-len", "64", "--skip-bad-records")
    ds = build_text_dataset(tc)
    sa, sd = ds.source_stats()
    # 1000 + 2 tokens -> ceil(1000 / 64) + 1 samples; nothing cut
    assert (sa.documents, sa.tokens, sa.samples, sa.split, sa.truncated, sa.skipped) == (2, 1002, 17, 1, 0, 1)
    # README.TXT (150 -> 3 samples), more.jsonl (70 -> 2), notes.md (8 -> 1): every format, recursively
    assert (sd.files, sd.documents, sd.tokens, sd.samples, sd.split, sd.ignored) == (3, 3, 228, 6, 2, 1)
    assert ds.num_tokens == 1002 + 228  # every token of every document is a training row
    text = data_summary(ds, tc)
    lines = text.splitlines()
    assert lines[0] == "dsv4 train: data (--seq-len 64, long documents: split):"
    assert lines[1] == (
        f"  {a}: 1 file, 2 documents, 1,002 tokens -> 17 samples; 1 split, 0 truncated, 1 bad records skipped"
    )
    assert lines[2].startswith(f"  {d}: 3 files, 3 documents, 228 tokens -> 6 samples; 2 split, 0 truncated")
    assert lines[3].startswith("  total: 4 files, 5 documents, 1,230 tokens -> 23 samples; 3 split")
    assert any(x.startswith(f"  skipped bad record: {a}:2: record has no 'text' field") for x in lines)
    assert any(x.startswith(f"  ignored: {d / 'logo.png'}: unsupported file") for x in lines)
    batches = build_batches(ds, tc, vocab_size=258, dp_size=1, dp_rank=0)
    assert batches.config.layout == "sbhd" and batches.config.too_long == "split"


def test_truncate_is_counted(tmp_path):
    a, _ = _sources(tmp_path)
    tc = _tc("--data", str(a), "--seq-len", "64", "--skip-bad-records", "--long-docs", "truncate")
    ds = build_text_dataset(tc)
    (st,) = ds.source_stats()
    assert (st.samples, st.split, st.truncated, st.truncated_tokens) == (2, 0, 1, 936)
    assert "1 truncated (936 tokens not used)" in data_summary(ds, tc)


def test_bad_record_error_names_the_cli_switch(tmp_path):
    a, _ = _sources(tmp_path)
    with pytest.raises(ValueError) as err:
        build_text_dataset(_tc("--data", str(a)))
    msg = str(err.value)
    assert msg.startswith(f"{a}:2: record has no 'text' field")
    assert msg.endswith("pass --skip-bad-records to skip bad records and count them.")
    assert "errors=" not in msg


def test_dsv4_train_stops_on_bad_data_before_building_the_model(tmp_path):
    a, _ = _sources(tmp_path)
    code = "import sys; from dsv4_train.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, "train", "--data", str(a), "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"dsv4 train: error: {a}:2: record has no 'text' field" in proc.stderr
    assert "--skip-bad-records" in proc.stderr


@pytest.mark.slow
def test_dsv4_train_prints_the_data_summary(tmp_path):
    a, d = _sources(tmp_path)
    argv = ["train", "--data", str(a), "--data", str(d), "--skip-bad-records", "--packed", "--steps", "1"]
    # no --micro-batch-size: a --packed micro-batch is one pack
    argv += ["--seq-len", "64", "--global-batch-size", "4", "--no-progress"]
    argv += ["--out", str(tmp_path / "run"), "--no-save-final"]
    code = "import sys; from dsv4_train.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, OMP_NUM_THREADS="2"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "dsv4 train: data (--seq-len 64, long documents: split):" in out
    assert f"  {a}: 1 file, 2 documents, 1,002 tokens -> 17 samples; 1 split" in out
    assert f"  {d}: 3 files, 3 documents, 228 tokens -> 6 samples; 2 split" in out
    assert "dsv4 train: 1 step, lm loss " in out


def test_eval_data_that_is_also_training_data_is_noted(tmp_path, monkeypatch):
    """Evaluating on a --data source is allowed (e.g. to compare with the training forward) but said in the start
    summary; a relative and an absolute spelling of the same file are the same source."""
    from dsv4_train.eval_data import build_run_data

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_text(
        "".join(f'{{"text": "document {i} " }}\n'.replace("document", "word " * 40) for i in range(20))
    )
    tc = TrainConfig.from_flat(
        data=["a.jsonl"],
        eval_data=[str(tmp_path / "a.jsonl")],
        eval_interval=1,
        eval_iters=1,
        seq_len=32,
        global_batch_size=2,
    )
    assert "is also a --data source" in build_run_data(tc, 512).summary
    (tmp_path / "b.jsonl").write_text((tmp_path / "a.jsonl").read_text())
    assert "is also a --data source" not in build_run_data(tc.replace(eval_data=["b.jsonl"]), 512).summary
