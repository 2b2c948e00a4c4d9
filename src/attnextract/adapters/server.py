"""Serve a model as an HTTP black box: ``attnextract serve --secret FILE.npz --port P``.

The black box a remote API would be: it answers one number per sequence (or, for a
vector model, the output vectors) and nothing else, charges what it serves exactly once, enforces its own query budget,
keeps its books (``--state FILE.sqlite``: a restart, a crash or ``kill -9`` loses
nothing) and survives any request a client can send. docs/serving.md is the user's
guide; in short:

Protocol (HTTP/1.0 and 1.1, keep-alive):

- ``POST /query`` with a batch (B, N, d) of B >= 1 sequences of N >= 1 tokens of
  width d, as JSON ``{"sequences": [[[x_11, ..., x_1d], ...], ...]}`` (the default),
  one npy array of float64 (``Content-Type: application/x-npy``) or raw little-endian
  float64 (``Content-Type: application/octet-stream`` with ``X-Shape: B,N,d``). The
  answer is ``200 {"outputs": [f_1, ..., f_B], "remaining": R, "charged": B,
  "replayed": false}`` or, with ``Accept: application/x-npy``, one npy array (B,) of
  float64. Floats cross the wire exactly (shortest round-trip decimals, or raw bytes).
- ``Idempotency-Key: K`` (1-128 visible ASCII characters, one per request, reused on
  its retries): K is charged once; a repeat of K with the same numbers is answered
  from the ledger (``replayed: true``, not charged), with other numbers it is a 422.
  Answers are kept up to ``cache_bytes`` of outputs (least recently used dropped).
- Every answer carries ``X-Charged``, ``X-Replayed`` (0/1), ``X-Served`` and
  ``X-Remaining``. ``GET /health`` -> ``{"ok", "kind", "dim", "served", "charged",
  "replayed", "budget", "remaining", "binary", "state"}``.
- Access control (:class:`BlackBoxServer`): with ``tokens`` a query needs
  ``Authorization: Bearer TOKEN`` (else 401, nothing charged) and ``/health`` without
  one says only ``{"ok": true, "auth": "bearer"}``; one address holds at most
  ``max_client_connections`` connections and ``max_client_rate`` requests a second.
  ``Expect: 100-continue`` is answered once the body has room. A refusal is followed
  by a bounded drain of what the client still sends (:meth:`BlackBoxServer._linger`).
- Refusals: ``{"error": reason}`` with 400 (malformed; a bare LF at once; two
  Idempotency-Keys), 401, 404, 405,
  408 (headers over ``header_timeout``; a body that pauses over ``idle_timeout`` or
  falls below ``min_body_rate``), 411, 413, 415, 422, 429 (the budget cannot cover the
  whole batch), 417, 431, 500 (the model failed: not charged, its text only in the log),
  503 (too many connections; no room for a body within ``slot_timeout``), 505 (an HTTP
  version other than 1.0 and 1.1).

Charging (:class:`ServerState`, :class:`Ledger`): a batch is checked against the
budget with the batches in flight, evaluated, then charged in one SQLite transaction
with its answer, and only if its client is still connected (a client that has gone is
not charged).

Hardening (one asyncio event loop reads every connection; the model runs on a small
thread pool): at most ``max_connections`` connections, each buffering at most
CONNECTION_BUFFER bytes before its body is admitted; Content-Length checked before a
byte of the body is read; a body admitted only once its cost
(:meth:`BlackBoxServer.body_cost`) fits in ``body_memory`` (:class:`ByteBudget`, first
come first served); bodies parsed as they arrive into float64 arrays, refused the
moment they pass a limit (``max_floats`` numbers, not bytes); npy headers parsed with
``numpy.lib.format`` (no pickles). Peak memory: :func:`peak_rss_bound`.

Vector models (a saved :class:`~attnextract.models.VectorAttention`, or any model that
declares ``output_kind`` "last" or "all" and ``out_dim``) answer (B, m) or (B, N, m):
nested JSON lists or one npy array of that shape. ``/health`` then adds ``outputs``,
``out_dim`` and ``causal``. A model that declares nothing has its kind fixed by its
first answer; an answer of another shape later is a 500 (not charged). Every byte
bound counts the m (last position) or N m (every position) numbers of each answer.

``--round DIGITS`` rounds every output to that many decimals, as APIs that print
their answers do (the extraction then meets a noisy black box).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import io
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import sqlite3
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import InputError
from ..oracle import OUTPUT_KINDS, answer_kind
from .journal import challenge_sequences
from .journal import checksum as journal_checksum
from .reaper import alive, start_time

LOG = logging.getLogger("attnextract.server")

MAX_BODY_BYTES = 64 << 20        # Content-Length accepted (JSON text, npy or raw)
MAX_SEQUENCES = 100_000          # sequences per request
MAX_FLOATS = 1 << 20             # B * N * d per request: 8 MiB of float64
MAX_LENGTH = 4096                # tokens per sequence
MAX_CONNECTIONS = 2048
BACKLOG = 128
HEADER_TIMEOUT = 5.0             # seconds for a request line and headers, from the first byte
KEEPALIVE_TIMEOUT = 15.0         # seconds an idle keep-alive connection is kept
IDLE_TIMEOUT = 2.0               # seconds a body may pause, and its grace before MIN_BODY_RATE
MIN_BODY_RATE = 256 << 10        # bytes/s a body must average after its grace (else 408)
WRITE_TIMEOUT = 30.0             # seconds a client may take to read an answer
SLOT_TIMEOUT = 10.0              # seconds a body may wait for memory (else 503, unread)
SHUTDOWN_GRACE = 5.0             # seconds the requests being answered get at shutdown
LINGER_TIMEOUT = 2.0             # seconds a refused request's unread body is drained
LINGER_BYTES = MAX_BODY_BYTES    # most bytes drained (discarded) after a refusal
CLIENT_SHARE = 8                 # one address may hold 1/CLIENT_SHARE of the connections
MIN_TOKEN_LENGTH = 16            # characters of a bearer token (guessing must not pay)
MAX_HEADER_BYTES = 16 << 10
BODY_MEMORY = 96 << 20           # bytes all bodies being answered may hold (body_cost)
CACHE_BYTES = 32 << 20           # bytes of answers kept for their Idempotency-Keys
WORKERS = 4                      # threads evaluating the model
READ_SIZE = 64 << 10             # bytes the server reads from a socket at once
CONNECTION_BUFFER = 2 * MAX_HEADER_BYTES + READ_SIZE   # most a connection's stream buffers
ANSWER_BYTES = 100               # bytes an answer takes per sequence while it is encoded
                                 # (JSON: 94.5 measured with tracemalloc at B = 100 000)
                                 # and per number of a vector answer (77-81 at 320 000)
LIST_BYTES = 200                 # and per innermost list of a vector answer's JSON (its
                                 # object, pointers and brackets: 65-175 measured)
CONNECTION_COST = CONNECTION_BUFFER + (16 << 10)   # a connection's buffers and objects
RSS_SLACK = 16 << 20             # allocator slack, SQLite's page cache, the model's temporaries
READ_CHUNK = 1 << 16             # pieces of a body given to the parser at once (parse())
JSON_SLICE = 1 << 14             # JSON text parsed between two turns of the event loop (~1 ms)
JSON = "application/json"
NPY = "application/x-npy"
RAW = "application/octet-stream"
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           408: "Request Timeout", 411: "Length Required", 413: "Content Too Large",
           401: "Unauthorized", 415: "Unsupported Media Type", 417: "Expectation Failed",
           422: "Unprocessable Content",
           429: "Too Many Requests", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 503: "Service Unavailable",
           505: "HTTP Version Not Supported"}
KEY_PATTERN = re.compile(r"[\x21-\x7e]{1,128}\Z")


class RequestError(Exception):
    """A refused request: an HTTP status and the reason sent back."""

    def __init__(self, status: int, reason: str, **extra):
        super().__init__(reason)
        self.status, self.reason, self.extra = status, reason, extra


# -- incremental body parsers -------------------------------------------------------

_NUM = rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_TOKEN = re.compile(rb"\s*(?:(\[\s*" + _NUM + rb"(?:\s*,\s*" + _NUM + rb")*\s*\])|(\[)|(\])|(,))")
_PREFIX = re.compile(rb'\s*\{\s*"sequences"\s*:\s*')
_SUFFIX = re.compile(rb"\s*\}\s*\Z")
_DEEP = re.compile(rb"\[\s*\[\s*\[\s*\[")
_NOT_OBJECT = 'body must be a JSON object {"sequences": [[[...]]]} with that one key'
_SHAPE = "sequences must form an array (B, N, {d}) of numbers with N >= 1"


def _diagnose(fragment: bytes, d: int) -> RequestError:
    """The reason a piece of JSON that is not a token of numbers was refused."""
    text = fragment[:200]
    if re.search(rb"NaN|Infinity", text):
        return RequestError(400, "sequences contain NaN or Infinity (not numbers in JSON)")
    if re.match(rb"\s*\[\s*\[", text):
        return RequestError(400, _SHAPE.format(d=d) + ": nested too deeply")
    if re.search(rb'true|false|null|"|\{', text):
        return RequestError(400, "tokens must hold numbers only, not strings, booleans, "
                                 "null or objects (non-numbers)")
    if re.match(rb"\s*\[\s*\]", text):
        return RequestError(400, _SHAPE.format(d=d) + ": an empty token")
    return RequestError(400, f"body is not valid JSON of numbers near {text[:40]!r}")


class JsonBatchParser:
    """``{"sequences": [[[...]]]}`` parsed as it arrives into float64, within limits.

    Each innermost list (a token) is matched whole by one regular expression and its
    numbers converted by ``float`` (correctly rounded); only the unfinished tail of
    the last chunk is kept as text. Shape, raggedness and limits are checked token
    by token, so a body is refused as soon as it goes wrong.
    """

    def __init__(self, dim: int, max_floats: int, max_sequences: int, max_length: int):
        self.dim, self.max_floats = dim, max_floats
        self.max_sequences, self.max_length = max_sequences, max_length
        self.tail = b""
        self.stage = "prefix"
        self.depth = 0
        self.expect_item = True      # after "[" or ",": an element (or "]" after "[")
        self.after_open = False
        self.sequences = 0           # sequences finished
        self.tokens = 0              # tokens of the current sequence
        self.length: int | None = None   # N, from the first sequence
        self.numbers = 0
        self.parts: list[np.ndarray] = []
        self.max_tail = 64 * 1024 + 32 * dim

    def feed(self, chunk: bytes) -> None:
        data = self.tail + chunk
        pos = 0
        if self.stage == "prefix":
            match = _PREFIX.match(data)
            if match is None:
                if len(data) < 64 and data.lstrip()[:1] in (b"", b"{"):
                    self.tail = data         # the key may still be arriving
                    return
                raise RequestError(400, _NOT_OBJECT)
            pos = match.end()
            self.stage = "body"
        if self.stage == "body":
            pos = self._tokens(data, pos)
        self.tail = data[pos:]
        if self.stage == "body" and len(self.tail) > self.max_tail:
            if _DEEP.match(self.tail.lstrip()):
                raise RequestError(400, _SHAPE.format(d=self.dim) + ": nested too deeply")
            raise RequestError(413, f"a token longer than {self.max_tail} bytes of JSON")
        if self.stage == "suffix" and len(self.tail) > 1024:
            raise RequestError(400, "body is not valid JSON: text after the sequences")

    def _tokens(self, data: bytes, pos: int) -> int:
        end = data.rfind(b"]") + 1        # every complete token ends at or before the last "]"
        if end <= pos:
            return pos
        values: list[bytes] = []
        d = self.dim
        while pos < end:
            match = _TOKEN.match(data, pos, end)
            if match is None:
                raise _diagnose(data[pos:end], d)
            token, opened, closed, comma = match.groups()
            if comma:
                if self.expect_item:
                    raise RequestError(400, "body is not valid JSON: misplaced comma")
                self.expect_item, self.after_open = True, False
            elif closed:
                if self.expect_item and not self.after_open:
                    raise RequestError(400, "body is not valid JSON: comma before ]")
                self._close()
                if self.depth == 0:
                    pos = match.end()
                    self.stage = "suffix"
                    break
            elif not self.expect_item:
                raise RequestError(400, "body is not valid JSON: missing comma")
            elif opened:
                if self.depth >= 2:
                    raise _diagnose(data[match.start(2):end], d)
                self.depth += 1
                self.expect_item, self.after_open = True, True
            else:
                if self.depth != 2:
                    raise RequestError(400, _SHAPE.format(d=d) + (
                        ": a token outside a sequence" if self.depth == 1
                        else ": not a list of sequences"))
                width = token.count(b",") + 1
                if width != d:
                    if self.tokens or self.sequences:
                        raise RequestError(400, "sequences are ragged: every token must have "
                                                "the same width")
                    raise RequestError(422, f"tokens must have width {d}, got {width}")
                self.tokens += 1
                if self.tokens > self.max_length:
                    raise RequestError(413, f"sequences of more than {self.max_length} tokens;"
                                            f" at most {self.max_length}")
                self.numbers += d
                if self.numbers > self.max_floats:
                    raise RequestError(413, f"more than {self.max_floats} numbers in one "
                                            f"request; at most {self.max_floats}")
                values.append(token[1:-1])
                self.expect_item, self.after_open = False, False
            pos = match.end()
        if values:
            joined = b",".join(values).split(b",")
            self.parts.append(np.fromiter(map(float, joined), dtype=np.float64,
                                          count=len(joined)))
        return pos

    def _close(self) -> None:
        if self.depth == 2:
            if self.tokens == 0:
                raise RequestError(400, _SHAPE.format(d=self.dim) + ": got an empty sequence")
            if self.length is None:
                self.length = self.tokens
            elif self.tokens != self.length:
                raise RequestError(400, "sequences are ragged: every sequence of a request "
                                        "must have the same length")
            self.sequences += 1
            self.tokens = 0
            if self.sequences > self.max_sequences:
                raise RequestError(413, f"more than {self.max_sequences} sequences in one "
                                        f"request; at most {self.max_sequences}")
        elif self.depth == 1 and self.sequences == 0:
            raise RequestError(400, '"sequences" must be a non-empty list of sequences')
        elif self.depth == 0:
            raise RequestError(400, "body is not valid JSON: unbalanced ]")
        self.depth -= 1
        self.expect_item, self.after_open = False, False

    def finish(self) -> np.ndarray:
        if self.stage == "prefix":
            raise RequestError(400, _NOT_OBJECT)
        if self.stage == "body":
            if self.depth == 0 and not self.parts:
                raise RequestError(400, '"sequences" must be a non-empty list of sequences '
                                        '(B, N, d)')
            raise _diagnose(self.tail, self.dim) if re.search(rb"NaN|Infinity|true|false|null|\"",
                                                               self.tail[:200]) \
                else RequestError(400, "body is not valid JSON: it ends inside the sequences")
        if not _SUFFIX.match(self.tail):
            raise RequestError(400, _NOT_OBJECT)
        assert self.length is not None           # the parts are non-empty sequences
        X = np.concatenate(self.parts).reshape(self.sequences, self.length, self.dim)
        if not np.isfinite(X).all():
            raise RequestError(400, "sequences contain NaN or infinity (numbers beyond "
                                    "float64)")
        return X


LITTLE_F8 = np.dtype("<f8")      # the wire's float64 (little-endian)


class NpyBatchParser:
    """One npy array (B, N, d) of float64, its header checked before any data is read."""

    def __init__(self, dim: int, length: int, max_floats: int, max_sequences: int,
                 max_length: int):
        self.dim, self.content_length = dim, length
        self.max_floats, self.max_sequences, self.max_length = (max_floats, max_sequences,
                                                                max_length)
        self.head = b""
        self.data: np.ndarray | None = None   # preallocated once the header is known
        self.filled = 0

    kind = "npy"

    def feed(self, chunk: bytes) -> None:
        if self.data is None:
            self.head += chunk
            chunk = self._header()
            if self.data is None:
                return
        # an ndarray exports the buffer protocol (numpy's stubs do not say so)
        view = memoryview(self.data.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        n = min(len(chunk), len(view) - self.filled)
        view[self.filled:self.filled + n] = chunk[:n]
        self.filled += n

    def _header(self) -> bytes:
        head = self.head
        if len(head) < 10:
            return b""
        if head[:6] != b"\x93NUMPY":
            raise RequestError(400, "body is not an npy array (bad magic)")
        major = head[6]
        size_bytes = 2 if major == 1 else 4 if major in (2, 3) else None
        if size_bytes is None:
            raise RequestError(400, f"npy format version {major} is not supported")
        if len(head) < 8 + size_bytes:
            return b""
        header_len = int.from_bytes(head[8:8 + size_bytes], "little")
        start = 8 + size_bytes
        if header_len > 4096:
            raise RequestError(400, f"npy header of {header_len} bytes; at most 4096")
        if len(head) < start + header_len:
            return b""
        stream = io.BytesIO(head[:start + header_len])
        stream.seek(8)
        try:
            reader = (np.lib.format.read_array_header_1_0 if major == 1
                      else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = reader(stream, max_header_size=4096)
        except Exception as exc:     # numpy's header parser raises several kinds
            raise RequestError(400, f"bad npy header: {type(exc).__name__}: {exc}") from None
        if dtype.kind != "f" or dtype.itemsize != 8 or dtype.hasobject:
            raise RequestError(415, f"npy arrays must hold float64, got {dtype.str}")
        self._allocate(shape, fortran, start + header_len, dtype)
        rest, self.head = head[start + header_len:], b""
        return rest

    def _allocate(self, shape, fortran: bool, header_bytes: int, dtype=LITTLE_F8) -> None:
        """Check a batch's shape against the limits and the Content-Length; allocate it."""
        if len(shape) != 3 or shape[0] < 1 or shape[1] < 1:
            raise RequestError(400, _SHAPE.format(d=self.dim) + f"; got shape {list(shape)}")
        B, N, d = shape
        if d != self.dim:
            raise RequestError(422, f"tokens must have width {self.dim}, got {d}")
        if B > self.max_sequences:
            raise RequestError(413, f"{B} sequences in one request; at most "
                                    f"{self.max_sequences}")
        if N > self.max_length:
            raise RequestError(413, f"sequences of {N} tokens; at most {self.max_length}")
        if B * N * d > self.max_floats:
            raise RequestError(413, f"{B * N * d} numbers in one request; at most "
                                    f"{self.max_floats}")
        if header_bytes + 8 * B * N * d != self.content_length:
            raise RequestError(400, f"Content-Length {self.content_length} is not the "
                                    f"{self.kind} size {header_bytes + 8 * B * N * d}")
        self.shape, self.fortran = shape, fortran
        self.data = np.empty(B * N * d, dtype=dtype)

    def finish(self) -> np.ndarray:
        if self.data is None or self.filled != self.data.nbytes:
            raise RequestError(400, "npy body ended early")
        X = self.data.reshape(self.shape, order="F" if self.fortran else "C")
        X = np.ascontiguousarray(X, dtype=np.float64)
        if not np.isfinite(X).all():
            raise RequestError(400, "sequences contain NaN or infinity")
        return X


