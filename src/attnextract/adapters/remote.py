"""An HTTP endpoint as a black box: ``attnextract extract --target http://HOST:PORT``.

:class:`HttpBlackBox` is a callable (B, N, d) -> (B,) like any other target, so the
oracle (counting, budget, journal) and every learner work through it unchanged. It
speaks the protocol of :mod:`attnextract.adapters.server` with the standard library
only (``http.client``, one keep-alive connection per sending thread):

- a batch is cut into requests of at most ``max_floats`` numbers, sent by
  ``concurrency`` threads at once, answers put back in order;
- transport ``npy`` (default): the request is one npy array (B, N, d) of float64 and
  the answer one npy array (B,); a server that refuses it (415, or 400 to an npy
  body) is asked again in JSON, and JSON is used from then on; ``json`` sends
  ``{"sequences": ...}`` with floats as shortest round-trip decimals. Both are exact;
- every request carries an ``Idempotency-Key`` (a fresh uuid per request, reused on
  its retries), so a retry after a lost answer is answered from the server's cache and
  not charged twice;
- each attempt has a whole-request deadline of ``timeout`` seconds (connect, send and
  receive together: a server that drips its answer a byte at a time is cut at the
  deadline), and an answer may hold at most :func:`max_answer_bytes` bytes, derived
  from the numbers expected (a larger Content-Length is refused before a byte of the
  body is read; a body without one is read in pieces and cut at the cap);
- timeouts, dropped connections, 408 and 5xx answers are retried ``retries`` times with
  exponential backoff (``backoff * 2^attempt`` seconds, capped at 30 s); an answer that
  is malformed (too large, not HTTP, a redirect, strings or nesting where numbers were
  expected) is not retried: it raises :class:`MalformedOutputError` or
  :class:`BlackBoxError` at once;
- ``token`` (the server's ``--token-file``) is sent as ``Authorization: Bearer TOKEN``
  on every request, ``/health`` included;
- 429 (the server's budget) raises :class:`BudgetExceededError` whose
  ``partial_outputs`` holds the answers (k,) to the first k sequences of the batch that
  were answered before the refusal (requests not yet sent are cancelled); other 4xx
  raise :class:`BlackBoxError` with the server's reason, a server that stays
  unreachable raises :class:`BlackBoxError` naming the URL and the last failure, and
  an answer of the wrong shape raises :class:`MalformedOutputError`.

A server of a vector model answers (B, m) (the output at the last position) or
(B, N, m) (every position), in npy or as nested JSON lists, and says so in ``/health``
(``outputs``, ``out_dim``, ``causal``): the client declares it (``output_kind``,
``out_dim``, ``causal``, read by :class:`~attnextract.oracle.Oracle`) and refuses, as
:class:`MalformedOutputError`, answers whose kind or m disagree with the declaration or
change between calls, and JSON answers holding strings, booleans, nulls or ragged lists.

:meth:`HttpBlackBox.accounting` says what was sent and what the server charged
(from its ``X-Charged`` header, each key counted once).

:class:`JsonApiBlackBox` is the hook for an HTTP API that is not ours: two functions
map a batch to a request body and a response to numbers; retries, chunking,
concurrency and accounting are the same.
"""

from __future__ import annotations

import http.client
import io
import json
import select
import socket
import threading
import time
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import (
    AttnExtractError,
    BlackBoxError,
    BudgetExceededError,
    InputError,
    MalformedOutputError,
)
from ..oracle import OUTPUT_KINDS, answer_kind

MAX_BACKOFF = 30.0
NPY = "application/x-npy"
TRANSPORTS = ("npy", "json")
# bytes an answer may take per number it carries: npy 8; JSON at most 24 (the longest
# shortest-round-trip float64, -2.2250738585072014e-308) and ", " between numbers
BYTES_PER_NUMBER = {"npy": 8, "json": 32}
ANSWER_OVERHEAD = 64 << 10       # an answer's bytes beyond its numbers (keys, npy header)
ANSWER_HEADROOM = 2              # factor on the numbers' bytes: a server's extra fields
ERROR_BYTES = 64 << 10           # most read of a refusal's or /health's body
READ_PIECE = 64 << 10            # an answer is read this much at a time (memory bounded)
FOREIGN_ANSWER_BYTES = 1 << 20   # JsonApiBlackBox: an answer's bytes beyond its sequences'
FOREIGN_BYTES_PER_SEQUENCE = 1 << 10   # and per sequence (ids, labels, several scores)


class _Refused(Exception):
    """An HTTP refusal (status, reason, the JSON it carried)."""

    def __init__(self, status: int, reason: str, body: dict, server: str = "",
                 location: str = ""):
        super().__init__(reason)
        self.status, self.reason, self.body, self.server = status, reason, body, server
        self.location = location


# -- bounds on what a server can make the client do ------------------------------------

