"""Full-rank multi-head attention with biases (issue 26): `multi-head --biases` on a grid.

For every (H, d) in {2, 4, 8} x {8, 16} and 20 seeds: a random multi-head box (W_h entries
N(0, 1/d), v_h N(0, 1), the multi-head grid's target seeds) with query biases b_h and an
output constant c (targets.with_biases: |b_h| cycling through 1, 5.1 (MiniLM's |b_q|),
0 (exactly), 0.3 by seed; c = 0 on every fifth seed). The biased learner runs on it, and
the bias-free learner on the same box without its biases (today's count). Recorded per
run: the canonical errors of W_h, b_h, v_h and c, the error bar, queries against the
bias-free run's + H d and against paper 2's count + H d (the bias-free learner's cap), the
biased learner's own count (biased_count: paper 2's + (H + 1) d + 1, c and H + 1 more
samples per short-probe row), whether the short probes ran, the floor H(d^2 + 2d) + 1 and
CPU seconds.

Run:  nice -n 10 python benchmarks/bench_multi_head_biases.py [--seeds 20] [--out FILE.md]
(1 BLAS thread: OPENBLAS_NUM_THREADS=1). Writes benchmarks/results/bench_multi_head_biases.md.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from attnextract.adapters.targets import random_multi_head, with_biases
from attnextract.errors import AttnExtractError
from attnextract.learners.multi_head import (biased_count, canonical_error, extract_multi_head,
                                              paper2_count)
from attnextract.learners.multi_head.canonical import biased_canonical_errors
from attnextract.models import MultiHeadAttention
from attnextract.oracle import Oracle

import _results

BIAS_SCALES = (1.0, 5.1, 0.0, 0.3)
GOAL = 1e-10


def biased_target(H: int, d: int, seed: int):
    """The grid's biased box for (H, d, seed) (see the module docstring)."""
    heads = random_multi_head(H, d, seed=10_000 * H + 100 * d + seed)
    return with_biases(heads, seed, bias_scale=BIAS_SCALES[seed % 4],
                       c=0.0 if seed % 5 == 0 else None)


