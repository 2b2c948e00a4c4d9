"""The hostile HTTP suite as one runnable list: raw requests, the documented answer, time.

Runs against any server speaking the attnextract protocol for a model of token width 4
(docs/serving.md), e.g. the prototypes in benchmarks/parsers/:

    python benchmarks/hostile_http.py --port P [--out FILE.md]

Each case opens a fresh connection, sends raw bytes (some slowly, some not at all) and
reads until the server closes or ``--wait`` seconds pass. A case holds when the status
is the documented one (or, for ``None``, the server hangs up without a word) and, for a
refusal, the body is ``{"error": ...}`` JSON. After every case the server must still
answer ``GET /health``. Prints one JSON line per case, then the count that held.
"""

from __future__ import annotations

import argparse
import io
import json
import socket
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))     # the tests load this file
import _results  # noqa: E402

D = 4


def npy(array) -> bytes:
    stream = io.BytesIO()
    np.lib.format.write_array(stream, np.asarray(array), allow_pickle=False)
    return stream.getvalue()


def npy_header(shape, descr: str, data: bytes = b"") -> bytes:
    stream = io.BytesIO()
    np.lib.format.write_array_header_1_0(stream, {"descr": descr, "fortran_order": False,
                                                  "shape": shape})
    return stream.getvalue() + data


