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

import numpy as np

from ..errors import BlackBoxError, InputError, JournalError, JournalMismatchError

try:                       # POSIX only; elsewhere two runs sharing a journal are not stopped
    import fcntl
except ImportError:        # pragma: no cover
    fcntl = None

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
    """Every (digest, occurrence, output) in the journal file, opened read-only (checked)."""
    uri = "file:" + os.path.abspath(os.fspath(path)) + "?mode=ro"
    try:
        with sqlite3.connect(uri, uri=True) as db:
            rows = db.execute("SELECT id, digests, occurrences, outputs, checksum FROM batches "
                              "ORDER BY id").fetchall()
    except sqlite3.Error as exc:
        raise JournalError(f"cannot read journal {path}: {exc}", path=os.fspath(path)) from exc
    return [entry for row in rows for entry in _unpack(os.fspath(path), *row)]


def _unpack(path: str, row_id: int, digests: bytes, occurrences: bytes, outputs: bytes,
            stored_checksum: bytes):
    """The (digest, occurrence, output) entries of one batch row, checked."""
    where = f"journal {path}: row {row_id} of its batches"
    if not all(isinstance(b, bytes) for b in (digests, occurrences, outputs, stored_checksum)):
        raise JournalError(f"{where} is malformed (a field that should be bytes is not)",
                           path=path)
    if stored_checksum != checksum(digests, occurrences, outputs):
        raise JournalError(f"{where} fails its checksum (the file was changed or cut short); "
                           f"delete the journal or use another one", path=path)
    if len(occurrences) % 8 or len(outputs) % 8:
        raise JournalError(f"{where} has blobs of inconsistent lengths", path=path)
    occ = np.frombuffer(occurrences, dtype=np.int64)
    out = np.frombuffer(outputs, dtype=np.float64)
    if len(digests) != DIGEST_BYTES * len(occ) or len(out) != len(occ):
        raise JournalError(f"{where} has blobs of inconsistent lengths", path=path)
    if not np.all(np.isfinite(out)):
        raise JournalError(f"{where} holds a non-finite answer "
                           f"({out[~np.isfinite(out)][0]})", path=path)
    if np.any(occ < 0):
        raise JournalError(f"{where} holds a negative occurrence", path=path)
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
        self._db = None
        self._lock = None
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
            rows = self._db.execute("SELECT id, digests, occurrences, outputs, checksum "
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
                               f"wait for it or use another journal file", path=self.path)

    def _check_schema(self) -> None:
        columns = [row[1] for row in self._db.execute("PRAGMA table_info(batches)")]
        if columns and "checksum" not in columns:
            raise JournalError(f"journal {self.path} was written by an older attnextract "
                               f"(no checksums, no fingerprint of its black box) and cannot be "
                               f"trusted; delete it or use another one", path=self.path)

    def _import_sidecars(self) -> None:
        """Answers a failed write saved beside the journal are written into it now."""
        for sidecar in sorted(glob.glob(glob.escape(self.path) + ".unsaved-*.npz")):
            with np.load(sidecar, allow_pickle=False) as data:
                keys = [(bytes(d), int(k)) for d, k in zip(data["digests"], data["occurrences"])]
                outputs = np.asarray(data["outputs"], dtype=np.float64)
            if outputs.shape != (len(keys),) or not np.all(np.isfinite(outputs)):
                raise JournalError(f"sidecar {sidecar} of journal {self.path} is malformed",
                                   path=self.path)
            new = [i for i, key in enumerate(keys) if key not in self._answers]
            if new:
                self._insert([keys[i] for i in new], outputs[new], sample=None)
                for i in new:
                    self._answers[keys[i]] = float(outputs[i])
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
            with self._db:
                for table in ("fingerprint", "samples", *also):
                    self._db.execute(f"DELETE FROM {table}")
        except sqlite3.Error as exc:
            raise JournalError(f"cannot write to journal {self.path}: {exc}",
                               path=self.path) from exc

    def remember(self, **context) -> None:
        """Store context entries (JSON values) that are not stored yet."""
        if not context:
            return
        try:
            with self._db:
                self._db.executemany("INSERT OR IGNORE INTO context VALUES (?, ?)",
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
            live = _ask_ragged(ask, challenges)
        except BlackBoxError as exc:          # a box that refuses long sequences, say
            if getattr(exc, "first_batch", False):
                raise                         # already says what to fix (a wrong --dim)
            raise type(exc)(f"the black box failed on the run's first queries, the journal's "
                            f"{len(challenges)} challenge sequences (lengths 1-256): "
                            f"{exc}") from exc
        spent = len(challenges)
        scale = float(np.sqrt(np.mean(live ** 2)))
        if stored is None:
            outputs = live.tobytes()
            self._write("INSERT INTO fingerprint VALUES (?, ?, ?, ?)",
                        (FINGERPRINT_VERSION, int(dim), outputs, checksum(outputs)),
                        "the fingerprint of its black box")
            self.bound = True
            return spent
        stored_dim, stored_outputs = stored
        if stored_dim != dim:
            raise InputError(f"journal {self.path} was recorded with d = {stored_dim}, not {dim}")
        ok = answers_agree(stored_outputs, live, scale, tau, rho)
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            self._mismatch(f"challenge sequence {i} (length {len(challenges[i])})",
                           stored_outputs[i], live[i])
        sample = self._sample(RESUME_SAMPLE)
        if sample:
            again = _ask_ragged(ask, [x for _, x, _ in sample])
            spent += len(sample)
            ok = answers_agree(np.array([y for _, _, y in sample]), again, scale, tau, rho,
                               FLOAT_SLACK + SAMPLE_SLACK)
            if not ok.all():
                i = int(np.flatnonzero(~ok)[0])
                row, x, y = sample[i]
                self._mismatch(f"journaled query {row} (a sequence of length {len(x)})", y,
                               again[i])
        self.bound = True
        return spent

    def _mismatch(self, what: str, stored: float, live: float):
        stored, live = float(stored), float(live)
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
            cursor = self._db.execute(sql, row)
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
        if (stored_checksum != checksum(outputs) or values is None
                or values.shape != (CHALLENGES,) or not np.all(np.isfinite(values))):
            raise JournalError(f"journal {self.path}: its fingerprint fails its checksum or "
                               f"shape check; delete it or use another one", path=self.path)
        return int(dim), values

    def _sample(self, k: int) -> list[tuple[int, np.ndarray, float]]:
        """Up to k kept sequences, drawn afresh at random: [(row id, (N, d), answer)]."""
        ids = [row[0] for row in self._read("SELECT id FROM samples", (), "its kept sequences")]
        if not ids:
            return []
        rng = np.random.default_rng()                    # fresh: not predictable
        chosen = rng.choice(ids, size=min(k, len(ids)), replace=False)
        out = []
        for row_id in sorted(int(i) for i in chosen):
            row = self._read(
                "SELECT length, sequence, output, checksum FROM samples WHERE id = ?",
                (row_id,), f"kept sequence {row_id}", one=True)
            if row is None:                  # listed but gone: a damaged index page
                raise JournalError(f"journal {self.path}: kept sequence {row_id} is missing "
                                   f"(damaged?)", path=self.path)
            length, blob, y, stored_checksum = row
            if not (isinstance(blob, bytes) and isinstance(stored_checksum, bytes)
                    and isinstance(length, int) and isinstance(y, float)):
                raise JournalError(f"journal {self.path}: kept sequence {row_id} is malformed",
                                   path=self.path)
            x = np.frombuffer(blob, dtype=np.float64) if len(blob) % 8 == 0 else np.empty(0)
            if (stored_checksum != checksum(blob, np.float64(y).tobytes())
                    or length < 1 or x.size % length or not np.all(np.isfinite(x))
                    or not math.isfinite(y)):
                raise JournalError(f"journal {self.path}: kept sequence {row_id} fails its "
                                   f"checks (checksum, shape or finite values)", path=self.path)
            out.append((row_id, x.reshape(length, -1), float(y)))
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
        known = np.array([self._answers.get(key, np.nan) for key in keys])
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
        if X is not None and len(X) and slot < MAX_KEPT and X[0].size <= MAX_KEPT_NUMBERS:
            i = int(rng.integers(len(X)))
            sample = (slot + 1, np.ascontiguousarray(X[i], dtype=np.float64), float(outputs[i]))
        try:
            self._insert(keys, outputs, sample)
        except (sqlite3.Error, OSError) as exc:
            raise self._write_failed(keys, outputs, exc) from exc
        for key, y in zip(keys, outputs.tolist()):
            self._answers[key] = y
        self.recorded += len(keys)

    def _insert(self, keys, outputs: np.ndarray, sample) -> None:
        blobs = (b"".join(d for d, _ in keys), np.array([k for _, k in keys], np.int64).tobytes(),
                 np.ascontiguousarray(outputs, dtype=np.float64).tobytes())
        with self._db:                       # one transaction, committed on leaving
            self._db.execute("BEGIN")
            self._db.execute("INSERT INTO batches (digests, occurrences, outputs, checksum) "
                             "VALUES (?, ?, ?, ?)", (*blobs, checksum(*blobs)))
            if sample is not None:
                slot, x, y = sample
                blob = x.tobytes()
                self._db.execute("INSERT OR REPLACE INTO samples (id, length, sequence, output, "
                                 "checksum) VALUES (?, ?, ?, ?, ?)",
                                 (slot, len(x), blob, y, checksum(blob, np.float64(y).tobytes())))

    def _write(self, sql: str, row: tuple, what: str) -> None:
        try:
            with self._db:
                self._db.execute(sql, row)
        except sqlite3.Error as exc:
            raise JournalError(f"cannot record {what} in journal {self.path}: {exc}",
                               path=self.path) from exc

    def _write_failed(self, keys, outputs: np.ndarray, exc: Exception) -> JournalError:
        """Save a batch the journal could not take; the JournalError that says where."""
        batch = self._batches_recorded
        arrays = {"digests": np.frombuffer(b"".join(d for d, _ in keys), np.uint8)
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


def _ask_ragged(ask, sequences: list[np.ndarray]) -> np.ndarray:
    """Answers to sequences of mixed lengths, one call of ``ask`` per length."""
    lengths = np.array([len(s) for s in sequences])
    out = np.empty(len(sequences))
    for n in np.unique(lengths):
        idx = np.flatnonzero(lengths == n)
        out[idx] = ask(np.stack([sequences[i] for i in idx]))
    return out