class RawBatchParser(NpyBatchParser):
    """Raw little-endian float64 numbers, C order, of the shape in ``X-Shape: B,N,d``."""

    kind = "raw float64"

    def __init__(self, dim: int, length: int, max_floats: int, max_sequences: int,
                 max_length: int, shape: str | None):
        super().__init__(dim, length, max_floats, max_sequences, max_length)
        if shape is None:
            raise RequestError(400, f"{RAW} needs the header X-Shape: B,N,d")
        if not re.fullmatch(r"\s*[0-9]{1,9}\s*,\s*[0-9]{1,9}\s*,\s*[0-9]{1,9}\s*", shape):
            raise RequestError(400, f"bad X-Shape {shape[:40]!r}: send B,N,d")
        self._allocate(tuple(int(n) for n in shape.split(",")), False, 0)


def npy_bytes(array: np.ndarray) -> bytes:
    stream = io.BytesIO()
    np.lib.format.write_array(stream, np.ascontiguousarray(array, dtype="<f8"),
                              allow_pickle=False)
    return stream.getvalue()


# -- the ledger: budget, charges and recent answers ----------------------------------------

LEDGER_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    name TEXT PRIMARY KEY,       -- the header (version, dim, fingerprint), budget, counters
    value,
    checksum BLOB NOT NULL       -- of name and value (ledger_checksum)
);
CREATE TABLE IF NOT EXISTS answers (
    key TEXT PRIMARY KEY,        -- the Idempotency-Key
    digest BLOB NOT NULL,        -- SHA-256 of the batch's shape and numbers
    outputs BLOB NOT NULL,       -- float64 answers, as sent (rounded if --round)
    used INTEGER NOT NULL,       -- LRU clock: the newest use is the largest
    checksum BLOB NOT NULL       -- of key, digest, outputs and used
);
CREATE INDEX IF NOT EXISTS answers_used ON answers (used);
"""
LEDGER_VERSION = 2               # 2: checksums on every row, an application id, open marks
LEDGER_APPLICATION_ID = 0x6178_6C67   # "axlg" in the SQLite header (offset 68)
COUNTERS = ("served", "replayed", "abandoned", "cache_bytes", "clock")
HEADER = ("version", "dim", "fingerprint", "budget")
OPEN_MARK = "open:"              # meta rows of the servers using the ledger now


class LedgerError(InputError):
    """A ledger file that cannot be trusted (damaged, cut short, foreign, its WAL lost):
    refused at start, never reset (exit 2)."""


def _value_bytes(value) -> bytes:
    """A meta value's bytes for its checksum, its type included (1 and "1" differ)."""
    if value is None:
        return b"n"
    if isinstance(value, bytes):
        return b"b" + value
    if isinstance(value, int):
        return b"i" + str(value).encode()
    if isinstance(value, float):
        return b"f" + repr(value).encode()
    return b"s" + str(value).encode()


