"""HTTP black box benchmarks: transport speed, hardening, a large extraction, Ray replicas.

Every server runs in its own process (``python -m attnextract serve``) on 127.0.0.1, as
a remote one would, so its memory can be read from /proc and client and server do not
share an interpreter lock. Run with one BLAS thread per process:

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 python benchmarks/bench_http.py throughput
    ... bench_http.py memory        # 8 concurrent 64 MiB bodies: server peak RSS
    ... bench_http.py slowloris --slow 1000   # honest p50/p99 with slow clients connected
    ... bench_http.py flood         # 50 threads x 200 requests on fresh connections
    ... bench_http.py extract --dim 4096 --rank 128   # low-rank extraction over HTTP
    ... bench_http.py replicas      # torch target, 1 process vs 2 Ray replicas
    ... bench_http.py bounded       # answer cache full + 400 bodies of just under 1 MiB: peak RSS
    ... bench_http.py dribble       # 4 dribbling 64 MiB bodies: latency of legal requests

Sections print one JSON line per measurement; each run replaces its section of
benchmarks/results/bench_http.md (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from attnextract.adapters.remote import HttpBlackBox

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from netfaults import (Dribbler, fill_answer_cache, just_under,  # noqa: E402 (shared
                       request_bytes, send_at_once)                  # with the tests)

import _results  # noqa: E402

TARGETS = '''
import numpy as np


class Cheap:
    """Transport only: f(X) = sum of the last token (microseconds per batch)."""
    kind = "cheap"

    def __init__(self, d):
        self.dim = d

    def __call__(self, X):
        return X[:, -1, :].sum(axis=1)


class FactoredHead:
    """A single head with W = U V^T of rank r, evaluated through its factors: O(N d r)."""
    kind = "single-head"

    def __init__(self, path):
        with np.load(path) as f:
            self.U, self.V, self.v = f["U"], f["V"], f["v"]
        self.dim = self.U.shape[0]

    def __call__(self, X):
        q = (X[:, -1, :] @ self.V) @ self.U.T                   # (W x_N)^T, (B, d)
        scores = np.matmul(X, q[:, :, None])[:, :, 0]
        scores -= scores.max(axis=1, keepdims=True)
        alpha = np.exp(scores)
        alpha /= alpha.sum(axis=1, keepdims=True)
        return np.matmul(alpha[:, None, :], (X @ self.v)[:, :, None])[:, 0, 0]


def torch_head(E, H, seed):
    import torch
    torch.manual_seed(seed)
    from attnextract.adapters.torch_target import TorchAttentionBlackBox
    module = torch.nn.MultiheadAttention(E, H, bias=False, batch_first=True)
    return TorchAttentionBlackBox(module, readout=seed)
'''


def env1() -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Served:
    """``attnextract serve --secret SPEC`` in a subprocess; .url, .rss_peak_mb()."""

    def __init__(self, spec: str, *extra: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "attnextract", "serve", "--secret", spec, "--port", "0",
             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env1())
        banner = self.proc.stdout.readline()
        if " on http://" not in banner:
            raise RuntimeError(f"server did not start: {banner} {self.proc.stderr.read()}")
        self.url = banner.split(" on ")[1].split()[0].rstrip(";")
        self.port = int(self.url.rsplit(":", 1)[1])

    def status(self, field: str) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def close(self):
        self.proc.kill()
        self.proc.communicate(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def target_file(workdir: Path) -> Path:
    path = workdir / "bench_targets.py"
    path.write_text(TARGETS)
    return path


def emit(**row):
    print(json.dumps(row), flush=True)


# -- sections -------------------------------------------------------------------------

def throughput(args, workdir):
    """Queries per second of length-2 sequences, JSON vs npy, a target of negligible cost."""
    target_file(workdir)
    for d in args.dims:
        (workdir / f"t{d}.py").write_text(f"import sys; sys.path.insert(0, {str(workdir)!r})\n"
                                          f"from bench_targets import Cheap\ncheap = Cheap({d})\n")
        with Served(f"{workdir / f't{d}.py'}:cheap") as server:
            for transport in ("json", "npy"):
                box = HttpBlackBox(server.url, transport=transport, max_floats=1 << 20,
                                   concurrency=args.concurrency)
                X = np.random.default_rng(d).standard_normal((64, 2, d))
                box(X)                                     # connections up
                # about a fixed time per cell: as many batches as fit in args.seconds
                batch = max(1, (1 << 22) // (2 * d))
                X = np.random.default_rng(d).standard_normal((batch, 2, d))
                sent, start = 0, time.perf_counter()
                while time.perf_counter() - start < args.seconds:
                    out = box(X)
                    sent += len(X)
                seconds = time.perf_counter() - start
                assert np.array_equal(out, X[:, -1, :].sum(axis=1))
                emit(section="throughput", d=d, transport=transport, queries=sent,
                     seconds=round(seconds, 2), queries_per_s=round(sent / seconds, 1),
                     megabytes_per_s=round(sent * 2 * d * 8 / seconds / 1e6, 1),
                     requests=box.requests)


def _honest_latencies(url, count, d, stop=None, failures=None):
    box = HttpBlackBox(url, concurrency=1, retries=0, timeout=30)
    X = np.random.default_rng(0).standard_normal((1, 2, d))
    lat = []
    for _ in range(count):
        start = time.perf_counter()
        try:
            box(X)
        except Exception as exc:           # counted, not hidden: a failed honest request
            if failures is None:
                raise
            failures.append(repr(exc)[:120])
            continue
        lat.append(time.perf_counter() - start)
        if stop is not None and stop.is_set():
            break
    return np.array(lat) * 1000


def memory(args, workdir):
    """Server peak RSS while 8 clients send 64 MiB bodies at once (JSON and npy), and the
    latency of an honest client meanwhile."""
    target_file(workdir)
    d = 64
    (workdir / "m.py").write_text(f"import sys; sys.path.insert(0, {str(workdir)!r})\n"
                                  f"from bench_targets import Cheap\ncheap = Cheap({d})\n")
    token = b"[" + b",".join([b"0.12345678901234567"] * d) + b"]"
    json_piece = (b"[" + b",".join([token] * 16) + b"],") * 64            # ~1.3 MB
    legal = np.random.default_rng(0).standard_normal(((1 << 20) // (2 * d), 2, d))
    legal_json = json.dumps({"sequences": legal.tolist()}).encode()
    legal_npy = HttpBlackBox("http://x")._encode(legal, "npy")
    legal_npy = legal_npy[0][0] + bytes(legal_npy[0][1])

    def attack(port, kind):
        head = "POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: {}\r\nContent-Length: {}\r\n\r\n"
        sent = 0
        with socket.create_connection(("127.0.0.1", port), timeout=600) as sock:
            try:
                if kind == "json-64MiB":
                    sock.sendall(head.format("application/json", 64 << 20).encode() +
                                 b'{"sequences": [')
                    while sent < 64 << 20:
                        sock.sendall(json_piece)
                        sent += len(json_piece)
                elif kind == "npy-64MiB":
                    import io
                    stream = io.BytesIO()      # a header for 2^23 numbers, then 64 MiB
                    np.lib.format.write_array_header_1_0(stream, {
                        "descr": "<f8", "fortran_order": False, "shape": (1 << 16, 2, d)})
                    data = stream.getvalue() + bytes((64 << 20) - len(stream.getvalue()))
                    sock.sendall(head.format("application/x-npy", len(data)).encode())
                    sock.sendall(data)
                    sent = len(data)
                else:                                   # the largest legal request, 8 MiB of numbers
                    body = legal_json if kind == "json-legal" else legal_npy
                    ctype = "application/json" if kind == "json-legal" else "application/x-npy"
                    sock.sendall(head.format(ctype, len(body)).encode() + body)
                    sent = len(body)
            except OSError:
                pass
            try:
                answer = sock.recv(200).split(b"\r\n")[0].decode()
            except OSError as exc:
                answer = type(exc).__name__
        return sent, answer

    for kind in ("json-64MiB", "npy-64MiB", "json-legal", "npy-legal"):
        with Served(f"{workdir / 'm.py'}:cheap") as server:
            _honest_latencies(server.url, 20, d)
            base = server.status("VmRSS")
            stop = threading.Event()
            lat, failed = [], []
            honest = threading.Thread(target=lambda: lat.extend(
                _honest_latencies(server.url, 10_000, d, stop, failed)))
            honest.start()
            threads, results = [], []
            start = time.perf_counter()
            for _ in range(8):
                t = threading.Thread(target=lambda: results.append(attack(server.port, kind)))
                t.start()
                threads.append(t)
            for t in threads:
                t.join()
            seconds = time.perf_counter() - start
            stop.set()
            honest.join()
            lat = np.array(lat)
            emit(section="memory", bodies=f"8 x {kind}", rss_before_mb=round(base, 1),
                 rss_peak_mb=round(server.status("VmHWM"), 1),
                 bytes_sent_per_client_mb=round(np.mean([s for s, _ in results]) / 2**20, 1),
                 answers=sorted({a for _, a in results}), seconds=round(seconds, 2),
                 honest_requests=len(lat), honest_failures=failed[:3] + [len(failed)],
                 honest_p50_ms=round(float(np.median(lat)), 2),
                 honest_p99_ms=round(float(np.percentile(lat, 99)), 2))


def hold_slow_clients(port, slow, drip, stop, report):
    """In its own process: keep ``slow`` connections sending one header byte every ``drip``
    seconds; reconnect the ones the server cuts off. Reports (reconnects, min connected)."""
    sel = selectors.DefaultSelector()
    socks, reconnects, failures, connected = {}, 0, 0, []
    rng = np.random.default_rng(0)

    def connect():
        nonlocal failures
        try:                                    # connected before it is watched
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            failures += 1
            return None
        s.sendall(b"POST /query HTTP/1.1\r\n")
        s.setblocking(False)
        socks[s] = time.perf_counter() + rng.uniform(0, drip)
        sel.register(s, selectors.EVENT_READ)
        return s

    while len(socks) < slow and connect() is not None:
        pass
    while not stop.is_set():
        now = time.perf_counter()
        for key, _ in sel.select(0.05):
            s = key.fileobj
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if not data:                        # cut off by the server
                sel.unregister(s)
                s.close()
                del socks[s]
                reconnects += 1
        for s, due in list(socks.items()):
            if due <= now:
                try:
                    s.send(b"X")
                except OSError:
                    pass
                socks[s] = now + drip
        while len(socks) < slow and connect() is not None:
            pass
        connected.append(len(socks))
    report.put((reconnects, failures, min(connected[len(connected) // 10:], default=0)))
    for s in socks:
        s.close()


def slowloris(args, workdir):
    """p50/p99 latency of an honest client while N slow clients dribble headers.

    The slow clients run in another process (one thread, selectors): each sends a
    request line and then one header byte every ``--drip`` seconds; when the server
    hangs up on one (after its 5 s header timeout), it reconnects, so N stay connected."""
    import multiprocessing
    target_file(workdir)
    d = 64
    (workdir / "s.py").write_text(f"import sys; sys.path.insert(0, {str(workdir)!r})\n"
                                  f"from bench_targets import Cheap\ncheap = Cheap({d})\n")
    for slow in (0, args.slow):
        with Served(f"{workdir / 's.py'}:cheap") as server:
            stop, report = multiprocessing.Event(), multiprocessing.Queue()
            holder = multiprocessing.Process(target=hold_slow_clients,
                                             args=(server.port, slow, args.drip, stop, report))
            holder.start()
            time.sleep(3.0 if slow else 0.1)
            start = time.perf_counter()
            lat = _honest_latencies(server.url, args.requests, d)
            seconds = time.perf_counter() - start
            stop.set()
            reconnects, failures, connected = report.get(timeout=60)
            holder.join(30)
            emit(section="slowloris", slow_clients=slow, honest_requests=len(lat),
                 seconds=round(seconds, 1), p50_ms=round(float(np.median(lat)), 2),
                 p99_ms=round(float(np.percentile(lat, 99)), 2),
                 max_ms=round(float(lat.max()), 2), slow_reconnects=reconnects,
                 slow_connected_min=connected, slow_connect_failures=failures,
                 server_rss_mb=round(server.status("VmHWM"), 1))


def flood(args, workdir):
    """50 threads x 200 requests, each on a fresh connection: resets and failures counted."""
    from concurrent.futures import ThreadPoolExecutor
    target_file(workdir)
    d = 16
    (workdir / "f.py").write_text(f"import sys; sys.path.insert(0, {str(workdir)!r})\n"
                                  f"from bench_targets import Cheap\ncheap = Cheap({d})\n")
    body = json.dumps({"sequences": [[[0.5] * d] * 2]}).encode()
    request = (f"POST /query HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with Served(f"{workdir / 'f.py'}:cheap") as server:
        def worker(_):
            counts = {"ok": 0, "reset": 0, "other": 0}
            for _ in range(args.flood_requests):
                try:
                    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
                        s.sendall(request)
                        answer = b""
                        while True:
                            chunk = s.recv(65536)
                            if not chunk:
                                break
                            answer += chunk
                    counts["ok" if answer.startswith(b"HTTP/1.1 200") else "other"] += 1
                except ConnectionResetError:
                    counts["reset"] += 1
                except OSError:
                    counts["other"] += 1
            return counts

        start = time.perf_counter()
        with ThreadPoolExecutor(args.flood_threads) as pool:
            results = list(pool.map(worker, range(args.flood_threads)))
        seconds = time.perf_counter() - start
        total = {k: sum(r[k] for r in results) for k in ("ok", "reset", "other")}
        emit(section="flood", threads=args.flood_threads, requests=args.flood_threads *
             args.flood_requests, seconds=round(seconds, 1), **total,
             server_charged=HttpBlackBox(server.url).health()["served"])


def extract(args, workdir):
    """``attnextract extract --model low-rank`` of a (d, r) head served over HTTP."""
    target_file(workdir)
    d, r = args.dim, args.rank
    rng = np.random.default_rng(args.seed)
    U = rng.standard_normal((d, r)) / d ** 0.5
    V = rng.standard_normal((d, r)) / d ** 0.5
    v = rng.standard_normal(d)
    np.savez(workdir / "head.npz", U=U, V=V, v=v)
    (workdir / "h.py").write_text(
        f"import sys; sys.path.insert(0, {str(workdir)!r})\nfrom bench_targets import "
        f"FactoredHead\nhead = FactoredHead({str(workdir / 'head.npz')!r})\n")
    with Served(f"{workdir / 'h.py'}:head") as server:
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "attnextract", "extract", "--target", server.url,
             "--dim", str(d), "--model", "low-rank", "--out", str(workdir / "r.npz"),
             "--json", "--seed", str(args.seed), "--http-transport", args.transport,
             "--http-concurrency", str(args.concurrency)],
            capture_output=True, text=True, env=env1(), timeout=args.timeout)
        wall = time.perf_counter() - start
        served = HttpBlackBox(server.url).health()["served"]
        rss = server.status("VmHWM")
    if done.returncode != 0:
        emit(section="extract", d=d, r=r, ok=False, wall_s=round(wall, 1),
             error=done.stderr[-800:])
        return
    report = json.loads(done.stdout)
    with np.load(workdir / "r.npz") as result:
        W = result["W"]
    W_true = U @ V.T
    floor = d + r * (2 * d - r)
    emit(section="extract", d=d, r=r, ok=True, wall_s=round(wall, 1),
         black_box_s=round(report["black_box_seconds"], 1),
         queries=report["queries"], recovery_queries=report["breakdown"].get("recovery"),
         floor=floor, x_floor=round(report["breakdown"].get("recovery", 0) / floor, 4),
         w_error=float(np.linalg.norm(W - W_true) / np.linalg.norm(W_true)),
         server_charged=served, http=report["details"].get("http"),
         server_rss_mb=round(rss, 1))


def replicas(args, workdir):
    """A torch target whose evaluation dominates: 1 process vs N Ray replicas, in-process
    (the evaluation alone) and through the HTTP server (``serve --replicas``)."""
    target_file(workdir)
    E, H, N = args.embed, 8, args.length
    (workdir / "torch_t.py").write_text(
        f"import sys; sys.path.insert(0, {str(workdir)!r})\nfrom bench_targets import "
        f"torch_head\nhead = torch_head({E}, {H}, 0)\n")
    X = np.random.default_rng(0).standard_normal((args.batch, N, E))
    rows = {}
    for n in (None, args.replicas):
        # one request at a time, one worker: the only parallelism is the replicas'
        extra = ["--workers", "1"] + ([] if n is None else ["--replicas", str(n)])
        with Served(f"{workdir / 'torch_t.py'}:head", *extra) as server:
            box = HttpBlackBox(server.url, concurrency=1, max_floats=args.batch * N * E)
            box(X[:4])
            start = time.perf_counter()
            for _ in range(args.repeats):
                out = box(X)
            seconds = (time.perf_counter() - start) / args.repeats
            rows[n] = out
            emit(section="replicas", replicas=n or 0, embed=E, length=N, batch=args.batch,
                 seconds_per_batch=round(seconds, 3),
                 sequences_per_s=round(args.batch / seconds, 1))
    diff = float(np.max(np.abs(rows[None] - rows[args.replicas])))
    emit(section="replicas", max_output_difference=diff)


def cheap_spec(workdir: Path, d: int) -> str:
    target_file(workdir)
    (workdir / f"cheap{d}.py").write_text(f"import sys; sys.path.insert(0, {str(workdir)!r})\n"
                                          f"from bench_targets import Cheap\ncheap = Cheap({d})\n")
    return f"{workdir / f'cheap{d}.py'}:cheap"


def bounded(args, workdir):
    """Peak RSS of a server at its default settings (or ``--serve-args``): its answer cache
    filled, then ``--bodies`` connections sending a body of just under 1 MiB at once."""
    from attnextract.adapters.server import BODY_MEMORY, CACHE_BYTES, peak_rss_bound
    d = 4
    extra = args.serve_args.split() if args.serve_args else []
    cache_mb = CACHE_BYTES / 2**20
    body_mb = BODY_MEMORY / 2**20
    if "--cache-memory" in extra:
        cache_mb = float(extra[extra.index("--cache-memory") + 1])
    if "--body-memory" in extra:
        body_mb = float(extra[extra.index("--body-memory") + 1])
    for kind in args.kinds:
        body = just_under(1 << 20, kind, d)
        ctype = "application/x-npy" if kind == "npy" else "application/json"
        with Served(cheap_spec(workdir, d), *extra) as server:
            idle = server.status("VmRSS")
            start = time.perf_counter()
            filled = fill_answer_cache(server.url, d, cache_mb)
            cached = server.status("VmRSS")
            health = HttpBlackBox(server.url).health()
            answers = send_at_once(("127.0.0.1", server.port), request_bytes(body, ctype),
                                   args.bodies)
            seconds = time.perf_counter() - start
            codes = {}
            for a in answers:
                code = a.split(b" ")[1].decode() if a.startswith(b"HTTP/1.1 ") else "none"
                codes[code] = codes.get(code, 0) + 1
            emit(section="bounded", body=kind, body_bytes=len(body), bodies=args.bodies,
                 serve_args=" ".join(extra) or "defaults", rss_idle_mb=round(idle, 1),
                 rss_cache_full_mb=round(cached, 1), cache_requests=filled,
                 rss_peak_mb=round(server.status("VmHWM"), 1),
                 rss_bound_mb=round(peak_rss_bound(
                     int(idle * 2**20), connections=args.bodies + 2,
                     body_memory=int(body_mb * 2**20), cache_bytes=int(cache_mb * 2**20),
                     state="--state" in extra) / 2**20, 1), answers=codes,
                 served=HttpBlackBox(server.url).health()["served"] - health["served"],
                 seconds=round(seconds, 1))


def dribble(args, workdir):
    """4 connections announce 64 MiB of JSON and send a byte every 1.5 s; meanwhile a legal
    2 MiB npy request and a 344 kB JSON request: their latency, and when the dribblers are cut."""
    d = 64
    with Served(cheap_spec(workdir, d)) as server:
        address = ("127.0.0.1", server.port)
        dribblers = [Dribbler(address, every=1.5) for _ in range(args.dribblers)]
        for t in dribblers:
            t.start()
        for t in dribblers:
            t.connected.wait(30)
        time.sleep(0.5)                          # they hold their memory, dribbling
        rng = np.random.default_rng(0)
        rows = []
        for name, X, transport in (
                ("npy 2 MiB", rng.standard_normal(((2 << 20) // (16 * d) - 1, 2, d)), "npy"),
                ("json 344 kB", rng.standard_normal((130, 2, d)), "json")):
            box = HttpBlackBox(server.url, transport=transport, retries=0, timeout=60,
                               max_floats=1 << 20)
            body = box._encode(X, transport)[0]
            size = len(body) if isinstance(body, bytes) else len(body[0]) + len(body[1])
            start = time.perf_counter()
            out = box(X)
            seconds = time.perf_counter() - start
            assert np.array_equal(out, X[:, -1, :].sum(axis=1))
            rows.append((name.split()[0], size, seconds))
        for t in dribblers:
            t.join(120)
        for name, size, seconds in rows:
            emit(section="dribble", dribblers=len(dribblers), request=name, body_bytes=size,
                 answered_s=round(seconds, 3))
        emit(section="dribble", dribbler_answers=sorted({t.answer.decode() for t in dribblers}),
             dribbler_cut_after_s=[round(t.seconds, 2) for t in dribblers],
             dribbler_bytes_sent=[t.sent for t in dribblers])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("section", choices=["throughput", "memory", "slowloris", "flood",
                                            "extract", "replicas", "bounded", "dribble"])
    parser.add_argument("--bodies", type=int, default=400)
    parser.add_argument("--kinds", nargs="+", default=["npy", "json"])
    parser.add_argument("--serve-args", default="", help="extra 'serve' options (bounded)")
    parser.add_argument("--dribblers", type=int, default=4)
    parser.add_argument("--flood-threads", type=int, default=50)
    parser.add_argument("--flood-requests", type=int, default=200)
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 1024, 4096])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--slow", type=int, default=1000)
    parser.add_argument("--drip", type=float, default=1.0)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transport", default="npy")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--embed", type=int, default=256)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    _results.add_out_option(parser, __file__)
    args = parser.parse_args(argv)
    with _results.Run(__file__, args.out, section=args.section) as results, \
            tempfile.TemporaryDirectory() as tmp:
        results.capture()
        globals()[args.section](args, Path(tmp))


if __name__ == "__main__":
    main()
