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
