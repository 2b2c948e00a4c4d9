"""The query journal: answers come back from disk, a SIGKILLed run resumes, nothing is asked twice."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import numpy as np

from attnextract.verification import REPLAY_FRACTION
import pytest

from attnextract import BlackBoxError, InputError, Oracle, extract_single_head
from attnextract.adapters.journal import (CHALLENGES, RESUME_SAMPLE, QueryJournal, read_entries,
                                          sequence_digests)
from attnextract.errors import JournalError
from attnextract.adapters.targets import random_single_head
from attnextract.report import verification_count


class CountingBox:
    """A black box that remembers every sequence it was asked (as bytes)."""

    def __init__(self, box):
        self.box, self.asked = box, []

    def __call__(self, X):
        self.asked += [row.tobytes() for row in X]
        return self.box(X)


def test_second_run_is_answered_by_the_journal(tmp_path):
    path = tmp_path / "j.sqlite"
    for seed in range(3):
        path.unlink(missing_ok=True)
        target = random_single_head(7, seed=seed)
        first_box, second_box = CountingBox(target), CountingBox(target)
        learner = 7 * 7 + 7
        verification = verification_count(learner, learner)
        with QueryJournal(path) as journal:
            first_oracle = Oracle(first_box, 7, journal=journal, max_batch=10)
            first = extract_single_head(first_oracle, seed=seed)
            # held-out verification is journaled too
            assert journal.recorded == learner + verification and journal.hits == 0
            assert first_oracle.check_queries == CHALLENGES
        with QueryJournal(path) as journal:
            oracle = Oracle(second_box, 7, journal=journal, max_batch=10)
            second = extract_single_head(oracle, seed=seed)
            assert journal.stored == journal.hits == learner + verification
        # the second box was asked the binding checks, nothing else
        with sqlite3.connect(path) as db:       # one kept sequence per recorded batch
            kept = db.execute("SELECT COUNT(*) FROM samples").fetchone()[0]
        assert kept >= -(-learner // 10)
        assert oracle.check_queries == CHALLENGES + min(RESUME_SAMPLE, kept)
        assert len(second_box.asked) == oracle.check_queries
        assert len(first_box.asked) == CHALLENGES + first.queries
        assert first.queries == second.queries == learner + verification
        assert (oracle.journal_queries, oracle.black_box_queries) == (learner + verification, 0)
        np.testing.assert_array_equal(first.model.W, second.model.W)
        np.testing.assert_array_equal(first.model.v, second.model.v)


def test_partial_journal_asks_only_the_missing_sequences(tmp_path):
    box = CountingBox(random_single_head(4, seed=1))
    X = np.random.default_rng(0).standard_normal((10, 3, 4))
    with QueryJournal(tmp_path / "j.sqlite") as journal:
        Oracle(box, 4, journal=journal).query(X[[1, 4, 7]])
    box.asked.clear()
    with QueryJournal(tmp_path / "j.sqlite") as journal:
        oracle = Oracle(box, 4, journal=journal, max_batch=4)
        out = oracle.query(X)
        assert journal.hits == 3 and journal.recorded == 7
    np.testing.assert_array_equal(out, random_single_head(4, seed=1)(X))
    assert oracle.check_queries == CHALLENGES + 1
    assert sorted(box.asked[oracle.check_queries:]) == sorted(X[i].tobytes() for i in range(10) if i not in (1, 4, 7))
    assert (oracle.queries, oracle.journal_queries, oracle.black_box_queries) == (10, 3, 7)


def test_repeated_probes_get_fresh_answers_and_replay_in_order(tmp_path):
    """A learner that repeats a probe (to average noise) must not get the first answer back."""
    noise = iter(np.arange(100.0))
    # a noisy box (declared to the journal): each answer to the probe is a fresh number
    box = lambda X: np.array([next(noise) if np.all(x == 1) else 0.0 for x in X])  # noqa: E731
    X = np.ones((3, 2, 2))                                         # the same sequence 3 times
    with QueryJournal(tmp_path / "j.sqlite", tolerance=100.0) as journal:
        first = Oracle(box, 2, journal=journal).query(X)
        again = Oracle(box, 2, journal=journal).query(X[:1])      # a new oracle, same journal
    assert list(first) == [0.0, 1.0, 2.0] and list(again) == [3.0]  # 4th occurrence is new
    with QueryJournal(tmp_path / "j.sqlite", tolerance=100.0) as journal:
        oracle = Oracle(box, 2, journal=journal)
        assert list(oracle.query(X[:2])) == [0.0, 1.0]
        # the resume check asked the probe again (one kept sequence per recorded batch)
        assert oracle.check_queries == CHALLENGES + 2
        assert list(oracle.query(X)) == [2.0, 3.0, 6.0]            # occurrences 2, 3 known, 4 new
    assert (oracle.journal_queries, oracle.black_box_queries) == (4, 1)


def test_distinct_shapes_and_signed_zero_are_distinct_keys():
    a = np.zeros((1, 2, 3))
    b = np.zeros((1, 3, 2))
    c = -np.zeros((1, 2, 3))
    assert len({sequence_digests(a)[0], sequence_digests(b)[0], sequence_digests(c)[0]}) == 3


def test_refused_answers_are_not_recorded(tmp_path):
    with QueryJournal(tmp_path / "j.sqlite") as journal:
        nan_on_ones = lambda X: np.where(np.all(X == 1, axis=(1, 2)), np.nan, 0.0)  # noqa: E731
        oracle = Oracle(nan_on_ones, 2, journal=journal)
        with pytest.raises(BlackBoxError):
            oracle.query(np.ones((4, 1, 2)))
        assert len(journal) == 0 and oracle.queries == 4    # spent, but nothing recorded


def test_context_mismatch_and_corrupt_file(tmp_path):
    with QueryJournal(tmp_path / "j.sqlite", context={"target": "a.py:f", "dim": 3}) as journal:
        Oracle(lambda X: X.sum(axis=(1, 2)), 3, journal=journal).query(np.ones((2, 1, 3)))
        assert len(journal) == 2
    with pytest.raises(InputError, match="dim = 3"):      # answers recorded: refused
        QueryJournal(tmp_path / "j.sqlite", context={"target": "a.py:f", "dim": 4})
    with QueryJournal(tmp_path / "j.sqlite", context={"dim": 3, "seed": 5}) as journal:
        assert journal.context == {"target": "a.py:f", "dim": 3, "seed": 5}
    (tmp_path / "bad.sqlite").write_bytes(b"this is not a database" * 100)
    with pytest.raises(JournalError, match="query journal"):
        QueryJournal(tmp_path / "bad.sqlite")


def test_a_journal_without_answers_takes_the_corrected_context(tmp_path):
    """A first run that failed before any answer (a wrong --dim) leaves nothing to resume:
    the corrected rerun's context replaces it instead of being refused."""
    QueryJournal(tmp_path / "j.sqlite", context={"target": "a.py:f", "dim": 3}).close()
    with QueryJournal(tmp_path / "j.sqlite", context={"target": "a.py:f", "dim": 4}) as journal:
        assert journal.context == {"target": "a.py:f", "dim": 4}
        Oracle(lambda X: X.sum(axis=(1, 2)), 4, journal=journal).query(np.ones((2, 1, 4)))
    with QueryJournal(tmp_path / "j.sqlite", context={"dim": 4}) as journal:
        assert len(journal) == 2 and journal.context["dim"] == 4


