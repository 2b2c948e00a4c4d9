"""The server's ledger under damage: byte flips on every page, truncation, an empty or
foreign file, a lost write-ahead log. Each is refused at start with the reason (exit 2
on the command line), never reset, never read as a changed count."""

import os
import re
import shutil
import sqlite3
import subprocess
import sys

import numpy as np
import pytest
from conftest import run_cli

from attnextract import InputError, Oracle
from attnextract.adapters.journal import QueryJournal
from attnextract.adapters.server import (
    Ledger,
    LedgerError,
    RequestError,
    ServerState,
    model_fingerprint,
)
from attnextract.adapters.targets import random_single_head

D = 4
SEED = 5
CACHE = 1 << 20


def model():
    return random_single_head(D, seed=SEED)


def snapshot(path) -> dict:
    """Everything a ledger says, read with plain SQLite (read-only)."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        meta = dict(db.execute("SELECT name, value FROM meta WHERE name NOT LIKE 'open:%'"))
        answers = db.execute("SELECT key, digest, outputs FROM answers ORDER BY key").fetchall()
    return {"meta": meta, "answers": answers}


@pytest.fixture(scope="module")
def ledger_file(tmp_path_factory):
    """A ledger closed cleanly: budget 5000, 40 keyed batches answered, one replayed."""
    path = tmp_path_factory.mktemp("ledger") / "ledger.sqlite"
    state = ServerState(model(), budget=5000, state=path, cache_bytes=CACHE)
    rng = np.random.default_rng(0)
    for i in range(40):
        state.answer(rng.standard_normal((int(rng.integers(1, 20)), 3, D)), key=f"key-{i}")
    again = np.random.default_rng(0)
    state.answer(again.standard_normal((int(again.integers(1, 20)), 3, D)), key="key-0")
    state.close()
    assert not os.path.exists(f"{path}-wal")
    return path


def open_ledger(path, **options):
    return Ledger(path, cache_bytes=CACHE, dim=D,
                  fingerprint=model_fingerprint(model(), D), **options)


def test_a_clean_ledger_opens_with_what_was_written(ledger_file, tmp_path):
    copy = tmp_path / "copy.sqlite"
    shutil.copyfile(ledger_file, copy)
    before = snapshot(copy)
    assert before["meta"]["budget"] == 5000 and len(before["answers"]) == 40
    ledger = open_ledger(copy)
    assert ledger.budget == 5000 and ledger.served == before["meta"]["served"]
    ledger.close()
    assert snapshot(copy) == before


def test_a_flipped_byte_on_any_page_is_refused_or_changes_nothing(ledger_file, tmp_path):
    """Flip one byte at 64 places of every page. A flip SQLite or a checksum sees is
    refused with its reason; a flip in unused space (free bytes of a page) must leave
    every count, the budget and every answer as they were: never a silent change."""
    original = ledger_file.read_bytes()
    page = int.from_bytes(original[16:18], "big")
    pages = len(original) // page
    truth = snapshot(ledger_file)
    copy = tmp_path / "flipped.sqlite"
    refused, harmless, reasons = 0, 0, set()
    refused_pages = set()
    for p in range(pages):
        for offset in range(0, page, 64):
            position = p * page + offset + (p * 7 + offset // 64 * 13) % 64
            data = bytearray(original)
            data[position] ^= 0x5A
            copy.write_bytes(bytes(data))
            for extra in ("-wal", "-shm"):
                if os.path.exists(f"{copy}{extra}"):
                    os.remove(f"{copy}{extra}")
            try:
                ledger = open_ledger(copy)
            except InputError as exc:
                text = str(exc)
                assert "\n" not in text and str(copy) in text, text
                refused += 1
                refused_pages.add(p)
                reasons.add(text.replace(str(copy), "")[:50])
                continue
            ledger.close()
            assert snapshot(copy) == truth, f"flip at byte {position} changed the ledger"
            harmless += 1
    assert refused_pages == set(range(pages)), sorted(set(range(pages)) - refused_pages)
    assert refused > harmless
    print(f"{pages} pages, {refused + harmless} flips: {refused} refused, {harmless} in "
          f"unused bytes changed nothing; {len(reasons)} distinct reasons")


@pytest.mark.parametrize("what, sql, reason", [
    ("served 304 -> 305", "UPDATE meta SET value = value + 1 WHERE name = 'served'",
     "header row .*'served'.* fails its checksum"),
    ("budget 5000 -> 21384", "UPDATE meta SET value = 21384 WHERE name = 'budget'",
     "header row .*'budget'.* fails its checksum"),
    ("a kept answer", ("UPDATE answers SET outputs = zeroblob(length(outputs)) "
                       "WHERE key = 'key-3'"), "kept answer row .* fails its checksum"),
    ("a deleted counter", "DELETE FROM meta WHERE name = 'served'", "no 'served' row"),
    ("the LRU clock of an answer", "UPDATE answers SET used = 0 WHERE key = 'key-7'",
     "kept answer row .* fails its checksum"),
])
def test_rows_changed_behind_the_checksums_are_refused(ledger_file, tmp_path, what, sql,
                                                       reason):
    copy = tmp_path / "tampered.sqlite"
    shutil.copyfile(ledger_file, copy)
    with sqlite3.connect(copy) as db:
        db.execute(sql)
    db.close()
    with pytest.raises(LedgerError, match=reason):
        open_ledger(copy)


def test_a_row_damaged_while_serving_refuses_the_request_uncharged(tmp_path):
    path = tmp_path / "live.sqlite"
    state = ServerState(model(), budget=100, state=path, cache_bytes=CACHE)
    X = np.ones((2, 1, D))
    state.answer(X, key="k")
    with sqlite3.connect(path, isolation_level=None) as other:
        other.execute("UPDATE meta SET value = 99999 WHERE name = 'budget'")
    other.close()
    with pytest.raises(RequestError) as caught:
        state.answer(X)
    assert caught.value.status == 500 and "ledger is damaged" in caught.value.reason
    state.close()


def test_a_ledger_cut_short_at_any_size_is_refused(ledger_file, tmp_path):
    """Cut at every multiple of 256 bytes and at odd sizes around each page boundary."""
    data = ledger_file.read_bytes()
    page = int.from_bytes(data[16:18], "big")
    sizes = sorted({*range(256, len(data), 256), 1, 50, 99, 100,
                    *(p * page + k for p in range(len(data) // page) for k in (-1, 1))}
                   - {0, len(data)})
    copy = tmp_path / "cut.sqlite"
    for size in sizes:
        copy.write_bytes(data[:size])
        with pytest.raises(LedgerError, match="cut short|not a ledger|damaged") as caught:
            open_ledger(copy)
        assert "\n" not in str(caught.value)
    assert len(sizes) > 100


def test_an_empty_file_is_refused_unless_state_new_creates_it(ledger_file, tmp_path):
    empty = tmp_path / "empty.sqlite"
    empty.write_bytes(b"")
    with pytest.raises(LedgerError, match="empty file, not a ledger.*--state-new"):
        open_ledger(empty)
    ledger = open_ledger(empty, new=True)
    assert ledger.served == 0
    ledger.close()
    open_ledger(empty).close()                        # now a ledger: opens without the flag
    copy = tmp_path / "kept.sqlite"
    shutil.copyfile(ledger_file, copy)
    with pytest.raises(LedgerError, match="never overwrites"):
        open_ledger(copy, new=True)
    assert snapshot(copy) == snapshot(ledger_file)


def test_foreign_files_are_refused_and_left_untouched(tmp_path):
    journal = tmp_path / "run.journal.sqlite"
    oracle = Oracle(model(), D, journal=QueryJournal(journal))
    oracle.query(np.ones((3, 2, D)))
    oracle.journal.close()
    before = journal.read_bytes()
    with pytest.raises(LedgerError, match="not an attnextract ledger .*query journal"):
        open_ledger(journal)
    assert journal.read_bytes() == before and not os.path.exists(f"{journal}-wal")
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE people (name TEXT)")
    db.close()
    with pytest.raises(LedgerError, match="not an attnextract ledger .*tables people"):
        open_ledger(other)
    old = tmp_path / "old.sqlite"                       # a ledger from before checksums
    with sqlite3.connect(old) as db:
        db.executescript("CREATE TABLE meta (name TEXT PRIMARY KEY, value);"
                         "CREATE TABLE answers (key TEXT PRIMARY KEY, digest BLOB, "
                         "outputs BLOB, used INTEGER);")
    db.close()
    with pytest.raises(LedgerError, match="older attnextract, without checksums"):
        open_ledger(old)


CRASH = """
import os, sys
import numpy as np
from attnextract.adapters.server import ServerState
from attnextract.adapters.targets import random_single_head
state = ServerState(random_single_head({d}, seed={seed}), budget=5000, state=sys.argv[1],
                    cache_bytes={cache})
