"""The client against a hostile server: every bad answer is a one-line typed error, within
the deadline, in bounded memory, and the client's journal is left as it was."""

import io
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest

from attnextract import BlackBoxError, MalformedOutputError, Oracle
from attnextract.adapters.journal import QueryJournal, read_entries
from attnextract.adapters.remote import HttpBlackBox, max_answer_bytes
from attnextract.adapters.server import make_server
from attnextract.adapters.targets import random_single_head

D = 4
HEALTH = json.dumps({"ok": True, "kind": "single-head", "dim": D}).encode()


def reply(conn, status: str, body: bytes, content_type="application/json", extra=""):
    conn.sendall(f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: "
                 f"{len(body)}\r\nConnection: close\r\n{extra}\r\n".encode() + body)


class HostileServer:
    """A raw-socket HTTP server on loopback: ``behave(conn, path, body)`` answers each
    request however the test wants (one thread per connection, one request each)."""

    def __init__(self, behave):
        self.behave = behave
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = []
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            conn.settimeout(30)
            data = b""
            while b"\r\n\r\n" not in data:
                piece = conn.recv(65536)
                if not piece:
                    return
                data += piece
            head, body = data.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip()
                       for k, _, v in (line.partition(":") for line in lines[1:])}
            length = int(headers.get("content-length", 0))
            while len(body) < length:
                body += conn.recv(65536)
            path = lines[0].split(" ")[1]
            self.requests.append((path, headers))
            self.behave(conn, path, body)
        except OSError:                # the client hung up: what a hostile answer expects
            pass
        finally:
            conn.close()

    def close(self):
        self.closed.set()
        self.sock.close()


def honest_health(behave):
    """``behave`` for /query; /health answers honestly."""
    def serve(conn, path, body):
        if path == "/health":
            reply(conn, "200 OK", HEALTH)
        else:
            behave(conn, path, body)
    return serve


def stream_forever(conn, path, body, total=200 << 20):
    """200 OK without a length, then up to 200 MB of digits until the client hangs up."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\n\r\n{\"outputs\": [")
    piece = b"1.0, " * 13107
    for _ in range(total // len(piece)):
        conn.sendall(piece)


def drip(conn, path, body):
    """A valid status line, one byte every 0.2 s, for ever."""
    for byte in b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" * 100:
        conn.sendall(bytes([byte]))
        time.sleep(0.2)


def drip_body(conn, path, body):
    """Honest headers announcing 40 bytes, then the body one byte every 0.2 s."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 4000\r\n\r\n")
    for _ in range(4000):
        conn.sendall(b" ")
        time.sleep(0.2)


def huge_length(conn, path, body):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000000000000000\r\n\r\n" + b"0" * 65536)


def garbage(conn, path, body):
    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n" + bytes(range(256)) * 4)


def redirect(conn, path, body):
    reply(conn, "302 Found", b"", extra="Location: http://elsewhere.example/query\r\n")


def answering(payload, content_type="application/json"):
    """Answer ``payload``, or ``payload(B)`` for a request of B sequences (JSON)."""
    def serve(conn, path, body):
        data = payload(len(json.loads(body)["sequences"])) if callable(payload) else payload
        reply(conn, "200 OK", data, content_type)
    return serve


def outputs(make):
    """An answer {"outputs": make(B)} for B sequences."""
    return answering(lambda B: json.dumps({"outputs": make(B)}).encode())


def npy(array) -> bytes:
    stream = io.BytesIO()
    np.save(stream, array)
    return stream.getvalue()