def ledger_checksum(*parts) -> bytes:
    """The checksum of a ledger row (the journal's: SHA-256 of length-prefixed parts)."""
    return journal_checksum(*(_value_bytes(p) for p in parts))


def check_ledger_file(path: str, *, new: bool = False) -> bool:
    """Whether ``path`` is to be created; raises LedgerError unless it is a whole ledger
    of this server's, read from its raw header before SQLite opens (and writes) it.

    A missing file is created; an empty one only with ``new`` (``--state-new``); a
    file that is not SQLite, another SQLite file (a client's query journal, say) or a
    ledger cut short is refused, and ``new`` never overwrites a file that has bytes."""
    where = f"--state {path}"
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return True
    except OSError as exc:
        raise LedgerError(f"{where}: cannot read it: {exc}") from None
    if size == 0:
        if new:
            return True
        raise LedgerError(f"{where} is an empty file, not a ledger: its budget and charges "
                          f"are not there (was it emptied?); to start a new ledger in it, "
                          f"add --state-new")
    if new:
        raise LedgerError(f"{where} already exists ({size} bytes): --state-new creates a "
                          f"new ledger and never overwrites a file; drop --state-new to use "
                          f"it, or give another file")
    with open(path, "rb") as f:
        header = f.read(100)
    if len(header) < 100 or not header.startswith(b"SQLite format 3\x00"):
        raise LedgerError(f"{where} is not a ledger (not an SQLite file)")
    page = int.from_bytes(header[16:18], "big")
    page = 65536 if page == 1 else page
    if page < 512 or page & (page - 1):
        raise LedgerError(f"{where} is damaged: its header gives pages of {page} bytes")
    # with a -wal beside it another server may be checkpointing into the file now (its
    # size and page count in flux): SQLite's integrity check judges it then
    if not os.path.exists(path + "-wal"):
        if size % page:
            raise LedgerError(f"{where} was cut short or damaged: {size} bytes is not a "
                              f"whole number of {page}-byte pages")
        pages = int.from_bytes(header[28:32], "big")
        if header[24:28] == header[92:96] and pages * page > size:   # the count is valid
            raise LedgerError(f"{where} was cut short: its header counts {pages} pages of "
                              f"{page} bytes, the file holds {size // page}")
    application = int.from_bytes(header[68:72], "big")
    if application != LEDGER_APPLICATION_ID:
        raise LedgerError(f"{where} is not an attnextract ledger ({_foreign(path)}); "
                          f"give the server a file of its own")
    return False


def _foreign(path: str) -> str:
    """What a foreign SQLite file holds, read without writing to it."""
    try:
        # immutable: no lock, no -wal or -shm created beside someone else's file
        uri = "file:" + os.path.abspath(path) + "?mode=ro&immutable=1"
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
            tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE "
                                                "type = 'table' ORDER BY name").fetchall()]
    except sqlite3.Error:
        return "an SQLite file it cannot read"
    if {"batches", "fingerprint"} <= set(tables):
        return "a client's query journal: tables " + ", ".join(tables)
    if "meta" in tables and "answers" in tables:
        return "a ledger of an older attnextract, without checksums"
    return "tables " + (", ".join(tables[:8]) or "none")


def _process_mark(pid: int) -> str:
    """``PID@HOST@START``: a process, told apart from a later one with its pid by its start
    time (Linux; empty elsewhere)."""
    start = start_time(pid)
    return f"{pid}@{socket.gethostname()}@{'' if start is None else start}"


def _mark_gone(mark: str) -> bool:
    """Whether the process of an open mark (``_process_mark``) is gone; marks of other
    hosts are not judged (False)."""
    pid, _, rest = mark.partition("@")
    host, _, start = rest.partition("@")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    if not alive(int(pid)):
        return True
    now = start_time(int(pid))
    return bool(start) and now is not None and str(now) != start   # the pid was reused


