"""The stats reader every server test uses leaves a half-written last line for the next read."""

import json

import pytest

from sglang_ext.testing.jsonl import read_jsonl


def test_an_unterminated_last_line_is_not_read_until_its_newline_arrives(tmp_path):
    path = tmp_path / "stats.jsonl"
    assert read_jsonl(path) == []
    first, second = {"step": 1, "x": "a"}, {"step": 2, "x": "b"}
    line = json.dumps(second) + "\n"
    path.write_text(json.dumps(first) + "\n" + line[:9])  # a write caught half-way
    assert read_jsonl(path) == [first]
    with pytest.raises(json.JSONDecodeError):  # negative control: the naive reader this replaces
        [json.loads(s) for s in path.read_text().splitlines() if s.strip()]
    path.write_text(json.dumps(first) + "\n" + line)
    assert read_jsonl(path) == [first, second]
    assert read_jsonl(path, start=1) == [second]
