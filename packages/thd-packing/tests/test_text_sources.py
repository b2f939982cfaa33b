import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from thd_packing import ReadReport, TextRecordError, read_text_records


def _read(paths, **kw):
    report = ReadReport()
    recs = list(read_text_records(paths, report=report, **kw))
    return recs, report


def test_jsonl_json_parquet_and_txt_dir(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "id": 3}\n')
    (tmp_path / "b.json").write_text('[\n  {"text": "three"},\n  {"text": ""}\n]\n')
    pq.write_table(pa.table({"text": ["four", "five"]}), tmp_path / "c.parquet")
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "z.txt").write_text("last")
    (d / "sub" / "m.txt").write_text("middle\n")
    (d / "a.txt").write_text("first")
    (d / "notes.md").write_text("markdown is text too")
    recs, report = _read([tmp_path / "a.jsonl", tmp_path / "b.json", tmp_path / "c.parquet", d])
    assert [r.text for r in recs] == [
        "one",
        "two",
        "three",
        "",
        "four",
        "five",
        "first",
        "markdown is text too",
        "middle\n",
        "last",
    ]
    assert [r.line for r in recs[:4]] == [1, 3, 2, 3]
    assert [r.source for r in recs] == [0, 0, 1, 1, 2, 2, 3, 3, 3, 3]
    assert report.files == 7 and report.records == 10 and report.num_skipped == 0 and report.ignored == []


def test_custom_text_key(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"content": "x"}\n')
    recs, _ = _read(tmp_path / "a.jsonl", text_key="content")
    assert recs[0].text == "x"


BAD_JSONL = [
    ('{"text": "ok"}\n{"txt": "no"}\n', "a.jsonl:2: record has no 'text' field"),
    ('{"text": 5}\n', "a.jsonl:1: field 'text' is int, expected a string"),
    ('{"text": null}\n', "a.jsonl:1: field 'text' is null"),
    ('{"text": "ok"}\n{"text": "unterminated\n', "a.jsonl:2: invalid JSON"),
    ('["text"]\n', "a.jsonl:1: record is a JSON list, expected an object"),
    ("   \n\n", "a.jsonl: empty file"),
]


@pytest.mark.parametrize(("content", "message"), BAD_JSONL)
def test_jsonl_errors_name_file_and_line(tmp_path, content, message):
    (tmp_path / "a.jsonl").write_text(content)
    with pytest.raises(TextRecordError) as err:
        _read(tmp_path / "a.jsonl")
    assert message in str(err.value)
    assert str(tmp_path) in str(err.value)


def test_undecodable_bytes_name_the_line(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "bad \xff byte"}\n')
    with pytest.raises(TextRecordError, match=r"a\.jsonl:2: undecodable UTF-8 bytes at column 15"):
        _read(tmp_path / "a.jsonl")
    (tmp_path / "b.txt").write_bytes(b"line one\nline \xc3\x28 two\n")
    with pytest.raises(TextRecordError, match=r"b\.txt:2: undecodable"):
        _read(tmp_path / "b.txt")
    (tmp_path / "c.json").write_bytes(b'[\n{"text": "a"},\n{"text": "\xfe"}]')
    with pytest.raises(TextRecordError, match=r"c\.json:3: undecodable"):
        _read(tmp_path / "c.json")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('[\n  {"text": "a"},\n  {"text": 1}\n]', "a.json:3: field 'text' is int"),
        ('[\n  {"text": "a"}\n  {"text": "b"}\n]', "a.json:3: invalid JSON: expected ',' or ']'"),
        ('[{"text": "a"},\n {"text": "b"}] trailing', "a.json:2: invalid JSON: extra data"),
        ('{"text": "single"} {"text": "two"}', "a.json:1: invalid JSON: extra data"),
        ("", "a.json: empty file"),
    ],
)
def test_json_errors(tmp_path, content, message):
    (tmp_path / "a.json").write_text(content)
    with pytest.raises(TextRecordError) as err:
        _read(tmp_path / "a.json")
    assert message in str(err.value)


def test_json_single_object_and_empty_array(tmp_path):
    (tmp_path / "a.json").write_text('{"text": "only"}')
    (tmp_path / "b.json").write_text("[ ]")
    recs, _ = _read([tmp_path / "a.json", tmp_path / "b.json"])
    assert [r.text for r in recs] == ["only"]