class Ledger:
    """What the server has charged, in SQLite: a file (``serve --state``) or memory.

    One connection, used under the server's lock, every change one transaction
    (``BEGIN IMMEDIATE``): the charge of a batch, its counters and its answer (for its
    Idempotency-Key) are committed together or not at all. The file is in WAL mode
    with ``synchronous=NORMAL``: a committed charge survives the death of the process
    (SIGKILL included; its pages are in the operating system's hands before the commit
    returns), a power cut may lose the last transactions. Several server processes on
    one machine may share a file (SQLite's own locks; the budget is checked inside the
    charging transaction).

    Answers are kept for their keys up to ``cache_bytes`` bytes of outputs (least
    recently used dropped first); counters and the budget are kept for ever.

    The file is bound to its model: it stores the model's token width and its answers
    to fixed challenge sequences, and refuses (InputError) to serve another model.

    **Integrity.** Every row (the header: version, d, the model's fingerprint; the
    budget and counters; every kept answer) carries a checksum, and the file an
    application id. At start the file is checked (:func:`check_ledger_file`, SQLite's
    ``integrity_check``, every row's checksum) and a damaged, cut-short, empty or
    foreign file is refused with :class:`LedgerError` naming the row and the reason,
    never reset; a row read later that fails its checksum refuses the request (500).
    Each server marks the ledger open (a row, checkpointed into the file) and unmarks
    it when it closes: a mark of a process that is gone, with no ``-wal`` file beside
    the ledger, is a crash whose write-ahead log was lost, and is refused too.
    """

    def __init__(self, path=None, *, cache_bytes: int, budget=None, dim: int,
                 fingerprint: bytes | None = None, new: bool = False):
        self.path = None if path is None else str(path)
        self.cache_bytes = int(cache_bytes)
        self.mark = None
        self.recovered: list[str] = []     # open marks of crashed servers, cleared
        creating = True if self.path is None else check_ledger_file(self.path, new=new)
        wal_present = self.path is not None and os.path.exists(self.path + "-wal")
        try:
            self.db = sqlite3.connect(self.path or ":memory:", isolation_level=None,
                                      check_same_thread=False, timeout=30.0)
        except sqlite3.Error as exc:
            raise LedgerError(f"--state {self.path}: cannot open it: {exc}") from None
        try:
            if self.path is not None:
                mode = self.db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if mode.lower() != "wal":
                    raise InputError(f"--state {self.path}: SQLite cannot use WAL there "
                                     f"(journal mode {mode})")
                self.db.execute("PRAGMA synchronous=NORMAL")
            if creating:
                self.db.execute(f"PRAGMA application_id = {LEDGER_APPLICATION_ID}")
                self.db.executescript(LEDGER_SCHEMA)
            else:
                self._verify(wal_present)
            with self._transaction():
                self._bind(dim, fingerprint, budget)
                if self.path is not None:
                    self.mark = f"{OPEN_MARK}{uuid.uuid4().hex}"
                    self._set(self.mark, _process_mark(os.getpid()))
            if self.path is not None:     # the mark (and a new header) into the file itself
                self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.DatabaseError as exc:
            self.db.close()
            raise LedgerError(f"--state {self.path}: not a usable ledger (damaged?): "
                              f"{exc}") from None
        except BaseException:
            self.db.close()
            raise

    def _verify(self, wal_present: bool) -> None:
        """Refuse a ledger whose pages, rows or open marks are not what was written."""
        where = f"--state {self.path}"
        problems = [r[0] for r in self.db.execute("PRAGMA integrity_check(5)").fetchall()]
        if problems != ["ok"]:
            first = " ".join(str(problems[0]).split())[:200]     # one line
            raise LedgerError(f"{where} is damaged (SQLite integrity check): {first}")
        tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master")}
        if not {"meta", "answers"} <= tables:
            raise LedgerError(f"{where} is not a ledger: tables {sorted(tables)}")
        rows = self.db.execute("SELECT rowid, name, value, checksum FROM meta").fetchall()
        names = set()
        for rowid, name, value, stored in rows:
            if stored != ledger_checksum(name, value):
                raise LedgerError(f"{where} is damaged: header row {rowid} "
                                  f"({str(name)[:40]!r}) fails its checksum; refused, "
                                  f"not reset: restore the file from a copy")
            names.add(name)
        missing = [n for n in (*HEADER, *COUNTERS) if n not in names]
        if missing:
            raise LedgerError(f"{where} is damaged: its header has no {missing[0]!r} row")
        for rowid, key, digest, outputs, used, stored in self.db.execute(
                "SELECT rowid, key, digest, outputs, used, checksum FROM answers"):
            if stored != ledger_checksum(key, digest, outputs, used):
                raise LedgerError(f"{where} is damaged: kept answer row {rowid} fails its "
                                  f"checksum; refused, not reset: restore the file from a "
                                  f"copy")
        version = self._get("version")
        if version != LEDGER_VERSION:
            raise LedgerError(f"{where}: ledger version {version}, this server reads "
                              f"{LEDGER_VERSION}")
        dead = []
        for name in names:
            if str(name).startswith(OPEN_MARK) and _mark_gone(str(self._get(name))):
                dead.append((name, str(self._get(name)).split("@")[0]))
        if dead and not wal_present:
            assert self.path is not None         # an in-memory ledger has no log to miss
            raise LedgerError(
                f"{where}: the server that used it last (pid {dead[0][1]}) stopped without "
                f"closing it, and its write-ahead log {self.path}-wal is missing: the "
                f"charges it committed since its last checkpoint are lost, so the counts "
                f"in the file may be too low. Put {os.path.basename(self.path)}-wal back "
                f"beside it, or start a new ledger (another file, --state-new)")
        if dead:                         # SQLite replayed the log: the marks are stale
            with self._transaction():
                for name, owner in dead:
                    self.db.execute("DELETE FROM meta WHERE name = ?", (name,))
                    self.recovered.append(owner)
            LOG.warning("--state %s: recovered after an unclean stop of %s", self.path,
                        ", ".join(o for _, o in dead))

    # -- plumbing ----------------------------------------------------------------------
    def _transaction(self):
        ledger = self

        class _Tx:
            def __enter__(self):
                ledger.db.execute("BEGIN IMMEDIATE")

            def __exit__(self, kind, exc, tb):
                ledger.db.execute("COMMIT" if kind is None else "ROLLBACK")
                return False
        return _Tx()

    def _get(self, name, default=None):
        row = self.db.execute("SELECT value, checksum FROM meta WHERE name = ?",
                              (name,)).fetchone()
        if row is None:
            return default
        if row[1] != ledger_checksum(name, row[0]):
            LOG.error("--state %s: header row %r fails its checksum", self.path, name)
            raise RequestError(500, "internal error: the server's ledger is damaged; "
                                    "not charged")
        return row[0]

    def _set(self, name, value) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta (name, value, checksum) VALUES (?, ?, ?)",
                        (name, value, ledger_checksum(name, value)))

    def _add(self, name, amount: int) -> None:
        self._set(name, self._get(name) + amount)

    def _bind(self, dim: int, fingerprint, budget) -> None:
        version = self._get("version")
        if version is None:                              # a new ledger
            self._set("version", LEDGER_VERSION)
            self._set("dim", int(dim))
            self._set("fingerprint", fingerprint)
            self._set("budget", budget)
            for name in COUNTERS:
                self._set(name, 0)
            return
        where = f"--state {self.path}"
        if version != LEDGER_VERSION:
            raise InputError(f"{where}: ledger version {version}, this server writes "
                             f"{LEDGER_VERSION}")
        if self._get("dim") != dim:
            raise InputError(f"{where} was kept for tokens of width {self._get('dim')}, "
                             f"not {dim}: it belongs to another model")
        if fingerprint is not None and self._get("fingerprint") not in (None, fingerprint):
            raise InputError(f"{where} was kept for another model (its answers to the "
                             f"challenge sequences differ): use a new --state file")
        if budget is not None:                            # a new --budget replaces the old
            self._set("budget", budget)

    # -- reading -----------------------------------------------------------------------
    def counters(self) -> dict:
        rows = {name: self._get(name) for name in ("budget", "served", "replayed",
                                                   "abandoned", "cache_bytes")}
        rows["cached_keys"] = self.db.execute("SELECT count(*) FROM answers").fetchone()[0]
        return rows

    @property
    def budget(self):
        return self._get("budget")

    @property
    def served(self) -> int:
        return self._get("served", 0)

    # -- writing (each one transaction) --------------------------------------------------
    def _kept(self, key: str):
        """(digest, outputs) kept for ``key``, checked against its checksum, or None."""
        row = self.db.execute("SELECT digest, outputs, used, checksum FROM answers WHERE "
                              "key = ?", (key,)).fetchone()
        if row is None:
            return None
        digest, blob, used, stored = row
        if stored != ledger_checksum(key, digest, blob, used) or len(blob) % 8:
            LOG.error("--state %s: the answer kept for a key fails its checksum", self.path)
            raise RequestError(500, "internal error: the server's ledger is damaged; not "
                                    "charged")
        return digest, blob

    def _keep(self, key: str, digest: bytes, blob: bytes) -> None:
        """Keep (or touch) the answer of ``key`` with the next clock value."""
        clock = self._get("clock") + 1
        self._set("clock", clock)
        self.db.execute("INSERT OR REPLACE INTO answers (key, digest, outputs, used, checksum) "
                        "VALUES (?, ?, ?, ?, ?)",
                        (key, digest, blob, clock, ledger_checksum(key, digest, blob, clock)))

    def replay(self, key: str, digest: bytes, shape: tuple | None = None):
        """The answer kept for ``key`` (counted as replayed, reshaped to ``shape`` when
        given), or None if not kept."""
        with self._transaction():
            row = self._kept(key)
            if row is None:
                return None
            if row[0] != digest:
                raise RequestError(422, "Idempotency-Key reused with a different batch")
            # vector answers: the batch's shape (the digest checked it is the same batch)
            outputs = np.frombuffer(row[1], dtype="<f8").copy().reshape(shape or -1)
            self._keep(key, row[0], row[1])
            self._add("replayed", len(outputs))
        return outputs

    def charge(self, outputs: np.ndarray, key: str | None, digest: bytes):
        """Charge a computed batch and keep its answer: ("charged" or "replayed", outputs).

        Inside one transaction: a key another process has answered meanwhile is a
        replay; a batch the budget cannot cover is a 429; else the sequences are
        charged and the answer kept for the key (older answers dropped past
        ``cache_bytes``)."""
        n = len(outputs)
        blob = np.ascontiguousarray(outputs, dtype="<f8").tobytes()
        with self._transaction():
            if key is not None:
                row = self._kept(key)
                if row is not None:
                    if row[0] != digest:
                        raise RequestError(422, "Idempotency-Key reused with a different "
                                                "batch")
                    self._add("replayed", n)
                    return "replayed", np.frombuffer(row[1], dtype="<f8").copy().reshape(
                        outputs.shape)
            budget, served = self._get("budget"), self._get("served")
            if budget is not None and served + n > budget:
                raise RequestError(429, f"budget exhausted: {n} sequences asked, "
                                        f"{max(0, budget - served)} of {budget} remain",
                                   remaining=max(0, budget - served))
            self._add("served", n)
            if key is not None and len(blob) <= self.cache_bytes:
                self._keep(key, digest, blob)
                self._add("cache_bytes", len(blob))
                self._evict()
        return "charged", outputs

    def _evict(self) -> None:
        excess = self._get("cache_bytes") - self.cache_bytes
        while excess > 0:
            key, size = self.db.execute("SELECT key, length(outputs) FROM answers "
                                        "ORDER BY used LIMIT 1").fetchone()
            self.db.execute("DELETE FROM answers WHERE key = ?", (key,))
            self._add("cache_bytes", -size)
            excess -= size

    def count(self, name: str, amount: int = 1) -> None:
        """Add to a counter (sequences abandoned by their clients)."""
        with self._transaction():
            self._add(name, amount)

    def close(self) -> None:
        """Unmark the ledger open (a clean stop), then close it: SQLite checkpoints the
        log into the file and removes it when the last server closes."""
        try:
            if self.mark is not None:
                with self._transaction():
                    self.db.execute("DELETE FROM meta WHERE name = ?", (self.mark,))
                self.mark = None
        except sqlite3.Error as exc:     # a full disk, say: the next start says so
            LOG.error("--state %s: could not mark the ledger closed: %s", self.path, exc)
        finally:
            self.db.close()


