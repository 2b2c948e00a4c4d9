"""One-head boxes through the multi-head learner: queries (verification and journal checks
included) against paper 2's count 4Hd^2 - 2H + 1 = 4d^2 - 1, told H = 1 and not told.

Run:  python benchmarks/bench_one_head_count.py [--dims 4 6 8 12 16 32] [--seeds 5]
          [--float32-seeds 5] [--out FILE.md]

Float64 boxes: random_multi_head(1, d) (W scale 1 / sqrt(d)); float32 boxes:
Float32MultiHeadBlackBox(1, d) (numpy, as nn.MultiheadAttention(d, 1, bias=False) in
float32). Writes benchmarks/results/bench_one_head_count.md.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

from attnextract import Oracle
from attnextract.adapters.targets import Float32MultiHeadBlackBox, random_multi_head
from attnextract.errors import RefusalWithResult
from attnextract.learners.multi_head import extract_multi_head, paper2_count
from attnextract.learners.multi_head.canonical import canonical_error
from attnextract.report import verification_count

import _results


def run(box, truth, d, told, seed):
    """One extraction: (outcome, canonical error, error bar, queries, CPU seconds, notes)."""
    cpu = time.process_time()
    oracle = Oracle(box, d)
    try:
        result = extract_multi_head(oracle, 1 if told else None, seed=seed)
        error, outcome = canonical_error(result.model, truth), "recovered"
        report = result.report
    except RefusalWithResult as exc:
        error, outcome = None, type(exc).__name__
        report = exc.result.report if exc.result is not None else None
    bar = report.details.get("error bar") if report is not None else None
    notes = [n for n in (report.notes if report is not None else []) if "count" in n]
    return outcome, error, bar, oracle.queries, time.process_time() - cpu, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[4, 6, 8, 12, 16, 32])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--float32-seeds", type=int, default=5)
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as results:
        lines = table(args)
        results.add(lines[0])
        results.add("\n".join(lines[1:]))


def table(args) -> list[str]:
    """The summary line, then the table of every run."""
    lines = ["| box | d | told | seed | outcome | canonical error | error bar | queries | "
             "paper 2's count | floor + verification | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    runs = []
    with threadpool_limits(1):
        for d in args.dims:
            kinds = [("float64", s) for s in range(args.seeds)]
            kinds += [("float32", s) for s in range(args.float32_seeds)]
            for kind, s in kinds:
                if kind == "float64":
                    box = random_multi_head(1, d, seed=10_000 + 100 * d + s,
                                            w_scale=1 / np.sqrt(d))
                    truth = box
                else:
                    box = Float32MultiHeadBlackBox(1, d, seed=s)
                    truth = box.truth
                for told in (True, False):
                    outcome, error, bar, queries, cpu, notes = run(box, truth, d, told, s)
                    floor = d * d + d
                    row = {"box": kind, "d": d, "told": told, "seed": s, "outcome": outcome,
                           "error": error, "error_bar": bar, "queries": queries,
                           "paper2_count": paper2_count(1, d),
                           "floor_plus_verification": floor + verification_count(floor),
                           "cpu_seconds": cpu, "notes": notes}
                    runs.append(row)
                    lines.append(
                        f"| {kind} | {d} | {'yes' if told else 'no'} | {s} | {outcome} | "
                        f"{'-' if error is None else f'{error:.1e}'} | "
                        f"{'-' if bar is None else f'{bar:.1e}'} | {queries} | "
                        f"{row['paper2_count']} | {row['floor_plus_verification']} | "
                        f"{'; '.join(notes)} |")
                    print(lines[-1], f"{cpu:.1f} s CPU", flush=True, file=sys.stderr)
    fits = [r for r in runs if r["floor_plus_verification"] <= r["paper2_count"]]
    summary = (f"{sum(r['outcome'] == 'recovered' for r in runs)} of {len(runs)} recovered; "
               f"where floor + verification <= paper 2's count: "
               f"{sum(r['queries'] <= r['paper2_count'] for r in fits)} of {len(fits)} within "
               f"the count")
    print(summary)
    return [summary] + lines


if __name__ == "__main__":
    main()