# before a server's kind of answers is known (no /health declaration, no answer yet), its
# first answer may hold up to this many numbers per token sent (vectors at every position
# of width m <= this)
UNKNOWN_NUMBERS_PER_TOKEN = 1024


def max_answer_bytes(sequences: int, numbers_per_sequence: int = 1,
                     transport: str = "npy") -> int:
    """Most bytes the client reads of an answer to ``sequences`` sequences.

    Parameters
    ----------
    sequences : int
        Sequences in the request.
    numbers_per_sequence : int
        Numbers the answer holds per sequence: 1 for outputs (B,), m for (B, m), N m
        for (B, N, m).
    transport : {"npy", "json"}
        The answer's format: 8 bytes a number in npy, at most 32 in JSON.

    Returns
    -------
    int
        ``ANSWER_OVERHEAD + ANSWER_HEADROOM * numbers * BYTES_PER_NUMBER[transport]``: an
        honest answer fits with room to spare, a server cannot make the client buffer more.
    """
    numbers = max(0, int(sequences)) * max(1, int(numbers_per_sequence))
    return ANSWER_OVERHEAD + ANSWER_HEADROOM * numbers * BYTES_PER_NUMBER[transport]


class _TooLarge(Exception):
    """An answer over its byte cap (announced or read)."""

    def __init__(self, size: int, cap: int, announced: bool):
        super().__init__(size)
        self.size, self.cap, self.announced = size, cap, announced


class _DeadlineExceeded(TimeoutError):
    """The attempt's whole-request deadline passed (a TimeoutError: it is retried)."""


class _DeadlineSocket:
    """A connected socket whose every send and receive is bounded by its connection's
    deadline: the socket timeout is set to the time left before each call, so a server
    that sends one byte at a time cannot stretch an attempt past the deadline."""

    def __init__(self, sock, owner):
        self._sock, self._owner = sock, owner
        self._readers = 0            # open makefiles: close() waits for them, as socket does
        self._closing = False

    def _arm(self) -> None:
        deadline = self._owner.deadline
        if deadline is None:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise _DeadlineExceeded(f"no complete answer within the {self._owner.allowed:g} s "
                                    f"deadline")
        self._sock.settimeout(left)

    def sendall(self, data) -> None:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), READ_PIECE):    # re-armed between pieces
            self._arm()
            try:
                self._sock.sendall(view[i:i + READ_PIECE])
            except TimeoutError:
                self._arm()          # the deadline, said as such, if that is what passed
                raise

    def recv_into(self, buffer, nbytes: int = 0) -> int:
        self._arm()
        try:
            return self._sock.recv_into(buffer, nbytes)
        except TimeoutError:
            self._arm()
            raise

    def makefile(self, mode="rb", *args, **kwargs):
        """What http.client reads a response through: buffered, every read bounded."""
        if "r" not in mode:
            raise ValueError("only reading makefiles are bounded")
        self._readers += 1
        return io.BufferedReader(_DeadlineReader(self), READ_PIECE)

    def close(self) -> None:
        """Close the socket once no response reads from it (http.client closes the
        connection of a ``Connection: close`` answer before its body is read)."""
        self._closing = True
        if self._readers == 0:
            self._sock.close()

    def _reader_closed(self) -> None:
        self._readers -= 1
        if self._closing and self._readers == 0:
            self._sock.close()

    def __getattr__(self, name):     # fileno, recv (the stale check), setsockopt...
        return getattr(self._sock, name)


class _DeadlineReader(io.RawIOBase):
    def __init__(self, sock: _DeadlineSocket):
        self._deadline_sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self._deadline_sock.recv_into(buffer)

    def close(self) -> None:
        if not self.closed:
            self._deadline_sock._reader_closed()
        super().close()


class _DeadlineConnection(http.client.HTTPConnection):
    """An HTTP connection whose attempt (connect, send, receive) ends at ``deadline``."""

    deadline: float | None = None     # time.monotonic() at which the attempt ends
    allowed: float = 0.0              # the attempt's seconds, for the message

    def start(self, seconds: float) -> None:
        """Begin an attempt of at most ``seconds``, the connection (if any) reused."""
        self.allowed = seconds
        self.deadline = time.monotonic() + seconds

    def connect(self):
        self.timeout = max(1e-3, self.deadline - time.monotonic()) if self.deadline else None
        super().connect()
        self.sock = _DeadlineSocket(self.sock, self)


class _DeadlineHTTPSConnection(_DeadlineConnection, http.client.HTTPSConnection):
    pass