def model_fingerprint(model, dim: int) -> bytes:
    """The model's float64 answers to the journal's challenge sequences (its identity for a
    ledger): a ledger kept for one model is never used to answer for another."""
    # every number of each answer (one for a scalar model: the bytes ledgers always had)
    outputs = np.concatenate([np.asarray(model(X[None]), dtype=np.float64).reshape(-1)
                              for X in challenge_sequences(dim)])
    # rounded to 12 significant digits: a float32 model batched differently still agrees
    return np.array([float(f"{o:.12g}") for o in outputs]).tobytes()


def declared_answers(model) -> tuple[str | None, int | None, bool | None]:
    """(outputs, m, causal) a served model declares (``output_kind``, ``out_dim``,
    ``causal``); (None, None, None) when it declares nothing (fixed by its first answer)."""
    kind, m = getattr(model, "output_kind", None), getattr(model, "out_dim", None)
    if kind == "scalar":
        return "scalar", 1, None
    if kind in OUTPUT_KINDS and isinstance(m, (int, np.integer)) and m >= 1:
        causal = getattr(model, "causal", None)
        return kind, int(m), bool(causal) if isinstance(causal, (bool, np.bool_)) else None
    return None, None, None


class ClientGone(Exception):
    """The client closed its connection before its answer was charged."""


# -- the model, its budget and its ledger ------------------------------------------------