def test_parquet_errors(tmp_path):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nocol.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "null.parquet")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    raw = pa.DictionaryArray.from_arrays(pa.array([0, 1], pa.int8()), pa.array([b"\x00", b"\x01"]))
    pq.write_table(pa.table({"text": raw}), tmp_path / "bytesdict.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    cases = {
        "nocol": "no 'text' column",
        "ints": "column 'text' has type int64, expected text: string, large_string, string_view or a dictionary",
        "bytesdict": "column 'text' has type dictionary<values=binary, indices=int8, ordered=0>, expected text",
        "null": "null.parquet row 1: field 'text' is null",
        "empty": "empty file (no rows)",
        "junk": "not a readable Parquet file",
    }
    for name, message in cases.items():
        with pytest.raises(TextRecordError) as err:
            _read(tmp_path / f"{name}.parquet")
        assert message in str(err.value), name


def test_parquet_text_columns_of_every_string_type_and_dictionary_encoded(tmp_path):
    """Dictionary-encoded text columns (an explicit dictionary array, written with ``use_dictionary=True``; string
    and large_string values; row groups with different dictionaries) decode to their values, as do large_string
    and string_view columns; a null index is a null record."""
    words = ["alpha", "beta", "alpha", "gamma"]
    idx = pa.array([0, 1, 0, 2], pa.int32())
    chunks = pa.chunked_array(
        [
            pa.DictionaryArray.from_arrays(pa.array([1, 0], pa.int32()), pa.array(["x", "y"])),
            pa.DictionaryArray.from_arrays(pa.array([0, 0, 1], pa.int32()), pa.array(["z", "w"])),
        ]
    )
    columns = {
        "dict": (pa.DictionaryArray.from_arrays(idx, pa.array(["alpha", "beta", "gamma"])), words),
        "dict_large": (
            pa.DictionaryArray.from_arrays(idx, pa.array(["alpha", "beta", "gamma"], pa.large_string())),
            words,
        ),
        "dict_encoded": (pa.array(words).dictionary_encode(), words),
        "chunked": (chunks, ["y", "x", "z", "z", "w"]),
        "large": (pa.array(words, pa.large_string()), words),
        "view": (pa.array(words, pa.string_view()), words),
    }
    for name, (column, expected) in columns.items():
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"text": column}), path, use_dictionary=True, row_group_size=2)
        recs, report = _read(path)
        assert [r.text for r in recs] == expected and report.records == len(expected), name
        assert [r.line for r in recs] == list(range(len(expected))), name
    assert pa.types.is_dictionary(pq.read_schema(tmp_path / "chunked.parquet").field("text").type)

    nulls = pa.DictionaryArray.from_arrays(pa.array([0, None, 1], pa.int32()), pa.array(["a", "b"]))
    pq.write_table(pa.table({"text": nulls}), tmp_path / "dictnull.parquet")
    with pytest.raises(TextRecordError, match=r"dictnull\.parquet row 1: field 'text' is null"):
        _read(tmp_path / "dictnull.parquet")
    recs, report = _read(tmp_path / "dictnull.parquet", errors="skip")
    assert [r.text for r in recs] == ["a", "b"] and report.num_skipped == 1


def test_skip_mode_counts_every_bad_record(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(
        b'{"text": "good"}\n{"text": 3}\nnot json\n{"text": "b\xffd"}\n{"other": 1}\n{"text": "also good"}\n'
    )
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "b.json").write_text(json.dumps([{"text": "x"}, {"text": None}]))
    recs, report = _read([tmp_path / "a.jsonl", tmp_path / "empty.txt", tmp_path / "b.json"], errors="skip")
    assert [r.text for r in recs] == ["good", "also good", "x"]
    assert report.num_skipped == 6 and report.records == 3 and report.files == 3
    assert [(s.line, s.path.rsplit("/", 1)[-1]) for s in report.skipped] == [
        (2, "a.jsonl"),
        (3, "a.jsonl"),
        (4, "a.jsonl"),
        (5, "a.jsonl"),
        (None, "empty.txt"),
        (1, "b.json"),
    ]
    assert "6 skipped" in report.summary()


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        (lambda p: p / "missing.jsonl", "does not exist"),
        (lambda p: (p / "x.csv").write_text("a") and p / "x.csv", "unsupported file type"),
        (lambda p: (p / "emptydir").mkdir() or p / "emptydir", "holds no files of a supported type"),
        (lambda p: [], "no data paths"),
    ],
)
def test_path_errors(tmp_path, setup, match):
    with pytest.raises(ValueError, match=match):
        _read(setup(tmp_path))


