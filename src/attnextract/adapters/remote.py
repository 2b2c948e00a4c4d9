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
- timeouts, dropped connections, 408 and 5xx answers are retried ``retries`` times with
  exponential backoff (``backoff * 2^attempt`` seconds, capped at 30 s);
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
import socket
import threading
import time
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import (AttnExtractError, BlackBoxError, BudgetExceededError, InputError,
                      MalformedOutputError)
from ..oracle import OUTPUT_KINDS, answer_kind

MAX_BACKOFF = 30.0
NPY = "application/x-npy"
TRANSPORTS = ("npy", "json")


class _Refused(Exception):
    """An HTTP refusal (status, reason, the JSON it carried)."""

    def __init__(self, status: int, reason: str, body: dict, server: str = ""):
        super().__init__(reason)
        self.status, self.reason, self.body, self.server = status, reason, body, server


class HttpBlackBox:
    """A remote black box at ``url`` (``http://HOST:PORT``), called with batches (B, N, d).

    Parameters
    ----------
    url : str
        Base address of a server speaking the :mod:`attnextract.adapters.server` protocol.
    timeout : float
        Seconds to wait for one request's answer.
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
    """

    query_path = "/query"

    def __init__(self, url: str, *, timeout: float = 60.0, retries: int = 4,
                 backoff: float = 0.25, concurrency: int = 4, max_floats: int = 1 << 20,
                 max_sequences: int = 10_000, transport: str = "npy"):
        if not url.startswith(("http://", "https://")):
            raise InputError(f"an HTTP target must start with http:// or https://, got {url!r}")
        if (timeout <= 0 or retries < 0 or backoff < 0 or concurrency < 1 or max_floats < 1
                or max_sequences < 1):
            raise InputError("timeout > 0, retries >= 0, backoff >= 0, concurrency >= 1, "
                             "max_floats >= 1 and max_sequences >= 1 are required")
        if transport not in TRANSPORTS:
            raise InputError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.url = url.rstrip("/")
        parts = urllib.parse.urlsplit(self.url)
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
        self._pool = None

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
        """The server's ``GET /health`` answer (kind, dim, served, budget, remaining)."""
        data, _ = self._request("GET", "/health", None, {"Accept": "application/json"})
        return json.loads(data)

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
        served = self.health().get("dim")
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

    def _encode(self, X: np.ndarray, transport: str) -> tuple[bytes, dict]:
        if transport == "npy":       # the npy header, then the array's own bytes (no copy)
            stream = io.BytesIO()
            np.lib.format.write_array_header_1_0(stream, {
                "descr": "<f8", "fortran_order": False, "shape": X.shape})
            header = stream.getvalue()
            data = memoryview(np.ascontiguousarray(X, dtype="<f8")).cast("B")
            return [header, data], {"Content-Type": NPY, "Accept": NPY,
                                    "Content-Length": str(len(header) + len(data))}
        return (json.dumps({"sequences": X.tolist()}).encode(),
                {"Content-Type": "application/json", "Accept": "application/json"})

    def _decode(self, data: bytes, content_type: str, batch: int) -> np.ndarray:
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
        except ValueError:
            raise MalformedOutputError(
                f"{self.url} answered something that is not JSON: {data[:80]!r}") from None
        outputs = answer.get("outputs") if isinstance(answer, dict) else None
        if not isinstance(outputs, list) or len(outputs) != batch:
            raise MalformedOutputError(
                f"{self.url} answered {type(outputs).__name__} of length "
                f"{len(outputs) if isinstance(outputs, list) else '-'} for {batch} sequences")
        return json_numbers(outputs, self.url)

    def _query(self, X: np.ndarray) -> np.ndarray:
        transport = self.transport
        body, headers = self._encode(X, transport)
        key = uuid.uuid4().hex
        try:
            data, reply = self._request("POST", self.query_path, body,
                                        {**headers, "Idempotency-Key": key}, batch=len(X))
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
                                            {**headers, "Idempotency-Key": key}, batch=len(X))
            except _Refused as again:
                raise self._refusal(again, len(X)) from None
            with self._lock:
                self.transport = "json"
                self.fallbacks += 1
        out = self._decode(data, reply.get("content-type", "").split(";")[0].strip(), len(X))
        out = self._check_answers(out, X)
        charged = reply.get("x-charged")
        with self._lock:
            self.answered += len(X)
            if charged is not None and charged.isdigit():
                self.charges[key] = int(charged)
            else:
                self.charges_known = False
        return out

    def _refusal(self, exc: _Refused, batch: int) -> Exception:
        if exc.status == 429:
            return BudgetExceededError(f"{self.url} refused {batch} sequences: {exc.reason}",
                                       needed=batch, remaining=int(exc.body.get("remaining") or 0))
        return BlackBoxError(f"{self.url} refused the request (HTTP {exc.status}): {exc.reason}")

    def _connection(self, fresh: bool = False) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            cls = (http.client.HTTPSConnection if self._scheme == "https"
                   else http.client.HTTPConnection)
            conn = cls(self._host, self._port, timeout=self.timeout)
            self._local.conn = conn
        return conn

    def _request(self, method: str, path: str, body, headers: dict,
                 batch: int = 0) -> tuple[bytes, dict]:
        """(body, lowercase headers) of a 2xx answer; raises _Refused for 4xx."""
        failure = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                with self._lock:
                    self.retried += 1
                time.sleep(min(self.backoff * 2 ** (attempt - 1), MAX_BACKOFF))
            with self._lock:
                self.requests += 1
                self.sent += batch
            conn = self._connection(fresh=attempt > 0)
            reused = conn.sock is not None
            try:
                if reused and _stale(conn.sock):
                    conn = self._connection(fresh=True)   # the server closed an idle keep-alive
                conn.request(method, (self._base_path + path) or "/", body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                reply = {k.lower(): v for k, v in response.getheaders()}
                status = response.status
                if response.will_close:
                    conn.close()
            except (TimeoutError, socket.timeout, ConnectionError, http.client.HTTPException,
                    OSError) as exc:
                conn.close()
                failure = f"{type(exc).__name__}: {exc}"
                continue
            if status < 300:
                return data, reply
            try:
                error = json.loads(data)
            except ValueError:
                error = {}
            error = error if isinstance(error, dict) else {}
            reason = str(error.get("error", response.reason))
            if status >= 500 or status == 408:       # 408: the server gave up waiting; a
                failure = f"HTTP {status}: {reason}"  # retry is safe (same Idempotency-Key)
                continue
            raise _Refused(status, reason, error, reply.get("server", ""))
        if failure.startswith("HTTP 5"):
            # the server answered, with its own error (a model that fails every batch):
            # "unreachable" sent users looking at the network
            raise BlackBoxError(f"{self.url} answered a server error to all "
                                f"{self.retries + 1} attempt(s), last: {failure} (the server "
                                f"is reachable: its log says why)")
        raise BlackBoxError(f"{self.url} unreachable: {self.retries + 1} attempt(s) failed, "
                            f"last: {failure}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def json_numbers(outputs: list, url: str) -> np.ndarray:
    """A JSON answer's ``outputs`` (B numbers, or nested lists (B, m) or (B, N, m)) as
    float64; strings, booleans, nulls, objects and ragged lists are
    :class:`MalformedOutputError`, never converted."""
    try:
        arr = np.array(outputs, dtype=object)   # rectangular nesting becomes axes
    except ValueError as exc:
        raise MalformedOutputError(f"{url} answered ragged nested lists: {exc}") from None
    for item in arr.ravel():
        if type(item) not in (int, float):      # exact types: bool is an int subclass
            what = ("ragged nested lists" if isinstance(item, list) else
                    "booleans" if isinstance(item, bool) else f"a {type(item).__name__}")
            raise MalformedOutputError(f"{url} answered {what} among its outputs "
                                       f"({item!r:.40}); expected numbers")
    try:
        return arr.astype(np.float64)
    except OverflowError:
        raise MalformedOutputError(f"{url} answered a number beyond the float64 range") from None


def _kind_words(kind: tuple[str, int]) -> str:
    name, m = kind
    return ("one number per sequence" if name == "scalar" else
            f"vectors of m = {m} at the last position" if name == "last" else
            f"vectors of m = {m} at every position")


def _stale(sock: socket.socket) -> bool:
    """True if an idle keep-alive socket was closed by the server (readable at EOF)."""
    import select
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and not sock.recv(1, socket.MSG_PEEK)
    except (OSError, ValueError):
        return True


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
        ``max_sequences`` as for :class:`HttpBlackBox`.

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

    def _encode(self, X, transport):
        payload = self.encode_batch(X)
        headers = {"Accept": "application/json", **self.extra_headers}
        if isinstance(payload, (bytes, bytearray)):
            return bytes(payload), headers
        return json.dumps(payload).encode(), {"Content-Type": "application/json", **headers}

    def _decode(self, data, content_type, batch):
        try:
            answer = json.loads(data)
        except ValueError:
            raise MalformedOutputError(
                f"{self.url} answered something that is not JSON: {data[:80]!r}") from None
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
