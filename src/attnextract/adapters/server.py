"""Serve a model as an HTTP black box: ``attnextract serve --secret FILE.npz --port P``.

The black box a remote API would be: it answers one number per sequence and
nothing else, counts what it serves, enforces its own query budget, and survives
any request a client can send.

Protocol (JSON over HTTP/1.1, stdlib ``http.server``, one thread per connection):

- ``POST /query`` with ``{"sequences": [[[x_11, ..., x_1d], ...], ...]}``, a batch of
  B >= 1 sequences of N >= 1 tokens of width d (one N per request) ->
  ``200 {"outputs": [f_1, ..., f_B], "remaining": R}`` (R is null without a budget).
  Floats travel as shortest round-trip decimals, so float64 values arrive exactly.
- ``GET /health`` -> ``200 {"ok": true, "kind": ..., "dim": d, "served": n,
  "budget": b, "remaining": R}``.
- Every refused request gets ``{"error": reason}`` and a 4xx status: 400 not JSON,
  not an object, no ``sequences``, ragged, empty, non-numbers, NaN or infinity;
  411 no Content-Length; 413 body, batch or sequence too large; 422 wrong token
  width; 404 unknown path; 405 wrong method; 429 the budget cannot cover the whole
  batch (nothing of it is answered or counted). An unexpected failure is a 500; the
  server keeps serving after every one of them.

A client may send the batch as raw little-endian float64 instead of JSON
(``Content-Type: application/octet-stream``, header ``X-Shape: B,N,d``; the same
limits and refusals; ``/health`` says ``"binary": true``): 8 bytes a number instead
of about 20, and no parsing (the JSON text of a 384-wide layer costs more than the
layer itself).

``--round DIGITS`` rounds every output to that many decimals, as APIs that print
their answers do (the extraction then meets a noisy black box).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from ..errors import InputError

BINARY_TYPE = "application/octet-stream"   # float64 body, shape in the X-Shape header
MAX_BODY_BYTES = 64 << 20        # 64 MiB of JSON, about 3M numbers
MAX_SEQUENCES = 100_000          # sequences per request
MAX_FLOATS = 4 << 20             # B * N * d per request
MAX_LENGTH = 4096                # tokens per sequence
REQUEST_TIMEOUT = 30.0           # seconds a connection may stall while sending


class RequestError(Exception):
    """A refused request: an HTTP status and the reason sent back."""

    def __init__(self, status: int, reason: str, **extra):
        super().__init__(reason)
        self.status, self.reason, self.extra = status, reason, extra


class ServerState:
    """The model behind the endpoint, its limits and its budget (thread-safe)."""

    def __init__(self, model, *, budget: int | None = None, round_digits: int | None = None,
                 max_body: int = MAX_BODY_BYTES, max_sequences: int = MAX_SEQUENCES,
                 max_floats: int = MAX_FLOATS, max_length: int = MAX_LENGTH):
        if budget is not None and budget < 0:
            raise InputError(f"budget must be >= 0, got {budget}")
        self.model = model
        self.dim = int(model.dim)
        self.budget, self.round_digits = budget, round_digits
        self.max_body, self.max_sequences = max_body, max_sequences
        self.max_floats, self.max_length = max_floats, max_length
        self.served = 0
        self.refused = 0
        self.lock = threading.Lock()

    @property
    def remaining(self) -> int | None:
        return None if self.budget is None else self.budget - self.served

    def parse(self, body: bytes) -> np.ndarray:
        """The batch (B, N, d) of a request body, or RequestError with the reason."""
        def no_constants(name):
            raise ValueError(f"{name} is not a number this server accepts")
        try:
            payload = json.loads(body, parse_constant=no_constants)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RequestError(400, f"body is not valid JSON: {exc}") from None
        except RecursionError:
            raise RequestError(400, "body is not valid JSON: nested too deeply") from None
        if not isinstance(payload, dict) or "sequences" not in payload:
            raise RequestError(400, 'body must be a JSON object {"sequences": [[[...]]]}')
        sequences = payload["sequences"]
        if not isinstance(sequences, list) or not sequences:
            raise RequestError(400, '"sequences" must be a non-empty list of sequences')
        if len(sequences) > self.max_sequences:
            raise RequestError(413, f"{len(sequences)} sequences in one request; at most "
                                    f"{self.max_sequences}")
        try:
            X = np.array(sequences)
        except (ValueError, TypeError):
            raise RequestError(400, "sequences are ragged: every sequence of a request must "
                                    "have the same length and every token d numbers") from None
        if X.dtype == object:
            raise RequestError(400, "sequences are ragged or hold non-numbers")
        if X.dtype.kind not in "iuf" or X.dtype == np.bool_:
            raise RequestError(400, f"tokens must be numbers, got {X.dtype.kind!r} values")
        if X.ndim != 3 or X.shape[1] < 1:
            raise RequestError(400, f"sequences must form an array (B, N, {self.dim}) with "
                                    f"N >= 1; got shape {list(X.shape)}")
        if X.shape[2] != self.dim:
            raise RequestError(422, f"tokens must have width {self.dim}, got {X.shape[2]}")
        if X.shape[1] > self.max_length:
            raise RequestError(413, f"sequences of {X.shape[1]} tokens; at most {self.max_length}")
        if X.size > self.max_floats:
            raise RequestError(413, f"{X.size} numbers in one request; at most {self.max_floats}")
        X = X.astype(np.float64)
        if not np.all(np.isfinite(X)):
            raise RequestError(400, "sequences contain NaN or infinity (or numbers beyond "
                                    "float64)")
        return X

    def parse_binary(self, body: bytes, shape: str) -> np.ndarray:
        """The batch (B, N, d) of a binary request: little-endian float64, shape "B,N,d"."""
        try:
            B, N, d = (int(x) for x in shape.split(","))
        except ValueError:
            raise RequestError(400, f'a binary body needs the header X-Shape: "B,N,d", '
                                    f"got {shape!r}") from None
        if B < 1 or N < 1 or d < 1:
            raise RequestError(400, f"X-Shape must be positive, got {shape!r}")
        if d != self.dim:
            raise RequestError(422, f"tokens must have width {self.dim}, got {d}")
        if B > self.max_sequences:
            raise RequestError(413, f"{B} sequences in one request; at most {self.max_sequences}")
        if N > self.max_length:
            raise RequestError(413, f"sequences of {N} tokens; at most {self.max_length}")
        if B * N * d > self.max_floats:
            raise RequestError(413, f"{B * N * d} numbers in one request; at most {self.max_floats}")
        if len(body) != 8 * B * N * d:
            raise RequestError(400, f"a binary body of shape {shape} holds {8 * B * N * d} "
                                    f"bytes, got {len(body)}")
        X = np.frombuffer(body, dtype="<f8").reshape(B, N, d).astype(np.float64)
        if not np.all(np.isfinite(X)):
            raise RequestError(400, "sequences contain NaN or infinity")
        return X

    def answer(self, X: np.ndarray) -> dict:
        """Outputs of a parsed batch, charged to the budget (all or nothing)."""
        with self.lock:
            if self.budget is not None and len(X) > self.budget - self.served:
                raise RequestError(429, f"budget exhausted: {len(X)} sequences asked, "
                                        f"{self.budget - self.served} of {self.budget} remain",
                                   remaining=self.budget - self.served)
            self.served += len(X)
            remaining = self.remaining
        try:
            out = np.asarray(self.model(X), dtype=np.float64).reshape(len(X))
        except Exception:
            with self.lock:            # a batch the model failed on is not charged
                self.served -= len(X)
            raise
        if self.round_digits is not None:
            out = np.round(out, self.round_digits)
        return {"outputs": out.tolist(), "remaining": remaining}

    def health(self) -> dict:
        with self.lock:
            return {"ok": True, "kind": self.model.kind, "dim": self.dim, "binary": True,
                    "served": self.served,
                    "budget": self.budget, "remaining": self.remaining}


class QueryHandler(BaseHTTPRequestHandler):
    """``POST /query`` and ``GET /health``; every other request gets a 4xx and a reason."""

    protocol_version = "HTTP/1.1"
    timeout = REQUEST_TIMEOUT          # a stalled client frees its thread
    server_version = "attnextract"

    @property
    def state(self) -> ServerState:
        return self.server.state

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")

    def do_PUT(self):
        self._route("PUT")

    def do_DELETE(self):
        self._route("DELETE")

    def _route(self, method: str) -> None:
        try:
            path = self.path.split("?", 1)[0]
            if path not in ("/query", "/health"):
                raise RequestError(404, f"no such endpoint {path}; use POST /query or GET /health")
            wanted = "POST" if path == "/query" else "GET"
            if method != wanted:
                raise RequestError(405, f"{path} takes {wanted}, not {method}", allow=wanted)
            if path == "/health":
                self._send(200, self.state.health())
                return
            body = self._read_body()
            if self.headers.get("Content-Type", "").startswith(BINARY_TYPE):
                batch = self.state.parse_binary(body, self.headers.get("X-Shape", ""))
            else:
                batch = self.state.parse(body)
            self._send(200, self.state.answer(batch))
        except RequestError as exc:
            with self.state.lock:
                self.state.refused += 1
            self._send(exc.status, {"error": exc.reason, **exc.extra})
        except Exception as exc:     # never let one request take the server down
            self._send(500, {"error": f"internal error: {type(exc).__name__}: {exc}"})

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise RequestError(411, "chunked bodies are not accepted; send Content-Length")
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            raise RequestError(411, "a Content-Length header is required")
        try:
            length = int(length)
        except ValueError:
            self.close_connection = True
            raise RequestError(400, f"bad Content-Length {length!r}") from None
        if length < 0:
            self.close_connection = True
            raise RequestError(400, f"bad Content-Length {length}")
        if length > self.state.max_body:
            self.close_connection = True       # the unread body would be taken as a request
            raise RequestError(413, f"body of {length} bytes; at most {self.state.max_body}")
        body = self.rfile.read(length)
        if len(body) < length:
            self.close_connection = True
            raise RequestError(400, f"body ended after {len(body)} of {length} bytes")
        return body

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 405:
                self.send_header("Allow", payload.get("allow", "GET, POST"))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:                # the client went away: nothing to answer
            self.close_connection = True

    def log_message(self, format, *args):
        if getattr(self.server, "verbose", False):
            super().log_message(format, *args)


class BlackBoxServer(ThreadingHTTPServer):
    """A threaded HTTP server holding a :class:`ServerState`."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, state: ServerState, handler=QueryHandler, verbose=False):
        self.state, self.verbose = state, verbose
        super().__init__(address, handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


def make_server(model, host: str = "127.0.0.1", port: int = 0, *, handler=QueryHandler,
                verbose: bool = False, **limits) -> BlackBoxServer:
    """A bound (not yet serving) server for ``model``; port 0 picks a free port.

    ``limits`` are the keyword arguments of :class:`ServerState` (``budget``,
    ``round_digits``, ``max_body``, ``max_sequences``, ``max_floats``, ``max_length``).
    Call ``serve_forever()`` (in a thread for tests) and ``shutdown()``.
    """
    return BlackBoxServer((host, port), ServerState(model, **limits), handler, verbose)
