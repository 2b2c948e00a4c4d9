"""Serve a model as an HTTP black box: ``attnextract serve --secret FILE.npz --port P``.

The black box a remote API would be: it answers one number per sequence and
nothing else, charges what it serves exactly once, enforces its own query budget,
and survives any request a client can send.

Protocol (HTTP/1.1, keep-alive):

- ``POST /query`` with a batch (B, N, d) of B >= 1 sequences of N >= 1 tokens of
  width d, either as JSON ``{"sequences": [[[x_11, ..., x_1d], ...], ...]}``
  (``Content-Type: application/json``, the default) or as one npy array of float64
  (``Content-Type: application/x-npy``). The answer is
  ``200 {"outputs": [f_1, ..., f_B], "remaining": R, "charged": B, "replayed": false}``
  or, with ``Accept: application/x-npy``, one npy array (B,) of float64. Floats travel
  as shortest round-trip decimals or raw float64, so values cross the wire exactly.
- ``Idempotency-Key: K`` (any 1-128 visible ASCII characters, chosen by the client,
  one per request and reused on its retries): the first request with K is charged;
  a repeat of K with the same numbers gets the cached answer again with
  ``replayed: true`` and is not charged; a repeat of K with other numbers is a 422.
  The cache keeps the last ``cache_entries`` keys (LRU).
- Every answer carries ``X-Charged`` (sequences charged for this key, once),
  ``X-Replayed`` (0/1), ``X-Served`` (all sequences charged so far) and
  ``X-Remaining``; the JSON answer carries ``charged`` and ``replayed`` too.
- ``GET /health`` -> ``200 {"ok": true, "kind", "dim", "served", "charged",
  "replayed", "budget", "remaining"}`` (``served`` = ``charged``: sequences charged).
- Every refused request gets ``{"error": reason}`` and a status: 400 malformed
  (not the JSON above, ragged, empty, strings, booleans, null, NaN or infinity,
  a body shorter than its Content-Length, a bad npy header, duplicate
  Content-Length); 404 unknown path; 405 any other method (JSON body, ``Allow``
  header; a HEAD gets the headers only); 408 headers too slow; 411 no
  Content-Length or a chunked body; 413 body, batch, sequence or numbers over the
  limits; 415 an npy that is not float64; 422 wrong token width or a reused
  Idempotency-Key; 429 the budget cannot cover the whole batch (nothing of it is
  answered or charged); 431 headers too large; 500 the model failed or answered
  NaN or infinity (not charged); 503 too many connections. The server keeps
  serving after every one of them.

Hardening (one asyncio event loop reads every connection; the model runs on a small
thread pool):

- at most ``max_connections`` connections (2048); one more is answered 503 and
  closed; listen backlog 128;
- the request line and headers must arrive within ``header_timeout`` (5 s) of their
  first byte and be at most 16 KiB; an idle keep-alive connection is closed after
  ``keepalive_timeout`` (15 s); a body may pause at most
  ``idle_timeout`` (2 s) between bytes: a slow or short body is refused 400 after
  at most that pause, and its connection closed;
- Content-Length is checked (digits only, one header, at most ``max_body`` =
  64 MiB) before a byte of the body is read;
- the body is parsed as it arrives, 64 KiB at a time, into float64 arrays: the
  limit is on numbers (``max_floats`` = 2^20 = 8 MiB of float64 per request), not
  bytes, and a body is refused the moment it passes a limit, without reading the
  rest; no Python list of the numbers is ever built;
- an npy header is parsed with ``numpy.lib.format`` (no pickles; dtype float64,
  3 dimensions, the limits and the exact byte count checked before the data is
  read), and the data is read into a preallocated array.

A client may send the batch as raw little-endian float64 instead of JSON
(``Content-Type: application/octet-stream``, header ``X-Shape: B,N,d``; the same
limits and refusals; ``/health`` says ``"binary": true``): 8 bytes a number instead
of about 20, and no parsing (the JSON text of a 384-wide layer costs more than the
layer itself).

``--round DIGITS`` rounds every output to that many decimals, as APIs that print
their answers do (the extraction then meets a noisy black box).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import re
import socket
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import InputError

MAX_BODY_BYTES = 64 << 20        # Content-Length accepted (JSON text or npy)
MAX_SEQUENCES = 100_000          # sequences per request
MAX_FLOATS = 1 << 20             # B * N * d per request: 8 MiB of float64
MAX_LENGTH = 4096                # tokens per sequence
MAX_CONNECTIONS = 2048
BACKLOG = 128
HEADER_TIMEOUT = 5.0             # seconds for a request line and headers, from the first byte
KEEPALIVE_TIMEOUT = 15.0         # seconds an idle keep-alive connection is kept
IDLE_TIMEOUT = 2.0               # seconds a body may pause between bytes
WRITE_TIMEOUT = 30.0             # seconds a client may take to read an answer
MAX_HEADER_BYTES = 16 << 10
CACHE_ENTRIES = 4096             # Idempotency-Keys remembered
WORKERS = 4                      # threads evaluating the model
READ_CHUNK = 1 << 16             # pieces of a body given to the parser at once (tests, parse())
JSON_SLICE = 1 << 14             # JSON text parsed between two turns of the event loop (~1 ms)
BODY_BUFFER = 1 << 20            # bytes of a body buffered per connection while it is read
BIG_BODY = 1 << 20               # bodies above this wait for one of BIG_BODY_SLOTS
BIG_BODY_SLOTS = 4               # big bodies read at once (the others wait, unread)
BIG_JSON = 1 << 18               # JSON bodies above this are parsed one at a time
MIN_BODY_RATE = 1 << 20          # bytes/s a body must average (after the idle timeout)
NPY = "application/x-npy"
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           408: "Request Timeout", 411: "Length Required", 413: "Content Too Large",
           415: "Unsupported Media Type", 422: "Unprocessable Content",
           429: "Too Many Requests", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 503: "Service Unavailable"}
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
        self.length = None           # N, from the first sequence
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
        X = np.concatenate(self.parts).reshape(self.sequences, self.length, self.dim)
        if not np.isfinite(X).all():
            raise RequestError(400, "sequences contain NaN or infinity (numbers beyond "
                                    "float64)")
        return X


class NpyBatchParser:
    """One npy array (B, N, d) of float64, its header checked before any data is read."""

    def __init__(self, dim: int, length: int, max_floats: int, max_sequences: int,
                 max_length: int):
        self.dim, self.content_length = dim, length
        self.max_floats, self.max_sequences, self.max_length = (max_floats, max_sequences,
                                                                max_length)
        self.head = b""
        self.data = None             # preallocated once the header is known
        self.filled = 0

    def feed(self, chunk: bytes) -> None:
        if self.data is None:
            self.head += chunk
            chunk = self._header()
            if self.data is None:
                return
        view = memoryview(self.data.reshape(-1).view(np.uint8))
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
        if start + header_len + 8 * B * N * d != self.content_length:
            raise RequestError(400, f"Content-Length {self.content_length} is not the npy "
                                    f"size {start + header_len + 8 * B * N * d}")
        self.shape, self.fortran = shape, fortran
        self.data = np.empty(B * N * d, dtype=dtype)
        rest, self.head = head[start + header_len:], b""
        return rest

    def finish(self) -> np.ndarray:
        if self.data is None or self.filled != self.data.nbytes:
            raise RequestError(400, "npy body ended early")
        X = self.data.reshape(self.shape, order="F" if self.fortran else "C")
        X = np.ascontiguousarray(X, dtype=np.float64)
        if not np.isfinite(X).all():
            raise RequestError(400, "sequences contain NaN or infinity")
        return X


def npy_bytes(array: np.ndarray) -> bytes:
    stream = io.BytesIO()
    np.lib.format.write_array(stream, np.ascontiguousarray(array, dtype="<f8"),
                              allow_pickle=False)
    return stream.getvalue()


# -- the model, its budget and its cache -----------------------------------------------

class ServerState:
    """The model behind the endpoint, its limits, its budget and its answer cache (thread-safe)."""

    def __init__(self, model, *, budget: int | None = None, round_digits: int | None = None,
                 max_body: int = MAX_BODY_BYTES, max_sequences: int = MAX_SEQUENCES,
                 max_floats: int = MAX_FLOATS, max_length: int = MAX_LENGTH,
                 cache_entries: int = CACHE_ENTRIES):
        if budget is not None and budget < 0:
            raise InputError(f"budget must be >= 0, got {budget}")
        self.model = model
        self.dim = int(model.dim)
        self.budget, self.round_digits = budget, round_digits
        self.max_body, self.max_sequences = max_body, max_sequences
        self.max_floats, self.max_length = max_floats, max_length
        self.cache_entries = cache_entries
        self.served = 0              # sequences charged (each Idempotency-Key once)
        self.replayed = 0            # sequences answered again from the cache, not charged
        self.refused = 0
        self.cache: OrderedDict[str, tuple] = OrderedDict()
        self.inflight: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    @property
    def remaining(self) -> int | None:
        return None if self.budget is None else self.budget - self.served

    def parser(self, content_type: str, length: int):
        if content_type == NPY:
            return NpyBatchParser(self.dim, length, self.max_floats, self.max_sequences,
                                  self.max_length)
        return JsonBatchParser(self.dim, self.max_floats, self.max_sequences, self.max_length)

    def parse(self, body: bytes, content_type: str = "application/json") -> np.ndarray:
        """The batch (B, N, d) of a whole request body (the server feeds it in chunks)."""
        parser = self.parser(content_type, len(body))
        for i in range(0, len(body), READ_CHUNK):
            parser.feed(body[i:i + READ_CHUNK])
        return parser.finish()

    def answer(self, X: np.ndarray, key: str | None = None) -> dict:
        """Outputs of a parsed batch, charged once per key (all or nothing).

        Returns ``{"outputs", "remaining", "charged", "replayed"}``."""
        digest = hashlib.sha256(repr(X.shape).encode() + X.tobytes()).digest()
        for _ in range(3):           # a repeat of a key in flight waits for its answer
            with self.lock:
                if key is not None and key in self.cache:
                    known, outputs = self.cache[key]
                    if known != digest:
                        raise RequestError(422, "Idempotency-Key reused with a different "
                                                "batch")
                    self.cache.move_to_end(key)
                    self.replayed += len(outputs)
                    return {"outputs": outputs, "remaining": self.remaining,
                            "charged": len(outputs), "replayed": True}
                waiting = self.inflight.get(key) if key is not None else None
                if waiting is None:
                    if self.budget is not None and len(X) > self.budget - self.served:
                        raise RequestError(429, f"budget exhausted: {len(X)} sequences asked, "
                                                f"{self.budget - self.served} of {self.budget} "
                                                f"remain", remaining=self.budget - self.served)
                    self.served += len(X)
                    if key is not None:
                        self.inflight[key] = threading.Event()
                    break
            waiting.wait(WRITE_TIMEOUT)
        else:
            raise RequestError(503, "the same Idempotency-Key is still being answered")
        try:
            try:
                out = np.asarray(self.model(X), dtype=np.float64).reshape(len(X))
            except Exception as exc:
                raise RequestError(500, f"internal error: {type(exc).__name__}: {exc}") from exc
            if not np.isfinite(out).all():
                raise RequestError(500, "the model answered NaN or infinity; not charged")
            if self.round_digits is not None:
                out = np.round(out, self.round_digits)
        except BaseException:
            with self.lock:            # a batch the model failed on is not charged
                self.served -= len(X)
                if key is not None:
                    self.inflight.pop(key).set()
            raise
        with self.lock:
            remaining = self.remaining
            if key is not None:
                self.cache[key] = (digest, out)
                while len(self.cache) > self.cache_entries:
                    self.cache.popitem(last=False)
                self.inflight.pop(key).set()
        return {"outputs": out, "remaining": remaining, "charged": len(X), "replayed": False}

    def health(self) -> dict:
        with self.lock:
            return {"ok": True, "kind": getattr(self.model, "kind", "custom"), "dim": self.dim,
                    "served": self.served, "charged": self.served, "replayed": self.replayed,
                    "budget": self.budget, "remaining": self.remaining}


# -- the server ------------------------------------------------------------------------

class BlackBoxServer:
    """An asyncio HTTP/1.1 server holding a :class:`ServerState`.

    ``serve_forever()`` runs it (in a thread for tests), ``shutdown()`` stops it from
    another thread, ``server_close()`` releases the socket and the model's threads.
    """

    def __init__(self, address, state: ServerState, *, verbose: bool = False,
                 max_connections: int = MAX_CONNECTIONS, backlog: int = BACKLOG,
                 header_timeout: float = HEADER_TIMEOUT, idle_timeout: float = IDLE_TIMEOUT,
                 workers: int = WORKERS, keepalive_timeout: float = KEEPALIVE_TIMEOUT):
        self.state, self.verbose = state, verbose
        self.max_connections, self.backlog = max_connections, backlog
        self.header_timeout, self.idle_timeout = header_timeout, idle_timeout
        self.keepalive_timeout = keepalive_timeout
        self.socket = socket.create_server(address, backlog=backlog)
        self.server_address = self.socket.getsockname()
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="attnextract-model")
        self.connections = 0         # open now
        self.peak_connections = 0
        self.rejected_connections = 0
        self._loop = None
        self._stop = None
        self._stopped = threading.Event()
        self._tasks: set = set()
        self._big_bodies = None      # asyncio semaphores, made inside the loop
        self._json_parser = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def serve_forever(self, poll_interval=None) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()
            self._stopped.set()

    def shutdown(self) -> None:
        if self._loop is not None and not self._stopped.is_set():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._stopped.wait(30)

    def server_close(self) -> None:
        self.socket.close()
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self._big_bodies = asyncio.Semaphore(BIG_BODY_SLOTS)
        self._json_parser = asyncio.Semaphore(1)
        server = await asyncio.start_server(self._connection, sock=self.socket,
                                            limit=MAX_HEADER_BYTES, backlog=self.backlog)
        async with server:
            await self._stop.wait()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            if self.connections >= self.max_connections:
                self.rejected_connections += 1
                await self._send(writer, 503, {"error": "too many connections; retry later"},
                                 close=True)
                return
            self.connections += 1
            self.peak_connections = max(self.peak_connections, self.connections)
            try:
                while await self._request(reader, writer):
                    pass
            finally:
                self.connections -= 1
        except (ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _request(self, reader, writer) -> bool:
        """Read and answer one request; False when the connection must close."""
        try:                                         # an idle keep-alive connection may wait
            async with asyncio.timeout(self.keepalive_timeout):   # (a timer, not a task)
                first = await reader.read(1)
        except asyncio.TimeoutError:
            return False                             # idle: hang up without a word
        if not first:
            return False
        try:                                         # from its first byte, a request has
            async with asyncio.timeout(self.header_timeout):      # header_timeout for its head
                head = first + await reader.readuntil(b"\r\n\r\n")
        except asyncio.TimeoutError:
            await self._send(writer, 408, {"error": "request headers not received within "
                                                    f"{self.header_timeout} s"}, close=True)
            return False
        except asyncio.LimitOverrunError:
            await self._send(writer, 431, {"error": f"request headers over "
                                                    f"{MAX_HEADER_BYTES} bytes"}, close=True)
            return False
        except asyncio.IncompleteReadError:
            return False
        method = "?"
        try:
            method, path, version, headers = _parse_head(head)
            keep_alive = (version == "HTTP/1.1"
                          and "close" not in headers.get("connection", [""])[0].lower())
            return await self._route(reader, writer, method, path, headers, keep_alive)
        except RequestError as exc:
            with self.state.lock:
                self.state.refused += 1
            await self._send(writer, exc.status, {"error": exc.reason, **exc.extra},
                             close=True, head_only=method == "HEAD",
                             allow=exc.extra.get("allow"))
            return False

    async def _route(self, reader, writer, method, path, headers, keep_alive) -> bool:
        state = self.state
        has_body = "content-length" in headers or "transfer-encoding" in headers
        if path not in ("/query", "/health"):
            raise RequestError(404, f"no such endpoint {path}; use POST /query or GET /health")
        wanted = "POST" if path == "/query" else "GET"
        if method != wanted:
            raise RequestError(405, f"{path} takes {wanted}, not {method}", allow=wanted)
        if path == "/health":
            await self._send(writer, 200, state.health(), close=not keep_alive or has_body)
            return keep_alive and not has_body
        content_type = headers.get("content-type", ["application/json"])[0].split(";")[0]
        content_type = content_type.strip().lower()
        binary_answer = NPY in headers.get("accept", [""])[0].lower()
        key = headers.get("idempotency-key", [None])[0]
        if key is not None and not KEY_PATTERN.match(key):
            raise RequestError(400, "Idempotency-Key must be 1-128 visible ASCII characters")
        length = _content_length(headers, state.max_body)
        parser = state.parser(content_type, length)
        # a body is read in big pieces: the stream buffers up to BODY_BUFFER while it lasts
        # (asyncio keeps a private limit; headers stay limited to MAX_HEADER_BYTES)
        # memory and event-loop time are bounded by letting only a few big bodies in at once
        # (a waiting body stays unread in the client's socket)
        big = self._big_bodies if length > BIG_BODY else _NO_WAIT
        slow = (self._json_parser if length > BIG_JSON and isinstance(parser, JsonBatchParser)
                else _NO_WAIT)
        async with big, slow:
            reader._limit = BODY_BUFFER
            try:
                await self._read_body(reader, parser, length)
            finally:
                reader._limit = MAX_HEADER_BYTES
        X = parser.finish()
        loop = asyncio.get_running_loop()
        try:
            answer = await loop.run_in_executor(self.executor, state.answer, X, key)
        except RequestError as exc:
            with state.lock:
                state.refused += 1
            await self._send(writer, exc.status, {"error": exc.reason, **exc.extra},
                             close=not keep_alive)
            return keep_alive
        out = answer["outputs"]
        extra = {"X-Charged": answer["charged"], "X-Replayed": int(answer["replayed"]),
                 "X-Served": state.served, "X-Remaining": answer["remaining"]}
        if binary_answer:
            await self._send_bytes(writer, 200, npy_bytes(out), NPY, extra, close=not keep_alive)
        else:
            await self._send(writer, 200, {**answer, "outputs": out.tolist()}, extra=extra,
                             close=not keep_alive)
        return keep_alive

    async def _read_body(self, reader, parser, length: int) -> None:
        remaining = length
        loop = asyncio.get_running_loop()
        allowed = self.idle_timeout + length / MIN_BODY_RATE   # seconds spent waiting for it
        waited = 0.0
        while remaining:
            if waited > allowed:
                raise RequestError(400, f"body too slow: {length - remaining} of {length} bytes "
                                        f"in {allowed:.1f} s")
            start = loop.time()
            try:
                async with asyncio.timeout(self.idle_timeout):
                    chunk = await reader.read(min(BODY_BUFFER, remaining))
            except asyncio.TimeoutError:
                raise RequestError(400, f"body stalled after {length - remaining} of {length} "
                                        f"bytes (idle over {self.idle_timeout} s)") from None
            if not chunk:
                raise RequestError(400, f"body ended after {length - remaining} of {length} "
                                        f"bytes")
            waited += loop.time() - start
            remaining -= len(chunk)
            if isinstance(parser, NpyBatchParser):
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
        await self._send_bytes(writer, status, json.dumps(payload).encode(), "application/json",
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
            import sys
            print(f"{status} {len(data)} bytes", file=sys.stderr)


class _NoWait:
    """An async context manager that does nothing (a body that needs no slot)."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


