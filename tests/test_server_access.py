"""Access control and refusals that arrive: bearer tokens (401, nothing charged), /health
minimal without a token, per-address connection and rate limits, refusals read by a
client that writes its whole body first, Expect: 100-continue, duplicate keys."""

import http.client
import json
import logging
import secrets
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import run_cli

from attnextract import BlackBoxError, InputError
from attnextract.adapters.remote import HttpBlackBox, read_token_file
from attnextract.adapters.server import (
    exposure_warning,
    make_server,
    read_tokens,
    token_matches,
)
from attnextract.adapters.targets import random_single_head

D = 4
TOKEN = secrets.token_urlsafe(32)


@pytest.fixture
def serve(start_server):
    return lambda **kw: start_server(random_single_head(D, seed=3), **kw)


def post(server, body: bytes, headers: dict, source: str | None = None):
    """One POST with http.client, which writes the whole body before it reads: (status,
    JSON answer). ``source`` binds the client's address (127.0.0.x: another client)."""
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10,
                                      source_address=(source, 0) if source else None)
    try:
        conn.request("POST", "/query", body=body, headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


def json_body(X) -> bytes:
    return json.dumps({"sequences": np.asarray(X).tolist()}).encode()


BIG = json_body(np.random.default_rng(0).standard_normal((3000, 10, D)))   # ~2.4 MB


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-token-of-enough-length",
                                           f"Basic {TOKEN}", f"Bearer {TOKEN[:-1]}",
                                           f"Bearer {TOKEN}x"],
                         ids=["none", "wrong", "basic", "short", "long"])
