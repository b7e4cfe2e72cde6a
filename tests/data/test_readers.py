"""Prompt file readers: jsonl, json (list or {"data": [...]}), parquet, and the path@[start:end] slice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_rl.data import DataError, parse_data_spec, read_jsonl, read_records, write_records

ROWS = [{"input": f"q{i}", "label": str(i)} for i in range(6)]


def labels(pairs: list[tuple[int, dict]]) -> list[str]:
    return [r["label"] for _, r in pairs]


@pytest.fixture(params=["jsonl", "json", "parquet"])
def data_file(request, tmp_path) -> Path:
    return write_records(ROWS, tmp_path / f"d.{request.param}")


def test_each_format_reads_every_row_numbered_from_one(data_file):
    pairs = read_records(data_file)
    assert [n for n, _ in pairs] == [1, 2, 3, 4, 5, 6]
    assert pairs[0][1] == {"input": "q0", "label": "0"}
    assert labels(pairs) == ["0", "1", "2", "3", "4", "5"]


@pytest.mark.parametrize("spec, want_rows", [
    ("@[1:3]", [2, 3]),
    ("@[:2]", [1, 2]),
    ("@[4:]", [5, 6]),
    ("@[-2:]", [5, 6]),
    ("@[:-4]", [1, 2]),
    ("@[-3:-1]", [4, 5]),
    ("@[2:100]", [3, 4, 5, 6]),
])
def test_slice_follows_python_semantics_and_keeps_file_row_numbers(data_file, spec, want_rows):
    pairs = read_records(f"{data_file}{spec}")
    assert [n for n, _ in pairs] == want_rows
    assert labels(pairs) == [str(n - 1) for n in want_rows]


def test_parse_data_spec():
    assert parse_data_spec("a/b.jsonl") == ("a/b.jsonl", None)
    assert parse_data_spec("a@b/c.jsonl@[2:-1]") == ("a@b/c.jsonl", slice(2, -1))
    assert parse_data_spec("x.parquet@[:]") == ("x.parquet", slice(None, None))
    with pytest.raises(DataError, match="bad row slice"):
        parse_data_spec("x.jsonl@[a:b]")
    with pytest.raises(DataError, match="bad row slice"):
        parse_data_spec("x.jsonl@[1:5:2]")


def test_empty_slice_names_the_file_and_size(data_file):
    with pytest.raises(DataError, match=r"selects no rows \(the file has 6\)"):
        read_records(f"{data_file}@[4:2]")


def test_json_accepts_hf_data_wrapper_and_rejects_other_shapes(tmp_path):
    wrapped = tmp_path / "w.json"
    wrapped.write_text(json.dumps({"version": "1", "data": ROWS[:2]}))
    assert labels(read_records(wrapped)) == ["0", "1"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": ROWS}))
    with pytest.raises(DataError, match=r"bad.json: expected a list of objects.*keys \['rows'\]"):
        read_records(bad)
    not_obj = tmp_path / "n.json"
    not_obj.write_text(json.dumps([{"input": "a", "label": 1}, 5]))
    with pytest.raises(DataError, match=r"n.json: row 2: expected a JSON object, got int"):
        read_records(not_obj)


def test_jsonl_bad_line_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"input": "a", "label": 1}\n\n{oops\n')  # the blank line 2 counts, as editors count
    with pytest.raises(DataError, match=r"bad.jsonl: 1 bad row\(s\) of 2:\n  line 3: not valid JSON"):
        read_records(f)
    f.write_text('{"input": "a", "label": 1}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"line 2: expected a JSON object, got list"):
        read_jsonl(f)


def test_a_lone_surrogate_is_a_bad_row_named_by_line_and_a_pair_is_text(tmp_path):
    """JSON's "\\ud800" escape parses to a string no tokenizer encodes (a raw TypeError deep in the
    tokenizer before); an escaped pair (an emoji) is ordinary text."""
    f = tmp_path / "s.jsonl"
    f.write_text('{"input": "smile \\ud83d\\ude00", "label": "1"}\n{"input": "half \\ud800", "label": "2"}\n'
                 '{"input": "low \\uDC00 too", "label": "3"}\n')
    with pytest.raises(DataError) as err:
        read_records(f)
    msg = str(err.value)
    assert "s.jsonl: 2 bad row(s) of 3:" in msg
    assert "line 2: a string holds a lone UTF-16 surrogate ('\\ud800')" in msg
    assert "line 3: a string holds a lone UTF-16 surrogate ('\\udc00')" in msg and "line 1" not in msg
    f.write_text('{"input": "smile \\ud83d\\ude00", "label": "1"}\n')
    assert read_records(f)[0][1]["input"] == "smile \U0001F600"
    j = tmp_path / "s.json"
    j.write_text('[{"input": "x \\udfff", "label": "1"}]')
    with pytest.raises(DataError, match=r"s.json: a string holds a lone UTF-16 surrogate"):
        read_records(j)


def test_every_structurally_bad_jsonl_line_is_listed(tmp_path):
    good = json.dumps({"input": "a", "label": "1"}).encode()
    lines = [good, b"{oops", good, b"\xff\xfe not utf-8", b"", b"[1, 2]", good] + [b"nope"] * 12
    f = tmp_path / "mixed.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError) as err:
        read_records(f)
    msg = str(err.value)
    # 18 lines hold something, 3 of them good; 15 bad; line 5 is blank and is neither
    assert "mixed.jsonl: 15 bad row(s) of 18:" in msg
    assert "line 2: not valid JSON" in msg and "line 4: not valid UTF-8" in msg
    assert "line 6: expected a JSON object, got list" in msg
    assert "line 8: not valid JSON" in msg and "... and 5 more" in msg
    assert "line 1:" not in msg and "line 3:" not in msg and "line 7:" not in msg


def test_blank_lines_do_not_count_as_rows(tmp_path):
    f = tmp_path / "gaps.jsonl"
    f.write_text('\n{"label": "a"}\n\n\n{"label": "b"}\n')
    assert [(n, r["label"]) for n, r in read_records(f)] == [(1, "a"), (2, "b")]


def test_missing_unknown_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: no such file"):
        read_records(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="unknown data format"):
        read_records(tmp_path / "data.csv")
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="e.jsonl: no rows"):
        read_records(empty)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="broken.parquet: cannot read parquet"):
        read_records(broken)


def test_parquet_keeps_nested_message_lists_and_dicts(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
             "label": "7", "meta": {"level": 3, "source": "x"}}]
    got = read_records(write_records(rows, tmp_path / "nested.parquet"))
    assert got == [(1, rows[0])]