# (name, how /query is answered, error class, what the one-line message says)
QUERY_CASES = [
    ("stream 200 MB", stream_forever, MalformedOutputError, "sent over .* bytes"),
    ("huge Content-Length", huge_length, MalformedOutputError, "announced 1000000000000000"),
    ("garbage", garbage, MalformedOutputError, "did not answer in HTTP"),
    ("redirect", redirect, BlackBoxError, "redirect .*302.* not followed"),
    ("strings", outputs(lambda B: ["0.12"] * B), MalformedOutputError, "string '0.12'"),
    ("nesting", outputs(lambda B: [[0.1]] * B), MalformedOutputError, "nested lists"),
    ("deep nesting", outputs(lambda B: [0.1] * (B - 1) + [[[[0.3]]]]), MalformedOutputError,
     "nested lists"),
    ("null", outputs(lambda B: [None] * B), MalformedOutputError, "null"),
    ("one too many", outputs(lambda B: [0.1] * (B + 1)), MalformedOutputError,
     r"list of length (\d+) for \d+ sequences"),
    ("a list, not an object", answering(lambda B: json.dumps([0.1] * B).encode()),
     MalformedOutputError, "list of .* without \"outputs\""),
    ("not JSON", answering(b"<html>hello</html>"), MalformedOutputError, "not JSON"),
    ("nesting 30 000 deep", answering(b'{"outputs": ' + b"[" * 30000 + b"]" * 30000 + b"}"),
     MalformedOutputError, "not JSON"),
    ("huge integer", answering(lambda B: b'{"outputs": [' + b"1, " * (B - 1) + b"9" * 400
                               + b"]}"), MalformedOutputError, "beyond float64"),
    ("npy of the wrong shape", answering(npy(np.zeros((3, 2))), "application/x-npy"),
     MalformedOutputError, r"shape \(3, 2\)"),
    ("npy of strings", answering(npy(np.array(["a", "b", "c"])), "application/x-npy"),
     MalformedOutputError, "dtype <U1"),
]


