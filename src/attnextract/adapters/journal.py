"""The query journal: every query and its answer, on disk, bound to the black box that gave them.

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

**Bound to its black box.** A journal answers for one black box only. When it is
created it stores a *fingerprint*: the black box's answers to :data:`CHALLENGES`
fixed challenge sequences (lengths 1 to 256, token scales 1e-2 to 3, seeded by d).
It also keeps one random sequence of each recorded batch with its answer (a uniform
reservoir of at most :data:`MAX_KEPT` batches).
Before a resumed run answers anything from the journal, the live black box is asked
the challenges and a fresh random sample of :data:`RESUME_SAMPLE` kept sequences; any
answer that differs refuses the journal (:class:`JournalMismatchError`, naming the
file and the first difference) before the learner spends a query. These checks are
answered by the black box, so they are counted in the run's queries and within its
budget like every other query (``Oracle.check_queries`` says how many). Two answers to the same query agree when

    |a - b| <= 2 (tau + rho max(|a|, |b|)) + 1e-12 max(|a|, |b|, rms)

with (tau, rho) the noise bound of the black box (the CLI's ``--tolerance`` and
``--relative-tolerance``, or a wrapper's ``tolerance`` / ``relative_tolerance``; for
random noise of standard deviation s, tau = 6 s), rms the root mean square of the
challenge answers. So a deterministic black box must answer the challenges (asked in
the same batches every time) the same to 1e-12, and a noisy one within twice its
stated noise: a journal of a noisy black box resumes, and a black box that differs by
less than its own noise cannot be told apart by any query anyway. The kept sequences
are asked in other batches than the first time, which moves a float32 forward pass by
~1e-7: they are allowed 1e-6 relative (``SAMPLE_SLACK``) on top. A black box whose
answers depend on their batch by more must state it as noise.

**Vector answers.** A black box that answers a vector (m,) per sequence (the output at
the last position) or an array (N, m) (every position) is journaled the same way: each
batch row holds its answers' shape beside their numbers, inside the row's checksum;
the fingerprint stores what the box answers (the kind and m) and every number of its
answers to the challenges, so a journal recorded against a box answering one number
is refused for a box answering vectors, and the reverse, before anything is answered
from it.

**Checked when read.** Every row carries a checksum (SHA-256 of its blobs); a row that
fails it, holds a non-finite answer, or has blobs of inconsistent lengths, and a file
that is not a whole number of pages (cut short), raise :class:`JournalError`, as does
every SQLite read error (a damaged page of the samples or the fingerprint). So do
write failures (full disk, read-only or locked file): the error says which batch was
being recorded, and its answers are saved to a sidecar ``JOURNAL.unsaved-K.npz``
(beside the journal, else in the temporary directory, else kept in memory in
``unsaved``); the next opening of the journal imports sidecars. A journal is used by
one run at a time (an exclusive ``flock``).

The learners are deterministic given their seed, so a resumed run asks the same
sequences in the same order and returns the same result. The journal also keeps a
small context (d, the seed, the target's name) and refuses to be reused for another d
or seed.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import sqlite3
import tempfile
from collections import Counter
from typing import Any, BinaryIO

import numpy as np

from ..errors import BlackBoxError, InputError, JournalError, JournalMismatchError

try:                       # POSIX only; elsewhere two runs sharing a journal are not stopped
    import fcntl
except ImportError:        # pragma: no cover
    fcntl = None  # type: ignore[assignment]  # no such module off POSIX: no locking

DIGEST_BYTES = 16
CHECKSUM_BYTES = 16
CHALLENGES = 8             # challenge sequences of the fingerprint
RESUME_SAMPLE = 8          # journaled sequences asked again when a journal is resumed
MAX_KEPT = 256             # kept sequences (a uniform reservoir over all recorded batches)
MAX_KEPT_NUMBERS = 1 << 19 # a longer sequence is not kept (4 MiB)
CHALLENGE_NUMBERS = 1 << 17  # numbers in the longest challenge (an HTTP request carries 2^18)
FINGERPRINT_VERSION = 1
FLOAT_SLACK = 1e-12        # relative disagreement allowed to a deterministic black box
# A kept sequence is asked again in another batch than the first time, and a float32
# forward pass depends on its batch (a torch float32 head: 3.5e-7 relative, measured):
SAMPLE_SLACK = 1e-6
RANDOM_NOISE_WIDTH = 6.0   # tau = 6 std for random noise of a given std

# One row per answered batch (a row per sequence made large runs spend more time in
# SQLite than in the black box): B digests of 16 bytes, B occurrences (int64) and B
# outputs (float64, exact), each packed in one blob, and the checksum of the three.
SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    id INTEGER PRIMARY KEY,
    digests BLOB NOT NULL,       -- sha256 (first 16 bytes) of each sequence's shape and bytes
    occurrences BLOB NOT NULL,   -- int64: 0 the first time a sequence was asked in a run
    outputs BLOB NOT NULL,       -- float64 answers
    checksum BLOB NOT NULL       -- sha256 (first 16 bytes) of digests, occurrences, outputs
);
CREATE TABLE IF NOT EXISTS samples (   -- one sequence of each batch, to ask again on resume
    id INTEGER PRIMARY KEY,
    length INTEGER NOT NULL,
    sequence BLOB NOT NULL,      -- float64 (length, d)
    output REAL NOT NULL,
    checksum BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS fingerprint (
    version INTEGER PRIMARY KEY,
    dim INTEGER NOT NULL,
    outputs BLOB NOT NULL,       -- float64 answers to challenge_sequences(dim)
    checksum BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS context (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS answer_kind (  -- absent: one number per sequence
    id INTEGER PRIMARY KEY CHECK (id = 1),
    kind TEXT NOT NULL,          -- "last": a vector (m,) per sequence; "all": (N, m)
    width INTEGER NOT NULL,      -- m
    checksum BLOB NOT NULL
);
"""
# Columns vector answers add (NULL for one number per sequence); added to journals
# written before them, whose rows stay valid as they are.
VECTOR_COLUMNS = (("batches", "shape"),     # int64 shape of one answer: (m,) or (N, m)
                  ("samples", "answer"))    # float64 numbers of the kept answer


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


