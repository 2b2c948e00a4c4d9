"""The HTTP black box: a real server on a loopback port, a real client, bad requests, budget, retries."""

import http.client
import json
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from attnextract import (BlackBoxError, BudgetExceededError, InputError, MalformedOutputError,
                         Oracle, extract_single_head)
from attnextract.adapters.journal import CHALLENGES
from attnextract.adapters.remote import HttpBlackBox
from attnextract.adapters.targets import random_single_head
from attnextract.report import verification_count

from conftest import rel_err, run_cli
from netfaults import LossyProxy

D = 5


@pytest.fixture
def serve(start_server):
    """Start servers (default: a single head of width D) on free loopback ports in threads;
    all shut down after the test."""
    return lambda model=None, **kw: start_server(model or random_single_head(D, seed=3), **kw)


def raw(server, method, path, body=None, headers=None):
    """One request over a fresh connection; returns (status, JSON body)."""
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


def post(server, payload):
    body = payload if isinstance(payload, (bytes, str)) else json.dumps(payload)
    return raw(server, "POST", "/query", body)


def test_query_answers_exactly_what_the_model_computes(serve):
    model = random_single_head(D, seed=3)
    server = serve(model)
    X = np.random.default_rng(0).standard_normal((7, 4, D))
    status, answer = post(server, {"sequences": X.tolist()})
    assert status == 200 and answer["remaining"] is None
    assert (answer["charged"], answer["replayed"]) == (7, False)
    assert np.array_equal(np.array(answer["outputs"]), model(X))     # bit for bit over JSON
    status, health = raw(server, "GET", "/health")
    assert status == 200 and health == {"ok": True, "kind": "single-head", "dim": D,
                                        "served": 7, "charged": 7, "replayed": 0,
                                        "budget": None, "remaining": None, "binary": True,
                                        "state": False, "max_length": 4096,
                                        "max_numbers": 1 << 20}


BAD_REQUESTS = [
    (b"this is not json", 400, "JSON object"),
    (b'{"sequences": [[[1, 2, 3, 4, 5]]', 400, "not valid JSON"),
    ('[1, 2]', 400, "JSON object"),
    ('{"inputs": [[[1, 2, 3, 4, 5]]]}', 400, "JSON object"),
    ('{"sequences": []}', 400, "non-empty"),
    ('{"sequences": 3}', 400, "non-empty"),
    ('{"sequences": [[1, 2, 3, 4, 5]]}', 400, "(B, N, 5)"),
    ('{"sequences": [[]]}', 400, "N >= 1"),
    ('{"sequences": [[[1, 2, 3]]]}', 422, "width 5"),
    ('{"sequences": [[[1, 2, 3, 4, 5]], [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]]]}', 400, "ragged"),
    ('{"sequences": [[[1, 2, 3, 4, 5], [1, 2, 3, 4]]]}', 400, "ragged"),
    ('{"sequences": [[[1, 2, NaN, 4, 5]]]}', 400, "NaN"),
    ('{"sequences": [[[1, 2, Infinity, 4, 5]]]}', 400, "Infinity"),
    ('{"sequences": [[[1, 2, -Infinity, 4, 5]]]}', 400, "Infinity"),
    ('{"sequences": [[[1, 2, 1e308, 4, 5]]], "x": 1}', 400, "JSON object"),
    ('{"sequences": [[[1, 2, 3, 4, 5],]]}', 400, "not valid JSON"),
    ('{"sequences": [[[1, 2, 3, 4, 5]] [[1, 2, 3, 4, 5]]]}', 400, "missing comma"),
    ('{"sequences": [[[1, 2, 3, 4, 5]]]} trailing', 400, "JSON object"),
    ('{"sequences": [[[01, 2, 3, 4, 5]]]}', 400, "not valid JSON"),
    ('{"sequences": [[[1, 2, 1e400, 4, 5]]]}', 400, "infinity"),
    ('{"sequences": [[[1, 2, "3", 4, 5]]]}', 400, "numbers"),
    ('{"sequences": [[[1, 2, null, 4, 5]]]}', 400, "non-numbers"),
    ('{"sequences": [[[true, false, true, true, false]]]}', 400, "numbers"),
    ('{"sequences": [[[1, 2, 3, 4, true]]]}', 400, "non-numbers"),
    ('{"sequences": [[[1, 2, {"a": 1}, 4, 5]]]}', 400, "non-numbers"),
    ('{"sequences": [[[1, 2, 3, 4, 1' + '0' * 400 + ']]]}', 400, "infinity"),
    ('{"sequences": [[[[1, 2, 3, 4, 5]]]]}', 400, "(B, N, 5)"),
    ('{"sequences": ' + '[' * 100_000 + ']' * 100_000 + '}', 400, "nested too deeply"),
    (b'\xff\xfe{"sequences"', 400, "JSON object"),
]


