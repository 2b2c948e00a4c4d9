"""The server under attack: methods, framing, slow senders, floods, big bodies, npy bodies.

Every loop is bounded in count and time; all traffic stays on 127.0.0.1. Timing is
never asserted: a server that waited where it must answer at once makes a socket
timeout (a few seconds) fail the test instead.
"""

import io
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from attnextract import Oracle
from attnextract.adapters.remote import HttpBlackBox
from attnextract.adapters.server import npy_bytes
from attnextract.adapters.targets import random_single_head

D = 4


@pytest.fixture
def serve(start_server):
    """Start servers (default: a single head of width D) on free loopback ports in threads;
    all shut down after the test."""
    return lambda model=None, **kw: start_server(model or random_single_head(D, seed=3), **kw)


def exchange(server, data: bytes, timeout=5.0, shut=False) -> bytes:
    """Send raw bytes on a fresh connection; everything the server answers until it closes."""
    with socket.create_connection(server.server_address[:2], timeout=timeout) as sock:
        sock.sendall(data)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def status_and_json(answer: bytes):
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    return status, (json.loads(body) if body else None), head.decode("latin-1")


def query(body: bytes, *headers: str, length=None) -> bytes:
    length = len(body) if length is None else length
    head = ["POST /query HTTP/1.1", "Host: x", f"Content-Length: {length}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


ONE = json.dumps({"sequences": [[[0.5] * D]]}).encode()


@pytest.mark.parametrize("method", ["PATCH", "OPTIONS", "TRACE", "PUT", "DELETE", "CONNECT",
                                    "PROPFIND", "GET"])
def test_every_other_method_is_a_405_with_json(serve, method):
    server = serve()
    status, body, head = status_and_json(exchange(
        server, f"{method} /query HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()))
    assert status == 405 and "application/json" in head and "Allow: POST" in head
    assert "takes POST" in body["error"]
    status, body, _ = status_and_json(exchange(
        server, f"{method} /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()))
    assert (status == 405 and "takes GET" in body["error"]) or method == "GET"


def test_head_gets_a_405_without_a_body(serve):
    server = serve()
    status, body, head = status_and_json(exchange(server, b"HEAD /query HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert status == 405 and body is None and "application/json" in head


@pytest.mark.parametrize("headers, status, reason", [
    (["Content-Length: 5", "Content-Length: 5"], 400, "more than one Content-Length"),
    (["Content-Length: 5", "Content-Length: 6"], 400, "more than one Content-Length"),
    (["Content-Length: 5, 5"], 400, "more than one Content-Length"),
    (["Content-Length: +5"], 400, "bad Content-Length"),
    (["Content-Length: 0x5"], 400, "bad Content-Length"),
    (["Content-Length: 5 5"], 400, "bad Content-Length"),
    (["Content-Length: 99999999999999999999999"], 400, "bad Content-Length"),
    (["Content-Length: 0"], 400, "empty body"),
    (["Transfer-Encoding: chunked"], 411, "chunked"),
    (["Content-Length: 5", "Transfer-Encoding: chunked"], 411, "chunked"),
    ([], 411, "Content-Length header is required"),
    (["Content-Length: 67108865"], 413, "at most 67108864"),
    (["Content-Length: 5", " folded"], 400, "malformed header"),
    (["no colon here"], 400, "malformed header"),
    (["Content-Length: 5", "Idempotency-Key: a b"], 400, "Idempotency-Key"),
])
def test_malformed_framing_is_refused_at_once(serve, headers, status, reason):
    server = serve()
    head = "\r\n".join(["POST /query HTTP/1.1", "Host: x", *headers]) + "\r\n\r\n"
    got, body, _ = status_and_json(exchange(server, head.encode() + b"12345"))
    assert (got, reason in body["error"]) == (status, True), body
    assert server.state.served == 0


@pytest.mark.parametrize("line", [b"\x00\x01\x02 garbage", b"GET /health", b"GET /health HTTP/1",
                                  b"GET /health HTTP/1.10", b"G3T /health HTTP/1.1",
                                  b"GET  /health HTTP/1.1"])
def test_bad_request_lines(serve, line):
    server = serve()
    status, body, _ = status_and_json(exchange(server, line + b"\r\n\r\n"))
    assert status == 400 and "request line" in body["error"]


@pytest.mark.parametrize("version", [b"HTTP/1.7", b"HTTP/2.0", b"HTTP/0.9", b"HTTP/3.0"])
def test_other_http_versions_get_a_505(serve, version):
    server = serve()
    status, body, head = status_and_json(exchange(server, b"GET /health " + version +
                                                  b"\r\nHost: x\r\n\r\n"))
    assert status == 505 and "HTTP Version Not Supported" in head and "HTTP/1.1" in body["error"]
    assert HttpBlackBox(server.url).health()["ok"]


@pytest.mark.parametrize("request_bytes", [
    b"GET /health HTTP/1.1\n\n",                                   # bare LF everywhere
    b"GET /health HTTP/1.1\r\nHost: x\n\r\n",                       # one header line
    b"GET /health HTTP/1.1\nHost: x\r\n\r\n",                       # the request line
    b"GET /health HTTP/1.1\r\nHost: x\rX: y\r\n\r\n",               # a bare CR
    b"\n",
])
def test_a_bare_lf_request_gets_a_400_at_once(serve, request_bytes):
    """Not a 408 after the header timeout: the connection stays open on the client side,
    so a server waiting for CRLF CRLF would answer only after 30 s (the timeout set here
    fails the test long before)."""
    server = serve(header_timeout=30.0)
    status, body, _ = status_and_json(exchange(server, request_bytes, timeout=10.0))
    assert status == 400 and "CRLF" in body["error"]


def test_oversized_headers_431_and_pipelined_requests_answered_in_order(serve):
    server = serve(max_floats=100)
    huge = b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n"
    assert status_and_json(exchange(server, huge))[0] == 431
    X1, X2 = np.full((1, 1, D), 0.25), np.full((2, 1, D), -0.5)
    pipelined = (query(json.dumps({"sequences": X1.tolist()}).encode()) +
                 query(json.dumps({"sequences": X2.tolist()}).encode(), "Connection: close"))
    answers = exchange(server, pipelined).split(b"HTTP/1.1 ")[1:]
    outputs = [json.loads(a.partition(b"\r\n\r\n")[2])["outputs"] for a in answers]
    model = random_single_head(D, seed=3)
    assert outputs == [model(X1).tolist(), model(X2).tolist()]


def test_a_short_body_is_refused_after_the_idle_timeout_not_30_s(serve):
    server = serve(idle_timeout=0.3)
    # the client keeps the connection open but never sends the rest: the server must
    # answer within its idle timeout (the socket timeout of 5 s would fail this test)
    status, body, _ = status_and_json(exchange(server, query(ONE[:10], length=len(ONE))))
    assert status == 408 and "stalled after 10 of" in body["error"]
    status, body, _ = status_and_json(exchange(server, query(ONE[:10], length=len(ONE)),
                                               shut=True))           # half-closed: at once
    assert status == 400 and "ended after 10 of" in body["error"]
    assert server.state.served == 0


@pytest.mark.parametrize("tokens", [1e308, -1e308, 1e200])
def test_overflowing_inputs_give_a_500_with_json_and_are_not_charged(serve, tokens):
    server = serve(budget=10)
    X = np.full((2, 3, D), tokens)
    X[:, 1] *= -1
    status, body, head = status_and_json(exchange(server, query(
        json.dumps({"sequences": X.tolist()}).encode(), "Connection: close")))
    if status == 200:                  # a finite answer is a correct answer
        assert all(np.isfinite(body["outputs"]))
    else:
        assert status == 500 and "NaN or infinity" in body["error"]
        assert server.state.served == 0 and server.state.remaining == 10


def test_a_model_answering_nan_is_refused_and_not_charged(serve):
    def broken(X):
        return np.full(len(X), np.nan)
    broken.dim, broken.kind = D, "custom"
    server = serve(broken, budget=5)
    status, body, _ = status_and_json(exchange(server, query(ONE, "Connection: close")))
    assert status == 500 and "not charged" in body["error"] and server.state.served == 0


@pytest.mark.slow
def test_slowloris_clients_are_dropped_and_honest_clients_are_served(serve):
    """100 clients send headers one byte at a time; 40 honest queries meanwhile all succeed."""
    server = serve(header_timeout=1.0)
    slow = []
    for _ in range(100):
        sock = socket.create_connection(server.server_address[:2], timeout=5)
        sock.sendall(b"POST /query HTTP/1.1\r\n")
        slow.append(sock)
    model = random_single_head(D, seed=3)
    box = HttpBlackBox(server.url, concurrency=1, retries=0)
    X = np.random.default_rng(0).standard_normal((1, 2, D))
    answers = []
    for i in range(40):                           # about 2 s, slow clients dribbling
        for sock in slow[i % 10::10]:
            try:
                sock.sendall(b"X")
            except OSError:
                pass
        answers.append(box(X)[0])
        time.sleep(0.05)
    assert answers == [model(X)[0]] * 40
    assert server.peak_connections >= 100
    closed = 0
    for sock in slow:                             # every slow client was cut off (408 or EOF)
        try:
            data = sock.recv(4096)
            closed += data == b"" or data.startswith(b"HTTP/1.1 408")
        except OSError:
            closed += 1
        sock.close()
    assert closed == 100


def test_connections_are_capped_with_a_503(serve):
    server = serve(max_connections=20, header_timeout=5.0)
    idle = [socket.create_connection(server.server_address[:2], timeout=5) for _ in range(20)]
    try:
        time.sleep(0.2)
        status, body, _ = status_and_json(exchange(server, b"GET /health HTTP/1.1\r\n\r\n"))
        assert status == 503 and "too many connections" in body["error"]
        assert server.rejected_connections >= 1
    finally:
        for sock in idle:
            sock.close()
    for _ in range(50):                          # the slots free up as the idle ones close
        if server.connections == 0:
            break
        time.sleep(0.05)
    assert HttpBlackBox(server.url).health()["ok"]


@pytest.mark.slow
def test_a_flood_of_requests_gets_no_resets(serve):
    model = random_single_head(D, seed=3)
    server = serve(model)
    X = np.random.default_rng(2).standard_normal((2, 2, D))
    body = json.dumps({"sequences": X.tolist()}).encode()
    expected = model(X).tolist()

    def one_thread(_):
        good = 0
        for _ in range(25):                      # a fresh connection per request
            status, answer, _ = status_and_json(exchange(server, query(body, "Connection: close")))
            good += status == 200 and answer["outputs"] == expected
        return good

    with ThreadPoolExecutor(40) as pool:
        assert sum(pool.map(one_thread, range(40))) == 1000
    assert server.state.served == 2000


def test_big_bodies_are_refused_by_their_number_count_without_being_read(serve):
    """8 clients at once announce 64 MiB of JSON numbers; each is refused after 2^16 numbers."""
    server = serve(max_floats=1 << 16)
    token = b"[" + b",".join([b"0.123456789012345"] * D) + b"]"
    chunk = (b"[" + b",".join([token] * 10) + b"],") * 200        # sequences of 10 tokens

    def big(_):
        sent = 0
        with socket.create_connection(server.server_address[:2], timeout=10) as sock:
            sock.sendall(query(b'{"sequences": [', length=64 << 20))
            try:
                while sent < 64 << 20:
                    sock.sendall(chunk)
                    sent += len(chunk)
            except OSError:
                pass
            answer = b""
            try:
                answer = sock.recv(4096)
            except OSError:
                pass
        return sent, answer

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(big, range(8)))
    for sent, answer in results:
        # refused after 2^16 numbers; the rest of the body is drained (discarded, at most
        # LINGER_TIMEOUT s) so the 413 reaches a client that writes its whole body first
        if answer:                                # (a drain cut at its bound may still reset)
            status, body, _ = status_and_json(answer)
            assert status == 413 and "more than 65536 numbers" in body["error"]
    assert server.state.served == 0 and HttpBlackBox(server.url).health()["ok"]


# -- npy bodies ---------------------------------------------------------------------------

def npy_with_header(header: dict, data: bytes = b"", version=(1, 0)) -> bytes:
    stream = io.BytesIO()
    np.lib.format.write_array_header_1_0(stream, header)
    return stream.getvalue() + data


@pytest.mark.parametrize("body, status, reason", [
    (npy_bytes(np.zeros((2, 3, 3))), 422, "width 4"),
    (npy_bytes(np.zeros((2, D))), 400, "(B, N, 4)"),
    (npy_bytes(np.zeros((0, 1, D))), 400, "(B, N, 4)"),
    (npy_bytes(np.zeros((2, 3, D)))[:-8], 400, "not the npy size"),
    (npy_bytes(np.zeros((2, 3, D))) + b"\0" * 8, 400, "not the npy size"),
    (npy_with_header({"descr": "<f4", "fortran_order": False, "shape": (1, 1, D)},
                     b"\0" * 16), 415, "float64"),
    (npy_with_header({"descr": "|O", "fortran_order": False, "shape": (1, 1, D)},
                     b"\x80\x04" + b"\0" * 30), 415, "float64"),
    (npy_with_header({"descr": "<f8", "fortran_order": False, "shape": (10 ** 9, 1, D)}),
     413, "at most"),
    (npy_with_header({"descr": "<f8", "fortran_order": False, "shape": (1, 10 ** 5, D)}),
     413, "tokens"),
    (b"\x93NUMPX\x01\x00" + b"\0" * 40, 400, "bad magic"),
    (b"\x93NUMPY\x09\x00" + b"\0" * 40, 400, "version"),
    (b"\x93NUMPY\x01\x00\xff\xff" + b"\0" * 40, 400, "header of 65535 bytes"),
    (b"\x93NUMPY\x01\x00\x10\x00{'descr': os.system('x')}" + b"\0" * 40, 400, "bad npy header"),
    (npy_bytes(np.full((1, 2, D), np.inf)), 400, "NaN or infinity"),
])
def test_bad_npy_bodies(serve, body, status, reason):
    server = serve()
    got, answer, _ = status_and_json(exchange(server, query(
        body, "Content-Type: application/x-npy", "Connection: close")))
    assert (got, reason in answer["error"]) == (status, True), answer
    assert server.state.served == 0


def test_npy_both_ways_is_exact_for_extreme_values(serve):
    model = random_single_head(D, seed=8)
    server = serve(model)
    rng = np.random.default_rng(0)
    X = rng.standard_normal((50, 3, D)) * np.array([1e-300, 5e-324, 1.0, 1e15])  # subnormals too
    X[::2] = np.nextafter(X[::2], np.inf)
    for transport in ("npy", "json"):
        box = HttpBlackBox(server.url, transport=transport, max_floats=7 * 3 * D)
        assert np.array_equal(box(X), model(X)) and box.transport == transport
    fortran = npy_bytes(X)        # a Fortran-ordered npy is read in its own order
    stream = io.BytesIO()
    np.lib.format.write_array(stream, np.asfortranarray(X))
    for body in (fortran, stream.getvalue()):
        answer = exchange(server, query(body, "Content-Type: application/x-npy",
                                        "Accept: application/x-npy", "Connection: close"))
        out = np.lib.format.read_array(io.BytesIO(answer.partition(b"\r\n\r\n")[2]),
                                       allow_pickle=False)
        assert out.dtype == np.float64 and np.array_equal(out, model(X))


def test_client_falls_back_to_json_for_a_server_without_npy(serve):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    model = random_single_head(D, seed=9)

    class JsonOnly(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers["Content-Type"] != "application/json":
                status, answer = 415, {"error": "JSON only"}
            else:
                X = np.array(json.loads(body)["sequences"])
                status, answer = 200, {"outputs": model(X).tolist()}
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    old = ThreadingHTTPServer(("127.0.0.1", 0), JsonOnly)
    threading.Thread(target=old.serve_forever, daemon=True).start()
    try:
        box = HttpBlackBox(f"http://127.0.0.1:{old.server_address[1]}", max_floats=5 * 2 * D)
        X = np.random.default_rng(3).standard_normal((23, 2, D))
        assert np.array_equal(Oracle(box, D).query(X), model(X))
        assert box.transport == "json" and box.fallbacks >= 1
        assert box.accounting()["queries_charged_by_server"] is None    # it does not say
    finally:
        old.shutdown()
        old.server_close()


def test_a_400_from_our_own_server_is_about_the_batch_not_the_format(serve):
    from attnextract import BlackBoxError
    server = serve()
    box = HttpBlackBox(server.url)
    with pytest.raises(BlackBoxError, match="HTTP 400.*NaN or infinity"):
        box(np.full((2, 1, D), np.nan))
    assert box.transport == "npy" and box.fallbacks == 0


@pytest.mark.slow
def test_an_idle_keep_alive_connection_is_not_taken_for_a_slow_request(serve):
    """The header timeout runs from a request's first byte, not from the previous answer."""
    server = serve(header_timeout=0.3, keepalive_timeout=5.0)
    with socket.create_connection(server.server_address[:2], timeout=5) as sock:
        for _ in range(2):
            sock.sendall(query(ONE))
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200"), answer
            time.sleep(0.6)                      # idle longer than the header timeout
    quiet = serve(keepalive_timeout=0.3)
    with socket.create_connection(quiet.server_address[:2], timeout=5) as sock:
        assert sock.recv(100) == b""             # idle past the keep-alive limit: closed, no 408


@pytest.mark.slow
def test_the_hostile_suite_of_the_parser_comparison_holds(serve, capsys):
    """benchmarks/hostile_http.py (the suite the h11 and uvicorn prototypes were measured
    with, docs/serving.md) against this server: every case gets its documented answer."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "hostile_http.py"
    spec = importlib.util.spec_from_file_location("hostile_http", path)
    hostile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hostile)
    server = serve(header_timeout=1.0, idle_timeout=0.5, keepalive_timeout=2.0)
    hostile.main(["--port", str(server.server_address[1]), "--wait", "20"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    failed = [row for row in rows[:-1] if not row["held"]]
    assert failed == [] and rows[-1] == {"held": len(hostile.CASES), "cases": len(hostile.CASES)}