def run(H: int, d: int, seed: int) -> dict:
    truth = biased_target(H, d, seed)
    row = {"H": H, "d": d, "seed": seed, "bias": BIAS_SCALES[seed % 4],
           "floor": H * (d * d + 2 * d) + 1}
    plain = Oracle(MultiHeadAttention(truth.W, truth.v), d)
    try:
        plain_result = extract_multi_head(plain, H, seed=seed)
        row["bias-free queries"] = plain.queries
        row["bias-free error"] = float(canonical_error(plain_result.model, MultiHeadAttention(truth.W, truth.v)))
        row["bias-free short probes"] = plain_result.report.details.get("short probes")
        row["bias-free breakdown"] = dict(plain_result.report.breakdown)
        row["bias-free wide rounds"] = plain_result.report.details.get(
            "wide column rounds", int("main wide columns" in plain_result.report.breakdown))
    except AttnExtractError as exc:
        row["bias-free queries"], row["bias-free refused"] = plain.queries, type(exc).__name__
    oracle = Oracle(truth, d)
    start = time.process_time()
    try:
        result = extract_multi_head(oracle, H, seed=seed, biases=True)
        errors = biased_canonical_errors(result.model, truth)
        row.update({k: errors[k] for k in ("W", "b", "v", "c")})
        row["error bar"] = result.report.details["error bar"]
        row["recovery"] = result.report.breakdown["recovery"]
        row["breakdown"] = dict(result.report.breakdown)
        row["wide rounds"] = result.report.details.get(
            "wide column rounds", int("main wide columns" in result.report.breakdown))
        row["polish"] = result.report.details.get("joint polish")
        row["short probes"] = result.report.details.get("short probes")
    except AttnExtractError as exc:
        row["refused"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    row["queries"] = oracle.queries
    row["cpu s"] = time.process_time() - start
    row["ratio"] = row["queries"] / (row["bias-free queries"] + H * d)
    row["ratio to paper 2 + Hd"] = row["queries"] / (paper2_count(H, d) + H * d)
    row["count"] = biased_count(H, d)
    return row


def short_kept(detail) -> bool:
    """Whether a run's report says its short probes were sent and kept."""
    return isinstance(detail, str) and detail.endswith("kept") and "not kept" not in detail


def short_sent(detail) -> bool:
    """Whether a run's report says its short probes were sent (kept or not)."""
    return isinstance(detail, str) and " sent " in detail


def summary(rows) -> str:
    out = ["| H | d | runs | refused | worst W | worst b | worst v | worst c | median error "
           "| max error / bar "
           "| within 1e-10 | polish kept | median queries (biased) | median bias-free + Hd "
           "| median ratio | max ratio | biased count | paper 2 + Hd | max queries / (paper 2 + Hd) "
           "| floor | median CPU s | short probes sent (biased) "
           "| short probes kept (biased, bias-free) "
           "| bias-free within 1e-10 |", "|" + "---|" * 24]
    for H, d in sorted({(r["H"], r["d"]) for r in rows}, key=lambda x: (x[1], x[0])):
        cell = [r for r in rows if (r["H"], r["d"]) == (H, d)]
        ok = [r for r in cell if "refused" not in r]
        err = [max(r["W"], r["b"], r["v"], r["c"]) for r in ok]
        out.append("| {} | {} | {} | {} | {:.1e} | {:.1e} | {:.1e} | {:.1e} | {:.1e} | {:.2f} "
                   "| {} | {} | {:.0f} | {:.0f} | {:.3f} | {:.3f} | {} | {} | {:.3f} | {} "
                   "| {:.1f} | {} | {}, {} | {} |".format(
                       H, d, len(cell), len(cell) - len(ok),
                       max((r["W"] for r in ok), default=np.nan),
                       max((r["b"] for r in ok), default=np.nan),
                       max((r["v"] for r in ok), default=np.nan),
                       max((r["c"] for r in ok), default=np.nan),
                       np.median(err) if err else np.nan,
                       max((e / r["error bar"] for e, r in zip(err, ok)), default=np.nan),
                       sum(e <= GOAL for e in err),
                       sum(r.get("polish") == "kept" for r in ok),
                       np.median([r["queries"] for r in cell]),
                       np.median([r["bias-free queries"] + H * d for r in cell]),
                       np.median([r["ratio"] for r in cell]),
                       max(r["ratio"] for r in cell), biased_count(H, d),
                       paper2_count(H, d) + H * d,
                       max(r["queries"] / (paper2_count(H, d) + H * d) for r in cell),
                       cell[0]["floor"],
                       np.median([r["cpu s"] for r in cell]),
                       sum(short_sent(r.get("short probes")) for r in cell),
                       sum(short_kept(r.get("short probes")) for r in cell),
                       sum(short_kept(r.get("bias-free short probes")) for r in cell),
                       sum(r.get("bias-free error", np.inf) <= GOAL for r in cell)))
    misses = [r for r in rows if "refused" in r or max(r["W"], r["b"], r["v"], r["c"]) > GOAL]
    if misses:
        out += ["", "Runs beyond 1e-10 (or refused):", ""]
        out += [f"- H = {r['H']}, d = {r['d']}, seed {r['seed']}: " + (
            r["refused"] if "refused" in r else
            f"W {r['W']:.1e} b {r['b']:.1e} v {r['v']:.1e} c {r['c']:.1e} "
            f"(bar {r['error bar']:.1e}); bias-free learner on the same heads "
            f"{r.get('bias-free error', np.nan):.1e}; short probes: {r.get('short probes')}")
            for r in misses]
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--heads", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--dims", type=int, nargs="+", default=[8, 16])
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as results:
        results.add(measure(args))


def measure(args) -> str:
    """Every run (a line each); returns the notes and the summary table."""
    rows = []
    for d in args.dims:
        for H in args.heads:
            for seed in range(args.seeds):
                rows.append(run(H, d, seed))
                r = rows[-1]
                print(H, d, seed, r.get("refused") or
                      f"W {r['W']:.1e} b {r['b']:.1e} v {r['v']:.1e} c {r['c']:.1e} "
                      f"bar {r['error bar']:.1e}", r["queries"], r["bias-free queries"],
                      f"{r['cpu s']:.1f}s", flush=True)
    table = summary(rows)
    print(table)
    return (
        "polish kept: runs whose joint polish (with b_h and c) was kept.\n"
        "queries include the 64 verification queries of each run (biased and bias-free);\n"
        "ratio = biased queries / (bias-free queries + H d) on the same heads; the biased\n"
        "count (the learner's cap, verification included) is paper 2's count 4Hd^2 - 2H + 1\n"
        "plus (H + 1) d + 1 (c and H + 1 more samples per short-probe row).\n\n" + table)


if __name__ == "__main__":
    main()
