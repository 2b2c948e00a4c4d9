"""Adversarial tests of the journal's promises: bound to its black box, checked when read,
typed failures that lose no paid answer, and a CLI that wastes nothing it could see first."""

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import numpy as np

from attnextract.verification import REPLAY_FRACTION
import pytest

from attnextract import Oracle, extract, extract_single_head, verify_model
from attnextract.adapters.journal import (CHALLENGES, QueryJournal, challenge_sequences,
                                          checksum, read_entries, sequence_digests)
from attnextract.adapters.targets import random_single_head
from attnextract.errors import BudgetExceededError, JournalError, JournalMismatchError
from attnextract.models import SingleHeadAttention
from attnextract.oracle import BoundedNoise, GaussianNoise
from attnextract.report import verification_count
from conftest import run_cli

D = 6
JOURNAL_EXIT = 4


class CountingBox:
    """A black box that remembers every sequence it was asked (as bytes)."""

    def __init__(self, box):
        self.box, self.asked = box, []

    def __call__(self, X):
        self.asked += [row.tobytes() for row in X]
        return self.box(X)


def record_run(path, box, seed=0, **journal_options):
    """A complete extraction with a journal at ``path``; the result."""
    with QueryJournal(path, **journal_options) as journal:
        return extract_single_head(Oracle(box, D, journal=journal, max_batch=8), seed=seed)


# -- bound to its black box ------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_another_black_box_is_refused_before_any_learner_query(tmp_path, seed):
    path = tmp_path / "j.sqlite"
    record_run(path, random_single_head(D, seed=seed))
    other = CountingBox(random_single_head(D, seed=seed + 100))
    with QueryJournal(path) as journal:
        oracle = Oracle(other, D, journal=journal)
        with pytest.raises(JournalMismatchError) as caught:
            extract_single_head(oracle, seed=0)
    message = str(caught.value)
    assert str(path) in message and "challenge sequence 0" in message
    assert caught.value.difference["journaled"] != caught.value.difference["live"]
    # the challenges were asked (the first differs), then nothing: no learner query
    assert len(other.asked) == CHALLENGES == oracle.check_queries
    assert oracle.queries == 0 and oracle.calls == 0


@pytest.mark.parametrize("change", [1e-6, 1e-9])
def test_stale_weights_are_refused(tmp_path, change):
    """The same head with its weights moved by a relative 1e-6 or 1e-9: a stale target."""
    path = tmp_path / "j.sqlite"
    head = random_single_head(D, seed=3)
    record_run(path, head)
    W = head.W * (1 + change * np.random.default_rng(0).standard_normal(head.W.shape))
    with QueryJournal(path) as journal:
        oracle = Oracle(SingleHeadAttention(W, head.v), D, journal=journal)
        with pytest.raises(JournalMismatchError, match="another black box") as caught:
            extract_single_head(oracle, seed=0)
        assert oracle.queries == 0
    assert "if this black box is noisy, state its noise" in str(caught.value)


def test_a_box_that_only_knows_the_challenges_is_caught_by_the_resume_sample(tmp_path):
    """An impostor that answers the fixed challenges right, and everything else wrong."""
    path = tmp_path / "j.sqlite"
    head = random_single_head(D, seed=4)
    record_run(path, head)
    known = {d for x in challenge_sequences(D) for d in sequence_digests(x[None])}

    def impostor(X):
        shift = np.array([0.0 if d in known else 1e-3 for d in sequence_digests(X)])
        return head(X) + shift

    with QueryJournal(path) as journal:
        oracle = Oracle(impostor, D, journal=journal)
        with pytest.raises(JournalMismatchError, match="journaled query"):
            extract_single_head(oracle, seed=0)
        assert oracle.queries == 0