def checksum(*blobs: bytes) -> bytes:
    """SHA-256 (first 16 bytes) of the blobs, each prefixed by its length."""
    h = hashlib.sha256()
    for blob in blobs:
        h.update(len(blob).to_bytes(8, "little"))
        h.update(blob)
    return h.digest()[:CHECKSUM_BYTES]


def challenge_sequences(dim: int, max_length: int | None = None) -> list[np.ndarray]:
    """The fingerprint's fixed challenge sequences for token width ``dim``: (N, dim) each.

    Lengths 1, 2, 4, 16, 16, 64, 256, 256 (the long ones cut to 2^17 numbers for wide
    tokens, at least 16: 128 tokens at d = 1024, 32 at d = 4096); Gaussian tokens at
    scale d^{-1/4} times a per-sequence factor (0.01 to 3), and per-token log-uniform
    factors in the long ones, so that the fingerprint sees short and long sequences,
    saturated and flat attention. Seeded by ``dim`` alone: the same for every journal of
    that width. ``max_length`` (the black box's longest sequence) cuts longer ones to it.
    """
    rng = np.random.default_rng([0x6A6F75726E616C, FINGERPRINT_VERSION, int(dim)])
    anchor = dim ** -0.25
    longest = max(16, min(256, CHALLENGE_NUMBERS // dim))
    if max_length:
        longest = min(longest, int(max_length))
    plan = [(1, 1.0), (2, 0.1), (4, 3.0), (16, 1.0), (16, 0.01), (64, 1.0), (256, 0.3),
            (256, 1.0)]
    out = []
    for n, factor in plan:
        n = min(n, longest)
        X = rng.standard_normal((n, dim)) * (anchor * factor)
        if n >= 16:
            X *= np.exp(rng.uniform(np.log(0.1), np.log(3.0), size=(n, 1)))
        out.append(X)
    return out


def noise_bound(black_box) -> tuple[float, float]:
    """(tau, rho) a black box declares about its answers' noise (0, 0 when it declares none).

    Reads the ``tolerance`` / ``relative_tolerance`` of the oracle's output wrappers
    (bounded noise, rounding) and ``std`` (random noise: tau = 6 std)."""
    tau = getattr(black_box, "tolerance", 0.0)
    rho = getattr(black_box, "relative_tolerance", 0.0)
    std = getattr(black_box, "std", None)
    tau = float(tau) if isinstance(tau, (int, float)) else 0.0
    if isinstance(std, (int, float)):
        tau = max(tau, RANDOM_NOISE_WIDTH * float(std))
    rho = float(rho) if isinstance(rho, (int, float)) else 0.0
    return (tau if math.isfinite(tau) else 0.0), (rho if math.isfinite(rho) else 0.0)


def answers_agree(stored: np.ndarray, live: np.ndarray, scale: float, tolerance: float = 0.0,
                  relative_tolerance: float = 0.0, slack: float = FLOAT_SLACK) -> np.ndarray:
    """Elementwise: do two answers to the same queries agree (see the module docstring)?"""
    size = np.maximum(np.abs(stored), np.abs(live))
    slack = (2.0 * (tolerance + relative_tolerance * size)
             + slack * np.maximum(size, scale))
    return np.abs(stored - live) <= slack


def read_entries(path) -> list[tuple[bytes, int, float]]:
    """Every (digest, occurrence, output) in the journal file, opened read-only (checked);
    a vector answer is an array (m,) or (N, m)."""
    uri = "file:" + os.path.abspath(os.fspath(path)) + "?mode=ro"
    try:
        with sqlite3.connect(uri, uri=True) as db:
            rows = db.execute(f"SELECT id, digests, occurrences, outputs, checksum"
                              f"{_shape_column(db)} FROM batches ORDER BY id").fetchall()
    except sqlite3.Error as exc:
        raise JournalError(f"cannot read journal {path}: {exc}", path=os.fspath(path)) from exc
    return [entry for row in rows for entry in _unpack(os.fspath(path), *row)]


def _shape_column(db) -> str:
    """", shape" where the batches table has the column (journals older than vector
    answers have not)."""
    columns = [row[1] for row in db.execute("PRAGMA table_info(batches)")]
    return ", shape" if "shape" in columns else ""


def _answer_shape(shape: bytes | None, where: str, path: str) -> tuple[int, ...]:
    """The shape of one answer a row's ``shape`` blob states: () when NULL (scalars)."""
    if shape is None:
        return ()
    dims = np.frombuffer(shape, dtype=np.int64) if isinstance(shape, bytes) and \
        len(shape) % 8 == 0 else None
    if dims is None or not 1 <= len(dims) <= 2 or np.any(dims < 1):
        raise JournalError(f"{where} states a malformed answer shape", path=path)
    return tuple(int(n) for n in dims)


def _unpack(path: str, row_id: int, digests: bytes, occurrences: bytes, outputs: bytes,
            stored_checksum: bytes, shape: bytes | None = None):
    """The (digest, occurrence, output) entries of one batch row, checked; a vector
    answer is an array of the row's answer shape (the shape blob is in the checksum)."""
    where = f"journal {path}: row {row_id} of its batches"
    if not all(isinstance(b, bytes) for b in (digests, occurrences, outputs, stored_checksum)):
        raise JournalError(f"{where} is malformed (a field that should be bytes is not)",
                           path=path)
    blobs = (digests, occurrences, outputs) + (() if shape is None else (shape,))
    if stored_checksum != checksum(*blobs):
        raise JournalError(f"{where} fails its checksum (the file was changed or cut short); "
                           f"delete the journal or use another one", path=path)
    if len(occurrences) % 8 or len(outputs) % 8:
        raise JournalError(f"{where} has blobs of inconsistent lengths", path=path)
    occ = np.frombuffer(occurrences, dtype=np.int64)
    out = np.frombuffer(outputs, dtype=np.float64)
    each = _answer_shape(shape, where, path)
    if len(digests) != DIGEST_BYTES * len(occ) or len(out) != len(occ) * math.prod(each):
        raise JournalError(f"{where} has blobs of inconsistent lengths", path=path)
    if not np.all(np.isfinite(out)):
        raise JournalError(f"{where} holds a non-finite answer "
                           f"({out[~np.isfinite(out)][0]})", path=path)
    if np.any(occ < 0):
        raise JournalError(f"{where} holds a negative occurrence", path=path)
    if each:
        answers = out.reshape((len(occ),) + each).copy()
        return [(digests[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES], int(k), answers[i])
                for i, k in enumerate(occ)]
    return [(digests[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES], int(k), float(y))
            for i, (k, y) in enumerate(zip(occ, out))]


class QueryJournal:
    """An SQLite journal of queries and answers, shared by every learner through the oracle.

    Parameters
    ----------
    path : str or PathLike
        The journal file; created if missing, resumed if it exists.
    context : dict, optional
        What this run is (e.g. ``{"dim": ..., "seed": ...}``); stored on first use.
        Reopening the journal with a context that disagrees on a stored key raises
        :class:`InputError`; keys not stored yet are added.
    tolerance, relative_tolerance : float, optional
        The black box's noise bound |answer - f(X)| <= tau + rho |f(X)|, used when the
        fingerprint and the resume sample are compared (default: what the black box
        declares, see :func:`noise_bound`; 0 for a deterministic black box).

    Attributes
    ----------
    hits : int
        Sequences answered from the journal during this run.
    recorded : int
        Sequences whose answers this run added to the journal.
    stored : int
        Entries in the journal when it was opened (sidecars imported).
    bound : bool
        Whether the journal has been bound to the live black box (:meth:`bind`).
    unsaved : list
        Batches whose answers could be written neither to the journal nor to a sidecar.
    """

    def __init__(self, path, context: dict | None = None, *, tolerance: float | None = None,
                 relative_tolerance: float | None = None):
        self.path = os.fspath(path)
        self.tolerance, self.relative_tolerance = tolerance, relative_tolerance
        self.unsaved: list[dict] = []
        self.bound = False
        self._db: sqlite3.Connection | None = None     # None once closed
        self._lock: BinaryIO | None = None
        self._batches_recorded = 0
        if os.path.isdir(self.path):
            raise JournalError(f"journal {self.path} is a directory", path=self.path)
        try:
            self._check_whole_pages()
            self._lock_file()
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                       timeout=5.0)
            self._db.execute("PRAGMA journal_mode=WAL")      # a commit is durable and cheap
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._check_schema()
            self._db.executescript(SCHEMA)
            self._add_vector_columns()
            rows = self._db.execute("SELECT id, digests, occurrences, outputs, checksum, shape "
                                    "FROM batches").fetchall()
            stored_context = dict(self._db.execute("SELECT key, value FROM context"))
            self._answers = {(d, k): y for row in rows for d, k, y in _unpack(self.path, *row)}
            self._batch_count = len(rows)
            self._import_sidecars()
        except JournalError:
            self.close()
            raise
        except (sqlite3.Error, OSError) as exc:
            self.close()
            raise JournalError(f"cannot use {self.path} as a query journal: {exc}",
                               path=self.path) from exc
        self.context = {k: json.loads(v) for k, v in stored_context.items()}
        if not self._answers and any(k in self.context and self.context[k] != v
                                     for k, v in (context or {}).items()):
            self.restart()                    # e.g. a first run with a wrong --dim
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

    # -- opening ------------------------------------------------------------
    def _check_whole_pages(self) -> None:
        """A database file is a whole number of pages; one that is not was cut short."""
        try:
            size = os.path.getsize(self.path)
        except FileNotFoundError:
            return
        if size == 0:
            return
        with open(self.path, "rb") as f:
            header = f.read(100)
        if len(header) < 100 or not header.startswith(b"SQLite format 3\x00"):
            raise JournalError(f"{self.path} is not a query journal (not an SQLite file)",
                               path=self.path)
        page = int.from_bytes(header[16:18], "big")
        page = 65536 if page == 1 else page
        if page and size % page:
            raise JournalError(f"journal {self.path} was cut short ({size} bytes, not a whole "
                               f"number of {page}-byte pages); its last answers cannot be "
                               f"trusted: delete it or use another one", path=self.path)

    def _lock_file(self) -> None:
        if fcntl is None:
            return
        self._lock = open(self.path, "ab")
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            self._lock = None
            raise JournalError(f"journal {self.path} is in use by another run (locked); "
                               f"wait for it or use another journal file",
                               path=self.path) from None

    def _check_schema(self) -> None:
        columns = [row[1] for row in self._connection.execute("PRAGMA table_info(batches)")]
        if columns and "checksum" not in columns:
            raise JournalError(f"journal {self.path} was written by an older attnextract "
                               f"(no checksums, no fingerprint of its black box) and cannot be "
                               f"trusted; delete it or use another one", path=self.path)

    def _add_vector_columns(self) -> None:
        """Add the columns of vector answers to a journal written before them."""
        for table, column in VECTOR_COLUMNS:
            columns = [row[1] for row in self._connection.execute(f"PRAGMA table_info({table})")]
            if column not in columns:
                self._connection.execute(f"ALTER TABLE {table} ADD COLUMN {column} BLOB")

    def _import_sidecars(self) -> None:
        """Answers a failed write saved beside the journal are written into it now."""
        for sidecar in sorted(glob.glob(glob.escape(self.path) + ".unsaved-*.npz")):
            with np.load(sidecar, allow_pickle=False) as data:
                keys = [(bytes(d), int(k)) for d, k in zip(data["digests"], data["occurrences"])]
                outputs = np.asarray(data["outputs"], dtype=np.float64)
            if (outputs.ndim > 3 or outputs.shape[:1] != (len(keys),)
                    or not np.all(np.isfinite(outputs))):
                raise JournalError(f"sidecar {sidecar} of journal {self.path} is malformed",
                                   path=self.path)
            new = [i for i, key in enumerate(keys) if key not in self._answers]
            if new:
                self._insert([keys[i] for i in new], outputs[new], sample=None)
                for i in new:
                    self._answers[keys[i]] = _entry(outputs[i])
            os.remove(sidecar)

    # -- context ------------------------------------------------------------
    def restart(self) -> bool:
        """Forget the context, fingerprint and kept sequences of a journal holding no answers.

        A run that failed before its first answer (a wrong --dim, a target that raised)
        leaves nothing to resume, so the corrected rerun starts the journal afresh instead
        of being refused. Returns whether it did (False: the journal holds answers)."""
        if self._answers:
            return False
        self._forget_black_box(("context",))
        self.context = {}
        return True

    def _forget_black_box(self, also: tuple[str, ...] = ()) -> None:
        """Delete the fingerprint and kept sequences (and the ``also`` tables)."""
        try:
            with self._connection:
                for table in ("fingerprint", "samples", "answer_kind", *also):
                    self._connection.execute(f"DELETE FROM {table}")
        except sqlite3.Error as exc:
            raise JournalError(f"cannot write to journal {self.path}: {exc}",
                               path=self.path) from exc

    def remember(self, **context) -> None:
        """Store context entries (JSON values) that are not stored yet."""
        if not context:
            return
        try:
            with self._connection:
                self._connection.executemany("INSERT OR IGNORE INTO context VALUES (?, ?)",
                                     [(k, json.dumps(v)) for k, v in context.items()])
        except sqlite3.Error as exc:
            raise JournalError(f"cannot write to journal {self.path}: {exc}",
                               path=self.path) from exc
        for key, value in context.items():
            self.context.setdefault(key, value)

    # -- binding to the black box -------------------------------------------
    def bind(self, ask, dim: int, black_box=None, max_length: int | None = None) -> int:
        """Bind the journal to the live black box; returns the queries this cost.

        ``ask`` answers a batch (B, N, dim) from the live black box (validated).
        A new journal stores the answers to :func:`challenge_sequences`; a journal
        with a fingerprint asks them again, with a random sample of its kept
        sequences, and raises :class:`JournalMismatchError` on the first difference.
        """
        tau, rho = noise_bound(black_box)
        tau = tau if self.tolerance is None else float(self.tolerance)
        rho = rho if self.relative_tolerance is None else float(self.relative_tolerance)
        challenges = challenge_sequences(dim, max_length)
        stored = self._fingerprint()
        if stored is not None and not self._answers:
            # recorded by a run that failed before its first answer: nothing rests on it,
            # so a corrected black box (or --dim) is fingerprinted afresh, not refused
            self._forget_black_box()
            stored = None
        if stored is None and self._answers:
            raise JournalError(f"journal {self.path} holds answers but no fingerprint of its "
                               f"black box; it cannot be checked: delete it or use another one",
                               path=self.path)
        try:
            answers = _answers_ragged(ask, challenges)
        except BlackBoxError as exc:          # a box that refuses long sequences, say
            if getattr(exc, "first_batch", False) or isinstance(exc, InputError):
                raise                         # already says what to fix (a wrong --dim)
            raise type(exc)(f"the black box failed on the run's first queries, the journal's "
                            f"{len(challenges)} challenge sequences (lengths 1-256): "
                            f"{exc}") from exc
        spent = len(challenges)
        kind = _kind_of(answers)
        # every number of every answer, in order: for one number per sequence, the 8
        # answers exactly as journals have always stored them
        live = np.concatenate([np.ravel(a) for a in answers])
        scale = float(np.sqrt(np.mean(live ** 2)))
        if stored is None:
            outputs = live.tobytes()
            self._write("INSERT INTO fingerprint VALUES (?, ?, ?, ?)",
                        (FINGERPRINT_VERSION, int(dim), outputs, checksum(outputs)),
                        "the fingerprint of its black box")
            if kind[0] != "scalar":
                self._write("INSERT OR REPLACE INTO answer_kind VALUES (1, ?, ?, ?)",
                            (kind[0], kind[1], _kind_checksum(*kind)),
                            "what its black box answers")
            self.bound = True
            return spent
        stored_dim, stored_outputs = stored
        if stored_dim != dim:
            raise InputError(f"journal {self.path} was recorded with d = {stored_dim}, not {dim}")
        self._check_kind(kind)
        sizes = np.cumsum([0] + [np.size(a) for a in answers])
        if len(stored_outputs) != sizes[-1]:
            self._mismatch("the challenge sequences (answers of another size)",
                           len(stored_outputs), sizes[-1])
        ok = answers_agree(stored_outputs, live, scale, tau, rho)
        if not ok.all():
            k = int(np.flatnonzero(~ok)[0])
            i = int(np.searchsorted(sizes, k, side="right") - 1)
            self._mismatch(f"challenge sequence {i} (length {len(challenges[i])})"
                           + (f", number {k - sizes[i]} of its answer" if kind[0] != "scalar"
                              else ""), stored_outputs[k], live[k])
        sample = self._sample(RESUME_SAMPLE)
        if sample:
            again = _answers_ragged(ask, [x for _, x, _ in sample])
            spent += len(sample)
            for (row, x, kept), live_y in zip(sample, again):
                y, live_y = np.ravel(kept), np.ravel(live_y)
                ok = (answers_agree(y, live_y, scale, tau, rho, FLOAT_SLACK + SAMPLE_SLACK)
                      if y.shape == live_y.shape else np.zeros(1, dtype=bool))
                if not ok.all():
                    k = int(np.flatnonzero(~ok)[0])
                    self._mismatch(f"journaled query {row} (a sequence of length {len(x)})",
                                   y[k] if k < len(y) else np.nan,
                                   live_y[k] if k < len(live_y) else np.nan)
        self.bound = True
        return spent

    def answer_kind(self) -> tuple[str, int]:
        """What the journal's black box answers: ("scalar", 1), ("last", m) or ("all", m)."""
        row = self._read("SELECT kind, width, checksum FROM answer_kind WHERE id = 1", (),
                         "what its black box answers", one=True)
        if row is None:
            return "scalar", 1
        kind, width, stored_checksum = row
        if (kind not in ("last", "all") or not isinstance(width, int) or width < 1
                or stored_checksum != _kind_checksum(kind, width)):
            raise JournalError(f"journal {self.path}: what its black box answers is "
                               f"malformed or fails its checksum", path=self.path)
        return kind, width

    def _check_kind(self, live: tuple[str, int]) -> None:
        """JournalMismatchError unless the live box answers what the journal's did."""
        stored = self.answer_kind()
        if stored == live:
            return
        raise JournalMismatchError(
            f"journal {self.path} was recorded against a black box answering "
            f"{_kind_words(stored)}; the live black box answers {_kind_words(live)}; nothing "
            f"more was asked. Use another journal (or --no-journal) for this black box",
            path=self.path, difference={"query": "what the black box answers",
                                        "journaled": list(stored), "live": list(live)})

    def _mismatch(self, what: str, stored: float, live: float):
        stored, live = float(stored), float(live)   # one number of the answers
        difference = {"query": what, "journaled": stored, "live": live}
        hint = ""
        if abs(stored - live) <= 1e-3 * max(abs(stored), abs(live)):
            hint = (" (if this black box is noisy, state its noise: --tolerance / "
                    "--relative-tolerance)")
        raise JournalMismatchError(
            f"journal {self.path} was recorded against another black box: the live black box "
            f"answers {what} with {live!r}, the journal holds {stored!r}; nothing more was "
            f"asked. Use another journal (or --no-journal) for this black box{hint}",
            path=self.path, difference=difference)

    def _read(self, sql: str, row: tuple = (), what: str = "its rows", one: bool = False):
        """A SELECT on the journal; any SQLite error (a damaged page) is a JournalError."""
        try:
            cursor = self._connection.execute(sql, row)
            return cursor.fetchone() if one else cursor.fetchall()
        except sqlite3.Error as exc:
            raise JournalError(f"cannot read {what} from journal {self.path} (damaged?): {exc}",
                               path=self.path) from exc

    def _fingerprint(self):
        row = self._read("SELECT dim, outputs, checksum FROM fingerprint WHERE version = ?",
                         (FINGERPRINT_VERSION,), "its fingerprint", one=True)
        if row is None:
            return None
        dim, outputs, stored_checksum = row
        if not (isinstance(outputs, bytes) and isinstance(stored_checksum, bytes)
                and isinstance(dim, int)):
            raise JournalError(f"journal {self.path}: its fingerprint is malformed",
                               path=self.path)
        values = np.frombuffer(outputs, dtype=np.float64) if len(outputs) % 8 == 0 else None
        kind, width = self.answer_kind()
        # one number per challenge; vectors: m (last) or N m (every position) each
        sized = values is not None and (values.shape == (CHALLENGES,) if kind == "scalar" else
                                        len(values) >= CHALLENGES and len(values) % width == 0)
        if (stored_checksum != checksum(outputs) or not sized
                or not np.all(np.isfinite(values))):
            raise JournalError(f"journal {self.path}: its fingerprint fails its checksum or "
                               f"shape check; delete it or use another one", path=self.path)
        return int(dim), values

    def _sample(self, k: int) -> list[tuple[int, np.ndarray, float | np.ndarray]]:
        """Up to k kept sequences, drawn afresh at random: [(row id, (N, d), answer)]; a
        vector answer as its numbers, flat."""
        ids = [row[0] for row in self._read("SELECT id FROM samples", (), "its kept sequences")]
        if not ids:
            return []
        rng = np.random.default_rng()                    # fresh: not predictable
        chosen = rng.choice(ids, size=min(k, len(ids)), replace=False)
        out = []
        for row_id in sorted(int(i) for i in chosen):
            row = self._read(
                "SELECT length, sequence, output, checksum, answer FROM samples WHERE id = ?",
                (row_id,), f"kept sequence {row_id}", one=True)
            if row is None:                  # listed but gone: a damaged index page
                raise JournalError(f"journal {self.path}: kept sequence {row_id} is missing "
                                   f"(damaged?)", path=self.path)
            length, blob, y, stored_checksum, answer = row
            if not (isinstance(blob, bytes) and isinstance(stored_checksum, bytes)
                    and isinstance(length, int) and isinstance(y, float)
                    and (answer is None or isinstance(answer, bytes) and len(answer) % 8 == 0)):
                raise JournalError(f"journal {self.path}: kept sequence {row_id} is malformed",
                                   path=self.path)
            x = np.frombuffer(blob, dtype=np.float64) if len(blob) % 8 == 0 else np.empty(0)
            blobs = (blob, np.float64(y).tobytes()) + (() if answer is None else (answer,))
            vector = None if answer is None else np.frombuffer(answer, dtype=np.float64).copy()
            if (stored_checksum != checksum(*blobs)
                    or length < 1 or x.size % length or not np.all(np.isfinite(x))
                    or not math.isfinite(y)
                    or vector is not None and not np.all(np.isfinite(vector))):
                raise JournalError(f"journal {self.path}: kept sequence {row_id} fails its "
                                   f"checks (checksum, shape or finite values)", path=self.path)
            out.append((row_id, x.reshape(length, -1), float(y) if vector is None else vector))
        return out

    # -- queries ------------------------------------------------------------
    def lookup(self, X: np.ndarray) -> tuple[list[tuple[bytes, int]], np.ndarray]:
        """Keys of the sequences of X (B, N, d) and their journal answers (NaN where unknown).

        Every call advances the occurrence counts: call it once per batch asked.
        """
        keys = []
        for digest in sequence_digests(X):
            keys.append((digest, self._seen[digest]))
            self._seen[digest] += 1
        found = [self._answers.get(key) for key in keys]
        shapes = {np.shape(y) for y in found if y is not None}
        if shapes - {()}:
            # vector answers: (B,) + the answer's shape, NaN rows where unknown (the
            # journal's answers to one batch share its length, so one shape)
            if len(shapes) > 1:
                raise JournalError(f"journal {self.path} holds answers of different shapes "
                                   f"({sorted(shapes)}) for one batch", path=self.path)
            known = np.full((len(keys),) + shapes.pop(), np.nan)
            for i, y in enumerate(found):
                if y is not None:
                    known[i] = y
            self.hits += sum(y is not None for y in found)
            return keys, known
        known = np.array([np.nan if y is None else y for y in found], dtype=np.float64)
        self.hits += int(np.count_nonzero(~np.isnan(known)))
        return keys, known

    def record(self, keys: list[tuple[bytes, int]], outputs: np.ndarray,
               X: np.ndarray | None = None) -> None:
        """Write validated answers of one batch and commit them (one transaction).

        ``X`` (B, N, d), the batch asked, gives one random sequence to keep for the resume
        check. On failure the answers go to a sidecar file and :class:`JournalError` says
        where."""
        outputs = np.ascontiguousarray(outputs, dtype=np.float64)
        self._batches_recorded += 1
        self._batch_count += 1
        sample = None
        rng = np.random.default_rng()
        # reservoir sampling: each recorded batch's sequence is kept with chance
        # MAX_KEPT / batches, in a random slot, so the kept set stays small and uniform
        slot = (self._batch_count - 1 if self._batch_count <= MAX_KEPT
                else int(rng.integers(self._batch_count)))
        if X is not None and len(X) and slot < MAX_KEPT and X[0].size <= MAX_KEPT_NUMBERS \
                and outputs[:1].size <= MAX_KEPT_NUMBERS:
            i = int(rng.integers(len(X)))
            sample = (slot + 1, np.ascontiguousarray(X[i], dtype=np.float64), outputs[i])
        try:
            self._insert(keys, outputs, sample)
        except (sqlite3.Error, OSError) as exc:
            raise self._write_failed(keys, outputs, exc) from exc
        for key, y in zip(keys, outputs):
            self._answers[key] = _entry(y)
        self.recorded += len(keys)

    def _insert(self, keys, outputs: np.ndarray, sample) -> None:
        outputs = np.ascontiguousarray(outputs, dtype=np.float64)
        blobs = (b"".join(d for d, _ in keys), np.array([k for _, k in keys], np.int64).tobytes(),
                 outputs.tobytes())
        # vector answers: the shape of one answer, inside the checksum (NULL for scalars,
        # whose rows are as they always were)
        shape = np.array(outputs.shape[1:], np.int64).tobytes() if outputs.ndim > 1 else None
        checked = blobs + (() if shape is None else (shape,))
        with self._connection:                       # one transaction, committed on leaving
            self._connection.execute("BEGIN")
            self._connection.execute("INSERT INTO batches (digests, occurrences, outputs, checksum, "
                             "shape) VALUES (?, ?, ?, ?, ?)", (*blobs, checksum(*checked), shape))
            if sample is not None:
                slot, x, y = sample
                blob, first = x.tobytes(), float(np.ravel(y)[0])
                answer = None if np.ndim(y) == 0 else np.ascontiguousarray(y, np.float64).tobytes()
                kept = (blob, np.float64(first).tobytes()) + (() if answer is None else (answer,))
                self._connection.execute("INSERT OR REPLACE INTO samples (id, length, sequence, output, "
                                 "checksum, answer) VALUES (?, ?, ?, ?, ?, ?)",
                                 (slot, len(x), blob, first, checksum(*kept), answer))

    def _write(self, sql: str, row: tuple, what: str) -> None:
        try:
            with self._connection:
                self._connection.execute(sql, row)
        except sqlite3.Error as exc:
            raise JournalError(f"cannot record {what} in journal {self.path}: {exc}",
                               path=self.path) from exc

    def _write_failed(self, keys, outputs: np.ndarray, exc: Exception) -> JournalError:
        """Save a batch the journal could not take; the JournalError that says where."""
        batch = self._batches_recorded
        arrays: dict[str, Any] = {"digests": np.frombuffer(b"".join(d for d, _ in keys), np.uint8)
                  .reshape(len(keys), DIGEST_BYTES),
                  "occurrences": np.array([k for _, k in keys], np.int64), "outputs": outputs}
        name = f"{os.path.basename(self.path)}.unsaved-{batch}.npz"
        sidecar, failures = None, []
        for folder in (os.path.dirname(os.path.abspath(self.path)), tempfile.gettempdir()):
            candidate = os.path.join(folder, name)
            try:
                with open(candidate, "wb") as f:
                    np.savez(f, **arrays)
                sidecar = candidate
                break
            except OSError as failure:
                failures.append(str(failure))
                try:
                    os.remove(candidate)
                except OSError:
                    pass
        if sidecar is None:
            self.unsaved.append({"batch": batch, **arrays})
            where = (f"they could not be saved to a sidecar file either ({failures[-1]}) and "
                     f"are kept in memory only")
        elif os.path.dirname(sidecar) == os.path.dirname(os.path.abspath(self.path)):
            where = f"they were saved to {sidecar} (imported when the journal is next opened)"
        else:
            where = (f"they were saved to {sidecar}; move it beside the journal to have them "
                     f"imported when it is next opened")
        return JournalError(
            f"cannot record batch {batch} ({len(keys)} answers) in journal {self.path}: "
            f"{type(exc).__name__}: {exc}; no answer is lost: {where}",
            path=self.path, batch=batch, sidecar=sidecar)

    def __len__(self) -> int:
        return len(self._answers)

    @property
    def _connection(self) -> sqlite3.Connection:
        """The journal's open database (JournalError after :meth:`close`)."""
        if self._db is None:
            raise JournalError(f"journal {self.path} is closed", path=self.path)
        return self._db

    def close(self) -> None:
        if self._db is not None:
            try:
                self._db.close()
            except sqlite3.Error:
                pass
            self._db = None
        if self._lock is not None:
            self._lock.close()        # releases the flock
            self._lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _answers_ragged(ask, sequences: list[np.ndarray]) -> list:
    """Answers to sequences of mixed lengths, one call of ``ask`` per length: a list of
    floats (one number per sequence) or of arrays (m,) or (N_i, m), in order."""
    lengths = np.array([len(s) for s in sequences])
    out: list = [None] * len(sequences)
    for n in np.unique(lengths):
        idx = np.flatnonzero(lengths == n)
        answers = np.asarray(ask(np.stack([sequences[i] for i in idx])), dtype=np.float64)
        for i, y in zip(idx, answers):
            out[i] = _entry(y)
    return out


def _entry(y):
    """One answer as the journal keeps it in memory: a float, or a copy of the array."""
    return float(y) if np.ndim(y) == 0 else np.array(y, dtype=np.float64)


def _kind_of(answers: list) -> tuple[str, int]:
    """What answers to the challenges show the box answers: ("scalar", 1), ("last", m)
    for vectors (m,), ("all", m) for arrays (N, m)."""
    first = np.shape(answers[0])
    if not first:
        return "scalar", 1
    return ("last" if len(first) == 1 else "all"), int(first[-1])


def _kind_checksum(kind: str, width: int) -> bytes:
    return checksum(kind.encode(), int(width).to_bytes(8, "little"))


def _kind_words(kind: tuple[str, int]) -> str:
    """("last", 4) -> "a vector of m = 4 numbers per sequence (the last position)"."""
    name, m = kind
    if name == "scalar":
        return "one number per sequence"
    return (f"a vector of m = {m} numbers per sequence (the last position)" if name == "last"
            else f"m = {m} numbers at every position of each sequence")
