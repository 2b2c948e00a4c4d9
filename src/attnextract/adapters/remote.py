"""An HTTP endpoint as a black box: ``attnextract extract --target http://HOST:PORT``.

:class:`HttpBlackBox` is a callable (B, N, d) -> (B,) like any other target, so the
oracle (counting, budget, journal) and every learner work through it unchanged. It
speaks the protocol of :mod:`attnextract.adapters.server` (``POST /query`` with
``{"sequences": ...}``, answers ``{"outputs": ...}``) with the standard library
only (``urllib``):

- a batch is cut into requests of at most ``max_floats`` numbers, sent by
  ``concurrency`` threads at once, answers put back in order;
- timeouts, dropped connections and 5xx answers are retried ``retries`` times with
  exponential backoff (``backoff * 2^attempt`` seconds, capped at 30 s);
- 429 (the server's budget) raises :class:`BudgetExceededError`, other 4xx raise
  :class:`BlackBoxError` with the server's reason, a server that stays unreachable
  raises :class:`BlackBoxError` naming the URL and the last failure, and an answer
  of the wrong shape raises :class:`MalformedOutputError`.

Floats travel as shortest round-trip decimals (Python's ``repr``), so float64
queries and answers cross the wire exactly. With ``binary=True`` batches go as raw
float64 instead (``X-Shape: B,N,d``; servers whose ``/health`` says ``"binary": true``),
exact too and without the JSON text's cost.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import BlackBoxError, BudgetExceededError, InputError, MalformedOutputError

MAX_BACKOFF = 30.0
BINARY_GAIN = 4        # a float64 body carries 4 x max_floats numbers (8 bytes each, not ~20)


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
        Numbers per request (B * N * d); a larger batch is cut into several requests.
    max_sequences : int
        Sequences per request (the server's own limit is 100000).
    binary : bool
        Send batches as raw float64 (``X-Shape: B,N,d``) instead of JSON text, with
        BINARY_GAIN x ``max_floats`` numbers a request; the server's ``/health`` must
        say ``"binary": true`` (checked once).
    """

    def __init__(self, url: str, *, timeout: float = 60.0, retries: int = 4,
                 backoff: float = 0.25, concurrency: int = 4, max_floats: int = 1 << 18,
                 max_sequences: int = 10_000, binary: bool = False):
        if not url.startswith(("http://", "https://")):
            raise InputError(f"an HTTP target must start with http:// or https://, got {url!r}")
        if (timeout <= 0 or retries < 0 or backoff < 0 or concurrency < 1 or max_floats < 1
                or max_sequences < 1):
            raise InputError("timeout > 0, retries >= 0, backoff >= 0, concurrency >= 1, "
                             "max_floats >= 1 and max_sequences >= 1 are required")
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.concurrency, self.max_floats = concurrency, max_floats
        self.max_sequences = max_sequences
        self.requests = 0          # HTTP requests made, retries included
        self.retried = 0           # of which retries
        self.binary = bool(binary)  # float64 bodies instead of JSON text
        self.binary_checked = False

    def __call__(self, X) -> np.ndarray:
        """Outputs (B,) of the batch X (B, N, d), in order."""
        X = np.asarray(X, dtype=np.float64)
        if self.binary and self.binary_checked is False:   # the server must say it takes them
            self.binary_checked = True
            if not self.health().get("binary", False):
                raise BlackBoxError(f"{self.url} does not take float64 bodies (its /health "
                                    "has no \"binary\": true); use JSON (binary=False)")
        floats = self.max_floats * (BINARY_GAIN if self.binary else 1)
        per_request = max(1, min(self.max_sequences, floats // max(1, X.shape[1] * X.shape[2])))
        chunks = [X[i:i + per_request] for i in range(0, len(X), per_request)]
        if len(chunks) == 1 or self.concurrency == 1:
            return np.concatenate([self._query(c) for c in chunks])
        with ThreadPoolExecutor(min(self.concurrency, len(chunks))) as pool:
            return np.concatenate(list(pool.map(self._query, chunks)))

    def health(self) -> dict:
        """The server's ``GET /health`` answer (kind, dim, served, budget, remaining)."""
        return self._request("GET", "/health", None)

    def check_dim(self, dim: int) -> None:
        """Raise InputError unless the server takes tokens of width ``dim``."""
        served = self.health().get("dim")
        if served != dim:
            raise InputError(f"{self.url} serves tokens of width {served}, not --dim {dim}")

    def _query(self, X: np.ndarray) -> np.ndarray:
        if self.binary:
            body = np.ascontiguousarray(X, dtype="<f8").tobytes()
            answer = self._request("POST", "/query", body, batch=len(X), headers={
                "Content-Type": "application/octet-stream", "X-Shape": ",".join(map(str, X.shape))})
        else:
            body = json.dumps({"sequences": X.tolist()}).encode()
            answer = self._request("POST", "/query", body, batch=len(X))
        outputs = answer.get("outputs") if isinstance(answer, dict) else None
        if not isinstance(outputs, list) or len(outputs) != len(X):
            raise MalformedOutputError(
                f"{self.url} answered {type(outputs).__name__} of length "
                f"{len(outputs) if isinstance(outputs, list) else '-'} for {len(X)} sequences")
        try:
            return np.array(outputs, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise MalformedOutputError(f"{self.url} answered non-numbers: {exc}") from None

    def _request(self, method: str, path: str, body: bytes | None, batch: int = 0,
                 headers: dict | None = None):
        headers = {"Content-Type": "application/json", "Accept": "application/json",
                   **(headers or {})}
        failure = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                self.retried += 1
                time.sleep(min(self.backoff * 2 ** (attempt - 1), MAX_BACKOFF))
            self.requests += 1
            request = urllib.request.Request(self.url + path, data=body, method=method,
                                             headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
            except urllib.error.HTTPError as exc:
                error = _error_body(exc)
                reason = str(error.get("error", exc.reason))
                if exc.code == 429:
                    remaining = error.get("remaining", 0)
                    raise BudgetExceededError(
                        f"{self.url} refused {batch} sequences: {reason}", needed=batch,
                        remaining=int(remaining or 0)) from None
                if exc.code >= 500:
                    failure = f"HTTP {exc.code}: {reason}"
                    continue
                raise BlackBoxError(f"{self.url}{path} refused the request "
                                    f"(HTTP {exc.code}): {reason}") from None
            except (urllib.error.URLError, TimeoutError, socket.timeout, ConnectionError,
                    http.client.HTTPException, OSError) as exc:
                failure = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
                continue
            try:
                return json.loads(raw)
            except ValueError:
                raise MalformedOutputError(
                    f"{self.url}{path} answered something that is not JSON: {raw[:80]!r}"
                ) from None
        raise BlackBoxError(f"{self.url} unreachable: {self.retries + 1} attempt(s) failed, "
                            f"last: {failure}")

    def __repr__(self) -> str:
        return f"HttpBlackBox({self.url!r})"


def _error_body(exc: urllib.error.HTTPError) -> dict:
    """The JSON object a refusal carries (``{"error": reason, ...}``), or {}."""
    try:
        data = json.loads(exc.read())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