def test_a_box_that_knows_the_journal_is_refused_by_a_live_verification(tmp_path):
    """Issue 13's scenario at its strongest: the new box agrees with the journal on every
    journaled query and every challenge, and differs everywhere else. A rerun asks it only
    the journal's checks, so the journal's answers rebuild the old model and its report
    says that the journal vouched for the held-out answers; a verification without the
    journal, asked live, refuses the box."""
    path = tmp_path / "j.sqlite"
    head = random_single_head(D, seed=5)
    record_run(path, head)
    known = {d for d, _, _ in read_entries(path)}
    known |= {d for x in challenge_sequences(D) for d in sequence_digests(x[None])}
    other = random_single_head(D, seed=6)

    def replica_of_the_journal(X):
        agree = np.array([d in known for d in sequence_digests(X)])
        return np.where(agree, head(X), other(X))

    learner, held_out = D * D + D, verification_count(D * D + D, D * D + D)
    with QueryJournal(path) as journal:
        # the recorded run's command (max_batch 8 sizes the held-out batch check too)
        oracle = Oracle(replica_of_the_journal, D, journal=journal, max_batch=8)
        result = extract(oracle, "single-head", seed=0)
        assert oracle.journal_queries == learner + held_out and oracle.black_box_queries == 0
    assert any("came from the journal" in note for note in result.report.notes)
    live = verify_model(Oracle(replica_of_the_journal, D), result.model, count=held_out, seed=1)
    assert not live.passed


def test_held_out_queries_are_journaled_and_not_kept_for_replay(tmp_path):
    box = CountingBox(random_single_head(D, seed=7))
    X = np.random.default_rng(1).standard_normal((5, 3, D))
    with QueryJournal(tmp_path / "j.sqlite") as journal:
        oracle = Oracle(box, D, journal=journal)
        first = oracle.query(X)
        asked = len(box.asked)
        again = oracle.query(X, live=True)
        with oracle.live():
            oracle.query(X)
        assert len(box.asked) == asked + 10 and len(journal) == 15
        np.testing.assert_array_equal(first, again)
        assert (oracle.journal_queries, oracle.black_box_queries) == (0, 15)
        assert len(oracle.replay) == 5


@pytest.mark.parametrize("wrapper", [
    lambda box, seed: BoundedNoise(box, 1e-4, "uniform", seed=seed),
    lambda box, seed: GaussianNoise(box, 1e-5, seed=seed),
])
def test_a_noisy_box_resumes_within_its_stated_noise(tmp_path, wrapper):
    """Noise is no difference: a noisy black box (with a fresh noise draw) still resumes,
    while another head behind the same noise is refused."""
    head = random_single_head(D, seed=8)
    X = np.random.default_rng(2).standard_normal((40, 3, D)) * 0.5
    with QueryJournal(tmp_path / "j.sqlite") as journal:
        oracle = Oracle(wrapper(head, 1), D, journal=journal, max_batch=5)
        first = oracle.query(X)
    with QueryJournal(tmp_path / "j.sqlite") as journal:
        oracle = Oracle(wrapper(head, 2), D, journal=journal, max_batch=5)
        np.testing.assert_array_equal(oracle.query(X), first)
        assert oracle.black_box_queries == 0 and oracle.check_queries == 2 * CHALLENGES
    with QueryJournal(tmp_path / "j.sqlite") as journal:
        oracle = Oracle(wrapper(random_single_head(D, seed=9), 3), D, journal=journal)
        with pytest.raises(JournalMismatchError):
            oracle.query(X)
        assert oracle.queries == 0


# -- checked when read -----------------------------------------------------------


def small_journal(path, box=None):
    box = box or random_single_head(D, seed=10)
    X = np.random.default_rng(3).standard_normal((12, 2, D))
    with QueryJournal(path) as journal:
        oracle = Oracle(box, D, journal=journal, max_batch=4)
        oracle.query(X)
    return X


def test_a_journal_cut_short_by_one_byte_is_refused(tmp_path):
    path = tmp_path / "j.sqlite"
    small_journal(path)
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    with pytest.raises(JournalError, match="cut short"):
        QueryJournal(path)