class ServerState:
    """The model behind the endpoint, its limits, and its :class:`Ledger` (thread-safe).

    ``state`` is the ledger file (None: kept in memory for the life of the process).
    """

    def __init__(self, model, *, budget: int | None = None, round_digits: int | None = None,
                 max_body: int = MAX_BODY_BYTES, max_sequences: int = MAX_SEQUENCES,
                 max_floats: int = MAX_FLOATS, max_length: int = MAX_LENGTH,
                 cache_bytes: int = CACHE_BYTES, state=None, state_new: bool = False):
        if budget is not None and budget < 0:
            raise InputError(f"budget must be >= 0, got {budget}")
        if cache_bytes < 0:
            raise InputError(f"cache_bytes must be >= 0, got {cache_bytes}")
        self.model = model
        self.dim = int(model.dim)
        self.round_digits = round_digits
        self.max_body, self.max_sequences = max_body, max_sequences
        self.max_floats, self.max_length = max_floats, max_length
        self.lock = threading.Lock()
        # what the model answers: declared, or fixed by its first answer
        self.outputs, self.out_dim, self.causal = declared_answers(model)
        fingerprint = None if state is None else model_fingerprint(model, self.dim)
        self.ledger = Ledger(state, cache_bytes=cache_bytes, budget=budget, dim=self.dim,
                             fingerprint=fingerprint, new=state_new)
        self.reserved = 0            # sequences being evaluated (checked against the budget)
        self.refused = 0             # requests refused, since the process started
        self.inflight: dict[str, threading.Event] = {}

    # counters, read from the ledger (the numbers /health shows)
    @property
    def budget(self):
        with self.lock:
            return self.ledger.budget

    @property
    def served(self) -> int:
        with self.lock:
            return self.ledger.served

    @property
    def replayed(self) -> int:
        return self.health()["replayed"]

    @property
    def remaining(self) -> int | None:
        with self.lock:
            budget = self.ledger.budget
            return None if budget is None else max(0, budget - self.ledger.served)

    def refuse(self) -> None:
        """Count a refused request (in memory: garbage traffic never writes the ledger)."""
        with self.lock:
            self.refused += 1

    def abandon(self, sequences: int) -> None:
        """Count sequences whose client left before they were evaluated (in the ledger)."""
        with self.lock:
            self.ledger.count("abandoned", sequences)

    def parser(self, content_type: str, length: int, shape: str | None = None):
        if content_type == NPY:
            return NpyBatchParser(self.dim, length, self.max_floats, self.max_sequences,
                                  self.max_length)
        if content_type == RAW:
            return RawBatchParser(self.dim, length, self.max_floats, self.max_sequences,
                                  self.max_length, shape)
        return JsonBatchParser(self.dim, self.max_floats, self.max_sequences, self.max_length)

    def parse(self, body: bytes, content_type: str = "application/json",
              shape: str | None = None) -> np.ndarray:
        """The batch (B, N, d) of a whole request body (the server feeds it in chunks)."""
        parser = self.parser(content_type, len(body), shape)
        for i in range(0, len(body), READ_CHUNK):
            parser.feed(body[i:i + READ_CHUNK])
        return parser.finish()

    def answer(self, X: np.ndarray, key: str | None = None, gone=None) -> dict:
        """Outputs of a parsed batch, charged once per key (all or nothing).

        The model is evaluated first and the batch charged after, in one ledger
        transaction, only if the client is still there (``gone()`` is False): a batch
        the model failed on, or whose client left, is never charged. Concurrent
        batches are checked against the budget together before evaluation.

        Returns ``{"outputs", "remaining", "charged", "replayed"}``."""
        digest = hashlib.sha256(repr(X.shape).encode() + X.tobytes()).digest()
        n = len(X)
        for _ in range(3):           # a repeat of a key in flight waits for its answer
            with self.lock:
                if key is not None:
                    kept = self.ledger.replay(key, digest, self.answer_shape(X))
                    if kept is not None:
                        return self._answer(kept, True)
                waiting = self.inflight.get(key) if key is not None else None
                if waiting is None:
                    budget, served = self.ledger.budget, self.ledger.served
                    if budget is not None and served + self.reserved + n > budget:
                        left = max(0, budget - served - self.reserved)
                        raise RequestError(429, f"budget exhausted: {n} sequences asked, "
                                                f"{left} of {budget} remain", remaining=left)
                    self.reserved += n
                    if key is not None:
                        self.inflight[key] = threading.Event()
                    break
            waiting.wait(WRITE_TIMEOUT)
        else:
            raise RequestError(503, "the same Idempotency-Key is still being answered")
        reserved = n                 # released in the same lock section as the charge: in
        try:                         # between, others would see the batch counted twice
            try:
                out = self._evaluate(X)
            except RequestError:
                raise
            except Exception as exc:
                # the reason stays in the server's log: a model's exception text may tell
                # a client more than the outputs would (paths, shapes, weights)
                LOG.error("the model failed on a batch of shape %s: %s: %s", X.shape,
                          type(exc).__name__, exc)
                raise RequestError(500, "internal error: the model failed on this batch; "
                                        "not charged") from exc
            if not np.isfinite(out).all():
                raise RequestError(500, "the model answered NaN or infinity; not charged")
            if self.round_digits is not None:
                out = np.round(out, self.round_digits)
            with self.lock:
                self.reserved -= reserved
                reserved = 0
                if gone is not None and gone():
                    self.ledger.count("abandoned", n)
                    raise ClientGone()
                how, out = self.ledger.charge(out, key, digest)
                return self._answer(out, how == "replayed")
        finally:
            with self.lock:
                self.reserved -= reserved
                if key is not None:
                    self.inflight.pop(key).set()

    def answer_shape(self, X: np.ndarray) -> tuple | None:
        """The shape of the answer to the batch X: (B,), (B, m) or (B, N, m); None while
        the kind is not known (no answer yet from a model that declares nothing)."""
        if self.outputs is None:
            return None
        B, N = X.shape[:2]
        return {"scalar": (B,), "last": (B, self.out_dim),
                "all": (B, N, self.out_dim)}[self.outputs]

    def answer_numbers(self, sequences: int, tokens: int) -> int:
        """Numbers in the answer to ``sequences`` sequences of ``tokens`` tokens in all: one
        per sequence, m per sequence (last position) or m per token (every position)."""
        if self.outputs == "last":
            assert self.out_dim is not None      # fixed with the outputs
            return sequences * self.out_dim
        if self.outputs == "all":
            assert self.out_dim is not None
            return tokens * self.out_dim
        return sequences

    def answer_bytes(self, sequences: int, tokens: int) -> int:
        """Bytes the answer to ``sequences`` sequences of ``tokens`` tokens may take while it
        is encoded: ANSWER_BYTES per number, and LIST_BYTES per list of a vector answer
        (one per sequence at the last position; one per token and one per sequence at
        every position)."""
        lists = {"last": sequences, "all": tokens + sequences}.get(self.outputs or "", 0)
        return self.answer_numbers(sequences, tokens) * ANSWER_BYTES + lists * LIST_BYTES

    def _evaluate(self, X: np.ndarray) -> np.ndarray:
        """The model's answer to X, float64 of :meth:`answer_shape` (a scalar model's B
        numbers may come in any shape, as always); a vector answer of another shape than
        the model's earlier ones is a 500, not charged."""
        n = len(X)
        out = np.asarray(self.model(X), dtype=np.float64)
        if self.outputs in (None, "scalar") and out.size == n and out.ndim <= 2:
            if self.outputs is None and out.ndim == 1:
                self.outputs, self.out_dim = "scalar", 1
            if self.outputs == "scalar" or out.ndim == 1:
                return out.reshape(n)
        found = answer_kind(out.shape, n, X.shape[1])
        if found is not None and self.outputs is None:
            with self.lock:
                self.outputs, self.out_dim = found
        if found is None or found != (self.outputs, self.out_dim):
            LOG.error("the model answered shape %s to a batch of shape %s; expected %s",
                      out.shape, X.shape, self.answer_shape(X))
            raise RequestError(500, "internal error: the model answered an array of another "
                                    "shape than before; not charged")
        return out.reshape(self.answer_shape(X))

    def _answer(self, outputs, replayed: bool) -> dict:
        budget = self.ledger.budget
        return {"outputs": outputs,
                "remaining": None if budget is None else max(0, budget - self.ledger.served),
                "charged": len(outputs), "replayed": replayed, "served": self.ledger.served}

    def health(self) -> dict:
        with self.lock:
            c = self.ledger.counters()
        budget, served = c["budget"], c["served"]
        return {"ok": True, "kind": getattr(self.model, "kind", "custom"), "dim": self.dim,
                "served": served, "charged": served, "replayed": c["replayed"],
                "budget": budget, "remaining": None if budget is None else max(0, budget - served),
                "binary": True, "state": self.ledger.path is not None,
                "max_length": min(self.max_length, self.max_floats // self.dim),
                "max_numbers": self.max_floats, **self._declaration()}

    def _declaration(self) -> dict:
        """/health's declaration of vector answers (nothing for one number per sequence)."""
        if self.outputs not in ("last", "all"):
            return {}
        return {"outputs": self.outputs, "out_dim": self.out_dim, "causal": self.causal}

    def close(self) -> None:
        with self.lock:
            self.ledger.close()


# -- access control: tokens and per-client limits -----------------------------------

def read_tokens(path) -> list[bytes]:
    """The bearer tokens of a ``--token-file``: one a line (several let a token be
    rotated), blank lines and ``#`` comments ignored.

    Raises
    ------
    InputError
        The file cannot be read, holds no token, or a token is shorter than
        MIN_TOKEN_LENGTH or not visible ASCII (the token itself is never shown).
    """
    try:
        with open(path, encoding="ascii") as f:
            lines = f.read(1 << 20).splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--token-file {path}: cannot read it ({type(exc).__name__})") from None
    tokens = []
    for number, line in enumerate(lines, 1):
        token = line.strip()
        if not token or token.startswith("#"):
            continue
        if len(token) < MIN_TOKEN_LENGTH or not all(33 <= ord(c) <= 126 for c in token):
            raise InputError(f"--token-file {path}, line {number}: a token must be at least "
                             f"{MIN_TOKEN_LENGTH} visible ASCII characters without spaces "
                             f"(e.g. python3 -c 'import secrets; "
                             f"print(secrets.token_urlsafe(32))')")
        tokens.append(token.encode())
    if not tokens:
        raise InputError(f"--token-file {path} holds no token")
    return tokens


def token_matches(header: str | None, tokens: list[bytes]) -> bool:
    """Whether an ``Authorization`` header carries one of ``tokens`` (``Bearer TOKEN``).

    Every token is compared with :func:`hmac.compare_digest`, all of them every time,
    so the time taken says nothing about how much of a token was right."""
    if header is None:
        return False
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    given_bytes = given.strip().encode("latin-1")
    found = False
    for token in tokens:
        found |= hmac.compare_digest(given_bytes, token)
    return found


def exposure_warning(host: str, tokens) -> str | None:
    """The warning for a server bound beyond loopback without tokens, or None."""
    if tokens:
        return None
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:                  # a name: loopback only if it is localhost
        loopback = host == "localhost"
    if loopback:
        return None
    return (f"serving on {host or 'every address'} without --token-file: anyone who can "
            f"reach this port can query the model, spend its budget and read /health")


class ClientLimits:
    """Per-address limits: connections held at once and requests a second.

    Used from the server's one event loop only (no lock). A token bucket per address
    (``rate`` requests a second, bursts of ``burst``); buckets of addresses with no
    connection left are dropped once full, so the table stays small."""

    def __init__(self, max_connections: int | None, rate: float | None = None,
                 burst: float | None = None):
        self.max_connections = max_connections
        self.rate = rate if rate else None
        self.burst = float(burst if burst else (2 * rate if rate else 0))
        self.open: dict[str, int] = {}
        self.buckets: dict[str, tuple[float, float]] = {}   # address -> (tokens, time)
        self.refused_connections = 0
        self.refused_requests = 0

    def connect(self, address: str) -> bool:
        """Count a new connection of ``address``; False (not counted) past its cap."""
        held = self.open.get(address, 0)
        if self.max_connections is not None and held >= self.max_connections:
            self.refused_connections += 1
            return False
        self.open[address] = held + 1
        return True

    def disconnect(self, address: str) -> None:
        held = self.open.get(address, 0) - 1
        if held > 0:
            self.open[address] = held
            return
        self.open.pop(address, None)
        # forget the full buckets of addresses that have gone: the table stays small
        if self.rate is not None and len(self.buckets) > 4096:
            now = time.monotonic()
            for other, (tokens, then) in list(self.buckets.items()):
                if other not in self.open and tokens + (now - then) * self.rate >= self.burst:
                    del self.buckets[other]

    def allow_request(self, address: str) -> bool:
        """Take one request from ``address``'s bucket; False if it is empty."""
        if self.rate is None:
            return True
        now = time.monotonic()
        tokens, then = self.buckets.get(address, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if tokens < 1:
            self.buckets[address] = (tokens, now)
            self.refused_requests += 1
            return False
        self.buckets[address] = (tokens - 1, now)
        return True


# -- the server ------------------------------------------------------------------------

class ByteBudget:
    """Bytes that request bodies may hold at once, granted first come, first served.

    ``acquire`` waits (at most ``timeout`` seconds) until the bytes fit; a grant never
    exceeds the limit, so one request larger than the limit is served alone.
    """

    def __init__(self, limit: int):
        self.limit, self.used, self.peak = int(limit), 0, 0
        self.waiters: deque = deque()

    async def acquire(self, n: int, timeout: float) -> "Reservation":
        n = min(n, self.limit)
        if not self.waiters and self.used + n <= self.limit:
            self._grant(n)
            return Reservation(self, n)
        future = asyncio.get_running_loop().create_future()
        entry = (n, future)
        self.waiters.append(entry)
        try:
            async with asyncio.timeout(timeout):
                await future
        except BaseException:                 # timed out or cancelled: never hold a grant
            if future.done() and not future.cancelled():
                self.release(n)
            else:
                future.cancel()
                try:
                    self.waiters.remove(entry)
                except ValueError:
                    pass
            raise
        return Reservation(self, n)

    def _grant(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    def release(self, n: int) -> None:
        self.used -= n
        while self.waiters and self.used + self.waiters[0][0] <= self.limit:
            n, future = self.waiters.popleft()
            if not future.done():
                self._grant(n)
                future.set_result(None)


class Reservation:
    """Bytes held from a :class:`ByteBudget`; ``shrink`` gives back all but ``n``."""

    def __init__(self, budget: ByteBudget, n: int):
        self.budget, self.n = budget, n

    def shrink(self, n: int) -> None:
        if n < self.n:
            self.budget.release(self.n - n)
            self.n = n

    def release(self) -> None:
        self.shrink(0)


class BlackBoxServer:
    """An asyncio HTTP/1.1 server holding a :class:`ServerState`.

    ``serve_forever()`` runs it (in a thread for tests), ``shutdown()`` stops it from
    another thread, ``server_close()`` releases the socket, the model's threads and the
    ledger.

    Access control: ``tokens`` (bearer tokens, bytes) make every ``/query`` without one
    a 401 that charges nothing, and ``/health`` say only ``{"ok": true, "auth":
    "bearer"}``; one address holds at most ``max_client_connections`` connections
    (default ``max_connections // CLIENT_SHARE``) and sends at most
    ``max_client_rate`` requests a second (default: no limit), else a 503.
    """

    def __init__(self, address, state: ServerState, *, verbose: bool = False,
                 max_connections: int = MAX_CONNECTIONS, backlog: int = BACKLOG,
                 header_timeout: float = HEADER_TIMEOUT, idle_timeout: float = IDLE_TIMEOUT,
                 workers: int = WORKERS, keepalive_timeout: float = KEEPALIVE_TIMEOUT,
                 body_memory: int = BODY_MEMORY, slot_timeout: float = SLOT_TIMEOUT,
                 min_body_rate: float = MIN_BODY_RATE, tokens: list[bytes] | None = None,
                 max_client_connections: int | None = None,
                 max_client_rate: float | None = None):
        if body_memory < 1 or slot_timeout <= 0 or min_body_rate <= 0 or idle_timeout <= 0:
            raise InputError("body_memory >= 1, slot_timeout > 0, min_body_rate > 0 and "
                             "idle_timeout > 0 are required")
        self.state, self.verbose = state, verbose
        self.max_connections, self.backlog = max_connections, backlog
        self.header_timeout, self.idle_timeout = header_timeout, idle_timeout
        self.keepalive_timeout = keepalive_timeout
        self.body_memory, self.slot_timeout = body_memory, slot_timeout
        self.min_body_rate = min_body_rate
        self.tokens = list(tokens or [])
        if max_client_connections is None:
            max_client_connections = max(1, max_connections // CLIENT_SHARE)
        if max_client_connections < 1 or (max_client_rate is not None and max_client_rate < 0):
            raise InputError("max_client_connections >= 1 and max_client_rate >= 0 are "
                             "required")
        self.clients = ClientLimits(max_client_connections, max_client_rate)
        self.socket = socket.create_server(address, backlog=backlog)
        self.server_address = self.socket.getsockname()
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="attnextract-model")
        self.connections = 0         # open now
        self.peak_connections = 0
        self.rejected_connections = 0
        self.slot_timeouts = 0       # bodies refused 503: no memory for them in time
        self.slow_bodies = 0         # bodies cut 408: slower than min_body_rate
        self.bodies: ByteBudget | None = None     # made inside the loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stopping = False
        self._stopped = threading.Event()
        self._stop_requested = threading.Event()
        self._tasks: set = set()
        self._busy: set = set()      # tasks answering a request (the others are idle)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def serve_forever(self, poll_interval=None, *, handle_signals: bool = False) -> None:
        """Serve until ``shutdown()`` (or SIGINT/SIGTERM with ``handle_signals``, from the
        main thread): stop accepting, finish the requests being answered (at most
        SHUTDOWN_GRACE seconds), close every connection."""
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._main(handle_signals))
        finally:
            self._loop.close()
            self._stopped.set()

    def shutdown(self) -> None:
        self._stop_requested.set()       # seen by a loop that has not started yet
        def stop() -> None:
            if self._stop is not None:
                self._stop.set()

        if self._loop is not None and not self._stopped.is_set():
            try:
                self._loop.call_soon_threadsafe(stop)
            except RuntimeError:     # the loop closed meanwhile
                pass
            self._stopped.wait(30)

    def server_close(self) -> None:
        self.socket.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.state.close()

    async def _main(self, handle_signals: bool) -> None:
        self._stop = asyncio.Event()
        if self._stop_requested.is_set():        # shut down before it started
            return
        self.bodies = ByteBudget(self.body_memory)
        loop = asyncio.get_running_loop()
        if handle_signals:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, self._stop.set)
        server = await asyncio.start_server(self._connection, sock=self.socket,
                                            limit=MAX_HEADER_BYTES, backlog=self.backlog)
        try:
            async with server:
                await self._stop.wait()
                self._stopping = True
                server.close()                   # no new connections
                for task in list(self._tasks - self._busy):
                    task.cancel()                # idle keep-alive connections: hang up
                busy = list(self._busy)
                if busy:                         # the requests being answered finish
                    await asyncio.wait(busy, timeout=SHUTDOWN_GRACE)
                for task in list(self._tasks):
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            if handle_signals:
                for signum in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(signum)

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        # the transport reads at most READ_SIZE bytes at a time, and pauses once the
        # stream holds 2 x MAX_HEADER_BYTES: a connection buffers at most
        # CONNECTION_BUFFER bytes that no body reservation counts
        # read by asyncio's selector transports (no public setter)
        writer.transport.max_size = READ_SIZE  # type: ignore[attr-defined]
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if peer else "?"
        try:
            if self.connections >= self.max_connections:
                self.rejected_connections += 1
                await self._refuse_connection(reader, writer, "too many connections; retry "
                                                              "later")
                return
            if not self.clients.connect(address):
                self.rejected_connections += 1
                await self._refuse_connection(
                    reader, writer, f"too many connections from {address} (at most "
                                    f"{self.clients.max_connections} per address); retry later")
                return
            self.connections += 1
            self.peak_connections = max(self.peak_connections, self.connections)
            try:
                while not self._stopping and await self._request(reader, writer, address):
                    pass
            finally:
                self.connections -= 1
                self.clients.disconnect(address)
        except (ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError,
                asyncio.CancelledError):
            pass
        finally:
            self._tasks.discard(task)
            self._busy.discard(task)
            writer.close()

    async def _refuse_connection(self, reader, writer, reason: str) -> None:
        """A 503 to a connection over a cap, then a short linger: a client that already
        sent its request reads the refusal, not a reset."""
        await self._send(writer, 503, {"error": reason}, close=True,
                         extra={"Retry-After": 1})
        await self._linger(reader, writer, LINGER_TIMEOUT / 4)

    async def _linger(self, reader, writer, timeout: float = LINGER_TIMEOUT) -> None:
        """After a refusal: close our side, then read and discard what the client still
        sends (at most LINGER_BYTES, ``timeout`` seconds). Closing with its body unread
        would make the kernel answer with a reset, which can reach the client before
        the refusal does (it then sees ECONNRESET, not the reason)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        left = LINGER_BYTES
        try:
            if writer.can_write_eof():
                writer.write_eof()
            while left > 0 and loop.time() < end:
                async with asyncio.timeout(end - loop.time()):
                    chunk = await reader.read(min(READ_SIZE, left))
                if not chunk:
                    return
                left -= len(chunk)
        except (TimeoutError, ConnectionError, OSError, RuntimeError):
            pass

    async def _request(self, reader, writer, address: str = "?") -> bool:
        """Read and answer one request; False when the connection must close."""
        task = asyncio.current_task()
        try:                                         # an idle keep-alive connection may wait
            async with asyncio.timeout(self.keepalive_timeout):   # (a timer, not a task)
                first = await reader.read(1)
        except asyncio.TimeoutError:
            return False                             # idle: hang up without a word
        if not first:
            return False
        self._busy.add(task)
        method = "?"
        try:
            try:                                     # from its first byte, a request has
                async with asyncio.timeout(self.header_timeout):  # header_timeout for its head
                    head = await self._read_head(reader, first)
            except asyncio.TimeoutError:
                raise RequestError(408, "request headers not received within "
                                        f"{self.header_timeout} s") from None
            except asyncio.IncompleteReadError:
                return False
            method, path, version, headers = _parse_head(head)
            if not self.clients.allow_request(address):
                raise RequestError(503, f"too many requests from {address} (at most "
                                        f"{self.clients.rate:g} a second); retry later")
            keep_alive = (version == "HTTP/1.1" and not self._stopping
                          and "close" not in headers.get("connection", [""])[0].lower())
            return await self._route(reader, writer, method, path, headers, keep_alive,
                                     version)
        except ClientGone:
            return False
        except RequestError as exc:
            self.state.refuse()
            await self._send(writer, exc.status, {"error": exc.reason, **exc.extra},
                             close=True, head_only=method == "HEAD",
                             allow=exc.extra.get("allow"), extra=_refusal_headers(exc.status))
            await self._linger(reader, writer)
            return False
        finally:
            self._busy.discard(task)

    async def _read_head(self, reader, first: bytes) -> bytes:
        """The request line and headers, each line ending in CRLF (a bare LF is a 400 at
        once), at most MAX_HEADER_BYTES in all (else 431)."""
        head: list[bytes] = []
        size = 0
        line = first
        while True:
            if not line.endswith(b"\n"):
                try:
                    line += await reader.readuntil(b"\n")
                except asyncio.LimitOverrunError:
                    raise RequestError(431, f"request headers over {MAX_HEADER_BYTES} "
                                            f"bytes") from None
            size += len(line)
            if size > MAX_HEADER_BYTES:
                raise RequestError(431, f"request headers over {MAX_HEADER_BYTES} bytes")
            if not line.endswith(b"\r\n") or b"\r" in line[:-2]:
                raise RequestError(400, "request lines must end in CRLF (a bare LF or CR "
                                        f"in {line[:60]!r})")
            if line == b"\r\n":
                return b"".join(head)
            head.append(line)
            line = b""

    def _gone(self, reader, writer):
        """A test, safe from another thread, of whether the client has closed its side."""
        transport = writer.transport
        return lambda: reader._eof or transport.is_closing()

    def body_cost(self, length: int, content_type: str) -> int:
        """Bytes of memory a body of ``length`` bytes may take while it is answered: its
        numbers twice (parsed, then assembled), its answer, and its read buffer."""
        state = self.state
        per_number = 8 if content_type in (NPY, RAW) else 2    # JSON: "0," is a number
        numbers = min(length // per_number + 1, state.max_floats)
        sequences = min(numbers // state.dim + 1, state.max_sequences)
        # the answer: one number per sequence, or m per sequence, or m per token
        answer = state.answer_bytes(sequences, numbers // state.dim + 1)
        return 16 * numbers + answer + min(length, CONNECTION_BUFFER)

    async def _route(self, reader, writer, method, path, headers, keep_alive,
                     version="HTTP/1.1") -> bool:
        state = self.state
        has_body = "content-length" in headers or "transfer-encoding" in headers
        if path not in ("/query", "/health"):
            raise RequestError(404, f"no such endpoint {path}; use POST /query or GET /health")
        wanted = "POST" if path == "/query" else "GET"
        if method != wanted:
            raise RequestError(405, f"{path} takes {wanted}, not {method}", allow=wanted)
        authorized = self._authorized(headers)
        if path == "/health":
            # without a token: alive, and that a token is needed; nothing about the budget
            health = state.health() if authorized else {"ok": True, "auth": "bearer"}
            await self._send(writer, 200, health, close=not keep_alive or has_body)
            if has_body:
                await self._linger(reader, writer)
            return keep_alive and not has_body
        if not authorized:                      # before a byte of the body: nothing charged
            raise RequestError(401, "a bearer token is required: send Authorization: "
                                    "Bearer TOKEN (attnextract: --http-token-file)")
        continue_first = _expects_continue(headers, version)
        content_type = headers.get("content-type", ["application/json"])[0].split(";")[0]
        content_type = content_type.strip().lower()
        if content_type not in (JSON, NPY, RAW):
            raise RequestError(415, f"Content-Type {content_type!r}: send {JSON}, {NPY} or "
                                    f"{RAW} (with X-Shape: B,N,d)")
        binary_answer = NPY in headers.get("accept", [""])[0].lower()
        keys = headers.get("idempotency-key", [])
        if len(keys) > 1:                        # which one would be charged? neither
            raise RequestError(400, f"{len(keys)} Idempotency-Key headers; send one")
        key = keys[0] if keys else None
        if key is not None and not KEY_PATTERN.match(key):
            raise RequestError(400, "Idempotency-Key must be 1-128 visible ASCII characters")
        length = _content_length(headers, state.max_body)
        parser = state.parser(content_type, length, headers.get("x-shape", [None])[0])
        # the body is read only once its memory is reserved: until then it waits unread
        # in the client's socket, for at most slot_timeout
        assert self.bodies is not None           # made when the loop started (_main)
        try:
            held = await self.bodies.acquire(self.body_cost(length, content_type),
                                             self.slot_timeout)
        except asyncio.TimeoutError:
            self.slot_timeouts += 1
            raise RequestError(503, f"server busy: no room for a body of {length} bytes "
                                    f"within {self.slot_timeout} s; retry") from None
        try:
            if continue_first:                  # admitted: now the client may send it
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                async with asyncio.timeout(WRITE_TIMEOUT):
                    await writer.drain()
            await self._read_body(reader, parser, length)
            X = parser.finish()
            del parser                                  # its pieces: X holds the numbers
            gone = self._gone(reader, writer)
            if gone():                                  # nobody to answer: no work
                self.state.abandon(len(X))
                raise ClientGone()
            loop = asyncio.get_running_loop()
            try:
                answer = await loop.run_in_executor(self.executor, state.answer, X, key, gone)
            except RequestError as exc:
                state.refuse()
                await self._send(writer, exc.status, {"error": exc.reason, **exc.extra},
                                 close=not keep_alive)
                return keep_alive
            del X
            out = answer.pop("outputs")
            extra = {"X-Charged": answer["charged"], "X-Replayed": int(answer["replayed"]),
                     "X-Served": answer.pop("served"), "X-Remaining": answer["remaining"]}
            if binary_answer:
                data, ctype = npy_bytes(out), NPY
            else:
                data, ctype = json.dumps({"outputs": out.tolist(), **answer}).encode(), JSON
            held.shrink(len(data))                      # only the answer is left to hold
            await self._send_bytes(writer, 200, data, ctype, extra, close=not keep_alive)
            return keep_alive
        finally:
            held.release()

    def _authorized(self, headers: dict) -> bool:
        """True without tokens; else whether the one Authorization header holds one."""
        if not self.tokens:
            return True
        values = headers.get("authorization", [])
        return len(values) == 1 and token_matches(values[0], self.tokens)

    async def _read_body(self, reader, parser, length: int) -> None:
        """Read a body at no less than min_body_rate bytes/s (after idle_timeout seconds
        of grace), with no pause longer than idle_timeout; else a 408."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        received = 0
        while received < length:
            due = start + self.idle_timeout + received / self.min_body_rate
            wait = min(self.idle_timeout, due - loop.time())
            try:
                if wait <= 0:
                    raise asyncio.TimeoutError
                async with asyncio.timeout(wait):
                    chunk = await reader.read(min(READ_SIZE, length - received))
            except asyncio.TimeoutError:
                self.slow_bodies += 1
                elapsed = loop.time() - start
                if wait >= self.idle_timeout:
                    reason = f"body stalled after {received} of {length} bytes (idle over " \
                             f"{self.idle_timeout} s)"
                else:
                    reason = f"body too slow: {received} of {length} bytes in {elapsed:.1f} " \
                             f"s (at least {self.min_body_rate:.0f} bytes/s after " \
                             f"{self.idle_timeout} s)"
                raise RequestError(408, reason) from None
            if not chunk:
                raise RequestError(400, f"body ended after {received} of {length} bytes")
            received += len(chunk)
            if not isinstance(parser, JsonBatchParser):
                parser.feed(chunk)                       # a copy into the array
                continue
            for i in range(0, len(chunk), JSON_SLICE):   # JSON: about a ms of parsing at a
                parser.feed(chunk[i:i + JSON_SLICE])     # time, other clients in between
                if len(chunk) > JSON_SLICE:
                    await asyncio.sleep(0)

    async def _send(self, writer, status: int, payload: dict, *, close=False, head_only=False,
                    allow=None, extra=None) -> None:
        headers = dict(extra or {})
        if status == 405:
            headers["Allow"] = allow or "GET, POST"
        await self._send_bytes(writer, status, json.dumps(payload).encode(), JSON,
                               headers, close=close, head_only=head_only)

    async def _send_bytes(self, writer, status, data: bytes, content_type, headers, *,
                          close=False, head_only=False) -> None:
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}",
                 "Server: attnextract", f"Content-Type: {content_type}",
                 f"Content-Length: {len(data)}"]
        lines += [f"{name}: {'' if value is None else value}" for name, value in headers.items()]
        if close:
            lines.append("Connection: close")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + (b"" if head_only else data))
        async with asyncio.timeout(WRITE_TIMEOUT):
            await writer.drain()
        if self.verbose:
            LOG.info("%s %d bytes", status, len(data))


