"""Policy store: versioning, validation, bearer-token auth, audit log, watch."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from controlplane.api import InvalidArgument, Unauthenticated
from controlplane.policy import Policy
from controlplane.policy_store import PolicyStore, load_policy_file, load_token_file


def test_update_bumps_version_and_audits() -> None:
    """An accepted update gets version+1, an audit record and a structlog event with both versions."""
    store = PolicyStore()
    with capture_logs() as logs:
        new = store.update({"alpha": 2.0, "lvf": {"beta_b": -0.5}}, actor="alice")
    assert new.version == 2 and new.alpha == 2.0 and new.lvf.beta_b == -0.5
    assert store.get() is new
    rec = store.audit_log()[-1]
    assert (rec.actor, rec.old_version, rec.policy.version) == ("alice", 1, 2)
    event = [e for e in logs if e["event"] == "policy_updated"][0]
    assert event["actor"] == "alice" and event["old_version"] == 1 and event["new_version"] == 2
    assert event["changed"] == ["alpha", "lvf"]


def test_noop_update_keeps_version() -> None:
    """An update that changes nothing creates no version and no audit record."""
    store = PolicyStore()
    assert store.update({"alpha": 1.0}).version == 1
    assert store.audit_log() == []


def test_writer_cannot_set_version() -> None:
    """The version is assigned by the store; a version in the changes is ignored."""
    store = PolicyStore()
    assert store.update({"version": 99, "alpha": 0.5}).version == 2


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"alpha": -1}, r"alpha: -1 is out of range \(allowed \[0.0, 1000000.0\]\)"),
        ({"ewma_factor": 1.5}, r"ewma_factor: 1.5 is out of range"),
        ({"window_min": 10, "window_max": 5}, r"window_max: 5 is below window_min"),
        ({"victim_rule": "oldest"}, r"victim_rule: 'oldest' is not one of"),
        ({"lvf": {"transfer_budget_blocks": -3}}, r"^lvf\.transfer_budget_blocks"),
        ({"layerkv": {"nope": 1}}, r"^layerkv\.nope: unknown field"),
        ({"bogus": 1}, r"bogus: unknown policy field"),
        ({"slo_tbt_ms": "fast"}, r"slo_tbt_ms: expected a number"),
    ],
)
def test_invalid_updates_name_field_and_range(changes: dict, pattern: str) -> None:
    """Invalid updates raise InvalidArgument naming the field (and range) and change nothing."""
    store = PolicyStore()
    with pytest.raises(InvalidArgument, match=pattern):
        store.update(changes)
    assert store.get() == Policy()


def test_token_required_when_configured() -> None:
    """With a token configured, a missing or wrong token is Unauthenticated; the right one works."""
    store = PolicyStore(token="s3cret")
    assert store.auth_required
    with pytest.raises(Unauthenticated):
        store.update({"alpha": 2.0})
    with pytest.raises(Unauthenticated):
        store.update({"alpha": 2.0}, token="s3cre")
    assert store.get().version == 1
    assert store.update({"alpha": 2.0}, token="s3cret").version == 2
    assert PolicyStore().update({"alpha": 2.0}, token="anything").version == 2


def test_auth_is_checked_before_validation() -> None:
    """An unauthenticated writer learns nothing about validation (UNAUTHENTICATED first)."""
    with pytest.raises(Unauthenticated):
        PolicyStore(token="t").update({"alpha": -5}, token="x")


def test_watch_yields_current_then_every_version_in_order() -> None:
    """A watcher gets the current policy, then each new version; close() ends the iteration."""
    store = PolicyStore()
    w = store.watch()
    got: list[int] = []
    done = threading.Event()

    def consume() -> None:
        for p in w:
            got.append(p.version)
        done.set()

    t = threading.Thread(target=consume)
    t.start()
    for i in range(5):
        store.update({"alpha": 1.0 + i + 1})
    deadline = time.monotonic() + 5
    while len(got) < 6 and time.monotonic() < deadline:
        time.sleep(0.005)
    w.close()
    assert done.wait(5)
    t.join(5)
    assert got == [1, 2, 3, 4, 5, 6]
    assert store.watcher_count() == 0


def test_watch_get_times_out_and_closes() -> None:
    """PolicyWatch.get returns None on timeout and after close."""
    store = PolicyStore()
    w = store.watch()
    assert w.get(0.01).version == 1  # type: ignore[union-attr]
    assert w.get(0.01) is None
    w.close()
    assert w.get(0.01) is None
    assert list(w) == []


def test_concurrent_updates_get_distinct_consecutive_versions() -> None:
    """Updates from many threads each get their own version; none is lost."""
    store = PolicyStore()
    results: list[int] = []
    lock = threading.Lock()

    def writer(k: int) -> None:
        for j in range(20):
            v = store.update({"alpha": k * 100 + j + 1.5}).version
            with lock:
                results.append(v)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(2, 82))
    assert store.get().version == 81


def test_policy_files_yaml_and_json(tmp_path: Path) -> None:
    """YAML and JSON policy files load; bad ones raise InvalidArgument naming the file and field."""
    y = tmp_path / "p.yaml"
    y.write_text("alpha: 0.5\nscheduler: layerkv\nlayerkv:\n  tpot_margin: 0.8\n")
    p = load_policy_file(y)
    assert (p.alpha, p.scheduler, p.layerkv.tpot_margin) == (0.5, "layerkv", 0.8)
    j = tmp_path / "p.json"
    j.write_text(json.dumps({"victim_rule": "shortest"}))
    assert load_policy_file(j).victim_rule == "shortest"
    bad = tmp_path / "bad.yaml"
    bad.write_text("window_min: 0\n")
    with pytest.raises(InvalidArgument, match=r"bad\.yaml.*window_min: 0 is out of range"):
        load_policy_file(bad)
    with pytest.raises(InvalidArgument, match="expected an object"):
        (tmp_path / "list.json").write_text("[1]")
        load_policy_file(tmp_path / "list.json")
    with pytest.raises(InvalidArgument, match="cannot read"):
        load_policy_file(tmp_path / "missing.yaml")


def test_token_file(tmp_path: Path) -> None:
    """A token file is stripped; an empty one is rejected; from_files wires both."""
    t = tmp_path / "token"
    t.write_text("  abc\n")
    assert load_token_file(t) == "abc"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(InvalidArgument, match="is empty"):
        load_token_file(tmp_path / "empty")
    y = tmp_path / "p.yaml"
    y.write_text("alpha: 3\n")
    store = PolicyStore.from_files(y, t)
    assert store.get().alpha == 3 and store.auth_required
    with pytest.raises(Unauthenticated):
        store.update({"alpha": 1})
    assert store.update({"alpha": 1}, token="abc").version == 2


WRAPPED_BASE64 = "A" * 64 + "\n" + "B" * 24 + "\n"
"""What `openssl rand -base64 64 > token` writes: 88 characters wrapped at 64 columns."""


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (WRAPPED_BASE64, "character 65 of the token is a line break"),
        ("abc\tdef", "character 4 of the token is a tab"),
        ("caf\u00e9-token\n", "character 4 of the token is a non-ASCII character (U+00E9)"),
        ("ab\x07cd", "character 3 of the token is a control character (0x07)"),
    ],
    ids=["two-lines", "tab", "non-ascii", "control"],
)
def test_token_file_gRPC_metadata_cannot_carry_is_refused(tmp_path: Path, content: str, problem: str) -> None:
    """A token with a character outside 0x20-0x7E (gRPC metadata cannot carry it: every write then
    failed with 'Invalid metadata' naming nothing) is refused naming the file, the position and the
    character class, never echoing the token. Negative control: on the old reader (strip + not
    empty) every case was accepted; ``test_token_file_printable_ascii_is_accepted`` passes."""
    t = tmp_path / "token"
    t.write_text(content, encoding="utf-8")
    with pytest.raises(InvalidArgument) as info:
        load_token_file(t)
    message = str(info.value)
    assert message.startswith(f"token file {str(t)!r}: {problem}") and "openssl rand -hex 32" in message
    assert "AAAA" not in message and "\n" not in message


def test_token_file_printable_ascii_is_accepted(tmp_path: Path) -> None:
    """Control: `openssl rand -hex 32` output and every printable ASCII character pass, a space inside
    included (gRPC metadata carries it and the server's ``Bearer`` parse splits at the first space
    only: such a token worked before the check; the deploy fixes' review, session 87)."""
    t = tmp_path / "token"
    t.write_text("0123456789abcdef" * 4 + "\n")
    assert load_token_file(t) == "0123456789abcdef" * 4
    every = "".join(chr(c) for c in range(0x21, 0x7F))
    t.write_text(f" {every}\r\n")
    assert load_token_file(t) == every
    t.write_text("abc def\n")
    assert load_token_file(t) == "abc def"