SLOW_TARGET = textwrap.dedent("""
    import os, time
    import numpy as np
    from attnextract.adapters.journal import sequence_digests
    from attnextract.adapters.targets import random_single_head

    head = random_single_head(6, seed=5)

    def slow(X):
        time.sleep(0.02)                       # a slow, paid API
        out = head(X)
        with open(os.environ["ASKED_LOG"], "a") as log:   # what the black box answered
            log.write("".join(d.hex() + "\\n" for d in sequence_digests(X)))
        return out
""")


def _cli(*args, log, **kw):
    env = dict(os.environ, ASKED_LOG=str(log))
    return subprocess.Popen([sys.executable, "-m", "attnextract", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _asked(log) -> list[str]:
    if not log.exists():
        return []
    return [line for line in log.read_text().splitlines() if len(line) == 32]


def _journal_digests(path) -> list[str]:
    return [d.hex() for d, _, _ in read_entries(path)]


@pytest.mark.slow
def test_sigkill_then_resume_loses_and_repeats_nothing(tmp_path):
    target = tmp_path / "slow.py"
    target.write_text(SLOW_TARGET)
    journal = tmp_path / "run.sqlite"
    total = 6 * 6 + 6 + verification_count(42, 42)
    args = ["extract", "--target", f"{target}:slow", "--dim", "6", "--max-batch", "3",
            "--journal", str(journal), "--no-progress", "--json"]

    first = _cli(*args, "--out", str(tmp_path / "first.npz"), log=tmp_path / "asked1.log")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and first.poll() is None:
        if journal.exists():
            try:
                if len(_journal_digests(journal)) >= 30:
                    break
            except JournalError:                 # the schema is being created
                pass
        time.sleep(0.005)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    answered_before_kill = _journal_digests(journal)
    assert 30 <= len(answered_before_kill) < total
    assert not (tmp_path / "first.npz").exists()

    second = _cli(*args, "--out", str(tmp_path / "resumed.npz"), log=tmp_path / "asked2.log")
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    report = json.loads(out)
    asked1, asked2 = _asked(tmp_path / "asked1.log"), _asked(tmp_path / "asked2.log")
    checks = report["details"]["check_queries"]
    assert CHALLENGES < checks <= CHALLENGES + RESUME_SAMPLE   # checked first
    asked1, asked2 = asked1[CHALLENGES:], asked2[checks:]
    # nothing the journal had answered was asked of the black box again, but for the
    # verification's replays: a sample of the learner's own queries re-asked on purpose
    replays = int(REPLAY_FRACTION * 64)
    assert len(set(asked2) & set(answered_before_kill)) <= replays
    assert len(asked2) == total - len(answered_before_kill)
    assert len(set(asked2)) >= len(asked2) - replays
    # at most the batch in flight at the kill was answered but not yet committed
    assert len(asked1) - len(answered_before_kill) <= 3
    assert report["queries"] == total + checks          # the fingerprint checks counted too
    assert report["details"]["journal_queries"] == len(answered_before_kill)
    assert report["details"]["black_box_queries"] == total - len(answered_before_kill)

    # the same result as an uninterrupted run with no journal
    reference = _cli(*args[:-4], "--seed", str(_stored_seed(journal)), "--no-progress",
                     "--out", str(tmp_path / "reference.npz"), log=tmp_path / "asked3.log")
    assert reference.communicate(timeout=120) and reference.returncode == 0
    with np.load(tmp_path / "resumed.npz") as a, np.load(tmp_path / "reference.npz") as b:
        np.testing.assert_array_equal(a["W"], b["W"])
        np.testing.assert_array_equal(a["v"], b["v"])
        # each run counts the fingerprint checks its own journal asked, on top of total
        b_checks = json.loads(str(b["report"]))["details"].get("check_queries", 0)
        assert int(a["queries"]) - checks == int(b["queries"]) - b_checks == total
        assert json.loads(str(a["report"]))["details"]["journal_queries"] == len(answered_before_kill)


def _stored_seed(journal) -> int:
    with sqlite3.connect(journal) as db:
        return json.loads(db.execute("SELECT value FROM context WHERE key = 'seed'").fetchone()[0])