def _refusal_headers(status: int) -> dict | None:
    """Headers a refusal carries: when to retry (503), how to authenticate (401)."""
    if status == 503:
        return {"Retry-After": 1}
    if status == 401:
        return {"WWW-Authenticate": 'Bearer realm="attnextract"'}
    return None


def _expects_continue(headers: dict, version: str) -> bool:
    """Whether the client waits for ``100 Continue`` before its body (HTTP/1.1 only); a
    417 for any other expectation."""
    values = headers.get("expect")
    if values is None:
        return False
    if len(values) != 1 or values[0].strip().lower() != "100-continue":
        raise RequestError(417, f"Expect {values[0][:40]!r} is not supported; only "
                                f"100-continue")
    return version == "HTTP/1.1"


def _parse_head(head: bytes):
    """(method, path, version, headers {lowercase name: [values]}) of a request head."""
    text = head.decode("latin-1")
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if (len(parts) != 3 or not parts[0].isalpha()
            or not re.fullmatch(r"HTTP/[0-9]\.[0-9]", parts[2])):
        raise RequestError(400, f"malformed request line {lines[0][:80]!r}")
    method, target, version = parts
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise RequestError(505, f"{version} is not supported; speak HTTP/1.1")
    headers: dict[str, list[str]] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or line[0] in " \t":
            raise RequestError(400, f"malformed header line {line[:80]!r}")
        headers.setdefault(name.lower(), []).append(value.strip())
    return method.upper(), target.split("?", 1)[0], version, headers


