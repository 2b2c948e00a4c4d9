"""Multi-head extraction (copy probes at designed steps): the grid of issue 12, item 1.

Run:  python benchmarks/bench_multi_head.py [--heads 1 2 4 6 8] [--dims 8 16 32]
                                           [--seeds 20] [--scales 1 3] [--float32]
                                           [--threads 1] [--json FILE] [--markdown FILE]
                                           [--plot FILE.png] [--low-rank 64:8:8 96:12:8]

Targets: independent numpy black boxes, W_h entries N(0, s^2 / d) (s in --scales),
v_h entries N(0, 1). Each cell: success rate (canonical error <= 1e-10, or within the
error bar for --float32), refusals by type, wrong models (a success whose error exceeds
its own error bar: must be 0), median recovery queries against paper 2's count
4Hd^2 - 2H + 1 and the floor H(d^2 + d), median and worst canonical error, median and
longest wall time (success and failure). --plot draws success rate and median error
against H (matplotlib, imported only then).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from attnextract.multi_head_grid import grid_cell, grid_markdown, grid_plot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8])
    parser.add_argument("--dims", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--float32", action="store_true")
    parser.add_argument("--low-rank", nargs="*", default=[], metavar="d:H:r",
                        help="low-rank cells (the low-rank multi-head learner), e.g. 64:8:8")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--plot")
    args = parser.parse_args()
    from threadpoolctl import threadpool_limits
    rows = []
    with threadpool_limits(args.threads):
        for d in args.dims:
            for H in args.heads:
                if H > d:
                    continue
                for scale in args.scales:
                    rows.append(grid_cell(H, d, args.seeds, scale, args.float32))
                    r = rows[-1]
                    print(f"d={d} H={H} scale={scale:g}: success {r['success_rate']:.0%}, "
                          f"refusals {r['refusals']}, wrong {r['wrong_models']}, queries "
                          f"{r['recovery_median']} (paper {r['paper2']}, floor {r['floor']}), "
                          f"error {r['error_median']}, {r['wall_success_median']} s", flush=True)
        for case in args.low_rank:
            d, H, r = (int(x) for x in case.split(":"))
            for scale in args.scales:
                rows.append(grid_cell(H, d, args.seeds, scale, rank=r))
                print(f"d={d} H={H} r={r} scale={scale:g}: success "
                      f"{rows[-1]['success_rate']:.0%}", flush=True)
    table = grid_markdown(rows)
    print(table)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(table)
    if args.plot:
        grid_plot(rows, args.plot)


if __name__ == "__main__":
    main()
