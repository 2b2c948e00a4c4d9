"""Multi-head extraction (copy probes at designed steps): the grid of issues 12 and 22.

Run:  nice -n 10 python benchmarks/bench_multi_head.py [--heads 1 2 4 6 8] [--dims 8 16 32]
          [--seeds 20] [--scales 1 3] [--learner-seed random|target] [--no-heads]
          [--precision full|fast] [--float32] [--threads 1] [--out FILE.md]
          [--plot FILE.svg] [--scatter FILE.svg] [--low-rank 64:8:8] [--per-run]

Targets: independent numpy black boxes, W_h entries N(0, s^2 / d) (s in --scales),
v_h entries N(0, 1). The learner's seed is drawn at random per run by default (printed
as each run ends; --per-run puts it in the table). Each cell: success rate (canonical error <= 1e-10, or within the error bar
for --float32), first-try success (one design, no main row redesigned), retries (designs
beyond the first, and main rows redesigned), refusals by type, wrong models (a success
whose error exceeds its own error bar: must be 0), median recovery queries against paper
2's count 4Hd^2 - 2H + 1 and the floor H(d^2 + d), median and worst canonical error, wall
times (median success, whole cell, longest failure). --no-heads runs without telling H.
--plot draws success rate and median error against H; --scatter draws every run's
queries / floor against its error (matplotlib, imported only then). Each run's wall and CPU
seconds and the load average are printed as it ends; --per-run also puts them in the
results file, one row per run. The results file is rewritten after every cell.
"""

from __future__ import annotations

import argparse

import numpy as np

from attnextract.bench_grid import (grid_cell, grid_markdown, grid_plot, queries_error_plot,
                                    runs_markdown)

import _results


def write(args, results, rows: list[dict]) -> str:
    """Save the cells so far to the results file; returns the markdown table."""
    table = grid_markdown(rows) + ("\n" + runs_markdown(rows) if args.per_run else "")
    results.parts = [table]
    results.save()
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8])
    parser.add_argument("--dims", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--learner-seed", choices=["random", "target"], default="random",
                        help="random (default): a fresh learner seed per run; target: the "
                             "target's seed index")
    parser.add_argument("--no-heads", action="store_true", help="do not tell the learner H")
    parser.add_argument("--precision", choices=["full", "fast"], default="full")
    parser.add_argument("--float32", action="store_true")
    parser.add_argument("--low-rank", nargs="*", default=[], metavar="d:H:r",
                        help="low-rank cells (the low-rank multi-head learner), e.g. 64:8:8")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads")
    parser.add_argument("--plot", metavar="FILE.svg", help="success and error against H")
    parser.add_argument("--scatter", metavar="FILE.svg", help="every run's queries and error")
    _results.add_out_option(parser, __file__)
    parser.add_argument("--per-run", action="store_true",
                        help="also write one markdown row per run (seeds, outcome, seconds)")
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as results:
        measure(args, results)


def measure(args, results) -> None:
    """The grid's cells, saved after every cell (a stopped grid keeps its cells)."""
    from threadpoolctl import threadpool_limits
    draw = np.random.default_rng()
    rows = []
    with threadpool_limits(args.threads):
        for d in args.dims:
            for H in args.heads:
                if H > d:
                    continue
                for scale in args.scales:
                    seeds = (draw.integers(0, 2 ** 31, size=args.seeds)
                             if args.learner_seed == "random" else None)
                    rows.append(grid_cell(H, d, args.seeds, scale, args.float32,
                                          learner_seeds=seeds, told=not args.no_heads,
                                          precision=args.precision,
                                          on_run=lambda run, d=d, H=H, scale=scale: print(
                                              f"  d={d} H={H} scale={scale:g} seed "
                                              f"{run['seed']} (learner {run['learner_seed']}): "
                                              f"{run['refused'] or run.get('error')}, "
                                              f"{run['queries']} queries, "
                                              f"{run['wall']:.1f} s wall, {run['cpu']:.1f} s "
                                              f"CPU, load {run['load']:.2f}", flush=True)))
                    r = rows[-1]
                    write(args, results, rows)
                    print(f"d={d} H={H} scale={scale:g}: success {r['success_rate']:.0%} "
                          f"(first try {r['first_try_rate']:.0%}, retries {r['retries']}, rows "
                          f"redesigned {r['rows_redesigned']}), refusals {r['refusals']}, wrong "
                          f"{r['wrong_models']}, queries {r['recovery_median']} (paper "
                          f"{r['paper_count']}, floor {r['floor']}), error {r['error_median']} "
                          f"(worst {r['error_worst']}), {r['wall_success_median']} s median, "
                          f"{r['wall_total']:.0f} s cell, failed seeds {r['failed_seeds']}",
                          flush=True)
        for case in args.low_rank:
            d, H, r = (int(x) for x in case.split(":"))
            for scale in args.scales:
                rows.append(grid_cell(H, d, args.seeds, scale, rank=r))
                print(f"d={d} H={H} r={r} scale={scale:g}: success "
                      f"{rows[-1]['success_rate']:.0%}", flush=True)
    print(write(args, results, rows))
    if args.plot:
        grid_plot(rows, args.plot)
    if args.scatter:
        queries_error_plot(rows, args.scatter)


if __name__ == "__main__":
    main()