def post(body: bytes, *headers: str, length=None, target="/query") -> bytes:
    length = len(body) if length is None else length
    head = [f"POST {target} HTTP/1.1", "Host: x", f"Content-Length: {length}", *headers,
            "Connection: close"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


ONE = json.dumps({"sequences": [[[0.5] * D]]}).encode()
GOOD_NPY = npy(np.zeros((2, 3, D)))

# (name, bytes sent at once, then "hold" (keep the connection open) or "shut" (half-close)
#  or "close-after" (default: wait for the answer), expected status (None: hang-up),
#  whether the answer must come before the wait runs out (all must))
CASES = [
    ("health", b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 200),
    ("query json", post(ONE), 200),
    ("query npy", post(GOOD_NPY, "Content-Type: application/x-npy"), 200),
    ("query raw float64", post(np.zeros((1, 1, D)).tobytes(),
                               "Content-Type: application/octet-stream", "X-Shape: 1,1,4"), 200),
    ("PATCH /query", b"PATCH /query HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405),
    ("GET /query", b"GET /query HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405),
    ("POST /health", post(ONE, target="/health"), 405),
    ("unknown path", b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404),
    ("two equal Content-Lengths", post(ONE, f"Content-Length: {len(ONE)}"), 400),
    ("two Content-Lengths", post(ONE, "Content-Length: 3"), 400),
    ("Content-Length: 5, 5", b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: 5, 5\r\n\r\n"
                             b"12345", 400),
    ("Content-Length: +5", b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: +5\r\n\r\n12345",
     400),
    ("Content-Length: 0x5", b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: 0x5\r\n\r\n"
                            b"12345", 400),
    ("Content-Length: 23 digits", b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: "
                                  b"99999999999999999999999\r\n\r\n12345", 400),
    ("Content-Length: -3", b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: -3\r\n\r\n", 400),
    ("empty body", post(b""), 400),
    ("chunked", b"POST /query HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"5\r\n12345\r\n0\r\n\r\n", 411),
    ("chunked and Content-Length", b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                                   b"Transfer-Encoding: chunked\r\n\r\n12345", 411),
    ("no Content-Length", b"POST /query HTTP/1.1\r\nHost: x\r\n\r\n", 411),
    ("64 MiB + 1 announced", b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: 67108865\r\n"
                             b"\r\n", 413),
    ("folded header", b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n folded\r\n\r\n"
                      b"12345", 400),
    ("header without colon", b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n", 400),
    ("bad Idempotency-Key", post(ONE, "Idempotency-Key: a b"), 400),
    ("garbage", b"\x00\x01\x02 garbage\r\n\r\n", 400),
    ("request line of 2 parts", b"GET /health\r\n\r\n", 400),
    ("two spaces", b"GET  /health HTTP/1.1\r\n\r\n", 400),
    ("HTTP/1.7", b"GET /health HTTP/1.7\r\nHost: x\r\n\r\n", 505),
    ("HTTP/2.0", b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    ("bare LF", b"GET /health HTTP/1.1\nHost: x\n\n", 400),
    ("headers of 20 kB", b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 431),
    ("JSON NaN", post(b'{"sequences": [[[1, 2, NaN, 4]]]}'), 400),
    ("JSON ragged", post(b'{"sequences": [[[1, 2, 3, 4], [1, 2, 3]]]}'), 400),
    ("JSON width 3", post(b'{"sequences": [[[1, 2, 3]]]}'), 422),
    ("JSON nested 100 000 deep", post(b'{"sequences": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
     400),
    ("npy float32", post(npy_header((1, 1, D), "<f4", b"\0" * 16),
                         "Content-Type: application/x-npy"), 415),
    ("npy of objects", post(npy_header((1, 1, D), "|O", b"\x80\x04" + b"\0" * 30),
                            "Content-Type: application/x-npy"), 415),
    ("npy announcing 4e9 numbers", post(npy_header((10 ** 9, 1, D), "<f8"),
                                        "Content-Type: application/x-npy"), 413),
    ("npy header with code", post(b"\x93NUMPY\x01\x00\x10\x00{'descr': os.system('x')}" +
                                  b"\0" * 40, "Content-Type: application/x-npy"), 400),
    ("npy short", post(GOOD_NPY[:-8], "Content-Type: application/x-npy"), 400),
    ("body shorter than announced, half-closed", post(ONE[:10], length=len(ONE)), 400, "shut"),
    ("body stalls", post(ONE[:10], length=len(ONE)), 408, "hold"),
    ("headers never end", b"POST /query HTTP/1.1\r\nHost: x\r\n", 408, "hold"),
    ("idle connection", b"", None, "hold"),
]


def run_case(port: int, data: bytes, mode: str, wait: float) -> tuple:
    start = time.monotonic()
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        try:
            sock.sendall(data)
            if mode == "shut":
                sock.shutdown(socket.SHUT_WR)
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
                if mode == "hold" and b"\r\n\r\n" in answer:
                    break
        except socket.timeout:
            return None, "no answer", time.monotonic() - start
        except OSError as exc:
            if not answer:
                return None, type(exc).__name__, time.monotonic() - start
    seconds = time.monotonic() - start
    if not answer:
        return None, "hang-up", seconds
    head, _, body = answer.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ")[1])
    except (IndexError, ValueError):
        return None, f"not HTTP: {answer[:40]!r}", seconds
    return status, body[:200], seconds


def health(port: int) -> bool:
    status, _, _ = run_case(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                  b"\r\n", "", 10)
    return status == 200


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--wait", type=float, default=20.0,
                        help="seconds a case may take (header/idle timeouts set below it)")
    parser.add_argument("--against", default="",
                        help="what the server is (the command that started it), for the record")
    _results.add_out_option(parser, __file__)
    args = parser.parse_args(argv)
    if args.against:
        print(f"against: {args.against}")
    held = 0
    for name, data, expected, *mode in CASES:
        status, body, seconds = run_case(args.port, data, mode[0] if mode else "", args.wait)
        json_error = True
        if status is not None and status >= 400:
            try:
                json_error = "error" in json.loads(body)
            except ValueError:
                json_error = False
        ok = status == expected and json_error and seconds < args.wait
        alive = health(args.port)
        held += ok and alive
        print(json.dumps({"case": name, "expected": expected, "got": status,
                          "json_error": json_error, "seconds": round(seconds, 2),
                          "held": bool(ok and alive), "server_alive": alive,
                          "detail": body.decode("latin-1") if isinstance(body, bytes)
                          else body}), flush=True)
    print(json.dumps({"held": held, "cases": len(CASES)}))
    return 0


if __name__ == "__main__":
    with _results.Run(__file__, _results.out_from_argv(__file__)) as results:
        results.capture()
        status = main()
    raise SystemExit(status)
