from pathlib import Path

import numpy as np
import pytest
import torch

from thd_packing import (
    ByteTokenizer,
    HFTokenizer,
    MockVarlenConfig,
    MockVarlenDataset,
    RawTextDataset,
    TextDatasetConfig,
    TextRecordError,
    VarlenDataset,
    default_corpus,
    default_corpus_dataset,
    default_corpus_documents,
    format_source_stats,
    load_tokenizer,
    read_lengths_csv,
)


def _bytes(s: str) -> list[int]:
    return list(s.encode())


def test_raw_text_sample_layout():
    cfg = TextDatasetConfig(seq_capacity=4, long_documents="truncate")
    with pytest.warns(
        UserWarning, match=r"truncated 2 of 3 documents to seq_capacity=4 rows \(8 tokens not used\)"
    ):
        ds = RawTextDataset.from_texts(["héllo", "", "abcdefghij"], cfg)
    assert isinstance(ds, VarlenDataset)
    eod = ByteTokenizer.eod
    s0 = ds[0]
    ids = _bytes("héllo") + [eod]  # 6 bytes + EOD, truncated to capacity 4 + EOD
    ids = ids[:4] + [eod]
    assert s0.tokens.tolist() == ids[:-1] and s0.labels.tolist() == ids[1:]
    assert s0.loss_mask.tolist() == [1.0] * 4 and s0.tokens.dtype == torch.int64
    # empty text becomes [EOD, EOD]: one row predicting EOD
    assert ds[1].tokens.tolist() == [eod] and ds[1].labels.tolist() == [eod]
    assert ds.lengths.tolist() == [4, 1, 4] and len(ds) == 3 and ds.num_tokens == 9
    assert ds.ids(2).tolist() == _bytes("abcd") + [eod]


def test_short_text_keeps_every_token_and_ends_with_eod():
    ds = RawTextDataset.from_texts(["ab"], TextDatasetConfig(seq_capacity=16))
    assert ds.ids(0).tolist() == _bytes("ab") + [256]
    assert ds[0].tokens.tolist() == _bytes("ab") and ds[0].labels.tolist() == [_bytes("b")[0], 256]


def test_split_long_documents_keeps_every_token():
    text = "0123456789"
    assert TextDatasetConfig(seq_capacity=4).long_documents == "split"  # the default: nothing is cut
    ds = RawTextDataset.from_texts([text, "ab"], TextDatasetConfig(seq_capacity=4))
    full = _bytes(text) + [256]
    assert ds.lengths.tolist() == [4, 4, 2, 2]
    assert torch.cat([ds[i].tokens for i in range(3)]).tolist() == full[:-1]
    assert torch.cat([ds[i].labels for i in range(3)]).tolist() == full[1:]
    assert ds.ids(3).tolist() == _bytes("ab") + [256]
    with pytest.raises(ValueError, match="long_documents"):
        TextDatasetConfig(4, long_documents="drop")


def test_eod_mask_loss():
    ds = RawTextDataset.from_texts(["abc", ""], TextDatasetConfig(seq_capacity=8, eod_mask_loss=True))
    assert ds[0].loss_mask.tolist() == [1.0, 1.0, 0.0]
    assert ds[1].loss_mask.tolist() == [0.0]


