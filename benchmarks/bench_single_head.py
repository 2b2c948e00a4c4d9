"""Single-head extraction: queries, parameter error and wall time vs d.

Run:  python benchmarks/bench_single_head.py [--dims 16 64 256 512] [--repeats 3]

Time inside the black box and time in the learner (everything else: probe
construction, logits, the solve, verification) are shown separately; each row is
the median over the repeats (fresh target each time).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from attnextract import Oracle, extract_single_head
from attnextract.adapters.targets import random_single_head

import _results


def run(dims, repeats):
    rows = []
    for d in dims:
        stats = []
        for seed in range(repeats):
            target = random_single_head(d, seed=seed)
            oracle = Oracle(target, d)
            start = time.perf_counter()
            result = extract_single_head(oracle, seed=seed)
            wall = time.perf_counter() - start
            stats.append({
                "queries": result.queries,
                "recovery_queries": result.report.breakdown["recovery"]
                + result.report.breakdown["rescaling"],
                "W_error": float(np.linalg.norm(result.model.W - target.W) / np.linalg.norm(target.W)),
                "v_error": float(np.linalg.norm(result.model.v - target.v) / np.linalg.norm(target.v)),
                "output_error": result.report.verification.max_relative_error,
                "wall_s": wall,
                "black_box_s": oracle.black_box_seconds,
                "learner_s": wall - oracle.black_box_seconds,
            })
        row = {"d": d, "floor": d * d + d}
        for key in stats[0]:
            values = [s[key] for s in stats]
            row[key] = max(values) if key.endswith("error") else float(np.median(values))
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[16, 64, 256, 512])
    parser.add_argument("--repeats", type=int, default=3)
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as results:
        results.capture()
        table(run(args.dims, args.repeats))


def table(rows) -> None:
    """Print the rows as one aligned table."""
    print(f"{'d':>5} {'floor':>8} {'recovery':>9} {'all q':>8} {'W err':>9} {'out err':>9} "
          f"{'wall s':>8} {'box s':>8} {'learner s':>9} {'learner/box':>11}")
    for r in rows:
        print(f"{r['d']:>5} {r['floor']:>8} {int(r['recovery_queries']):>9} {int(r['queries']):>8} "
              f"{r['W_error']:>9.1e} {r['output_error']:>9.1e} {r['wall_s']:>8.3f} "
              f"{r['black_box_s']:>8.3f} {r['learner_s']:>9.3f} "
              f"{r['learner_s'] / r['black_box_s']:>11.2f}")


if __name__ == "__main__":
    main()
