"""The training data's content identity (issue 29): recorded per file with every checkpoint, a resume refuses
changed contents under the same path (one line naming the file, what changed and a way out that works) and
accepts the same data under another spelling of the path or with a new modification time."""

import json
import os

import pytest

from dsv4_train.cli import main
from dsv4_train.config import TrainConfig
from dsv4_train.data_identity import (
    DATA_IDENTITY_FILE,
    DigestScheme,
    check_same_data,
    data_changes,
    data_identity,
    read_data_identity,
    sample_offsets,
    write_data_identity,
)

#: a sampled digest for files over 1 KiB: 4 blocks of 64 bytes
SMALL_SCHEME = DigestScheme(full_limit=1024, blocks=4, block_bytes=64)


def _jsonl(path, n: int, word: str = "alpha") -> None:
    path.write_text("".join(json.dumps({"text": f"{word} {i} " * 8}) + "\n" for i in range(n)))


def _recorded(tmp_path, tc: TrainConfig, scheme: DigestScheme | None = None):
    ck = tmp_path / "iter_0000001"
    ck.mkdir(exist_ok=True)
    write_data_identity(ck, data_identity(tc, scheme))
    return ck


def _bump_mtime(path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def test_changed_contents_under_the_same_path_are_refused_in_one_line(tmp_path):
    data = tmp_path / "a.jsonl"
    _jsonl(data, 20)
    tc = TrainConfig.from_flat(data=[str(data)])
    ck = _recorded(tmp_path, tc)
    saved = json.loads((ck / DATA_IDENTITY_FILE).read_text())["files"]
    assert [(f["role"], f["path"], f["size"], f["sampled"]) for f in saved] == [
        ("--data", str(data.resolve()), data.stat().st_size, False)
    ]

    _jsonl(data, 20, word="gamma")  # same size, other bytes
    with pytest.raises(ValueError) as err:
        check_same_data(ck, tc)
    msg = str(err.value)
    assert "\n" not in msg
    assert (
        f"--data file {data.resolve()} changed: same size ({data.stat().st_size:,} bytes), other content"
        in msg
    )
    assert f"--init-from {ck} --out NEW_DIR" in msg

    _jsonl(data, 30)  # another size
    with pytest.raises(ValueError, match=r"changed: [\d,]+ -> [\d,]+ bytes"):
        check_same_data(ck, tc)


def test_the_same_data_resume_under_another_path_spelling_and_mtime(tmp_path, monkeypatch):
    data = tmp_path / "a.jsonl"
    _jsonl(data, 5)
    ck = _recorded(tmp_path, TrainConfig.from_flat(data=[str(data)]))
    _bump_mtime(data)  # a copy or a touch: the whole-file digest proves the same content, no note
    monkeypatch.chdir(tmp_path)
    identity, notes = check_same_data(ck, TrainConfig.from_flat(data=["./a.jsonl"]))
    assert notes == [] and identity["files"][0]["mtime_ns"] == data.stat().st_mtime_ns


def test_directory_sources_tokenizer_and_mock_lengths_are_recorded(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    _jsonl(d / "a.jsonl", 3)
    (d / "b.txt").write_text("plain text")
    tok = tmp_path / "tok.json"
    tok.write_text('{"model": "x"}')
    tc = TrainConfig.from_flat(data=[str(d)], tokenizer=str(tok))
    ck = _recorded(tmp_path, tc)
    (d / "b.txt").unlink()
    (d / "c.md").write_text("new")
    tok.write_text('{"model": "y"}')
    changes, _, _ = data_changes(read_data_identity(ck), tc)
    assert changes == [
        f"--data file {(d / 'b.txt').resolve()} is gone",
        f"--tokenizer file {tok.resolve()} changed: same size (14 bytes), other content (SHA-256)",
        f"--data file {(d / 'c.md').resolve()} is new",
    ]

    lengths = tmp_path / "lengths.csv"
    lengths.write_text("10\n20\n")
    mock = TrainConfig.from_flat(data=[f"mock:lengths={lengths}"])
    assert [f["role"] for f in data_identity(mock)["files"]] == ["--data mock lengths"]
    assert data_identity(TrainConfig.from_flat())["files"] == []  # the embedded corpus


def test_large_files_are_digested_from_sampled_blocks(tmp_path):
    size = 4096
    assert sample_offsets(size, SMALL_SCHEME) == [0, 1344, 2688, 4032]  # first, last, evenly spaced
    data = tmp_path / "big.txt"
    data.write_bytes(b"a" * size)
    tc = TrainConfig.from_flat(data=[str(data)])
    ck = _recorded(tmp_path, tc, SMALL_SCHEME)
    saved = read_data_identity(ck)
    assert saved["scheme"] == SMALL_SCHEME and saved["files"][0].sampled

    _bump_mtime(data)  # size and blocks match, the mtime changed: resumed with a note saying what is not seen
    identity, notes = check_same_data(ck, tc)
    assert identity["scheme"] == vars(SMALL_SCHEME) and len(notes) == 1
    assert "4 sampled blocks match; resuming (an edit that keeps the size" in notes[0]

    data.write_bytes(b"a" * 2700 + b"b" + b"a" * (size - 2701))  # inside the third block
    with pytest.raises(ValueError, match="same size \\(4,096 bytes\\), other sampled content"):
        check_same_data(ck, tc)
    # outside every block with the same size: the documented limit of a sampled digest
    data.write_bytes(b"a" * 100 + b"b" + b"a" * (size - 101))
    assert data_changes(saved, tc)[0] == []


def test_checkpoints_without_or_with_a_broken_identity(tmp_path):
    data = tmp_path / "a.txt"
    data.write_text("text")
    tc = TrainConfig.from_flat(data=[str(data)])
    ck = tmp_path / "iter_0000003"
    ck.mkdir()
    identity, notes = check_same_data(ck, tc)  # written before the identity was recorded
    assert identity["files"][0]["path"] == str(data.resolve())
    assert "records no data identity" in notes[0]
    (ck / DATA_IDENTITY_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=f"{ck / DATA_IDENTITY_FILE} cannot be read .*delete it"):
        check_same_data(ck, tc)
    (ck / DATA_IDENTITY_FILE).write_text(json.dumps({"version": 99, "scheme": {}, "files": []}))
    with pytest.raises(ValueError, match="format version 99"):
        check_same_data(ck, tc)


def test_cli_resume_refuses_changed_data_and_its_advice_works(tmp_path, capsys):
    """Through ``dsv4 train`` as a user runs it: the refusal is one line and rc 2, and the command it suggests
    (``--init-from CHECKPOINT --out NEW_DIR``) trains on the new data."""
    data, out = tmp_path / "a.jsonl", tmp_path / "run"
    _jsonl(data, 40)
    argv = [
        "train",
        "--seq-len",
        "64",
        "--global-batch-size",
        "2",
        "--micro-batch-size",
        "2",
        "--no-progress",
    ]
    argv += ["--data", str(data), "--steps", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    ck = out / "checkpoints" / "iter_0000001"
    assert (ck / DATA_IDENTITY_FILE).is_file()
    _jsonl(data, 40, word="gamma")
    capsys.readouterr()
    assert main([*argv, "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--data file {data.resolve()} changed" in err, err
    suggested = err.split("with --init-from ")[1].split(" (")[0].split()  # CHECKPOINT --out NEW_DIR
    assert suggested == [str(ck), "--out", "NEW_DIR"]
    new = tmp_path / "NEW_DIR"
    assert main([*argv, "--init-from", suggested[0], "--out", str(new)]) == 0
    assert (new / "checkpoints" / "iter_0000001" / DATA_IDENTITY_FILE).is_file()
