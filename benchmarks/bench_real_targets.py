"""Real targets: HTTP endpoint, query journal, PyTorch head, MiniLM heads.

Run:  python benchmarks/bench_real_targets.py [--http-dims 32 64] [--journal-dim 128]
                                              [--minilm 0:0 1:5 ...] [--out FILE.md]

Measures, on this machine:
- HTTP: a single head served on loopback by ``attnextract.adapters.server``, extracted through
  ``HttpBlackBox`` with 1 and 4 requests in flight (wall time, requests, queries/s);
- journal: the same extraction without a journal, with a fresh journal, and resumed
  from the full journal (0 black-box queries);
- torch: one head of an ``nn.MultiheadAttention`` (E = 128, 4 heads);
- MiniLM: real heads (layer:head), queries against both floors and the error.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from attnextract import Oracle, extract_single_head
from attnextract.adapters.journal import QueryJournal
from attnextract.adapters.remote import HttpBlackBox
from attnextract.adapters.server import make_server
from attnextract.adapters.targets import random_single_head

import _results


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def bench_http(dims):
    rows = []
    for d in dims:
        target = random_single_head(d, seed=d)
        for concurrency in (1, 4):
            server = make_server(target, "127.0.0.1", 0)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            try:
                box = HttpBlackBox(server.url, concurrency=concurrency, max_floats=1 << 16)
                oracle = Oracle(box, d)
                start = time.perf_counter()
                result = extract_single_head(oracle, seed=0)
                wall = time.perf_counter() - start
            finally:
                server.shutdown()
                server.server_close()
            rows.append({"d": d, "concurrency": concurrency, "queries": result.queries,
                         "requests": box.requests, "wall_s": wall,
                         "queries_per_s": result.queries / wall,
                         "W_error": rel(result.model.W, target.W)})
    return rows


def bench_journal(d):
    target = random_single_head(d, seed=1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.sqlite"
        for label in ("no journal", "fresh journal", "resumed from journal"):
            journal = None if label == "no journal" else QueryJournal(path)
            oracle = Oracle(target, d, journal=journal)
            start = time.perf_counter()
            result = extract_single_head(oracle, seed=0)
            wall = time.perf_counter() - start
            rows.append({"d": d, "run": label, "queries": result.queries,
                         "black_box_queries": oracle.black_box_queries,
                         "journal_queries": oracle.journal_queries, "wall_s": wall,
                         "journal_bytes": sum(p.stat().st_size for p in Path(tmp).iterdir())})
            if journal is not None:
                journal.close()
    return rows


def bench_torch():
    import torch

    from attnextract.adapters.torch_target import TorchAttentionBlackBox
    torch.manual_seed(0)
    layer = torch.nn.MultiheadAttention(128, 4, bias=False, batch_first=True)
    box = TorchAttentionBlackBox(layer, readout=0, head=2)
    oracle = Oracle(box, 128)
    start = time.perf_counter()
    result = extract_single_head(oracle, seed=0)
    wall = time.perf_counter() - start
    W, v = box.merged_parameters()
    return [{"module": "MultiheadAttention(128, 4) head 2", "queries": result.queries,
             "W_error": rel(result.model.W, W), "v_error": rel(result.model.v, v),
             "wall_s": wall, "in_torch_s": oracle.black_box_seconds}]


def bench_minilm(heads):
    from attnextract.adapters.minilm import extract_minilm_head
    rows = []
    for spec in heads:
        layer, head = (int(x) for x in spec.split(":"))
        start = time.perf_counter()
        result, _ = extract_minilm_head(layer, head, readout_seed=0, seed=0)
        details = result.report.details
        rows.append({"layer": layer, "head": head, "learner": details["learner"],
                     "recovery_queries": details["recovery_queries"],
                     "low_rank_floor": details["low_rank_floor"],
                     "full_floor": details["full_floor"],
                     "W_error": details["relative_error_W"],
                     "v_error": details["relative_error_v"],
                     "wall_s": time.perf_counter() - start})
    return rows


def table(rows):
    if not rows:
        return "(not run)"
    keys = list(rows[0])
    fmt = lambda x: f"{x:.3g}" if isinstance(x, float) else str(x)      # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http-dims", type=int, nargs="*", default=[32, 64])
    parser.add_argument("--journal-dim", type=int, default=128)
    parser.add_argument("--minilm", nargs="*", default=["0:0", "1:5", "2:11", "3:7", "4:2", "5:9"])
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as results:
        measured = {"http": bench_http(args.http_dims),
                    "journal": bench_journal(args.journal_dim),
                    "torch": bench_torch(), "minilm": bench_minilm(args.minilm)}
        for name, rows in measured.items():
            print(f"\n### {name}\n\n{table(rows)}")
            results.add(f"## {name}\n\n{table(rows)}")


if __name__ == "__main__":
    main()