@pytest.fixture(scope="module")
def journal_file(tmp_path_factory):
    """A journal recorded against an honest server: its answers must survive every case."""
    path = tmp_path_factory.mktemp("journal") / "journal.sqlite"
    server = make_server(random_single_head(D, seed=1), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        oracle = Oracle(HttpBlackBox(server.url, retries=0), D, journal=QueryJournal(path))
        oracle.query(np.random.default_rng(0).standard_normal((5, 3, D)))
        oracle.journal.close()
    finally:
        server.shutdown()
        server.server_close()
    return path


def hostile_query(url, journal_file, tmp_path, **options):
    """Ask 3 sequences through an Oracle with a copy of the journal; the error, the seconds
    it took, the peak of traced memory, and whether the journal is as it was."""
    copy = tmp_path / "copy.sqlite"
    shutil.copyfile(journal_file, copy)
    box = HttpBlackBox(url, **{"retries": 0, "timeout": 5.0, "transport": "json", **options})
    journal = QueryJournal(copy)
    oracle = Oracle(box, D, journal=journal)
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(BlackBoxError) as caught:
            oracle.query(np.random.default_rng(9).standard_normal((3, 2, D)))
        elapsed = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        journal.close()
        box.close()
    intact = read_entries(copy) == read_entries(journal_file)
    QueryJournal(copy).close()              # opens: every row passes its checksum
    return caught.value, elapsed, peak, intact


@pytest.mark.parametrize("name, behave, error, message", QUERY_CASES,
                         ids=[case[0] for case in QUERY_CASES])
def test_a_hostile_answer_is_a_one_line_typed_error(name, behave, error, message,
                                                    journal_file, tmp_path):
    server = HostileServer(honest_health(behave))
    try:
        exc, elapsed, peak, intact = hostile_query(server.url, journal_file, tmp_path)
    finally:
        server.close()
    assert isinstance(exc, error), repr(exc)
    text = str(exc)
    assert "\n" not in text and len(text) < 400, text
    assert re.search(message, text), text
    assert intact
    assert elapsed < 30                      # the deadline is 5 s; nothing waits for 200 MB
    assert peak < 16 << 20, peak             # traced allocations while the answer came in


@pytest.mark.parametrize("behave", [drip, drip_body], ids=["drip headers", "drip body"])
def test_a_dripping_server_is_cut_at_the_whole_request_deadline(behave, journal_file,
                                                                tmp_path):
    server = HostileServer(honest_health(behave))
    try:
        exc, elapsed, _, intact = hostile_query(server.url, journal_file, tmp_path,
                                                timeout=1.5, retries=1, backoff=0.01)
    finally:
        server.close()
    # a byte every 0.2 s never trips a per-read timeout: before the deadline this waited
    # for ever; now each of the 2 attempts ends at 1.5 s
    assert "within the 1.5 s deadline in 2 attempt(s)" in str(exc), str(exc)
    assert 2.9 < elapsed < 15, elapsed
    assert intact


@pytest.mark.parametrize("health, message", [
    (b"[1, 2, 3]", "/health with a list of 3, not a JSON object"),
    (b"not json at all", "/health with something that is not JSON"),
    (b"[" * 30000 + b"]" * 30000, "/health with something that is not JSON"),
    (b'{"dim": "4"}', "dim a string '4', not an integer"),
    (b"9" * 100_000, "announced 100000 bytes for its /health"),
], ids=["list", "not JSON", "nested 30 000 deep", "string dim", "100 kB"])
def test_a_bad_health_answer_is_a_typed_error(health, message):
    server = HostileServer(lambda conn, path, body: reply(conn, "200 OK", health))
    try:
        box = HttpBlackBox(server.url, retries=0)
        with pytest.raises(MalformedOutputError, match=message):
            box.check_dim(D)
        assert box.max_length is None        # the Oracle's default: no bound, no traceback
    finally:
        server.close()


def test_the_answer_cap_follows_the_numbers_expected():
    assert max_answer_bytes(1000, 1, "npy") == (64 << 10) + 2 * 1000 * 8
    assert max_answer_bytes(1000, 7, "json") == (64 << 10) + 2 * 7000 * 32
    # an honest answer of 100 000 sequences fits, in JSON at the longest float64 repr
    worst = json.dumps({"outputs": [-2.2250738585072014e-308] * 100_000, "remaining": None,
                        "charged": 100_000, "replayed": False}).encode()
    assert len(worst) < max_answer_bytes(100_000, 1, "json")
    longest = npy(np.zeros(100_000))
    assert len(longest) < max_answer_bytes(100_000, 1, "npy")


def test_an_honest_large_answer_is_read_whole():
    """The cap does not cut an honest answer of many sequences (npy and JSON)."""
    model = random_single_head(D, seed=2)
    server = make_server(model, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        X = np.random.default_rng(3).standard_normal((20_000, 1, D))
        for transport in ("npy", "json"):
            box = HttpBlackBox(server.url, transport=transport, max_sequences=20_000)
            assert np.array_equal(box(X), model(X))
    finally:
        server.shutdown()
        server.server_close()


# the command line, then its peak RSS (VmHWM: this process's own, reset at exec; the
# rusage of a forked child starts at the size of the pytest process it was forked from)
CLI_WITH_PEAK = ("import sys; from attnextract.cli import main; code = main(sys.argv[1:]); "
                 "open('peak.txt', 'w').write([line for line in open('/proc/self/status') "
                 "if line.startswith('VmHWM')][0]); sys.exit(code)")


@pytest.mark.parametrize("case", ["health list", "strings", "stream 200 MB"])
def test_the_command_line_exits_3_with_one_line(case, tmp_path):
    behave = {"health list": lambda conn, path, body: reply(conn, "200 OK", b"[1, 2]"),
              "strings": honest_health(answering(b'{"outputs": ["0.12"]}')),
              "stream 200 MB": honest_health(stream_forever)}[case]
    server = HostileServer(behave)
    try:
        done = subprocess.run(
            [sys.executable, "-c", CLI_WITH_PEAK, "extract", "--target", server.url,
             "--dim", str(D), "--out", "r.npz", "--no-journal", "--no-progress",
             "--http-retries", "0", "--http-timeout", "5", "--http-transport", "json"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    finally:
        server.close()
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 3, done.stderr
    assert len(lines) == 1 and lines[0].startswith("attnextract: MalformedOutputError: "), \
        done.stderr
    peak_kib = int((tmp_path / "peak.txt").read_text().split()[1])
    # numpy, scipy and the learners' imports are most of it (89 MiB); a 200 MB stream
    # read whole took the client to 490 MiB
    assert peak_kib < 100 * 1024, peak_kib
    print(f"{case}: client peak RSS {peak_kib / 1024:.1f} MiB")
