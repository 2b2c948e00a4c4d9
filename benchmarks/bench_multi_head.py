"""Multi-head extraction (copy-count learner): queries and canonical error vs H and d.

Run:  python benchmarks/bench_multi_head.py [--heads 1 2 3 4] [--dims 4 8 16 32]
                                           [--seeds 20] [--break-heads 5 6 8]
                                           [--float32] [--json FILE]

Each row: H, d, seeds; recovery queries (median and max) against paper 2's count
4Hd^2 - 2H + 1, 2Hd^2 and the floor H(d^2 + d); the worst canonical error after
matching heads; failures (verification mismatch or error above 1e-8); the longest
sequence sent; median wall time. --break-heads runs larger H at d = 8 to show where
pole fitting breaks; --float32 rounds every output to float32.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from attnextract import Oracle
from attnextract.errors import ModelMismatchError
from attnextract.learners.multi_head import canonical_error, extract_multi_head
from attnextract.adapters.targets import random_multi_head

GOAL = 1e-8


def run_setting(H, d, seeds, float32=False):
    stats = []
    for seed in range(seeds):
        target = random_multi_head(H, d, seed=10_000 * H + 100 * d + seed)
        box = (lambda X: target(X).astype(np.float32)) if float32 else target
        oracle = Oracle(box, d)
        start = time.perf_counter()
        try:
            result = extract_multi_head(oracle, seed=seed,
                                        verify_tolerance=1e-4 if float32 else 1e-7)
            mismatch = False
        except ModelMismatchError as exc:
            result, mismatch = exc.result, True
        wall = time.perf_counter() - start
        err = canonical_error(result.model, target)
        lengths = result.report.details.get("sequence lengths", "")
        longest = max(int(x) for x in lengths.replace("[", ",").replace("]", ",")
                      .replace("up to", ",").split(",") if x.strip().isdigit()) if lengths else 1
        stats.append({"recovery": result.report.breakdown["recovery"], "error": err,
                      "failed": mismatch or not err <= (1e-3 if float32 else GOAL),
                      "heads_found": result.model.heads, "longest": longest, "wall": wall})
    rec = [s["recovery"] for s in stats]
    return {"H": H, "d": d, "seeds": seeds, "recovery_median": float(np.median(rec)),
            "recovery_max": int(max(rec)), "paper2": 4 * H * d * d - 2 * H + 1,
            "2Hd^2": 2 * H * d * d, "floor": H * (d * d + d),
            "worst_error": float(max(s["error"] for s in stats)),
            "median_error": float(np.median([s["error"] for s in stats])),
            "failures": int(sum(s["failed"] for s in stats)),
            "longest_sequence": int(max(s["longest"] for s in stats)),
            "wall_s_median": float(np.median([s["wall"] for s in stats]))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--dims", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--break-heads", type=int, nargs="*", default=[5, 6, 8])
    parser.add_argument("--break-seeds", type=int, default=5)
    parser.add_argument("--float32", action="store_true", help="also the float32 table")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()

    rows = [run_setting(H, d, args.seeds) for H in args.heads for d in args.dims]
    rows += [run_setting(H, 8, args.break_seeds) for H in args.break_heads]
    if args.float32:
        rows += [dict(run_setting(H, 8, args.break_seeds, float32=True), float32=True)
                 for H in (1, 2, 3, 4)]
    head = (f"{'H':>2} {'d':>3} {'seeds':>5} {'recovery med':>12} {'max':>6} {'paper2':>7} "
            f"{'2Hd^2':>6} {'floor':>6} {'worst err':>9} {'median err':>10} {'fail':>4} "
            f"{'len':>3} {'wall s':>7}")
    print(head)
    for r in rows:
        tag = " (float32)" if r.get("float32") else ""
        print(f"{r['H']:>2} {r['d']:>3} {r['seeds']:>5} {r['recovery_median']:>12.0f} "
              f"{r['recovery_max']:>6} {r['paper2']:>7} {r['2Hd^2']:>6} {r['floor']:>6} "
              f"{r['worst_error']:>9.1e} {r['median_error']:>10.1e} {r['failures']:>4} "
              f"{r['longest_sequence']:>3} {r['wall_s_median']:>7.2f}{tag}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