def test_a_changed_answer_fails_its_checksum(tmp_path):
    path = tmp_path / "j.sqlite"
    small_journal(path)
    stored = read_entries(path)[5][2]
    data = bytearray(path.read_bytes())
    at = data.find(np.float64(stored).tobytes())
    assert at > 0
    data[at] ^= 1                                        # one bit of one stored answer
    path.write_bytes(bytes(data))
    with pytest.raises(JournalError, match="fails its checksum"):
        QueryJournal(path)


@pytest.mark.parametrize("with_valid_checksum", [True, False])
def test_a_stored_infinity_never_reaches_the_learner(tmp_path, with_valid_checksum):
    path = tmp_path / "j.sqlite"
    small_journal(path)
    with sqlite3.connect(path) as db:
        row_id, digests, occurrences, outputs = db.execute(
            "SELECT id, digests, occurrences, outputs FROM batches").fetchone()
        values = np.frombuffer(outputs, np.float64).copy()
        values[1] = np.inf
        new = values.tobytes()
        stamp = checksum(digests, occurrences, new) if with_valid_checksum else b"x" * 16
        db.execute("UPDATE batches SET outputs = ?, checksum = ? WHERE id = ?",
                   (new, stamp, row_id))
    with pytest.raises(JournalError, match="non-finite" if with_valid_checksum else "checksum"):
        QueryJournal(path)


def test_blobs_of_inconsistent_lengths_are_refused(tmp_path):
    path = tmp_path / "j.sqlite"
    small_journal(path)
    with sqlite3.connect(path) as db:
        row_id, digests, occurrences, outputs = db.execute(
            "SELECT id, digests, occurrences, outputs FROM batches").fetchone()
        short = outputs[:-8]
        db.execute("UPDATE batches SET outputs = ?, checksum = ? WHERE id = ?",
                   (short, checksum(digests, occurrences, short), row_id))
    with pytest.raises(JournalError, match="inconsistent lengths"):
        QueryJournal(path)


# -- write failures: typed, and no paid answer lost ------------------------------


@pytest.mark.parametrize("failure", [
    sqlite3.OperationalError("database or disk is full"),
    sqlite3.OperationalError("attempt to write a readonly database"),
    OSError(28, "No space left on device"),
])
def test_a_failed_write_saves_the_batch_and_the_next_run_imports_it(tmp_path, monkeypatch,
                                                                      failure):
    path = tmp_path / "j.sqlite"
    box = CountingBox(random_single_head(D, seed=11))
    X = np.random.default_rng(4).standard_normal((7, 2, D))
    real_insert = QueryJournal._insert
    with QueryJournal(path) as journal:
        oracle = Oracle(box, D, journal=journal, max_batch=4)
        oracle.query(X[:4])                                # batch 1 recorded

        def failing(self, *args, **kw):
            raise failure
        monkeypatch.setattr(QueryJournal, "_insert", failing)
        with pytest.raises(JournalError) as caught:
            oracle.query(X[4:])                            # batch 2: paid for, write fails
    monkeypatch.setattr(QueryJournal, "_insert", real_insert)
    error = caught.value
    assert error.batch == 2 and error.path == str(path)
    assert "batch 2 (3 answers)" in str(error) and error.sidecar in str(error)
    assert os.path.dirname(error.sidecar) == str(tmp_path)
    box.asked.clear()
    with QueryJournal(path) as journal:                    # imports the sidecar
        assert journal.stored == 7 and not os.path.exists(error.sidecar)
        oracle = Oracle(box, D, journal=journal)
        np.testing.assert_array_equal(oracle.query(X), random_single_head(D, seed=11)(X))
        assert oracle.black_box_queries == 0 and len(box.asked) == oracle.check_queries


def test_a_journal_in_use_by_another_run_is_refused(tmp_path):
    with QueryJournal(tmp_path / "j.sqlite"):
        with pytest.raises(JournalError, match="in use by another run"):
            QueryJournal(tmp_path / "j.sqlite")
    QueryJournal(tmp_path / "j.sqlite").close()           # free again once closed