def test_every_bad_request_gets_a_4xx_with_a_reason_and_the_server_keeps_serving(serve):
    model = random_single_head(D, seed=3)
    server = serve(model, max_sequences=50, max_floats=1000, max_length=30, max_body=300_000)
    for body, status, reason in BAD_REQUESTS:
        got, answer = post(server, body)
        assert (got, reason in answer["error"]) == (status, True), (body, got, answer)
    too_many = np.zeros((51, 1, D)).tolist()
    too_long = np.zeros((1, 31, D)).tolist()
    too_big = np.zeros((40, 6, D)).tolist()                          # 1200 numbers > 1000
    for payload, reason in [(too_many, "more than 50 sequences"),
                            (too_long, "more than 30 tokens"),
                            (too_big, "more than 1000 numbers")]:
        got, answer = post(server, {"sequences": payload})
        assert got == 413 and reason in answer["error"]
    assert raw(server, "GET", "/nope")[0] == 404
    assert raw(server, "GET", "/query")[0] == 405
    assert raw(server, "POST", "/health", "{}")[0] == 405
    assert raw(server, "DELETE", "/query")[0] == 405
    assert raw(server, "POST", "/query", "{}", {"Content-Length": "-3"})[0] == 400
    # a body announced too large is refused before it is read
    with socket.create_connection(server.server_address[:2], timeout=10) as sock:
        sock.sendall(b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")
    # no Content-Length at all
    with socket.create_connection(server.server_address[:2], timeout=10) as sock:
        sock.sendall(b"POST /query HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 411")
    # a client that announces a body and hangs up half way
    with socket.create_connection(server.server_address[:2], timeout=10) as sock:
        sock.sendall(b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"seq")
    # garbage that is not HTTP
    with socket.create_connection(server.server_address[:2], timeout=10) as sock:
        sock.sendall(b"\x00\x01\x02 garbage\r\n\r\n")
        sock.recv(4096)
    assert server.state.served == 0                                  # nothing was answered
    X = np.random.default_rng(1).standard_normal((3, 2, D))
    status, answer = post(server, {"sequences": X.tolist()})
    assert status == 200 and np.array_equal(answer["outputs"], model(X))
    assert raw(server, "GET", "/health")[0] == 200


def test_a_failing_model_is_a_500_and_the_server_keeps_serving(serve):
    calls = []

    def flaky(X):
        calls.append(len(X))
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return np.zeros(len(X))

    flaky.dim, flaky.kind = D, "custom"
    server = serve(flaky)
    status, answer = post(server, {"sequences": [[[0.0] * D]]})
    assert status == 500 and "the model failed" in answer["error"]
    assert "out of memory" not in answer["error"]       # the model's text stays in the log
    assert server.state.served == 0                     # a failed batch is not charged
    assert post(server, {"sequences": [[[0.0] * D]]}) == (
        200, {"outputs": [0.0], "remaining": None, "charged": 1, "replayed": False})


def test_budget_is_enforced_server_side_all_or_nothing(serve):
    server = serve(budget=10)
    one = [[[0.5] * D]]
    assert post(server, {"sequences": one * 6})[0] == 200
    status, answer = post(server, {"sequences": one * 5})
    assert status == 429 and answer["remaining"] == 4 and "budget" in answer["error"]
    status, answer = post(server, {"sequences": one * 4})
    assert status == 200 and answer["remaining"] == 0
    assert post(server, {"sequences": one})[0] == 429
    assert server.state.served == 10
    # through the client and the oracle: a typed BudgetExceededError, not a crash
    oracle = Oracle(HttpBlackBox(server.url, backoff=0), D)
    with pytest.raises(BudgetExceededError, match="budget exhausted"):
        oracle.query(np.ones((2, 1, D)))


def test_rounded_outputs(serve):
    model = random_single_head(D, seed=3)
    server = serve(model, round_digits=3)
    X = np.random.default_rng(2).standard_normal((20, 3, D))
    out = np.array(post(server, {"sequences": X.tolist()})[1]["outputs"])
    assert np.array_equal(out, np.round(model(X), 3)) and not np.array_equal(out, model(X))


@pytest.mark.parametrize("seed", range(3))
def test_extraction_through_http_matches(serve, seed):
    model = random_single_head(D, seed=seed)
    server = serve(model)
    box = HttpBlackBox(server.url, concurrency=3, max_floats=40)    # many small requests
    result = extract_single_head(Oracle(box, D), seed=seed)
    assert rel_err(result.model.W, model.W) < 1e-10 and rel_err(result.model.v, model.v) < 1e-12
    assert server.state.served == result.queries == D * D + D + verification_count(D * D + D,
                                                                                  D * D + D)
    assert box.requests > 10 and box.retried == 0


def test_many_short_sequences_respect_the_servers_sequence_limit(serve):
    model = random_single_head(1, seed=0)
    server = serve(model, max_sequences=1000)
    X = np.random.default_rng(5).standard_normal((2500, 1, 1))
    box = HttpBlackBox(server.url, max_sequences=1000)
    assert np.array_equal(box(X), model(X)) and box.requests == 3


def test_large_batch_is_split_and_answered_in_order(serve):
    model = random_single_head(D, seed=4)
    server = serve(model)
    X = np.random.default_rng(3).standard_normal((500, 3, D))
    box = HttpBlackBox(server.url, concurrency=4, max_floats=15 * 7)   # 7 sequences a request
    assert np.array_equal(box(X), model(X))
    assert box.requests == 72


@pytest.mark.slow
def test_retries_timeouts_dropped_connections_and_5xx(serve):
    model = random_single_head(D, seed=5)
    server = serve(model)
    proxy = LossyProxy(server.server_address[:2], script=["503", "drop_before", "stall"])
    try:
        box = HttpBlackBox(proxy.url, timeout=1.0, retries=4, backoff=0.01, concurrency=1)
        X = np.random.default_rng(4).standard_normal((4, 2, D))
        assert np.array_equal(box(X), model(X))
        assert (box.requests, box.retried) == (4, 3)
        assert box.accounting()["queries_charged_by_server"] == 4 == server.state.served
        proxy.script = ["503"] * 3
        box = HttpBlackBox(proxy.url, retries=2, backoff=0.01)
        with pytest.raises(BlackBoxError, match="3 attempt.*HTTP 503: proxy says try later"):
            box(X)
    finally:
        proxy.close()


def test_unreachable_server_is_a_typed_error():
    with socket.socket() as sock:                  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    box = HttpBlackBox(f"http://127.0.0.1:{port}", retries=2, backoff=0.01, timeout=2)
    with pytest.raises(BlackBoxError, match="unreachable: 3 attempt"):
        Oracle(box, D).query(np.ones((2, 1, D)))
    with pytest.raises(BlackBoxError, match="unreachable"):
        box.check_dim(D)
    with pytest.raises(InputError):
        HttpBlackBox("ftp://example")
    # a URL without a host is refused when the client is made, not at its first query
    for url in ("http:///predict", "https://:8000", "http://"):
        with pytest.raises(InputError, match="must name its host"):
            HttpBlackBox(url)


def test_malformed_answers_and_wrong_dimension(serve):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Liar(BaseHTTPRequestHandler):
        answer = b'{"outputs": [1.0]}'            # one answer whatever was asked

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(self.answer)))
            self.end_headers()
            self.wfile.write(self.answer)

        def log_message(self, *args):
            pass

    liar = ThreadingHTTPServer(("127.0.0.1", 0), Liar)
    threading.Thread(target=liar.serve_forever, daemon=True).start()
    try:
        url = "http://127.0.0.1:%d" % liar.server_address[1]
        with pytest.raises(MalformedOutputError, match="length 1 for 3"):
            HttpBlackBox(url, transport="json")(np.ones((3, 1, D)))
        Liar.answer = b'{"outputs": [true, 1.0, 2.0]}'
        with pytest.raises(MalformedOutputError, match="booleans"):
            HttpBlackBox(url, transport="json")(np.ones((3, 1, D)))
    finally:
        liar.shutdown()
        liar.server_close()
    server = serve()
    with pytest.raises(InputError, match="width 5, not --dim 4"):
        HttpBlackBox(server.url).check_dim(4)