def test_without_the_token_a_query_is_a_401_that_charges_nothing(serve, authorization):
    server = serve(tokens=[TOKEN.encode()], budget=100)
    headers = {"Content-Type": "application/json"}
    if authorization:
        headers["Authorization"] = authorization
    for _ in range(3):               # the whole body written first: the 401 still arrives
        status, answer = post(server, BIG, headers)
        assert status == 401 and "bearer token is required" in answer["error"]
    assert server.state.served == 0 and server.state.remaining == 100
    assert server.state.health()["served"] == 0
    status, answer = post(server, json_body(np.ones((2, 1, D))),
                          {**headers, "Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and answer["charged"] == 2 and server.state.remaining == 98


def test_two_authorization_headers_are_refused(serve):
    server = serve(tokens=[TOKEN.encode()])
    with socket.create_connection(server.server_address[:2], timeout=5) as sock:
        body = json_body(np.ones((1, 1, D)))
        sock.sendall(b"POST /query HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode()
                     + b"\r\nAuthorization: Bearer " + TOKEN.encode()
                     + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert sock.recv(4096).startswith(b"HTTP/1.1 401 ")
    assert server.state.served == 0


def test_health_says_only_alive_without_the_token(serve):
    server = serve(tokens=[TOKEN.encode()], budget=50)
    assert HttpBlackBox(server.url).health() == {"ok": True, "auth": "bearer"}
    full = HttpBlackBox(server.url, token=TOKEN).health()
    assert full["budget"] == 50 and full["dim"] == D
    with pytest.raises(BlackBoxError, match="needs a bearer token"):
        HttpBlackBox(server.url).check_dim(D)
    HttpBlackBox(server.url, token=TOKEN).check_dim(D)


def test_the_client_sends_its_token_and_a_server_without_tokens_is_open(serve, tmp_path):
    model = random_single_head(D, seed=3)
    X = np.random.default_rng(1).standard_normal((5, 2, D))
    guarded = serve(tokens=[b"another-token-long-enough", TOKEN.encode()])   # rotation
    (tmp_path / "token").write_text(TOKEN + "\n")
    box = HttpBlackBox(guarded.url, token=read_token_file(tmp_path / "token"))
    assert np.array_equal(box(X), model(X)) and box.charged == 5
    with pytest.raises(BlackBoxError, match="HTTP 401.*--http-token-file"):
        HttpBlackBox(guarded.url, retries=0)(X)
    open_server = serve()
    assert HttpBlackBox(open_server.url).health()["dim"] == D


def test_token_files_and_matching(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"# rotated monthly\n\n{TOKEN}\n  second-token-0123456789  \n")
    assert read_tokens(path) == [TOKEN.encode(), b"second-token-0123456789"]
    for bad, reason in [("short\n", "at least 16"), ("# only a comment\n", "holds no token"),
                        ("with a space inside it\n", "at least 16")]:
        path.write_text(bad)
        with pytest.raises(InputError, match=reason) as caught:
            read_tokens(path)
        assert bad.strip() not in str(caught.value) or bad.startswith("#")
    with pytest.raises(InputError, match="cannot read"):
        read_tokens(tmp_path / "missing")
    tokens = [TOKEN.encode()]
    assert token_matches(f"Bearer {TOKEN}", tokens) and token_matches(f"bearer {TOKEN}", tokens)
    assert not token_matches(None, tokens) and not token_matches(TOKEN, tokens)
    assert not token_matches("Bearer ", tokens)
    with pytest.raises(InputError):
        HttpBlackBox("http://127.0.0.1:1", token="has space")


def test_binding_beyond_loopback_without_tokens_is_warned(caplog):
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("::1", None) is None and exposure_warning("localhost", None) is None
    assert "without --token-file" in exposure_warning("0.0.0.0", None)
    assert "without --token-file" in exposure_warning("", None)
    assert exposure_warning("0.0.0.0", [b"x" * 16]) is None
    with caplog.at_level(logging.WARNING, logger="attnextract.server"):
        server = make_server(random_single_head(D, seed=3), "0.0.0.0", 0)
        server.server_close()
    assert "anyone who can reach this port" in caplog.text


@pytest.mark.parametrize("slots, hoarded", [
    (256, 300), pytest.param(2048, 2048, marks=pytest.mark.slow)], ids=["256", "2048"])
def test_one_address_cannot_take_every_connection(serve, slots, hoarded):
    """Idle sockets from 127.0.0.2 hold at most their share (1/8) of the connections; a
    client from 127.0.0.1 keeps being answered (2048 such sockets took 81% of the honest
    requests before per-address limits)."""
    server = serve(max_connections=slots, header_timeout=30.0, keepalive_timeout=30.0)
    share = slots // 8
    host, port = server.server_address[:2]
    hoard = []
    try:
        for _ in range(hoarded):
            sock = socket.socket()
            sock.bind(("127.0.0.2", 0))
            sock.settimeout(10)
            sock.connect((host, port))
            hoard.append(sock)
        deadline = time.monotonic() + 30
        while (server.clients.refused_connections < hoarded - share
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert server.connections == share == server.clients.open["127.0.0.2"]
        assert server.clients.refused_connections == hoarded - share
        box = HttpBlackBox(server.url, retries=0, concurrency=1)
        X = np.ones((1, 1, D))
        answered = 0
        for _ in range(200):
            try:
                box(X)
                answered += 1
            except BlackBoxError:
                pass
        assert answered >= 198, answered
    finally:
        for sock in hoard:
            sock.close()


def test_a_request_rate_limit_per_address(serve):
    server = serve(max_client_rate=5.0)
    body = json_body(np.ones((1, 1, D)))
    statuses = [post(server, body, {})[0] for _ in range(30)]
    assert statuses.count(200) >= 10 and statuses.count(503) >= 10   # burst 10, then ~5/s
    assert post(server, body, {}, source="127.0.0.3")[0] == 200     # another address
    assert server.state.served == statuses.count(200) + 1


def test_refusals_arrive_before_the_connection_closes(serve):
    """413 from the Content-Length and 503 over the connection cap, each to a client that
    writes 2.4 MB before it reads: the JSON reason arrives, not a reset."""
    server = serve(max_body=1 << 20)
    for _ in range(5):
        status, answer = post(server, BIG, {"Content-Type": "application/json"})
        assert status == 413 and "at most 1048576" in answer["error"]
    full = serve(max_connections=1)
    with socket.create_connection(full.server_address[:2]):
        time.sleep(0.2)                                   # it holds the one slot
        for _ in range(3):
            status, answer = post(full, BIG, {})
            assert status == 503 and "too many connections" in answer["error"]


def raw_head(server, head: bytes, sock=None):
    sock = sock or socket.create_connection(server.server_address[:2], timeout=5)
    sock.sendall(head)
    return sock


def read_answer(sock) -> bytes:
    data = b""
    while True:
        piece = sock.recv(65536)
        if not piece:
            return data
        data += piece


def test_expect_100_continue_is_answered(serve):
    server = serve()
    body = json_body(np.ones((2, 1, D)))
    head = (b"POST /query HTTP/1.1\r\nExpect: 100-continue\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    sock = raw_head(server, head)
    with sock:
        interim = sock.recv(4096)                  # before the body: no 408 after 2 s
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        assert read_answer(sock).startswith(b"HTTP/1.1 200 OK")
    # refused before the body: the final answer at once, no 100
    sock = raw_head(server, b"POST /query HTTP/1.1\r\nExpect: 100-continue\r\n"
                            b"Content-Length: 999999999\r\n\r\n")
    with sock:
        assert read_answer(sock).startswith(b"HTTP/1.1 413 ")
    sock = raw_head(server, b"POST /query HTTP/1.1\r\nExpect: teapot\r\n"
                            b"Content-Length: 5\r\n\r\n")
    with sock:
        assert read_answer(sock).startswith(b"HTTP/1.1 417 ")
    assert server.state.served == 2


def test_two_idempotency_keys_are_a_400(serve):
    server = serve()
    body = json_body(np.ones((2, 1, D)))
    sock = raw_head(server, b"POST /query HTTP/1.1\r\nIdempotency-Key: a\r\n"
                            b"Idempotency-Key: b\r\nContent-Length: %d\r\n\r\n" % len(body)
                    + body)
    with sock:
        answer = read_answer(sock)
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert b"2 Idempotency-Key headers" in answer and server.state.served == 0


@pytest.mark.slow
def test_tokens_on_the_command_line(tmp_path):
    """serve --token-file, extract with and without --http-token-file."""
    secret = random_single_head(D, seed=4)
    np.savez(tmp_path / "secret.npz", W=secret.W, v=secret.v)
    (tmp_path / "token").write_text(TOKEN + "\n")
    server = subprocess.Popen([sys.executable, "-m", "attnextract", "serve", "--secret",
                               str(tmp_path / "secret.npz"), "--port", "0", "--token-file",
                               str(tmp_path / "token"), "--budget", "1000"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = server.stdout.readline()
        url = banner.split(" on ")[1].split()[0]
        common = ("extract", "--target", url, "--dim", D, "--no-journal", "--no-progress",
                  "--http-retries", 0)
        refused = run_cli(*common, "--out", tmp_path / "a.npz", cwd=tmp_path, timeout=120)
        assert refused.returncode == 3, refused.stderr
        assert "needs a bearer token" in refused.stderr.strip().splitlines()[-1]
        assert HttpBlackBox(url, token=TOKEN).health()["served"] == 0
        done = run_cli(*common, "--out", tmp_path / "b.npz", "--http-token-file",
                       tmp_path / "token", cwd=tmp_path, timeout=120)
        assert done.returncode == 0, done.stderr
        assert HttpBlackBox(url, token=TOKEN).health()["served"] > 0
    finally:
        server.terminate()
        server.communicate(timeout=60)
