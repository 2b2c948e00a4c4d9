"""The query journal: every query and its answer, on disk, so that a killed run resumes.

A black box that charges per query (or takes hours) must never be asked the same
thing twice because a run died. :class:`QueryJournal` is an SQLite file (stdlib
``sqlite3``) that the :class:`~attnextract.oracle.Oracle` consults for every batch:

- each sequence is keyed by a hash (SHA-256) of its exact bytes (shape and float64 values)
  and by its *occurrence*: the k-th time the same sequence is asked in one run is
  a different entry from the first, so learners that repeat probes on purpose (to
  average a noisy black box) get fresh answers, and a resumed run replays them in
  the same order;
- a batch's answers are written and committed in one transaction as soon as the
  black box has answered (and the answer was validated), before the learner sees
  them; a run killed with SIGKILL loses at most the batch in flight;
- a restarted run with the same journal is answered from the journal for every
  sequence it asks again, and only the rest reach the black box.

The learners are deterministic given their seed, so a resumed run asks the same
sequences in the same order and returns the same result. The journal also keeps a
small context (the target, d, the seed) and refuses to be reused for another one.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from collections import Counter

import numpy as np

from ..errors import InputError

DIGEST_BYTES = 16
# One row per answered batch (a row per sequence made large runs spend more time in
# SQLite than in the black box): B digests of 16 bytes, B occurrences (int64) and B
# outputs (float64, exact), each packed in one blob.
SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    id INTEGER PRIMARY KEY,
    digests BLOB NOT NULL,       -- sha256 (first 16 bytes) of each sequence's shape and bytes
    occurrences BLOB NOT NULL,   -- int64: 0 the first time a sequence was asked in a run
    outputs BLOB NOT NULL        -- float64 answers
);
CREATE TABLE IF NOT EXISTS context (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def sequence_digests(X: np.ndarray) -> list[bytes]:
    """Hash of the exact bytes of each sequence of a batch X (B, N, d); B digests of 16 bytes.

    The shape (N, d) is hashed too, so sequences of different shapes with the same
    bytes never collide; -0.0 and 0.0 differ (they are different bytes).
    """
    X = np.ascontiguousarray(X, dtype=np.float64)
    header = hashlib.sha256(np.array(X.shape[1:], dtype=np.int64).tobytes())
    digests = []
    for row in X:
        h = header.copy()
        h.update(row)                       # the buffer itself: no copy of the bytes
        digests.append(h.digest()[:DIGEST_BYTES])
    return digests


def read_entries(path) -> list[tuple[bytes, int, float]]:
    """Every (digest, occurrence, output) in the journal file, opened read-only."""
    uri = "file:" + os.path.abspath(os.fspath(path)) + "?mode=ro"
    with sqlite3.connect(uri, uri=True) as db:
        rows = db.execute("SELECT digests, occurrences, outputs FROM batches ORDER BY id").fetchall()
    return [entry for row in rows for entry in _unpack(*row)]


def _unpack(digests: bytes, occurrences: bytes, outputs: bytes):
    occ = np.frombuffer(occurrences, dtype=np.int64)
    out = np.frombuffer(outputs, dtype=np.float64)
    if len(digests) != DIGEST_BYTES * len(occ) or len(out) != len(occ):
        raise sqlite3.DatabaseError("a journal row has blobs of inconsistent lengths")
    return [(digests[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES], int(k), float(y))
            for i, (k, y) in enumerate(zip(occ, out))]


class QueryJournal:
    """An SQLite journal of queries and answers, shared by every learner through the oracle.

    Parameters
    ----------
    path : str or PathLike
        The journal file; created if missing, resumed if it exists.
    context : dict, optional
        What this run is (e.g. ``{"target": ..., "dim": ...}``); stored on first use.
        Reopening the journal with a context that disagrees on a stored key raises
        :class:`InputError`; keys not stored yet are added.

    Attributes
    ----------
    hits : int
        Sequences answered from the journal during this run.
    recorded : int
        Sequences whose answers this run added to the journal.
    stored : int
        Entries in the journal when it was opened.
    """

    def __init__(self, path, context: dict | None = None):
        self.path = os.fspath(path)
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")      # a commit is durable and cheap
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
            rows = self._db.execute("SELECT digests, occurrences, outputs FROM batches").fetchall()
            stored_context = dict(self._db.execute("SELECT key, value FROM context"))
            self._answers = {(d, k): y for row in rows for d, k, y in _unpack(*row)}
        except sqlite3.DatabaseError as exc:
            raise InputError(f"cannot use {self.path} as a query journal: {exc}") from exc
        self.context = {k: json.loads(v) for k, v in stored_context.items()}
        for key, value in (context or {}).items():
            if key in self.context and self.context[key] != value:
                self.close()
                raise InputError(
                    f"journal {self.path} was recorded with {key} = {self.context[key]!r}, "
                    f"not {value!r}; use another journal file")
        self.remember(**{k: v for k, v in (context or {}).items() if k not in self.context})
        self._seen: Counter = Counter()      # digest -> times asked in this run so far
        self.stored = len(self._answers)
        self.hits = 0
        self.recorded = 0

    def remember(self, **context) -> None:
        """Store context entries (JSON values) that are not stored yet."""
        if not context:
            return
        with self._db:
            self._db.executemany("INSERT OR IGNORE INTO context VALUES (?, ?)",
                                 [(k, json.dumps(v)) for k, v in context.items()])
        for key, value in context.items():
            self.context.setdefault(key, value)

    def lookup(self, X: np.ndarray) -> tuple[list[tuple[bytes, int]], np.ndarray]:
        """Keys of the sequences of X (B, N, d) and their journal answers (NaN where unknown).

        Every call advances the occurrence counts: call it once per batch asked.
        """
        keys = []
        for digest in sequence_digests(X):
            keys.append((digest, self._seen[digest]))
            self._seen[digest] += 1
        known = np.array([self._answers.get(key, np.nan) for key in keys])
        self.hits += int(np.count_nonzero(~np.isnan(known)))
        return keys, known

    def record(self, keys: list[tuple[bytes, int]], outputs: np.ndarray) -> None:
        """Write validated answers of one batch and commit them (one transaction)."""
        outputs = np.ascontiguousarray(outputs, dtype=np.float64)
        row = (b"".join(d for d, _ in keys), np.array([k for _, k in keys], np.int64).tobytes(),
               outputs.tobytes())
        with self._db:                       # one transaction, committed on leaving
            self._db.execute("BEGIN")
            self._db.execute("INSERT INTO batches (digests, occurrences, outputs) "
                             "VALUES (?, ?, ?)", row)
        for key, y in zip(keys, outputs.tolist()):
            self._answers[key] = y
        self.recorded += len(keys)

    def __len__(self) -> int:
        return len(self._answers)

    def close(self) -> None:
        self._db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
