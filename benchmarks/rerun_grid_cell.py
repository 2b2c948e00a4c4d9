"""Rerun one cell of a multi-head grid result (bench_multi_head.py --json) on the current code,
with the same boxes and the same learner seeds, and compare each run with the recorded one.

Run:  python benchmarks/rerun_grid_cell.py RESULT.json --heads 8 [--dim 8] [--scale 3]
          [--seed 9 10] [--markdown OUT.md] [--json OUT.json]

--scale and --seed (target seed indices) rerun only those runs of the cell, e.g. its failures.
Each run's wall and CPU seconds (process time, 1 BLAS thread), the tokens sent and the
1-minute load average at its end are printed and kept in --json.
A cell run without --heads (told H = no) is rerun without telling H.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

from attnextract import Oracle
from attnextract.adapters.targets import random_multi_head
from attnextract.errors import RefusalWithResult
from attnextract.learners.multi_head import extract_multi_head
from attnextract.learners.multi_head.canonical import canonical_error


# the stages a run went through (which paths of the learner it took)
DETAILS = ("head counts of the base rows", "canonical heads",
           "base row smallest step gap (first row)", "designed column scans",
           "designed column smallest step gap", "designed column spread columns",
           "base estimate relative error",
           "base estimate relative error (first row)", "base scans", "main rows redesigned",
           "main rows relabelled", "label misfit (before, after)", "held-out error",
           "designs tried", "failed designs", "short probes", "predicted relative error")


def _plain(value):
    """A JSON value for a numpy number or array in a run's details."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


def _recorded_cells(result: dict) -> list[dict]:
    """The cells of a recorded result: bench_multi_head.py's "rows", or this script's own
    --json output ("runs", one per box) grouped back into cells, so a rerun can be rerun."""
    if "rows" in result:
        return result["rows"]
    cells: dict = {}
    for run in result["runs"]:
        cell = cells.setdefault((run["H"], run["d"], run["scale"]),
                                {"H": run["H"], "d": run["d"], "scale": run["scale"],
                                 "told": run.get("told", True), "runs": []})
        cell["runs"].append({"seed": run["seed"], "learner_seed": run["learner_seed"],
                             "error": run["error"],
                             "refused": None if run["outcome"] == "recovered" else run["outcome"]})
    return list(cells.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result")
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--dim", type=int)
    parser.add_argument("--scale", type=float, help="only the cell of this W scale")
    parser.add_argument("--seed", type=int, nargs="+", help="only these target seeds")
    parser.add_argument("--markdown")
    parser.add_argument("--json")
    args = parser.parse_args()
    recorded = _recorded_cells(json.load(open(args.result)))
    lines = ["| d | H | W scale | target seed | outcome | canonical error | queries | recorded |",
             "|---|---|---|---|---|---|---|---|"]
    good = total = 0
    runs = []
    with threadpool_limits(1):
        for row in recorded:
            H, d, scale = row["H"], row["d"], row["scale"]
            if (H != args.heads or (args.dim and d != args.dim) or row.get("rank")
                    or (args.scale is not None and scale != args.scale)):
                continue
            for run in row["runs"]:
                if args.seed is not None and run["seed"] not in args.seed:
                    continue
                box = random_multi_head(H, d, seed=10_000 * H + 100 * d + run["seed"],
                                        w_scale=scale / np.sqrt(d))
                start, cpu = time.perf_counter(), time.process_time()
                oracle = Oracle(box, d)
                try:
                    result = extract_multi_head(oracle, H if row.get("told", True)
                                                else None, seed=run["learner_seed"])
                    error, outcome = canonical_error(result.model, box), "recovered"
                    queries, details = result.queries, result.report.details
                except RefusalWithResult as exc:
                    error, outcome = None, type(exc).__name__
                    queries = exc.result.queries if exc.result is not None else None
                    details = exc.result.report.details if exc.result is not None else {}
                total += 1
                runs.append({"d": d, "H": H, "scale": scale, "seed": run["seed"],
                             "learner_seed": run["learner_seed"], "told": row.get("told", True),
                             "outcome": outcome,
                             "error": error, "queries": queries,
                             "paper2_count": 4 * H * d * d - 2 * H + 1,
                             "seconds": time.perf_counter() - start,
                             "cpu_seconds": time.process_time() - cpu,
                             "tokens": oracle.tokens, "load": os.getloadavg()[0],
                             "recorded": run["refused"] or run["error"],
                             "details": {key: details[key] for key in details}})
                good += error is not None and error <= 1e-10
                before = run["refused"] or f"{run['error']:.1e}"
                lines.append(f"| {d} | {H} | {scale:g} | {run['seed']} | {outcome} | "
                             f"{'-' if error is None else f'{error:.1e}'} | {queries} | {before} |")
                print(lines[-1], f"{time.perf_counter() - start:.1f} s wall, "
                      f"{runs[-1]['cpu_seconds']:.1f} s CPU, {oracle.tokens} tokens, "
                      f"load {runs[-1]['load']:.1f}", flush=True)
                print("    stages:", {key: details[key] for key in DETAILS if key in details},
                      flush=True)
    summary = (f"{good} of {total} within 1e-10, {sum(r['outcome'] != 'recovered' for r in runs)} "
               f"refused, most queries {max((r['queries'] or 0) for r in runs)} (command: "
               f"rerun_grid_cell.py {' '.join(sys.argv[1:])})")
    write_results("rerun_grid_cell.py", summary, lines, runs, args.markdown, args.json)


def write_results(script: str, summary: str, lines: list[str], runs: list[dict],
                  markdown: str | None, json_path: str | None) -> None:
    """Print a run table's summary and write it with the table (markdown) and the runs
    (JSON, with the command that made them), as the benchmarks' result files."""
    print(summary)
    if markdown:
        with open(markdown, "w") as fh:
            fh.write(f"{summary}\n\n" + "\n".join(lines) + "\n")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"command": " ".join([f"benchmarks/{script}", *sys.argv[1:]]),
                       "summary": summary, "runs": runs}, fh, indent=1, default=_plain)


if __name__ == "__main__":
    main()
