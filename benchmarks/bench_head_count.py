"""Head count without --heads: each box run twice, told H and not told, same learner seed.

Run:  nice -n 10 python benchmarks/bench_head_count.py [--dims 8 16] [--heads 1 .. 8]
          [--scales 1 3] [--seeds 5] [--out FILE.md]

Targets as the multi-head grid (attnextract.bench_grid): independent numpy boxes,
W_h entries N(0, s^2 / d), v_h entries N(0, 1), target seed 10000 H + 100 d + seed. The
learner's seed is drawn at random per box (recorded) and used for both runs, so the two
runs differ only in whether H is given. Per box: the count found without H (must be H),
success of each run (canonical error <= 1e-10), total queries (verification included)
and time of each, and their ratios (issue 22 item 3: queries at most 1.5x, time never
above 3x the told run). The time ratio is of CPU time (process time, one BLAS thread),
which the load of a shared machine does not inflate as it does wall time (also recorded).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import _results

GOAL = 1e-10


def run_once(target, d: int, heads, seed: int) -> dict:
    from attnextract.errors import AttnExtractError
    from attnextract.learners.multi_head import canonical_error, extract_multi_head
    from attnextract.oracle import Oracle
    oracle = Oracle(target, d)
    start, cpu = time.perf_counter(), time.process_time()
    try:
        result = extract_multi_head(oracle, heads=heads, seed=seed)
    except AttnExtractError as exc:
        # a refusal after the count (a later stage failed) still reports the count found
        details = exc.result.report.details if getattr(exc, "result", None) else {}
        return {"refused": type(exc).__name__, "message": str(exc)[:300],
                "queries": oracle.queries, "seconds": time.perf_counter() - start,
                "cpu_seconds": time.process_time() - cpu,
                "heads_found": details.get("canonical heads"),
                "base_counts": details.get("head counts of the base rows"),
                "success": False}
    error = canonical_error(result.model, target)
    return {"refused": None, "queries": result.report.queries,
            "seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
            "heads_found": result.model.heads,
            "error": float(error), "success": bool(error <= GOAL),
            "base_counts": result.report.details.get("head counts of the base rows"),
            "notes": list(result.report.notes)}


def markdown(boxes: list[dict]) -> str:
    """The per-cell table of ``boxes``."""
    kind, seconds = "CPU", "cpu_seconds"
    lines = ["Times are CPU seconds of the process (one BLAS thread), which the load "
             "inflates less than wall time.", "",
             "Each box is run told H and not told, with the same random learner seed. "
             "found: the count without H equals H; success: canonical error <= 1e-10.", "",
             f"| d | H | s | boxes | count found | success told | success not told | "
             f"queries ratio median (max) | {kind} time ratio median (max) | {kind} s told (median) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    cells: dict = {}
    for b in boxes:
        cells.setdefault((b["d"], b["H"], b["scale"]), []).append(b)
    for (d, H, s), bs in cells.items():
        q = [b["query_ratio"] for b in bs]
        t = [b["time_ratio"] for b in bs]
        lines.append(f"| {d} | {H} | {s:g} | {len(bs)} | {sum(b['count_found'] for b in bs)} | "
                     f"{sum(b['told']['success'] for b in bs)} | "
                     f"{sum(b['not_told']['success'] for b in bs)} | {np.median(q):.2f} "
                     f"({max(q):.2f}) | {np.median(t):.2f} ({max(t):.2f}) | "
                     f"{np.median([b['told'][seconds] for b in bs]):.1f} |")
    q = [b["query_ratio"] for b in boxes]
    t = [b["time_ratio"] for b in boxes]
    lines += ["", f"All {len(boxes)} boxes: count found {sum(b['count_found'] for b in boxes)}, "
              f"queries ratio median {np.median(q):.2f}, max {max(q):.2f}; {kind} time ratio median "
              f"{np.median(t):.2f}, max {max(t):.2f}.", ""]
    misses = [b for b in boxes if not b["count_found"] or not b["not_told"]["success"]]
    if misses:
        lines += ["Boxes not recovered without H:", ""]
        for b in misses:
            f = b["not_told"]
            lines.append(f"- d = {b['d']}, H = {b['H']}, s = {b['scale']:g}, seed {b['seed']} "
                         f"(learner seed {b['learner_seed']}): found {f['heads_found']}, "
                         f"{f['refused'] or 'error %.1e' % f.get('error', np.nan)}: "
                         f"{f.get('message', '')[:200]}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--heads", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8])
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--seeds", type=int, default=5)
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as results:
        measure(args, results)


def measure(args, results) -> None:
    """Every box told and not told; the results file is saved after every box."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from threadpoolctl import threadpool_limits
    from attnextract.adapters.targets import random_multi_head
    draw = np.random.default_rng()
    boxes = []
    with threadpool_limits(1):
        for d in args.dims:
            for H in args.heads:
                if H > d:
                    continue
                for scale in args.scales:
                    for seed in range(args.seeds):
                        target = random_multi_head(H, d, seed=10_000 * H + 100 * d + seed,
                                                   w_scale=scale / np.sqrt(d))
                        learner_seed = int(draw.integers(2 ** 31))
                        told = run_once(target, d, H, learner_seed)
                        free = run_once(target, d, None, learner_seed)
                        box = {"d": d, "H": H, "scale": scale, "seed": seed,
                               "learner_seed": learner_seed, "told": told, "not_told": free,
                               "count_found": free["heads_found"] == H,
                               "query_ratio": free["queries"] / told["queries"],
                               "time_ratio": free["cpu_seconds"] / max(told["cpu_seconds"], 1e-9),
                               "wall_ratio": free["seconds"] / max(told["seconds"], 1e-9)}
                        boxes.append(box)
                        print(f"d={d} H={H} s={scale:g} seed={seed}: found "
                              f"{free['heads_found']} ({free['refused'] or 'ok'}), success "
                              f"{told['success']}/{free['success']}, queries x"
                              f"{box['query_ratio']:.2f}, time x{box['time_ratio']:.2f} "
                              f"(CPU {told['cpu_seconds']:.1f} / {free['cpu_seconds']:.1f} s)",
                              flush=True)
                        results.parts = [markdown(boxes)]
                        results.save()


if __name__ == "__main__":
    sys.exit(main())
