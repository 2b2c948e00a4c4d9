"""A TCP proxy on loopback that loses requests and answers on purpose (for the HTTP tests).

Each request on a client connection meets a fate, drawn from a seeded generator (or
taken from a script, for exact scenarios):

- ``pass``: forwarded, the answer relayed;
- ``drop_before``: the connection is closed before the request reaches the server;
- ``drop_after``: the request is forwarded and answered (the server charges it), then
  the connection is closed before the answer reaches the client;
- ``503``: a 503 answer without reaching the server; ``stall``: nothing for
  ``stall_seconds``, then the connection is closed.

Every loop is bounded: connections time out after ``timeout`` seconds, the proxy
stops at ``close()``.
"""

from __future__ import annotations

import random
import socket
import threading
import time

FATES = ("pass", "drop_before", "drop_after", "503", "stall")


def _read_message(sock: socket.socket, buffer: bytearray) -> bytes | None:
    """One HTTP message (head + Content-Length body) from sock, or None at EOF."""
    while b"\r\n\r\n" not in buffer:
        data = sock.recv(65536)
        if not data:
            return None
        buffer += data
    end = buffer.index(b"\r\n\r\n") + 4
    length = 0
    for line in bytes(buffer[:end]).split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(buffer) < end + length:
        data = sock.recv(65536)
        if not data:
            return None
        buffer += data
    message = bytes(buffer[:end + length])
    del buffer[:end + length]
    return message


class LossyProxy:
    def __init__(self, upstream, *, drop_before=0.0, drop_after=0.0, seed=0, script=None,
                 stall_seconds=2.5, timeout=20.0):
        self.upstream = upstream
        self.drop_before, self.drop_after = drop_before, drop_after
        self.rng = random.Random(seed)
        self.script = list(script or [])
        self.stall_seconds, self.timeout = stall_seconds, timeout
        self.counts = {fate: 0 for fate in FATES}
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.listener.settimeout(0.2)
        self.address = self.listener.getsockname()
        self.url = f"http://127.0.0.1:{self.address[1]}"
        self.closed = threading.Event()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _fate(self) -> str:
        with self.lock:
            if self.script:
                fate = self.script.pop(0)
            else:
                r = self.rng.random()
                fate = ("drop_before" if r < self.drop_before else
                        "drop_after" if r < self.drop_before + self.drop_after else "pass")
            self.counts[fate] += 1
            return fate

    def _accept(self):
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except (socket.timeout, OSError):
                continue
            thread = threading.Thread(target=self._serve, args=(client,), daemon=True)
            thread.start()

    def _serve(self, client: socket.socket):
        client.settimeout(self.timeout)
        upstream = None
        buffer, back = bytearray(), bytearray()
        try:
            while not self.closed.is_set():
                request = _read_message(client, buffer)
                if request is None:
                    return
                fate = self._fate()
                if fate == "drop_before":
                    return
                if fate == "503":
                    body = b'{"error": "proxy says try later"}'
                    client.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: "
                                   b"application/json\r\nContent-Length: " +
                                   str(len(body)).encode() + b"\r\n\r\n" + body)
                    continue
                if fate == "stall":
                    time.sleep(self.stall_seconds)
                    return
                if upstream is None:
                    upstream = socket.create_connection(self.upstream, timeout=self.timeout)
                upstream.sendall(request)
                answer = _read_message(upstream, back)
                if answer is None or fate == "drop_after":
                    return
                client.sendall(answer)
        except OSError:
            return
        finally:
            client.close()
            if upstream is not None:
                upstream.close()

    def close(self):
        self.closed.set()
        self.listener.close()
        self.threads[0].join(5)


# -- hostile clients ---------------------------------------------------------------------

def request_bytes(body: bytes, content_type: str = "application/json", length=None,
                  extra: str = "") -> bytes:
    """A whole POST /query request (head and body) as raw bytes."""
    length = len(body) if length is None else length
    return (f"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode() + body


class Dribbler(threading.Thread):
    """A connection that announces a big body (64 MiB of JSON by default) and then sends one
    byte every ``every`` seconds until the server answers or hangs up.

    ``answer`` is the first line the server sent (b"" for a hang-up without a word),
    ``seconds`` how long the connection lasted, ``sent`` the body bytes sent."""

    def __init__(self, address, *, length=64 << 20, every=1.5, limit=120.0):
        super().__init__(daemon=True)
        self.address, self.length, self.every, self.limit = address, length, every, limit
        self.answer, self.seconds, self.sent = None, None, 0
        self.connected = threading.Event()

    def run(self):
        start = time.monotonic()
        with socket.create_connection(self.address, timeout=30) as sock:
            sock.sendall(request_bytes(b'{"sequences": [', length=self.length))
            self.sent = 15
            self.connected.set()
            sock.settimeout(self.every)
            while time.monotonic() - start < self.limit:
                try:
                    data = sock.recv(4096)
                    self.answer = data.split(b"\r\n")[0]
                    break
                except socket.timeout:
                    pass
                except OSError:
                    self.answer = b""
                    break
                try:
                    sock.sendall(b"[")
                    self.sent += 1
                except OSError:
                    pass
        self.seconds = time.monotonic() - start


def send_at_once(address, request: bytes, count: int, timeout=300.0) -> list[bytes]:
    """``count`` connections, all opened first, then each sends ``request`` at once; the
    status line each got back (b"" for none)."""
    barrier = threading.Barrier(count)
    answers = [b""] * count

    def one(i):
        try:
            with socket.create_connection(address, timeout=timeout) as sock:
                barrier.wait(timeout)
                sock.sendall(request)
                answers[i] = sock.recv(4096).split(b"\r\n")[0]
        except (OSError, threading.BrokenBarrierError):
            pass

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    return answers


def just_under(limit: int, kind: str, d: int) -> bytes:
    """A legal body of ``kind`` (npy or json) of just under ``limit`` bytes (sequences of 2
    tokens of width d)."""
    import io
    import json
    import numpy as np
    rng = np.random.default_rng(0)
    if kind == "npy":
        X = rng.standard_normal(((limit - 200) // (16 * d), 2, d))
        stream = io.BytesIO()
        np.lib.format.write_array(stream, X, allow_pickle=False)
        return stream.getvalue()
    X = rng.standard_normal((limit // (2 * d * 20), 2, d))
    body = json.dumps({"sequences": X.tolist()}).encode()
    while len(body) >= limit:
        X = X[:-1]
        body = json.dumps({"sequences": X.tolist()}).encode()
    return body


def fill_answer_cache(url: str, d: int, cache_mb: float) -> int:
    """Keyed requests of 100 000 sequences (800 kB answers) until ``cache_mb`` MiB of answers
    are kept, and 4 more (the cache is full and evicting); returns the requests made."""
    import numpy as np
    from attnextract.adapters.remote import HttpBlackBox
    box = HttpBlackBox(url, max_floats=1 << 20, max_sequences=100_000, concurrency=1)
    X = np.random.default_rng(1).standard_normal((100_000, 1, d))
    requests = int(cache_mb * 2**20 / 800_000) + 4
    for _ in range(requests):
        box(X)
    return requests


def rss_mb(pid: int, field: str = "VmHWM") -> float:
    """A process's resident memory from /proc (VmHWM: its peak; VmRSS: now), in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise ValueError(f"no {field} for process {pid}")
