"""Low-rank heads: queries, error and time vs d for both methods; ROP success rate vs C.

Run:  python benchmarks/bench_low_rank.py [--dims 64 128 256 384 1024] [--repeats 2]
          [--sweep-c] [--c-dims 32 64 128] [--c-values 1 1.25 1.5 2 3] [--c-seeds 20]
          [--threads N] [--out FILE.md]

Part 1 (always): for each d, a generic rank-r target (W = G1 G2^T / sqrt(d r)), both
methods. The adaptive learner gets r = d/16 (at least 2; r = 32 at d = 384 and r = 64 at
d = 1024, the speed targets of the issue); the ROP learner, whose cost is
(solver iterations) x (m d r) with m = C r 2d, gets --rop-rank (default 8) so that d can
reach 1024, plus the (d, r) pairs given with --rop-extra (e.g. 384:32). Rows give the
median over the repeats of queries before verification, the low-rank floor
d + r(2d - r), the full floor d^2 + d, the largest relative error of W, and the wall
time split into black box and learner.

Part 2 (--sweep-c): the smallest C for which the ROP learner succeeds (relative error of
W <= 1e-9, no RecoveryFailedError) on at least 95% of seeds, for d in --c-dims.

--threads N sets OPENBLAS_NUM_THREADS / OMP_NUM_THREADS before numpy is imported (on a
contended machine multithreaded BLAS can be much slower than one thread).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import _results


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256, 384, 1024])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rop-rank", type=int, default=8)
    parser.add_argument("--rop-extra", nargs="*", default=[], help="d:r pairs for ROP")
    parser.add_argument("--oversampling", type=float, default=2.0, help="C of part 1's ROP runs")
    parser.add_argument("--no-rop", action="store_true", help="part 1 adaptive only")
    parser.add_argument("--sweep-c", action="store_true")
    parser.add_argument("--c-dims", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--c-ranks", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--c-values", type=float, nargs="+",
                        default=[1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0])
    parser.add_argument("--c-seeds", type=int, default=20)
    parser.add_argument("--threads", type=int)
    _results.add_out_option(parser, __file__)
    return parser.parse_args()


ARGS = parse()
if ARGS.threads:
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(ARGS.threads)

import numpy as np  # noqa: E402  (after the thread settings)

from attnextract import Oracle, RecoveryFailedError, SingleHeadAttention, extract_low_rank  # noqa: E402
from attnextract.learners.low_rank import low_rank_floor  # noqa: E402


def low_rank_head(d, r, seed):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((d, r)) @ rng.standard_normal((r, d)) / np.sqrt(d * r)
    return SingleHeadAttention(W, rng.standard_normal(d))


def adaptive_rank(d):
    return {384: 32, 1024: 64}.get(d, max(2, d // 16))


def one_run(d, r, method, seed, oversampling):
    target = low_rank_head(d, r, seed)
    oracle = Oracle(target, d)
    options = {"rank": r, "oversampling": oversampling} if method == "rop" else {}
    start = time.perf_counter()
    result = extract_low_rank(oracle, method=method, seed=seed, **options)
    wall = time.perf_counter() - start
    b = result.report.breakdown
    return {
        "queries": result.queries - b["verification"],
        "verification": b["verification"],
        "rank": result.report.details["rank"],
        "W_error": float(np.linalg.norm(result.model.W - target.W) / np.linalg.norm(target.W)),
        "output_error": result.report.verification.max_relative_error,
        "wall_s": wall, "black_box_s": oracle.black_box_seconds,
        "learner_s": wall - oracle.black_box_seconds,
    }


def part1():
    cases = []
    for d in ARGS.dims:
        cases.append((d, adaptive_rank(d), "adaptive"))
        if not ARGS.no_rop:
            cases.append((d, min(d, ARGS.rop_rank), "rop"))
    for pair in ARGS.rop_extra:
        d, r = (int(x) for x in pair.split(":"))
        cases.append((d, r, "rop"))
    rows = []
    print(f"{'method':>8} {'d':>5} {'r':>3} {'queries':>8} {'floor r':>8} {'x floor':>7} "
          f"{'d^2+d':>8} {'x full':>6} {'W err':>8} {'out err':>8} {'wall s':>7} "
          f"{'box s':>6} {'learner s':>9}", flush=True)
    for d, r, method in cases:
        stats = [one_run(d, r, method, seed, ARGS.oversampling) for seed in range(ARGS.repeats)]
        row = {"method": method, "d": d, "r": r, "floor": low_rank_floor(d, r),
               "full_floor": d * d + d, "oversampling": ARGS.oversampling if method == "rop" else None}
        for key in stats[0]:
            values = [s[key] for s in stats]
            row[key] = max(values) if key.endswith("error") else float(np.median(values))
        rows.append(row)
        print(f"{method:>8} {d:>5} {r:>3} {int(row['queries']):>8} {row['floor']:>8} "
              f"{row['queries'] / row['floor']:>7.4f} {row['full_floor']:>8} "
              f"{row['queries'] / row['full_floor']:>6.3f} {row['W_error']:>8.1e} "
              f"{row['output_error']:>8.1e} {row['wall_s']:>7.2f} {row['black_box_s']:>6.2f} "
              f"{row['learner_s']:>9.2f}", flush=True)
    return rows


def part2():
    rows = []
    print(f"\nROP success rate (W error <= 1e-9) vs C, {ARGS.c_seeds} seeds each", flush=True)
    for d in ARGS.c_dims:
        for r in ARGS.c_ranks:
            if r > d:
                continue
            line, smallest = [], None
            for C in ARGS.c_values:
                ok, seconds = 0, []
                for seed in range(ARGS.c_seeds):
                    start = time.perf_counter()
                    try:
                        run = one_run(d, r, "rop", 1000 + seed, C)
                        ok += run["W_error"] <= 1e-9
                    except RecoveryFailedError:
                        pass
                    seconds.append(time.perf_counter() - start)
                rate = ok / ARGS.c_seeds
                rows.append({"d": d, "r": r, "C": C, "success_rate": rate,
                             "median_s": float(np.median(seconds))})
                line.append(f"C={C:g}: {rate:.2f}")
                if smallest is None and rate >= 0.95:
                    smallest = C
            print(f"d = {d:4} r = {r:3}  " + "  ".join(line) +
                  f"  -> smallest C with >= 95%: {smallest}", flush=True)
    return rows


def main():
    with _results.Run(__file__, ARGS.out) as results:
        results.capture()
        part1()
        if ARGS.sweep_c:
            part2()


if __name__ == "__main__":
    sys.exit(main())
