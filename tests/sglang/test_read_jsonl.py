"""The stats reader every server test uses leaves a half-written last line for the next read."""

import json
import threading
import time

import pytest

from sglang_ext.testing.jsonl import read_jsonl, read_jsonl_settled


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


def test_the_settled_read_waits_for_a_line_written_after_the_caller_got_its_response(tmp_path):
    """A scheduler writes a step's stats line after that step's responses went out: the settled
    read returns once the file stops growing, with the late line; the plain read taken before the
    write misses it (negative control). The quiet window (2 s) is 40x the writer's delay."""
    path = tmp_path / "stats.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n")
    go = threading.Event()

    def late_write() -> None:
        go.wait(30)
        time.sleep(0.05)
        with path.open("a") as f:
            f.write(json.dumps({"step": 2}) + "\n")

    writer = threading.Thread(target=late_write)
    writer.start()
    try:
        assert read_jsonl(path) == [{"step": 1}]  # the plain read, before the write
        go.set()
        assert read_jsonl_settled(path, quiet_s=2.0) == [{"step": 1}, {"step": 2}]
    finally:
        go.set()
        writer.join()
    assert read_jsonl_settled(path, start=1, quiet_s=0.05) == [{"step": 2}]
    assert read_jsonl_settled(tmp_path / "absent.jsonl", quiet_s=0.05) == []