def _read_bounded(response: http.client.HTTPResponse, cap: int) -> bytes:
    """The body of ``response``, at most ``cap`` bytes, read in pieces; _TooLarge past it
    (an announced Content-Length over the cap before a byte is read)."""
    if response.length is not None and response.length > cap:
        raise _TooLarge(response.length, cap, True)
    pieces: list[bytes] = []
    size = 0
    while True:
        piece = response.read(min(READ_PIECE, cap + 1 - size))
        if not piece:
            return b"".join(pieces)
        size += len(piece)
        if size > cap:
            raise _TooLarge(size, cap, False)
        pieces.append(piece)


def _describe(value) -> str:
    """A JSON value's kind for an error message (a string shown short)."""
    if isinstance(value, str):
        return f"a string {value[:20]!r}"
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def json_numbers(value, shape: tuple[int, ...], where: str) -> np.ndarray:
    """The float64 array of a JSON answer that must be nested lists of numbers of ``shape``.

    Parameters
    ----------
    value
        The parsed JSON (the answer's ``outputs``).
    shape : tuple of int
        The shape expected: (B,) for one number per sequence, (B, m) or (B, N, m) for
        vectors.
    where : str
        Who answered, for the message.

    Raises
    ------
    MalformedOutputError
        At the first element that is not as expected: a string such as ``"0.12"``, a
        boolean, null, a list where a number belongs (nesting), a number where a list
        belongs, or a list of the wrong length; the message says which and where.
    """
    level = [value]
    for depth, size in enumerate(shape):
        items: list = []
        for position, item in enumerate(level):
            if not isinstance(item, list) or len(item) != size:
                at = "" if depth == 0 else f" at position {position} of depth {depth}"
                got = ("booleans" if item is True or item is False else _describe(item))
                if isinstance(item, list):
                    got = f"a list of length {len(item)}"
                raise MalformedOutputError(f"{where} answered {got}{at} for "
                                           f"{size} {'sequences' if depth == 0 else 'numbers'}"
                                           f" (expected shape {shape})")
            items.extend(item)
        level = items
    for position, item in enumerate(level):
        kind = type(item)
        if kind is not float and kind is not int:     # bool is not int here
            what = "booleans" if kind is bool else _describe(item)
            if kind is list:
                what = f"nested lists ({_describe(item)})"
            raise MalformedOutputError(f"{where} answered {what} at position {position}, "
                                       f"not numbers (expected shape {shape})")
    try:
        return np.array(level, dtype=np.float64).reshape(shape)
    except (OverflowError, ValueError) as exc:     # an integer beyond float64
        raise MalformedOutputError(f"{where} answered a number beyond float64: {exc}") from None