class RefusingMidBatch:
    """A black box whose budget runs out inside a batch: it answers the first ``left``
    sequences, then refuses, handing back what it did answer (``partial_outputs``)."""

    def __init__(self, box, left, full_length=False):
        self.box, self.left, self.full_length = box, left, full_length
        self.asked = 0

    def __call__(self, X):
        answers = self.box(X)
        k = min(self.left, len(X))
        self.left -= k
        self.asked += len(X)
        if k == len(X):
            return answers
        exc = BudgetExceededError("server budget exhausted", needed=len(X), remaining=0)
        if self.full_length:
            exc.partial_outputs = np.where(np.arange(len(X)) < k, answers, np.nan)
        else:
            exc.partial_outputs = answers[:k]
        raise exc


@pytest.mark.parametrize("full_length", [False, True])
def test_answers_received_before_a_budget_refusal_are_journaled(tmp_path, full_length):
    head = random_single_head(D, seed=12)
    X = np.random.default_rng(5).standard_normal((10, 2, D))
    path = tmp_path / "j.sqlite"
    with QueryJournal(path) as journal:
        oracle = Oracle(RefusingMidBatch(head, CHALLENGES + 6, full_length), D, journal=journal)
        with pytest.raises(BudgetExceededError) as caught:
            oracle.query(X)
    assert caught.value.journaled == 6
    assert f"6 answers received before it were journaled in {path}" in str(caught.value)
    box = CountingBox(head)
    with QueryJournal(path) as journal:
        assert journal.stored == 6
        oracle = Oracle(box, D, journal=journal)
        np.testing.assert_array_equal(oracle.query(X), head(X))
        assert (oracle.journal_queries, oracle.black_box_queries) == (6, 4)
        assert box.asked[oracle.check_queries:] == [x.tobytes() for x in X[6:]]


# -- the command line ------------------------------------------------------------

TARGET = textwrap.dedent("""
    import os, sqlite3, time
    import numpy as np
    from attnextract.adapters import journal as journal_module
    from attnextract.adapters.journal import sequence_digests
    from attnextract.adapters.targets import random_single_head

    head = random_single_head(6, seed=int(os.environ.get("HEAD_SEED", "5")))
    FAIL_AFTER = int(os.environ.get("FAIL_AFTER", "-1"))
    if FAIL_AFTER >= 0:                   # a disk that fills up after FAIL_AFTER batches
        real_insert, written = journal_module.QueryJournal._insert, [0]

        def insert(self, *args, **kw):
            written[0] += 1
            if written[0] > FAIL_AFTER:
                raise sqlite3.OperationalError("database or disk is full")
            return real_insert(self, *args, **kw)
        journal_module.QueryJournal._insert = insert

    def box(X):
        time.sleep(float(os.environ.get("SLEEP", "0")))
        with open(os.environ["ASKED_LOG"], "a") as log:
            log.write("".join(d.hex() + "\\n" for d in sequence_digests(X)))
        return head(X)
""")
LEARNER = D * D + D
VERIFY = verification_count(LEARNER, LEARNER)     # the held-out check of a single head


def write_target(folder, seed=5):
    folder.mkdir(exist_ok=True)
    (folder / "target.py").write_text(TARGET)
    return folder


def cli(*args, log, cwd=None, **env):
    environment = dict(os.environ, ASKED_LOG=str(log), **{k: str(v) for k, v in env.items()})
    return run_cli(*args, cwd=cwd, env=environment)


def asked(log) -> list[str]:
    return log.read_text().split() if log.exists() else []


