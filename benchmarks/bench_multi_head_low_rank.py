"""Low-rank multi-head attention (H r = d, like a real layer): success, queries, error, conditioning, time.

Run:  python benchmarks/bench_multi_head_low_rank.py [--cases 64:8:8 96:12:8] [--seeds 10]
          [--scales 1 3] [--minilm 0 3] [--threads 1 2] [--out FILE.md]

Part 1: random low-rank heads (``random_low_rank_multi_head``: W_h = s A_h B_h^T / sqrt(d r),
A_h, B_h Gaussian, v_h ~ N(0, I)) for every case d:H:r, scale s and seed. A seed succeeds
when the learner returns a model (held-out verification passed) whose canonical error
is <= 1e-8; a refusal is counted apart, a wrong model would be counted as "wrong".
Rows: success rate, median recovery queries against the floor H(d + r(2d - r)) and paper
2's 4 H d^2 - 2 H + 1, the largest canonical error, the largest predicted error, the
smallest head separations (crossing gap, query-space separation) and the median time.

The canonical error is the worst head's (relative error of W_h or v_h after matching).

Part 2 (--minilm L ...): the 12 heads of MiniLM-L6 layer L at the full width (d = 384,
r = 32) behind a random readout, once per BLAS thread count in --threads (threadpoolctl
limits the BLAS pool inside one process).

Times are wall-clock on whatever else the machine runs: say so when quoting them.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from threadpoolctl import threadpool_limits

from attnextract.adapters.targets import random_low_rank_multi_head
from attnextract.errors import ModelMismatchError, RecoveryFailedError
from attnextract.learners.multi_head import canonical_error
from attnextract.learners.multi_head_low_rank import (extract_multi_head_low_rank,
                                                      paper_two_count)
from attnextract.oracle import Oracle

import _results


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=["64:8:8", "96:12:8"],
                        help="d:H:r (none: MiniLM only)")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--minilm", type=int, nargs="*", default=[], help="layers")
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    _results.add_out_option(parser, __file__)
    return parser.parse_args()


def one_run(target, heads, rank, seed):
    oracle = Oracle(target, target.dim)
    start = time.perf_counter()
    try:
        result = extract_multi_head_low_rank(oracle, heads, rank, seed=seed)
    except (ModelMismatchError, RecoveryFailedError) as exc:
        return {"outcome": "refused", "reason": str(exc).splitlines()[0],
                "seconds": time.perf_counter() - start, "queries": oracle.queries}
    error = canonical_error(result.model, target)
    numbers = result.report.details["conditioning_numbers"]
    return {"outcome": "ok" if error <= 1e-8 else "wrong", "error": error,
            "predicted": numbers["predicted_error"],
            "gap": numbers["smallest_crossing_gap"],
            "separation": numbers["query_space_separation"],
            "recovery": result.report.breakdown["recovery"], "queries": result.queries,
            "seconds": time.perf_counter() - start,
            "black_box_seconds": result.report.black_box_seconds}


def random_cases(args, rows):
    print("| d | H | r | scale | success | refused | wrong | median queries | x floor | "
          "x paper 2 | max error | max predicted | min crossing gap | min separation | "
          "median s |")
    print("|" + "---|" * 15)
    for case in args.cases:
        d, H, r = (int(x) for x in case.split(":"))
        floor, paper = H * (d + r * (2 * d - r)), paper_two_count(d, H)
        for scale in args.scales:
            runs = []
            for seed in range(args.seeds):
                target = random_low_rank_multi_head(H, d, r, seed, scale=scale)
                run = one_run(target, H, r, seed)
                runs.append(run)
                rows.append({"d": d, "H": H, "r": r, "scale": scale, "seed": seed, **run})
            ok = [x for x in runs if x["outcome"] == "ok"]
            count = lambda what: sum(x["outcome"] == what for x in runs)  # noqa: E731
            med = float(np.median([x["recovery"] for x in ok])) if ok else float("nan")
            print(f"| {d} | {H} | {r} | {scale:g} | {len(ok)}/{len(runs)} | {count('refused')} "
                  f"| {count('wrong')} | {med:.0f} | {med / floor:.3f} | {med / paper:.4f} | "
                  f"{max((x['error'] for x in ok), default=float('nan')):.1e} | "
                  f"{max((x['predicted'] for x in ok), default=float('nan')):.1e} | "
                  f"{min((x['gap'] for x in ok), default=float('nan')):.1e} | "
                  f"{min((x['separation'] for x in ok), default=float('nan')):.1e} | "
                  f"{np.median([x['seconds'] for x in runs]):.2f} |", flush=True)


def minilm_layers(args, rows):
    from attnextract.adapters.minilm import minilm_layer_target
    print("\n| layer | BLAS threads | queries | x floor 287232 | x paper 2 | canonical error | "
          "predicted | s (black box) |")
    print("|" + "---|" * 8)
    for layer in args.minilm:
        truth = minilm_layer_target(layer)
        for threads in args.threads:
            with threadpool_limits(limits=threads, user_api="blas"):
                run = one_run(truth, 12, 32, 0)
            rows.append({"minilm_layer": layer, "threads": threads, **run})
            if run["outcome"] == "refused":
                print(f"| {layer} | {threads} | {run['queries']} | refused: {run['reason']} |")
                continue
            print(f"| {layer} | {threads} | {run['recovery']} | {run['recovery'] / 287232:.3f} | "
                  f"{run['recovery'] / 7077865:.4f} | {run['error']:.1e} | {run['predicted']:.1e} "
                  f"| {run['seconds']:.0f} ({run['black_box_seconds']:.0f}) |",
                  flush=True)


def main():
    args = parse()
    rows = []
    with _results.Run(__file__, args.out) as results:
        results.capture(markdown=True)
        if args.cases:
            random_cases(args, rows)
        if args.minilm:
            minilm_layers(args, rows)


if __name__ == "__main__":
    main()