@pytest.mark.slow
def test_serve_and_extract_on_the_command_line(tmp_path):
    secret = random_single_head(4, seed=9)
    np.savez(tmp_path / "secret.npz", W=secret.W, v=secret.v)
    server = subprocess.Popen([sys.executable, "-m", "attnextract", "serve", "--secret",
                               str(tmp_path / "secret.npz"), "--port", "0", "--budget", "150"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = server.stdout.readline()
        assert "serving single-head d = 4 on http://127.0.0.1:" in banner, server.stderr.read()
        url = banner.split(" on ")[1].split()[0]
        done = run_cli("extract", "--target", url, "--dim", "4", "--out", str(tmp_path / "r.npz"),
                       "--journal", str(tmp_path / "j.sqlite"), "--json")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        served = HttpBlackBox(url).health()["served"]      # learner + the journal's challenges
        assert (report["queries"] == report["details"]["http"]["queries_charged_by_server"]
                == served == report["details"]["black_box_queries"] + CHALLENGES)
        assert report["details"]["black_box_queries"] == 4 * 4 + 4 + verification_count(20, 20)
        assert report["details"]["check_queries"] == CHALLENGES
        with np.load(tmp_path / "r.npz") as r:
            assert rel_err(r["W"], secret.W) < 1e-10
        verify = run_cli("verify", "--target", url, "--result", str(tmp_path / "r.npz"))
        assert verify.returncode == 0 and "MATCH" in verify.stdout
        # the server's budget (150) is now spent: served + 68, too little for another run
        again = run_cli("extract", "--target", url, "--dim", "4", "--out", str(tmp_path / "s.npz"))
        assert again.returncode == 1 and "BudgetExceededError" in again.stderr
        wrong = run_cli("extract", "--target", url, "--dim", "3", "--out", str(tmp_path / "t.npz"))
        assert wrong.returncode == 2 and "width 4, not --dim 3" in wrong.stderr
    finally:
        server.kill()
        server.communicate(timeout=10)
    gone = run_cli("extract", "--target", url, "--dim", "4", "--out", str(tmp_path / "u.npz"),
                   "--http-retries", "1")
    assert gone.returncode == 3 and "unreachable" in gone.stderr
    bad = run_cli("serve", "--secret", str(tmp_path / "missing.npz"), "--port", "0")
    assert bad.returncode == 2


def test_a_rounding_endpoint_is_extracted_within_error_bars(serve):
    """--round 6 makes the endpoint noisy: exact extraction refuses, the noisy learner bounds it."""
    from attnextract import ModelMismatchError
    from attnextract.learners.noisy import extract_noisy
    for seed in range(2):
        model = random_single_head(D, seed=20 + seed)
        server = serve(model, round_digits=6)
        with pytest.raises(ModelMismatchError):
            extract_single_head(Oracle(HttpBlackBox(server.url), D), seed=seed)
        result = extract_noisy(Oracle(HttpBlackBox(server.url), D), tolerance=5e-7, seed=seed)
        bars = result.report.details
        assert np.linalg.norm(result.model.W - model.W) <= bars["error_bar_W"]
        assert np.linalg.norm(result.model.v - model.v) <= bars["error_bar_v"]
        assert bars["error_bar_W_relative"] < 1e-3


def test_verification_never_sends_what_the_server_refuses(serve):
    """A wide server takes at most 2^20 numbers a request: its /health says the longest
    sequence it answers, the client never sends more, and verification stops there (a
    default 4096-token ladder at d = 384 was refused, and looked like a dead server)."""
    server = serve(max_length=1000)
    url = "http://%s:%d" % server.server_address[:2]
    box = HttpBlackBox(url)
    assert box.health()["max_length"] == 1000 and box.max_length == 1000
    oracle = Oracle(box, D)
    assert oracle.max_length == 1000
    result = extract_single_head(oracle, seed=0)
    verification = result.report.verification
    assert verification.passed and verification.lengths[1] <= 1000 == verification.max_length
    narrow = HttpBlackBox(url, max_floats=50 * D)         # the client's own request size
    assert narrow.max_length == 50 and Oracle(narrow, D).max_length == 50
    assert Oracle(box, D, max_length=20).max_length == 20     # asked for: kept
    assert HttpBlackBox("http://127.0.0.1:1", retries=0).max_length is None


def test_a_model_failing_on_the_server_is_not_called_unreachable(serve):
    # newuser3 (issue 22): a served box that fails every batch answers HTTP 500; the
    # client said "unreachable", which sends a user looking at the network
    class Failing:
        dim, kind = D, "custom"

        def __call__(self, X):
            raise ValueError("a user's bug")
    server = serve(Failing())
    box = HttpBlackBox(server.url, retries=1, backoff=0.01)
    with pytest.raises(BlackBoxError, match="answered a server error to all 2 attempt") as info:
        Oracle(box, D).query(np.ones((2, 1, D)))
    assert "unreachable" not in str(info.value) and "HTTP 500" in str(info.value)