@pytest.mark.slow
def test_same_target_string_from_another_folder_is_refused(tmp_path):
    a, b = write_target(tmp_path / "a"), write_target(tmp_path / "b")
    journal = tmp_path / "j.sqlite"
    args = ["extract", "--target", "target.py:box", "--dim", D, "--journal", journal,
            "--seed", 1, "--json", "--no-progress"]
    first = cli(*args, "--out", tmp_path / "a.npz", log=tmp_path / "a.log", cwd=a, HEAD_SEED=5)
    assert first.returncode == 0, first.stderr
    before = (tmp_path / "a.npz").read_bytes()
    # the same relative target string in another folder is another black box
    second = cli(*args, "--out", tmp_path / "a.npz", log=tmp_path / "b.log", cwd=b, HEAD_SEED=6)
    assert second.returncode == JOURNAL_EXIT, second.stderr
    assert "JournalMismatchError" in second.stderr and str(journal) in second.stderr
    assert "challenge sequence" in second.stderr
    assert json.loads(second.stdout)["ok"] is False
    assert len(asked(tmp_path / "b.log")) == CHALLENGES      # the checks, nothing more
    assert (tmp_path / "a.npz").read_bytes() == before       # the result is untouched
    # the same black box from the other folder resumes
    third = cli(*args, "--out", tmp_path / "c.npz", log=tmp_path / "c.log", cwd=b, HEAD_SEED=5)
    assert third.returncode == 0, third.stderr
    report = json.loads(third.stdout)
    # the held-out check is journaled too: a finished run resumed asks only the checks
    assert report["details"]["journal_queries"] == LEARNER + VERIFY
    assert report["details"]["black_box_queries"] == 0
    assert len(asked(tmp_path / "c.log")) == report["details"]["check_queries"]


@pytest.mark.slow
def test_disk_full_exits_with_the_journal_code_and_the_rerun_loses_nothing(tmp_path):
    folder = write_target(tmp_path / "t")
    args = ["extract", "--target", f"{folder}/target.py:box", "--dim", D, "--max-batch", 4,
            "--seed", 2, "--out", tmp_path / "r.npz", "--json", "--no-progress"]
    failed = cli(*args, log=tmp_path / "1.log", FAIL_AFTER=3)
    assert failed.returncode == JOURNAL_EXIT, failed.stderr
    journal = tmp_path / "r.journal.sqlite"
    found = re.search(r"cannot record batch 4 \((\d+) answers\)", failed.stderr)
    assert found and "database or disk is full" in failed.stderr, failed.stderr
    sidecar = tmp_path / "r.journal.sqlite.unsaved-4.npz"
    assert str(sidecar) in failed.stderr and sidecar.exists()
    with np.load(sidecar) as saved:
        assert len(saved["outputs"]) == int(found.group(1))
    assert not (tmp_path / "r.npz").exists()
    paid = asked(tmp_path / "1.log")[CHALLENGES:]
    assert len(read_entries(journal)) + int(found.group(1)) == len(paid)
    resumed = cli(*args, log=tmp_path / "2.log")
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads(resumed.stdout)
    assert report["details"]["journal_queries"] == len(paid)   # 3 batches + the sidecar's
    again = asked(tmp_path / "2.log")[report["details"]["check_queries"]:]
    # the verification's replays re-ask a sample of the learner's queries on purpose
    assert len(set(again) & set(paid)) <= int(REPLAY_FRACTION * VERIFY)
    assert len(again) == LEARNER - len(paid) + VERIFY
    assert str(journal) == report["details"]["journal"]


def test_a_journal_locked_by_another_run_exits_with_the_journal_code(tmp_path):
    folder = write_target(tmp_path / "t")
    with QueryJournal(tmp_path / "j.sqlite"):
        busy = cli("extract", "--target", f"{folder}/target.py:box", "--dim", D, "--out",
                   tmp_path / "r.npz", "--journal", tmp_path / "j.sqlite",
                   log=tmp_path / "1.log")
    assert busy.returncode == JOURNAL_EXIT and "in use by another run" in busy.stderr
    assert asked(tmp_path / "1.log") == []