def test_bad_errors_policy(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(ValueError, match="errors must be"):
        _read(tmp_path / "a.txt", errors="ignore")


def test_directory_reads_every_format_recursively_and_lists_what_it_ignores(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub" / "deeper").mkdir(parents=True)
    (d / ".git").mkdir()
    (d / ".git" / "HEAD.txt").write_text("hidden directories are not read")
    (d / "A.TXT").write_text("upper-case extension")
    (d / "b.jsonl").write_text('{"text": "jsonl in a directory"}\n')
    (d / "sub" / "c.Md").write_text("markdown")
    (d / "sub" / "d.JSON").write_text('[{"text": "json"}]')
    pq.write_table(pa.table({"text": ["parquet"]}), d / "sub" / "deeper" / "e.parquet")
    (d / "sub" / "image.png").write_bytes(b"\x89PNG")
    (d / "README").write_text("no extension")
    (d / ".DS_Store").write_bytes(b"\0")
    recs, report = _read(d)
    assert [r.text for r in recs] == [
        "upper-case extension",
        "jsonl in a directory",
        "markdown",
        "json",
        "parquet",
    ]
    ignored = {i.path.removeprefix(str(d) + "/"): i.reason for i in report.ignored}
    assert ignored.keys() == {".git", ".DS_Store", "README", "sub/image.png"}
    assert ignored[".git"] == "hidden directory, not read"
    assert ignored[".DS_Store"] == "hidden file, not read"
    assert ignored["README"].startswith("unsupported file (no extension; supported: .jsonl")
    assert ignored["sub/image.png"].startswith("unsupported file (type '.png'")
    assert (
        "4 directory entries ignored" in report.summary()
        and "ignored " + str(d / "README") in report.summary()
    )
    (src,) = report.sources
    assert (src.path, src.files, src.records, src.skipped, len(src.ignored)) == (str(d), 5, 5, 0, 4)


def test_explicit_files_are_case_insensitive_and_unsupported_ones_refused(tmp_path):
    (tmp_path / "a.JSONL").write_text('{"text": "x"}\n')
    (tmp_path / "b.TXT").write_text("y")
    recs, _ = _read([tmp_path / "a.JSONL", tmp_path / "b.TXT"])
    assert [r.text for r in recs] == ["x", "y"]
    (tmp_path / "c.csv").write_text("text\nz\n")
    with pytest.raises(ValueError, match=r"c\.csv: unsupported file type '\.csv'"):
        _read(tmp_path / "c.csv")


def test_directory_of_only_unsupported_files_lists_them(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.csv").write_text("a")
    with pytest.raises(
        ValueError, match=r"holds no files of a supported type(.|\n)*x\.csv: unsupported file"
    ):
        _read(tmp_path / "d")


def test_several_sources_accumulate_in_order_with_per_source_counts(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "a1"}\n{"text": 2}\n{"text": "a3"}\n')
    d = tmp_path / "dir"
    d.mkdir()
    (d / "x.txt").write_text("x")
    (d / "y.txt").write_text("")
    (d / "z.bin").write_bytes(b"\0")
    (tmp_path / "b.json").write_text('[{"text": "b1"}]')
    recs, report = _read([tmp_path / "a.jsonl", d, tmp_path / "b.json"], errors="skip")
    assert [(r.text, r.source) for r in recs] == [("a1", 0), ("a3", 0), ("x", 1), ("b1", 2)]
    counts = [(s.files, s.records, s.skipped, len(s.ignored)) for s in report.sources]
    assert counts == [(1, 2, 1, 0), (2, 1, 1, 1), (1, 1, 0, 0)]
    assert (report.files, report.records, report.num_skipped) == (4, 4, 2)


def test_a_file_read_twice_is_refused(tmp_path):
    d = tmp_path / "dir"
    d.mkdir()
    (d / "x.txt").write_text("x")
    with pytest.raises(ValueError, match=r"x\.txt is read twice"):
        _read([d, d / "x.txt"])
    with pytest.raises(ValueError, match="read twice"):
        _read([d / "x.txt", d / "x.txt"])


def test_error_hint_names_the_skip_switch(tmp_path):
    (tmp_path / "a.jsonl").write_text("not json\n")
    with pytest.raises(TextRecordError, match="read with errors='skip' to skip bad records") as err:
        _read(tmp_path / "a.jsonl")
    cli = TextRecordError(err.value.record, skip_hint="pass --skip-bad-records")
    assert str(cli).startswith(f"{tmp_path / 'a.jsonl'}:1: invalid JSON")
    assert str(cli).endswith("Fix the record, or pass --skip-bad-records to skip bad records and count them.")