def test_from_paths_and_skip_report(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n{"text": 1}\n{"text": "yz"}\n')
    with pytest.raises(TextRecordError, match=r"a\.jsonl:2"):
        RawTextDataset.from_paths(tmp_path / "a.jsonl", TextDatasetConfig(8))
    with pytest.warns(UserWarning, match="1 skipped"):
        ds = RawTextDataset.from_paths(tmp_path / "a.jsonl", TextDatasetConfig(8, errors="skip"))
    assert len(ds) == 2 and ds.report.num_skipped == 1 and ds.report.records == 2


def test_source_stats_count_documents_tokens_splits_truncations_and_skips(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "0123456789"}\n{"text": 1}\n{"text": "ab"}\n')
    d = tmp_path / "dir"
    (d / "sub").mkdir(parents=True)
    (d / "x.TXT").write_text("x" * 9)
    (d / "sub" / "y.md").write_text("yyyy")
    (d / "skip.png").write_bytes(b"\0")
    paths = [tmp_path / "a.jsonl", d]
    with pytest.warns(UserWarning, match="1 skipped"):
        ds = RawTextDataset.from_paths(paths, TextDatasetConfig(4, errors="skip"))
    a, b = ds.source_stats()
    assert (a.source, a.files, a.documents, a.tokens, a.samples) == (str(paths[0]), 1, 2, 12, 4)
    assert (a.split, a.truncated, a.truncated_tokens, a.skipped, a.ignored) == (1, 0, 0, 1, 0)
    assert (b.source, b.files, b.documents, b.tokens, b.samples) == (str(d), 2, 2, 13, 4)
    assert (b.split, b.truncated, b.skipped, b.ignored) == (1, 0, 0, 1)
    assert ds.num_tokens == 12 + 13  # a row per token of every text (the last row of a document predicts EOD)
    text = format_source_stats(ds.source_stats())
    assert text.splitlines()[0] == (
        f"{paths[0]}: 1 file, 2 documents, 12 tokens -> 4 samples; 1 split, 0 truncated, 1 bad records skipped"
    )
    assert text.splitlines()[1].endswith(
        "1 split, 0 truncated, 0 bad records skipped, 1 directory entries ignored"
    )
    assert text.splitlines()[2].startswith("total: 3 files, 4 documents, 25 tokens -> 8 samples; 2 split")
    with pytest.warns(UserWarning, match="truncated 2 of 4 documents"):
        cut = RawTextDataset.from_paths(paths, TextDatasetConfig(4, errors="skip", long_documents="truncate"))
    a, b = cut.source_stats()
    assert (a.samples, a.split, a.truncated, a.truncated_tokens) == (2, 0, 1, 6)
    assert (b.samples, b.split, b.truncated, b.truncated_tokens) == (2, 0, 1, 5)
    assert "1 truncated (6 tokens not used)" in a.summary()


def test_from_texts_source_stats():
    (st,) = RawTextDataset.from_texts(["abcdefgh", ""], TextDatasetConfig(3)).source_stats()
    assert (st.source, st.files, st.documents, st.tokens, st.samples, st.split) == ("<texts>", 0, 2, 8, 4, 1)
    assert st.summary().startswith("<texts>: 2 documents, 8 tokens -> 4 samples")


def test_no_usable_documents(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": 1}\n')
    with pytest.raises(ValueError, match="no usable documents"), pytest.warns(UserWarning):
        RawTextDataset.from_paths(tmp_path / "a.jsonl", TextDatasetConfig(8, errors="skip"))


def test_bad_inputs():
    with pytest.raises(ValueError, match="seq_capacity"):
        TextDatasetConfig(0)
    with pytest.raises(ValueError, match="text 1 is int"):
        RawTextDataset.from_texts(["a", 3], TextDatasetConfig(4))
    with pytest.raises(IndexError):
        RawTextDataset.from_texts(["a"], TextDatasetConfig(4))[1]


@pytest.fixture
def hf_tokenizer_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<|endoftext|>": 1, "<pad>": 2, "hello": 3, "world": 4, "!": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_tokenizer_file(hf_tokenizer_file):
    tok = load_tokenizer(hf_tokenizer_file, pad_token="<pad>")
    assert isinstance(tok, HFTokenizer) and tok.eod == 1 and tok.pad_id == 2 and tok.vocab_size == 6
    ds = RawTextDataset.from_texts(["hello world !", "world"], TextDatasetConfig(8), tok)
    assert ds.ids(0).tolist() == [3, 4, 5, 1] and ds.ids(1).tolist() == [4, 1]
    assert ds.eod == 1 and ds.pad_id == 2 and ds.vocab_size == 6
    assert tok.decode([3, 4]) == "hello world"


def test_hf_tokenizer_errors(hf_tokenizer_file, tmp_path):
    with pytest.raises(ValueError, match="'<eos>' is not in the vocabulary"):
        HFTokenizer(hf_tokenizer_file, eod_token="<eos>")
    with pytest.raises(ValueError, match="does not exist"):
        HFTokenizer(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a valid Hugging Face tokenizers JSON"):
        HFTokenizer(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="tokenizer must be"):
        load_tokenizer(3)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve ✓ text"
    assert tok.decode(tok.encode(text) + [tok.eod]) == text
    assert [a.tolist() for a in tok.encode_batch(["ab", ""])] == [[97, 98], []]


def test_mock_lognormal_defaults_and_determinism():
    cfg = MockVarlenConfig(seq_length=64, num_samples=20_000, seed=3)
    ds = MockVarlenDataset(cfg)
    lengths = ds.lengths
    assert lengths.min() >= 32 and lengths.max() <= 64 and len(ds) == 20_000
    # clipping to [32, 64] pulls the heavy-tailed mean 48 between the bounds
    assert 40 < lengths.mean() < 56
    assert np.array_equal(MockVarlenDataset(cfg).lengths, lengths)
    a, b = ds[5], MockVarlenDataset(cfg)[5]
    assert torch.equal(a.tokens, b.tokens) and len(a) == lengths[5]
    assert a.labels[-1].item() == ds.eod and (a.tokens < ds.eod).all()
    assert not torch.equal(ds[6].tokens[:10], a.tokens[:10])


def test_mock_length_one_and_eod_mask():
    ds = MockVarlenDataset(MockVarlenConfig(seq_length=1, num_samples=3, eod_mask_loss=True))
    assert ds.lengths.tolist() == [1, 1, 1]
    assert ds[0].labels.tolist() == [ds.eod] and ds[0].loss_mask.tolist() == [0.0]


def test_mock_csv_lengths_and_truncation(tmp_path):
    (tmp_path / "plain.csv").write_text("5\n300\n\n1\n")
    (tmp_path / "header.csv").write_text("id,length\n0,7\n1,2\n")
    ds = MockVarlenDataset(MockVarlenConfig(seq_length=100, mode="file", lengths_csv=tmp_path / "plain.csv"))
    assert ds.lengths.tolist() == [5, 100, 1]
    assert read_lengths_csv(tmp_path / "header.csv").tolist() == [7, 2]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("5\nfive\n", "bad.csv:2: length 'five' is not an integer"),
        ("length\n3\n0\n", "bad.csv:3: length 0 must be >= 1"),
        ("a,b\n1,2\n", "bad.csv:1: header"),
        ("", "empty file"),
    ],
)
def test_mock_csv_errors(tmp_path, content, match):
    (tmp_path / "bad.csv").write_text(content)
    with pytest.raises(ValueError, match=match):
        read_lengths_csv(tmp_path / "bad.csv")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(seq_length=0), "seq_length"),
        (dict(seq_length=8, min_len=6, mean_len=4), "min_len"),
        (dict(seq_length=8, max_len=9), "max_len"),
        (dict(seq_length=8, sigma=0), "sigma"),
        (dict(seq_length=8, mode="file"), "lengths_csv"),
        (dict(seq_length=8, vocab_size=2), "vocab_size"),
    ],
)
def test_mock_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MockVarlenConfig(**kwargs)