@pytest.mark.slow
def test_a_truncated_journal_exits_with_the_journal_code(tmp_path):
    folder = write_target(tmp_path / "t")
    args = ["extract", "--target", f"{folder}/target.py:box", "--dim", D, "--out",
            tmp_path / "r.npz", "--no-progress"]
    assert cli(*args, log=tmp_path / "1.log").returncode == 0
    journal = tmp_path / "r.journal.sqlite"
    journal.write_bytes(journal.read_bytes()[:-1])
    cut = cli(*args, log=tmp_path / "2.log")
    assert cut.returncode == JOURNAL_EXIT and "cut short" in cut.stderr
    assert asked(tmp_path / "2.log") == []


@pytest.mark.parametrize("out, problem", [("missing/r.npz", "does not exist"),
                                          ("folder", "is a directory"),
                                          ("file/r.npz", "does not exist")])
@pytest.mark.slow
def test_an_unwritable_out_is_refused_before_any_query(tmp_path, out, problem):
    folder = write_target(tmp_path / "t")
    (tmp_path / "folder.npz").mkdir()
    (tmp_path / "file").write_text("a file, not a folder")
    done = cli("extract", "--target", f"{folder}/target.py:box", "--dim", D,
               "--out", tmp_path / out, log=tmp_path / "asked.log")
    assert done.returncode == 2 and problem in done.stderr, done.stderr
    assert asked(tmp_path / "asked.log") == []
    assert not list(tmp_path.glob("**/*.sqlite"))            # no journal either


@pytest.mark.slow
def test_out_gets_its_suffix_and_the_journal_sits_beside_it(tmp_path):
    folder = write_target(tmp_path / "t")
    base = ["extract", "--target", f"{folder}/target.py:box", "--dim", D, "--no-progress"]
    done = cli(*base, "--out", tmp_path / "result", log=tmp_path / "1.log")
    assert done.returncode == 0, done.stderr
    assert re.search(rf"^wrote +{re.escape(str(tmp_path / 'result.npz'))}$", done.stdout, re.M)
    assert (tmp_path / "result.npz").exists() and not (tmp_path / "result").exists()
    assert (tmp_path / "result.journal.sqlite").exists()
    as_json = cli(*base, "--out", tmp_path / "other", "--json", log=tmp_path / "2.log")
    assert json.loads(as_json.stdout)["out"] == str(tmp_path / "other.npz")
    bare = cli(*base, "--out", tmp_path / "bare.npz", "--no-journal", log=tmp_path / "3.log")
    assert bare.returncode == 0 and not (tmp_path / "bare.journal.sqlite").exists()
    assert len(asked(tmp_path / "3.log")) == LEARNER + VERIFY  # no checks without a journal
    # nothing temporary is left beside the results (written to a temp file, then renamed)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.slow