_NO_WAIT = _NoWait()


def _parse_head(head: bytes):
    """(method, path, version, headers {lowercase name: [values]}) of a request head."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:                      # pragma: no cover (latin-1 decodes all)
        raise RequestError(400, "request head is not text") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[0].isalpha():
        raise RequestError(400, f"malformed request line {lines[0][:80]!r}")
    method, target, version = parts
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


SERVER_OPTIONS = ("max_connections", "backlog", "header_timeout", "idle_timeout", "workers",
                  "keepalive_timeout")


def make_server(model, host: str = "127.0.0.1", port: int = 0, *, verbose: bool = False,
                **limits) -> BlackBoxServer:
    """A bound (not yet serving) server for ``model``; port 0 picks a free port.

    ``limits`` are the keyword arguments of :class:`ServerState` (``budget``,
    ``round_digits``, ``max_body``, ``max_sequences``, ``max_floats``, ``max_length``,
    ``cache_entries``) and of :class:`BlackBoxServer` (``max_connections``,
    ``backlog``, ``header_timeout``, ``idle_timeout``, ``workers``).
    Call ``serve_forever()`` (in a thread for tests), ``shutdown()`` and ``server_close()``.
    """
    options = {k: limits.pop(k) for k in SERVER_OPTIONS if k in limits}
    return BlackBoxServer((host, port), ServerState(model, **limits), verbose=verbose,
                          **options)