for i in range(30):
    state.answer(np.full((10, 2, {d}), i / 7.0), key=f"k{{i}}")
os._exit(0)                      # as kill -9: no close, the commits are in the WAL
"""


@pytest.fixture
def crashed(tmp_path):
    """A ledger whose server died (os._exit) after charging 300 sequences."""
    path = tmp_path / "crashed.sqlite"
    code = CRASH.format(d=D, seed=SEED, cache=CACHE)
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=120)
    assert os.path.getsize(f"{path}-wal") > 0
    return path


def test_after_a_crash_the_log_is_replayed(crashed):
    ledger = open_ledger(crashed)
    assert ledger.served == 300 and len(ledger.recovered) == 1
    ledger.close()


def test_a_lost_write_ahead_log_after_a_crash_is_refused_not_reset(crashed):
    os.remove(f"{crashed}-wal")
    if os.path.exists(f"{crashed}-shm"):
        os.remove(f"{crashed}-shm")
    with pytest.raises(LedgerError, match=r"stopped without closing it, and its write-ahead "
                                          r"log .*-wal is missing"):
        open_ledger(crashed)
    # without the check: the file alone says 0 served (the 300 charges were in the log)
    assert snapshot(crashed)["meta"]["served"] == 0


@pytest.mark.slow
def test_the_command_line_refuses_a_damaged_ledger_with_exit_2(ledger_file, tmp_path):
    copy = tmp_path / "tampered.sqlite"
    shutil.copyfile(ledger_file, copy)
    with sqlite3.connect(copy) as db:
        db.execute("UPDATE meta SET value = 21384 WHERE name = 'budget'")
    db.close()
    secret = model()
    np.savez(tmp_path / "secret.npz", W=secret.W, v=secret.v)
    for state, extra, reason in [(copy, [], "header row .* fails its checksum"),
                                 (tmp_path / "empty.sqlite", [], "empty file")]:
        if extra == [] and state.name == "empty.sqlite":
            state.write_bytes(b"")
        done = run_cli("serve", "--secret", tmp_path / "secret.npz", "--port", "0",
                       "--state", state, *extra, timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert re.search(reason, lines[0]), lines[0]