def test_ctrl_c_prints_one_line_with_the_queries_and_how_to_resume(tmp_path):
    folder = write_target(tmp_path / "t")
    journal = tmp_path / "r.journal.sqlite"
    env = dict(os.environ, ASKED_LOG=str(tmp_path / "asked.log"), SLEEP="0.05")
    args = [sys.executable, "-m", "attnextract", "extract", "--target",
            f"{folder}/target.py:box", "--dim", str(D), "--max-batch", "3",
            "--out", str(tmp_path / "r.npz"), "--no-progress"]
    # a test runner started in the background (`pytest &` in a script) ignores SIGINT,
    # and a child inherits that: give the run the default disposition, as a terminal would
    run = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and run.poll() is None:
        try:
            if journal.exists() and len(read_entries(journal)) >= 9:
                break
        except JournalError:            # read errors are typed (the schema is being created)
            pass
        time.sleep(0.01)
    run.send_signal(signal.SIGINT)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("attnextract: interrupted after ")
    assert f"journal {journal}" in lines[0] and "rerun the same command" in lines[0]
    spent = int(lines[0].split("interrupted after ")[1].split()[0])
    assert spent >= 9 and not (tmp_path / "r.npz").exists()
    # the process ends without the interpreter's shutdown (issue 22: within 1 s): no
    # temporary file is left, and the journal resumes below
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    resumed = subprocess.run(args[:-1] + ["--json"], env=dict(env, SLEEP="0"),
                             capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["details"]["journal_queries"] >= 9


def test_a_box_that_refuses_the_challenges_says_so(tmp_path):
    """A black box that only takes short sequences fails on the journal's long challenges:
    the black box error says why it was asked, and does not offer --no-journal as the fix
    (held-out verification asks sequences of 256 tokens too)."""
    head = random_single_head(D, seed=13)

    def short_only(X):
        if X.shape[1] > 64:
            raise ValueError("sequences longer than 64 tokens are not supported")
        return head(X)

    from attnextract import BlackBoxError
    with QueryJournal(tmp_path / "j.sqlite") as journal:
        oracle = Oracle(short_only, D, journal=journal)
        with pytest.raises(BlackBoxError, match="challenge sequences") as failure:
            oracle.query(np.ones((2, 3, D)))
        assert oracle.queries == 0 and "--no-journal" not in str(failure.value)
        text = str(failure.value)          # what happened first, the box's own words last
        assert text.index("challenge sequences") < text.index("longer than 64 tokens")


def test_a_float32_torch_head_resumes_and_another_is_refused(tmp_path, monkeypatch):
    """A float32 forward pass answers a sequence differently in another batch (~1e-7;
    here a kept sequence asked alone, a batch of one): the same module still resumes its
    journal; another module is refused."""
    import torch
    import attnextract.adapters.journal as journal_module
    monkeypatch.setattr(journal_module, "RESUME_SAMPLE", 1)
    from attnextract.adapters.torch_target import TorchAttentionBlackBox
    torch.manual_seed(0)
    dim = 64
    module = torch.nn.MultiheadAttention(dim, 4, bias=False, batch_first=True)
    other = torch.nn.MultiheadAttention(dim, 4, bias=False, batch_first=True)
    X = np.random.default_rng(6).standard_normal((200, 8, dim)) * 0.3
    with QueryJournal(tmp_path / "j.sqlite") as journal:
        first = Oracle(TorchAttentionBlackBox(module, readout=0, head=0, dtype="float32"), dim,
                       journal=journal, max_batch=25).query(X)
    for attempt in range(3):                         # three fresh resume samples
        box = TorchAttentionBlackBox(module, readout=0, head=0, dtype="float32")
        with QueryJournal(tmp_path / "j.sqlite") as journal:
            oracle = Oracle(box, dim, journal=journal)
            np.testing.assert_array_equal(oracle.query(X), first)
            assert oracle.check_queries == CHALLENGES + 1 and oracle.black_box_queries == 0
    box = TorchAttentionBlackBox(other, readout=0, head=0, dtype="float32")
    with QueryJournal(tmp_path / "j.sqlite") as journal:
        with pytest.raises(JournalMismatchError):
            Oracle(box, dim, journal=journal).query(X)


def test_the_checks_respect_max_batch(tmp_path):
    """A black box that takes one sequence per call gets the checks one at a time."""
    head = random_single_head(D, seed=14)

    def one_at_a_time(X):
        if len(X) > 1:
            raise ValueError("one sequence per request")
        return head(X)

    X = np.random.default_rng(7).standard_normal((3, 2, D))
    for _ in range(2):                               # recorded, then resumed
        with QueryJournal(tmp_path / "j.sqlite") as journal:
            oracle = Oracle(one_at_a_time, D, journal=journal, max_batch=1)
            np.testing.assert_allclose(oracle.query(X), head(X), rtol=1e-12)


def test_verification_through_a_learners_view_of_the_oracle_is_journaled(tmp_path):
    """Learners wrap the oracle (e.g. the odd part f(X) - f(-X)); held-out checks through the
    wrapper reach the black box once and are answered by the journal on a rerun."""
    from attnextract.learners.one_layer import OddPartOracle
    from attnextract.oracle import live_queries
    box = CountingBox(random_single_head(D, seed=15))
    X = np.random.default_rng(8).standard_normal((4, 3, D))
    with QueryJournal(tmp_path / "j.sqlite") as journal:
        oracle = Oracle(box, D, journal=journal)
        odd = OddPartOracle(oracle)
        first = odd.query(X)
        asked = len(box.asked)
        with live_queries(odd):
            np.testing.assert_array_equal(odd.query(X), first)
        assert len(box.asked) == asked + 8 and len(journal) == 16
        assert (oracle.journal_queries, oracle.black_box_queries) == (0, 16)
    with QueryJournal(tmp_path / "j.sqlite") as journal:     # a rerun replays both asks
        oracle = Oracle(box, D, journal=journal)
        np.testing.assert_array_equal(OddPartOracle(oracle).query(X), first)
        with live_queries(oracle):
            np.testing.assert_array_equal(OddPartOracle(oracle).query(X), first)
        assert (oracle.journal_queries, oracle.black_box_queries) == (16, 0)


def test_kept_sequences_stay_a_small_uniform_reservoir(tmp_path, monkeypatch):
    import attnextract.adapters.journal as journal_module
    monkeypatch.setattr(journal_module, "MAX_KEPT", 5)
    head = random_single_head(D, seed=16)
    X = np.random.default_rng(9).standard_normal((60, 2, D))
    with QueryJournal(tmp_path / "j.sqlite") as journal:
        Oracle(head, D, journal=journal, max_batch=1).query(X)     # 60 batches
    with sqlite3.connect(tmp_path / "j.sqlite") as db:
        kept = db.execute("SELECT id, sequence, output FROM samples").fetchall()
    assert sorted(row[0] for row in kept) == [1, 2, 3, 4, 5]
    asked = {x.tobytes(): y for x, y in zip(X, head(X))}
    for _, blob, y in kept:                        # each is a real query with its answer
        assert blob in asked and abs(asked[blob] - y) <= 1e-12 * abs(y)
    # later batches get kept too (a reservoir, not the first five; all five first ones
    # surviving 55 more batches has chance ~(5/60)^5 = 4e-6)
    later = {X[i].tobytes() for i in range(5, 60)}
    assert any(blob in later for _, blob, _ in kept)


def test_challenges_stay_within_one_request_for_wide_tokens():
    for dim, longest in ((6, 256), (384, 256), (1024, 128), (4096, 32), (20000, 16)):
        lengths = [len(x) for x in challenge_sequences(dim)]
        assert max(lengths) == longest and len(lengths) == CHALLENGES
        assert all(x.shape[1] == dim and np.all(np.isfinite(x)) for x in challenge_sequences(dim))
    a, b = challenge_sequences(8), challenge_sequences(8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))        # fixed: seeded by d


@pytest.mark.parametrize("column, value", [("outputs", "not bytes"), ("digests", 12),
                                           ("checksum", 1.5)])
def test_a_malformed_row_is_a_journal_error(tmp_path, column, value):
    path = tmp_path / "j.sqlite"
    small_journal(path)
    with sqlite3.connect(path) as db:
        db.execute(f"UPDATE batches SET {column} = ? WHERE id = 1", (value,))
    with pytest.raises(JournalError, match="row 1 of its batches is malformed"):
        QueryJournal(path)


def test_a_tampered_kept_sequence_is_a_journal_error_before_any_learner_query(tmp_path):
    path = tmp_path / "j.sqlite"
    box = CountingBox(random_single_head(D, seed=10))
    X = small_journal(path, box)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE samples SET output = output + 1")
    with QueryJournal(path) as journal:
        oracle = Oracle(box, D, journal=journal)
        with pytest.raises(JournalError, match="kept sequence .* fails its checks"):
            oracle.query(X)
        assert oracle.queries == 0