def test_default_corpus_is_real_deterministic_and_capped():
    docs, info = default_corpus(max_bytes=300_000)
    assert docs == default_corpus_documents(max_bytes=300_000)
    assert 0 < info.num_bytes <= 300_000 and len(docs) == len(info.files) >= 3
    assert list(info.files) == sorted(info.files)
    assert all("/test/" not in f and not f.startswith("test/") for f in info.files)
    assert sum(len(d.encode()) for d in docs) == info.num_bytes
    # real Python source text, e.g. the __future__ module comes first in sorted order
    assert info.files[0] == "__future__.py" and "absolute_import" in docs[0]
    # a smaller cap gives a prefix of the same corpus
    small, _ = default_corpus(max_bytes=100_000)
    assert small == docs[: len(small)]


def test_default_corpus_selects_every_stdlib_source_outside_the_excluded_directories():
    """The whole corpus (no cap) is the module docstring's selection, listed here independently: every ``*.py`` file
    below the stdlib directory, none inside an excluded directory, UTF-8 only, in sorted relative-path order."""
    docs, info = default_corpus(max_bytes=1 << 40)
    root = Path(info.stdlib_dir)
    excluded = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
    selected = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if p.is_file() and not excluded.intersection(p.relative_to(root).parts[:-1])
    )
    decodable = []
    for name in selected:
        try:
            (root / name).read_bytes().decode("utf-8")
            decodable.append(name)
        except UnicodeDecodeError:
            pass
    assert list(info.files) == decodable and len(docs) == len(decodable) > 100
    assert info.num_undecodable == len(selected) - len(decodable)


def test_default_corpus_dataset():
    ds = default_corpus_dataset(seq_capacity=256, max_bytes=200_000)
    # long source files are split, not truncated: every byte of the corpus is a training row
    assert len(ds) > len(ds.corpus_info.files) and ds.lengths.max() <= 256
    empty = sum(1 for d in default_corpus_documents(200_000) if not d)  # an empty file is one [EOD, EOD] row
    assert ds.num_tokens == ds.corpus_info.num_bytes + empty
    assert ds.tokenizer.decode(ds[0].tokens.tolist()) == default_corpus_documents(200_000)[0][:256]
    (st,) = ds.source_stats()
    assert st.source.startswith("default corpus (Python") and st.files == len(ds.corpus_info.files)
    assert (st.documents, st.samples, st.truncated) == (len(ds.corpus_info.files), len(ds), 0)
    with pytest.raises(ValueError, match="max_bytes"):
        default_corpus(max_bytes=0)
