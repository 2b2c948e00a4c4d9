"""Summarize rerun_grid_cell.py --json results into one table per (d, H, W scale) cell.

Run:  python benchmarks/summarize_reruns.py RERUN.json ... --markdown OUT.md

A run counts as recovered when it returned a model at canonical error <= 1e-10 with its queries
(verification included) within paper 2's count 4Hd^2 - 2H + 1. First try: recovered with one
design and no main row redesigned (as bench_multi_head.py); retries: designs beyond the first,
summed over the cell's runs (in brackets: the runs that tried more than one). CPU seconds are process time (1 BLAS
thread); the load column is the range of 1-minute load averages at the runs' ends. The last
column is the recorded result's (its error; a refusal or a larger error does not count).
"""

from __future__ import annotations

import argparse
import json
import statistics


def _cells(paths: list[str]) -> tuple[dict, list[str]]:
    cells: dict = {}
    commands = []
    for path in paths:
        result = json.load(open(path))
        commands.append(result["command"])
        for run in result["runs"]:
            cells.setdefault((run["d"], run["H"], run["scale"]), []).append(run)
    return cells, commands


def _recovered(run: dict) -> bool:
    return (run["error"] is not None and run["error"] <= 1e-10
            and run["queries"] <= run["paper2_count"])


def _error(statistic, errors: list[float]) -> str:
    return f"{statistic(errors):.1e}" if errors else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--markdown", required=True)
    parser.add_argument("--note", default="", help="text put above the table")
    args = parser.parse_args()
    cells, commands = _cells(args.results)
    lines = ["| d | H | W scale | recovered | first try | retries | refused | median error | "
             "worst error | most queries / paper 2 | CPU s median / max | load | recorded within 1e-10 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (d, H, scale), runs in sorted(cells.items()):
        errors = [r["error"] for r in runs if r["error"] is not None]
        designs = [r["details"].get("designs tried", 1) for r in runs]
        first_try = sum(_recovered(r) and n == 1 and not r["details"].get("main rows redesigned")
                        for r, n in zip(runs, designs))
        cpu = [r["cpu_seconds"] for r in runs]
        loads = [r["load"] for r in runs]
        recovered = sum(map(_recovered, runs))
        accurate = sum(r["error"] is not None and r["error"] <= 1e-10 for r in runs)
        also = (f" (+{accurate - recovered} within 1e-10 but over the count)"
                if accurate > recovered else "")
        lines.append(
            f"| {d} | {H} | {scale:g} | {recovered}/{len(runs)}{also} | "
            f"{first_try} | "
            f"{sum(n - 1 for n in designs)} ({sum(n > 1 for n in designs)}) | "
            f"{sum(r['outcome'] != 'recovered' for r in runs)} | "
            f"{_error(statistics.median, errors)} | {_error(max, errors)} | "
            f"{max(r['queries'] or 0 for r in runs)} / {runs[0]['paper2_count']} | "
            f"{statistics.median(cpu):.1f} / {max(cpu):.1f} | "
            f"{min(loads):.1f}-{max(loads):.1f} | "
            f"{sum(isinstance(r['recorded'], float) and r['recorded'] <= 1e-10 for r in runs)}"
            f"/{len(runs)} |")
    with open(args.markdown, "w") as fh:
        fh.write((args.note + "\n\n" if args.note else "") + "\n".join(lines) + "\n\nCommands:\n\n" +
                 "\n".join(f"    python {c}" for c in commands) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