class HttpBlackBox:
    """A remote black box at ``url`` (``http://HOST:PORT``), called with batches (B, N, d).

    Parameters
    ----------
    url : str
        Base address of a server speaking the :mod:`attnextract.adapters.server` protocol.
    timeout : float
        Seconds one attempt of a request may take in all: connecting, sending the body
        and receiving the whole answer (a whole-request deadline, not a per-read one).
    retries : int
        Further attempts after a timeout, a dropped connection or a 5xx answer.
    backoff : float
        First wait between attempts, doubled each time.
    concurrency : int
        Requests in flight at once.
    max_floats : int
        Numbers per request (B * N * d); a larger batch is cut into several requests
        (the server's own limit is 2^20).
    max_sequences : int
        Sequences per request (the server's own limit is 100000).
    transport : {"npy", "json"}
        Body format; ``npy`` falls back to ``json`` for a server that refuses it.
    token : str, optional
        The server's bearer token (``attnextract serve --token-file``), sent as
        ``Authorization: Bearer TOKEN`` on every request.
    max_answer_bytes : int, optional
        Most bytes read of one answer; default :func:`max_answer_bytes` of the request's
        sequences and ``numbers_per_sequence``.
    """

    query_path = "/query"
    numbers_per_sequence = 1     # numbers an answer holds per sequence (outputs (B,))

    def __init__(self, url: str, *, timeout: float = 60.0, retries: int = 4,
                 backoff: float = 0.25, concurrency: int = 4, max_floats: int = 1 << 20,
                 max_sequences: int = 10_000, transport: str = "npy",
                 token: str | None = None, max_answer_bytes: int | None = None):
        if not url.startswith(("http://", "https://")):
            raise InputError(f"an HTTP target must start with http:// or https://, got {url!r}")
        if (timeout <= 0 or retries < 0 or backoff < 0 or concurrency < 1 or max_floats < 1
                or max_sequences < 1):
            raise InputError("timeout > 0, retries >= 0, backoff >= 0, concurrency >= 1, "
                             "max_floats >= 1 and max_sequences >= 1 are required")
        if transport not in TRANSPORTS:
            raise InputError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if max_answer_bytes is not None and max_answer_bytes < 1:
            raise InputError(f"max_answer_bytes must be >= 1, got {max_answer_bytes!r}")
        self._auth = _bearer(token)
        self.answer_cap = max_answer_bytes
        self.url = url.rstrip("/")
        parts = urllib.parse.urlsplit(self.url)
        if not parts.hostname:
            raise InputError(f"an HTTP target must name its host (http://HOST:PORT), got {url!r}")
        self._scheme, self._host, self._port = parts.scheme, parts.hostname, parts.port
        self._base_path = parts.path
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.concurrency, self.max_floats = concurrency, max_floats
        self.max_sequences = max_sequences
        self.transport = transport
        self.requests = 0          # HTTP requests made, retries included
        self.retried = 0           # of which retries
        self.sent = 0              # sequences sent, retries included
        self.answered = 0          # sequences answered
        self.charges: dict[str, int] = {}   # Idempotency-Key -> sequences the server charged
        self.charges_known = True  # every answer so far carried X-Charged
        self.fallbacks = 0
        self._lock = threading.Lock()
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None

    # -- public ------------------------------------------------------------------------
    def __call__(self, X) -> np.ndarray:
        """Outputs (B,) of the batch X (B, N, d), in order."""
        X = np.ascontiguousarray(X, dtype=np.float64)
        per_request = max(1, min(self.max_sequences,
                                 self.max_floats // max(1, X.shape[1] * X.shape[2])))
        chunks = [X[i:i + per_request] for i in range(0, len(X), per_request)]
        if len(chunks) == 1 or self.concurrency == 1:
            results = []
            for chunk in chunks:
                try:
                    results.append(self._query(chunk))
                except BudgetExceededError as exc:
                    raise self._partial(exc, results) from None
            return np.concatenate(results)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="attnextract-http")
        futures = [self._pool.submit(self._query, c) for c in chunks]
        results, failure = [], None
        for future in futures:
            if failure is not None:
                future.cancel()        # not sent yet: never sent
                continue
            try:
                results.append(future.result())
            except BaseException as exc:   # noqa: BLE001 - re-raised below, after cancelling
                failure = exc
        if failure is None:
            return np.concatenate(results)
        # requests already in flight finish (their charges are counted), the rest never leave
        for future in futures:
            if not future.cancelled():
                try:
                    future.result()
                except BaseException:      # noqa: BLE001 - the first failure is the one raised
                    pass
        if isinstance(failure, BudgetExceededError):
            raise self._partial(failure, results) from None
        raise failure

    def health(self) -> dict:
        """The server's ``GET /health`` answer (kind, dim, served, budget, remaining).

        Raises :class:`MalformedOutputError` unless it is a JSON object."""
        try:
            data, _ = self._request("GET", "/health", None, {"Accept": "application/json"})
        except _Refused as exc:
            raise self._refusal(exc, 0) from None
        try:
            health = json.loads(data)
        except (ValueError, RecursionError):   # RecursionError: [[[[... nested deep
            raise MalformedOutputError(f"{self.url} answered /health with something that is "
                                       f"not JSON (or nested too deep): {data[:40]!r}") from None
        if not isinstance(health, dict):
            raise MalformedOutputError(f"{self.url} answered /health with {_describe(health)}"
                                       f", not a JSON object: not an attnextract server?")
        return health

    @property
    def max_length(self) -> int | None:
        """Longest sequence (tokens) this client can send to its server: the server's
        ``max_length`` from ``/health`` (older servers: None), and never more than one
        request's ``max_floats`` numbers hold. None if the server cannot be asked; the
        first query then reports why. :class:`~attnextract.oracle.Oracle` takes it as its
        default ``max_length``, so verification never sends what the server refuses."""
        if getattr(self, "_max_length", False) is False:
            try:
                health = self._health_once()
            except (AttnExtractError, ValueError):
                return None
            if not isinstance(health, dict):
                return None
            dim, served = health.get("dim"), health.get("max_length")
            bounds = [int(served)] if isinstance(served, int) and served > 0 else []
            if isinstance(dim, int) and dim > 0:
                bounds.append(max(1, self.max_floats // dim))
            self._max_length = min(bounds) if bounds else None
        return self._max_length

    # -- what the server answers (vector models declare it in /health) ------------------
    def _health_once(self) -> dict:
        """``/health`` asked once for what does not change (limits, the kind of answers):
        ``max_length`` and ``output_kind`` share one request."""
        if getattr(self, "_static_health", None) is None:
            self._static_health = self.health()
        return self._static_health

    def _declared(self) -> dict:
        """The server's declaration of its answers, from ``/health`` once: {} when it
        declares none (a scalar server, an older one) or cannot be asked."""
        if getattr(self, "_declaration", None) is None:
            try:
                health = self._health_once()
            except (AttnExtractError, ValueError):
                health = {}          # asked once: the first query reports what is wrong
            health = health if isinstance(health, dict) else {}
            kind, m = health.get("outputs"), health.get("out_dim")
            ok = kind in OUTPUT_KINDS and isinstance(m, int) and not isinstance(m, bool) \
                and m >= 1
            self._declaration = {"outputs": kind, "out_dim": m,
                                 "causal": health.get("causal")} if ok else {}
        return self._declaration

    @property
    def output_kind(self) -> str | None:
        """What the server declares it answers ("scalar", "last", "all"), or None."""
        return self._declared().get("outputs")

    @property
    def out_dim(self) -> int | None:
        """m, the width of the server's vector answers, as it declares it (or None)."""
        return self._declared().get("out_dim")

    @property
    def causal(self) -> bool | None:
        """Whether the server's every-position answers are causal, as it declares it."""
        causal = self._declared().get("causal")
        return causal if isinstance(causal, bool) else None

    def _check_answers(self, out: np.ndarray, X: np.ndarray) -> np.ndarray:
        """``out`` unless its shape is not (B,), (B, m) or (B, N, m) for the batch X, or
        its kind or m disagree with the server's declaration or an earlier answer
        (MalformedOutputError)."""
        B, N = X.shape[:2]
        found = answer_kind(out.shape, B, N)
        if found is None:
            raise MalformedOutputError(f"{self.url} answered shape {out.shape} for a batch of "
                                       f"{B} sequences of {N} tokens; expected ({B},), "
                                       f"({B}, m) or ({B}, {N}, m)")
        declared = getattr(self, "_declaration", None) or {}   # if asked: no extra request
        if declared and found != (declared["outputs"], declared["out_dim"]):
            raise MalformedOutputError(
                f"{self.url} answered shape {out.shape}, {_kind_words(found)}; its /health "
                f"declares {_kind_words((declared['outputs'], declared['out_dim']))}")
        with self._lock:
            held = getattr(self, "_answers_kind", None)
            if held is not None and held != found:
                raise MalformedOutputError(
                    f"{self.url} answered shape {out.shape}, {_kind_words(found)}; it answered "
                    f"{_kind_words(held)} before")
            self._answers_kind = found
        return out

    def check_dim(self, dim: int) -> None:
        """Raise InputError unless the server takes tokens of width ``dim``."""
        health = self.health()
        if "dim" not in health and health.get("auth") == "bearer":
            raise BlackBoxError(f"{self.url} needs a bearer token: give the server's token "
                                f"with --http-token-file (HttpBlackBox(..., token=...))")
        served = health.get("dim")
        if served is not None and (not isinstance(served, int) or isinstance(served, bool)):
            raise MalformedOutputError(f"{self.url} answered /health with dim "
                                       f"{_describe(served)}, not an integer")
        if served != dim:
            raise InputError(f"{self.url} serves tokens of width {served}, not --dim {dim}")

    @property
    def charged(self) -> int | None:
        """Sequences the server says it charged for this client's requests (None if unknown)."""
        return sum(self.charges.values()) if self.charges_known else None

    def accounting(self) -> dict:
        """What crossed the wire: requests, retries, sequences sent, answered and charged."""
        return {"transport": self.transport, "requests": self.requests, "retries": self.retried,
                "queries_sent": self.sent, "queries_answered": self.answered,
                "queries_charged_by_server": self.charged}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- one request -------------------------------------------------------------------
    def _partial(self, exc: BudgetExceededError, results: list) -> BudgetExceededError:
        """``exc`` with ``partial_outputs``: the answers to the first sequences, in order."""
        partial = np.concatenate(results) if results else np.empty(0)
        error = BudgetExceededError(f"{exc} ({len(partial)} sequences of the batch were "
                                    f"answered before the refusal)", needed=exc.needed,
                                    remaining=exc.remaining)
        error.partial_outputs = partial
        return error

    def _encode(self, X: np.ndarray,
                transport: str) -> tuple[bytes | list[bytes | memoryview], dict[str, str]]:
        if transport == "npy":       # the npy header, then the array's own bytes (no copy)
            stream = io.BytesIO()
            np.lib.format.write_array_header_1_0(stream, {
                "descr": "<f8", "fortran_order": False, "shape": X.shape})
            header = stream.getvalue()
            # an ndarray exports the buffer protocol (numpy's stubs do not say so)
            data = memoryview(np.ascontiguousarray(X, dtype="<f8")).cast("B")  # type: ignore[arg-type]
            return [header, data], {"Content-Type": NPY, "Accept": NPY,
                                    "Content-Length": str(len(header) + len(data))}
        return (json.dumps({"sequences": X.tolist()}).encode(),
                {"Content-Type": "application/json", "Accept": "application/json"})

    def _decode(self, data: bytes, content_type: str, batch: int,
                length: int = 1) -> np.ndarray:
        if content_type == NPY:
            try:
                out = np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
            except (ValueError, OSError, EOFError) as exc:
                raise MalformedOutputError(f"{self.url} answered a bad npy: {exc}") from None
            if not out.shape or out.shape[0] != batch or out.ndim > 3 or out.dtype.kind != "f":
                raise MalformedOutputError(f"{self.url} answered an npy of shape {out.shape} "
                                           f"and dtype {out.dtype} for {batch} sequences")
            return out.astype(np.float64)
        try:
            answer = json.loads(data)
        except (ValueError, RecursionError):
            raise MalformedOutputError(
                f"{self.url} answered something that is not JSON (or nested too deep): "
                f"{data[:80]!r}") from None
        if not isinstance(answer, dict) or "outputs" not in answer:
            raise MalformedOutputError(f"{self.url} answered {_describe(answer)} without "
                                       f"\"outputs\" for {batch} sequences")
        return json_numbers(answer["outputs"], self._json_shape(batch, length), self.url)

    def _query(self, X: np.ndarray) -> np.ndarray:
        transport = self.transport
        body, headers = self._encode(X, transport)
        key = uuid.uuid4().hex
        try:
            data, reply = self._request("POST", self.query_path, body,
                                        {**headers, "Idempotency-Key": key}, batch=len(X),
                                        cap=self._answer_cap(len(X), transport, X.shape[1]))
        except _Refused as exc:
            # an attnextract server speaks npy: its 400 is about the batch, not the format
            ours = exc.server.startswith("attnextract")
            if transport != "npy" or not (exc.status == 415 or exc.status == 400 and not ours):
                raise self._refusal(exc, len(X)) from None
            # a server without npy: ask in JSON (a new key: the refused request was not charged)
            body, headers = self._encode(X, "json")
            key = uuid.uuid4().hex
            try:
                data, reply = self._request("POST", self.query_path, body,
                                            {**headers, "Idempotency-Key": key}, batch=len(X),
                                            cap=self._answer_cap(len(X), "json",
                                                                 X.shape[1]))
            except _Refused as again:
                raise self._refusal(again, len(X)) from None
            with self._lock:
                self.transport = "json"
                self.fallbacks += 1
        out = self._decode(data, reply.get("content-type", "").split(";")[0].strip(), len(X),
                           X.shape[1])
        out = self._check_answers(out, X)
        charged = reply.get("x-charged")
        with self._lock:
            self.answered += len(X)
            if charged is not None and charged.isdigit():
                self.charges[key] = int(charged)
            else:
                self.charges_known = False
        return out

    def _answer_cap(self, sequences: int, transport: str, length: int = 1) -> int:
        """Most bytes read of the answer to ``sequences`` sequences of ``length`` tokens
        (JSON if not npy): the numbers the server's kind of answers holds (declared in
        ``/health`` or seen in an earlier answer; before either, up to
        UNKNOWN_NUMBERS_PER_TOKEN per token)."""
        if self.answer_cap is not None:
            return self.answer_cap
        return max_answer_bytes(sequences, self._numbers_expected(length),
                                "npy" if transport == "npy" else "json")

    def _numbers_expected(self, length: int) -> int:
        """Numbers one answer holds for a sequence of ``length`` tokens."""
        kind = getattr(self, "_answers_kind", None)
        declared = getattr(self, "_declaration", None) or {}
        if kind is None and declared:
            kind = (declared["outputs"], declared["out_dim"])
        if kind is None:
            return max(self.numbers_per_sequence, UNKNOWN_NUMBERS_PER_TOKEN * max(1, length))
        name, m = kind
        return 1 if name == "scalar" else m if name == "last" else m * max(1, length)

    def _json_shape(self, batch: int, length: int) -> tuple[int, ...]:
        """The shape a JSON answer's ``outputs`` must have: (B,) unless the server declared
        vector answers in ``/health`` ((B, m) or (B, N, m); an Oracle asks it at its
        start, a bare box on ``output_kind``); json_numbers checks every element against
        it, so nested lists from a server that declared none are refused."""
        # as declared when asked (the Oracle asks at its start): no request of its own
        declared = getattr(self, "_declaration", None) or {}
        if not declared or declared["outputs"] == "scalar":
            return (batch,)
        m = declared["out_dim"]
        return (batch, m) if declared["outputs"] == "last" else (batch, length, m)

    def _refusal(self, exc: _Refused, batch: int) -> Exception:
        if 300 <= exc.status < 400:
            return BlackBoxError(f"{self.url} answered a redirect (HTTP {exc.status} to "
                                 f"{exc.location[:80]!r}), which is not followed: give the "
                                 f"final address as the target")
        if exc.status == 401:
            return BlackBoxError(f"{self.url} refused the request (HTTP 401): {exc.reason} "
                                 f"(give the server's token with --http-token-file)")
        if exc.status == 429:
            return BudgetExceededError(f"{self.url} refused {batch} sequences: {exc.reason}",
                                       needed=batch, remaining=int(exc.body.get("remaining") or 0))
        return BlackBoxError(f"{self.url} refused the request (HTTP {exc.status}): {exc.reason}")

    def _connection(self, fresh: bool = False) -> _DeadlineConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            cls = (_DeadlineHTTPSConnection if self._scheme == "https"
                   else _DeadlineConnection)
            conn = cls(self._host, self._port, timeout=self.timeout)
            self._local.conn = conn
        return conn

    def _request(self, method: str, path: str, body, headers: dict, batch: int = 0,
                 cap: int | None = None) -> tuple[bytes, dict]:
        """(body, lowercase headers) of a 2xx answer of at most ``cap`` bytes (default: the
        cap of ``batch`` sequences, ERROR_BYTES without); raises _Refused for 3xx and 4xx,
        MalformedOutputError for an answer too large or not HTTP."""
        if cap is None:
            cap = self._answer_cap(batch, self.transport) if batch else ERROR_BYTES
        failure = "no attempt"
        headers = {**headers, **self._auth}
        for attempt in range(self.retries + 1):
            if attempt:
                with self._lock:
                    self.retried += 1
                time.sleep(min(self.backoff * 2 ** (attempt - 1), MAX_BACKOFF))
            with self._lock:
                self.requests += 1
                self.sent += batch
            conn = self._connection(fresh=attempt > 0)
            conn.start(self.timeout)
            try:
                if conn.sock is not None and _stale(conn.sock):
                    conn = self._connection(fresh=True)   # the server closed an idle keep-alive
                    conn.start(self.timeout)
                conn.request(method, (self._base_path + path) or "/", body=body, headers=headers)
                response = conn.getresponse()
                status = response.status
                data = _read_bounded(response, cap if status < 300 else ERROR_BYTES)
                reply = {k.lower(): v for k, v in response.getheaders()}
                if response.will_close:
                    conn.close()
            except _TooLarge as exc:
                conn.close()
                if status >= 300:    # a refusal's reason is short: a long one is not read
                    data, reply = b"", {k.lower(): v for k, v in response.getheaders()}
                else:
                    said = "announced" if exc.announced else "sent over"
                    raise MalformedOutputError(
                        f"{self.url} {said} {exc.size} bytes for {batch or 'its'} "
                        f"{'sequences' if batch else path} (at most {exc.cap} expected); "
                        f"not read further") from None
            except (http.client.BadStatusLine, http.client.LineTooLong,
                    http.client.UnknownProtocol) as exc:
                conn.close()
                if isinstance(exc, http.client.RemoteDisconnected):
                    failure = f"{type(exc).__name__}: {exc}"   # a dropped connection: retried
                    continue
                raise MalformedOutputError(f"{self.url} did not answer in HTTP: "
                                           f"{type(exc).__name__}: {str(exc)[:60]!r}") from None
            except (TimeoutError, ConnectionError, http.client.HTTPException, OSError) as exc:
                conn.close()
                failure = f"{type(exc).__name__}: {exc}"
                continue
            finally:
                conn.deadline = None
            if status < 300:
                return data, reply
            try:
                error = json.loads(data)
            except (ValueError, RecursionError):
                error = {}
            error = error if isinstance(error, dict) else {}
            reason = str(error.get("error", response.reason))[:200]
            if status >= 500 or status == 408:       # 408: the server gave up waiting; a
                failure = f"HTTP {status}: {reason}"  # retry is safe (same Idempotency-Key)
                continue
            raise _Refused(status, reason, error, reply.get("server", ""),
                           reply.get("location", ""))
        if failure.startswith("HTTP 5"):
            # the server answered, with its own error (a model that fails every batch):
            # "unreachable" sent users looking at the network
            raise BlackBoxError(f"{self.url} answered a server error to all "
                                f"{self.retries + 1} attempt(s), last: {failure} (the server "
                                f"is reachable: its log says why)")
        if failure.startswith(_DeadlineExceeded.__name__):
            raise BlackBoxError(f"{self.url} gave no complete answer within the "
                                f"{self.timeout:g} s deadline in {self.retries + 1} "
                                f"attempt(s) (--http-timeout)")
        raise BlackBoxError(f"{self.url} unreachable: {self.retries + 1} attempt(s) failed, "
                            f"last: {failure}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def _kind_words(kind: tuple[str, int]) -> str:
    name, m = kind
    return ("one number per sequence" if name == "scalar" else
            f"vectors of m = {m} at the last position" if name == "last" else
            f"vectors of m = {m} at every position")


def _stale(sock: socket.socket) -> bool:
    """True if an idle keep-alive socket was closed by the server (readable at EOF)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and not sock.recv(1, socket.MSG_PEEK)
    except (OSError, ValueError):
        return True


def _bearer(token: str | None) -> dict:
    """The Authorization header of ``token`` (empty without one); InputError for a token
    that cannot be a header value (its text is never echoed)."""
    if token is None:
        return {}
    if not isinstance(token, str) or not token or not all(33 <= ord(c) <= 126 for c in token):
        raise InputError("an HTTP token must be visible ASCII characters without spaces "
                         "(the token itself is not shown)")
    return {"Authorization": f"Bearer {token}"}


def read_token_file(path) -> str:
    """The bearer token in ``path``: its first line, stripped; InputError if missing or
    empty."""
    try:
        with open(path, encoding="ascii") as f:
            token = f.readline(4097).strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the token file {path}: {type(exc).__name__}") from None
    if not token:
        raise InputError(f"the token file {path} is empty")
    _bearer(token)
    return token


class JsonApiBlackBox(HttpBlackBox):
    """A foreign HTTP API as a black box: ``encode`` a batch, ``decode`` the answer.

    Parameters
    ----------
    url : str
        The full endpoint, e.g. ``https://api.example.com/v1/score``; every request is a
        POST there.
    encode : callable
        ``encode(X)`` with X (b, N, d) float64 -> the request body: a JSON-able object
        (sent as ``application/json``) or bytes.
    decode : callable
        ``decode(answer)`` with the parsed JSON answer -> b numbers, in order.
    headers : dict, optional
        Extra headers on every request (``Authorization``, ...).
    max_length : int, optional
        The longest sequence (tokens) the API accepts: its context length. A foreign API
        has no ``/health`` to say it, so state it here: :class:`~attnextract.oracle.Oracle`
        takes it as its default ``max_length``, so learners never send longer sequences and
        verification covers lengths up to it (unstated: the Oracle's default, which may
        send sequences the API refuses).
    **options
        ``timeout``, ``retries``, ``backoff``, ``concurrency``, ``max_floats``,
        ``max_sequences``, ``token``, ``max_answer_bytes`` as for :class:`HttpBlackBox`.
        A foreign API's answers are wordier than ours: by default an answer may take
        FOREIGN_ANSWER_BYTES plus FOREIGN_BYTES_PER_SEQUENCE per sequence.

    Every request still carries an ``Idempotency-Key`` (harmless where it is ignored).
    ``accounting()`` has ``queries_charged_by_server`` None unless the API sends
    ``X-Charged``.
    """

    def __init__(self, url: str, encode, decode, *, headers: dict | None = None,
                 max_length: int | None = None, **options):
        if not callable(encode) or not callable(decode):
            raise InputError("encode and decode must be functions")
        if max_length is not None and (not isinstance(max_length, (int, np.integer))
                                       or isinstance(max_length, bool) or max_length < 1):
            raise InputError(f"max_length must be a positive integer (the API's longest "
                             f"sequence, in tokens), got {max_length!r}")
        self._declared_length = None if max_length is None else int(max_length)
        super().__init__(url, transport="json", **options)
        self.encode_batch, self.decode_answer = encode, decode
        self.extra_headers = dict(headers or {})
        self.query_path = ""

    def _answer_cap(self, sequences: int, transport: str, length: int = 1) -> int:
        if self.answer_cap is not None:
            return self.answer_cap
        return FOREIGN_ANSWER_BYTES + FOREIGN_BYTES_PER_SEQUENCE * sequences

    def _encode(self, X, transport):
        payload = self.encode_batch(X)
        headers = {"Accept": "application/json", **self.extra_headers}
        if isinstance(payload, (bytes, bytearray)):
            return bytes(payload), headers
        return json.dumps(payload).encode(), {"Content-Type": "application/json", **headers}

    def _decode(self, data, content_type, batch, length=1):
        try:
            answer = json.loads(data)
        except (ValueError, RecursionError):
            raise MalformedOutputError(
                f"{self.url} answered something that is not JSON (or nested too deep): "
                f"{data[:80]!r}") from None
        try:
            out = np.asarray(self.decode_answer(answer), dtype=np.float64)
            # vectors (b, m) or (b, N, m) keep their shape; numbers any way they come
            out = out if out.ndim >= 2 and out.shape[0] == batch else out.reshape(-1)
        except Exception as exc:     # the user's decoder met an answer it did not expect
            raise MalformedOutputError(f"decode failed on the answer of {self.url}: "
                                       f"{type(exc).__name__}: {exc}") from None
        if out.ndim == 1 and out.shape != (batch,):
            raise MalformedOutputError(f"decode gave {out.shape[0]} numbers for {batch} "
                                       f"sequences")
        return out

    def _declared(self) -> dict:
        return {}                    # a foreign API declares nothing: the oracle finds out

    def health(self) -> dict:
        return {"url": self.url,
                **({"max_length": self._declared_length} if self._declared_length else {})}

    @property
    def max_length(self) -> int | None:
        """The API's longest sequence (tokens) as stated at construction, or None."""
        return self._declared_length

    def check_dim(self, dim: int) -> None:
        return None