def _content_length(headers: dict, max_body: int) -> int:
    """The one Content-Length of a request body, checked before the body is read."""
    if "transfer-encoding" in headers:
        raise RequestError(411, "chunked bodies are not accepted; send Content-Length")
    values = headers.get("content-length")
    if values is None:
        raise RequestError(411, "a Content-Length header is required")
    if len(values) != 1 or "," in values[0]:
        raise RequestError(400, f"more than one Content-Length: {values}")
    text = values[0]
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        raise RequestError(400, f"bad Content-Length {text!r}")
    length = int(text)
    if length > max_body:
        raise RequestError(413, f"body of {length} bytes; at most {max_body}")
    if length == 0:
        raise RequestError(400, "empty body: send a batch of sequences")
    return length


def peak_rss_bound(idle_rss: int, *, connections: int, body_memory: int = BODY_MEMORY,
                   cache_bytes: int = CACHE_BYTES, state: bool = False) -> int:
    """Bytes of resident memory a server will not exceed: its RSS when idle, plus

    - ``body_memory``: the bodies being read, parsed, evaluated and answered (each
      reserves :meth:`BlackBoxServer.body_cost` before a byte of it is read);
    - the answer cache: ``cache_bytes`` of outputs and SQLite's overhead (a quarter,
      measured) when the ledger is in memory; nothing when it is a file (``state``);
    - ``connections`` x CONNECTION_COST: what each open connection buffers before its
      body is admitted (at most 2 x 16 KiB of stream and one 64 KiB read) and its objects;
    - RSS_SLACK: the allocator's slack, SQLite's page cache, the model's temporaries for
      ``workers`` batches of the cheap targets measured (a big model needs its own).

    Checked by tests/test_server_state.py and measured by benchmarks/bench_http.py bounded.
    """
    cache = 0 if state else cache_bytes + cache_bytes // 4
    return idle_rss + body_memory + cache + connections * CONNECTION_COST + RSS_SLACK


SERVER_OPTIONS = ("max_connections", "backlog", "header_timeout", "idle_timeout", "workers",
                  "keepalive_timeout", "body_memory", "slot_timeout", "min_body_rate",
                  "tokens", "max_client_connections", "max_client_rate")


def make_server(model, host: str = "127.0.0.1", port: int = 0, *, verbose: bool = False,
                **limits) -> BlackBoxServer:
    """A bound (not yet serving) server for ``model``; port 0 picks a free port.

    ``limits`` are the keyword arguments of :class:`ServerState` (``budget``,
    ``round_digits``, ``max_body``, ``max_sequences``, ``max_floats``, ``max_length``,
    ``cache_bytes``, ``state``: the ledger file) and of :class:`BlackBoxServer`
    (``max_connections``, ``backlog``, ``header_timeout``, ``idle_timeout``, ``workers``,
    ``keepalive_timeout``, ``body_memory``, ``slot_timeout``, ``min_body_rate``,
    ``tokens``, ``max_client_connections``, ``max_client_rate``). A server bound beyond
    loopback without ``tokens`` logs :func:`exposure_warning`.
    Call ``serve_forever()`` (in a thread for tests), ``shutdown()`` and ``server_close()``.
    """
    options = {k: limits.pop(k) for k in SERVER_OPTIONS if k in limits}
    warning = exposure_warning(host, options.get("tokens"))
    if warning:
        LOG.warning("%s", warning)
    state = ServerState(model, **limits)
    try:
        return BlackBoxServer((host, port), state, verbose=verbose, **options)
    except BaseException:
        state.close()
        raise
