"""The multi-head benchmark grid: success rate, queries, error and time per (H, d) cell.

One cell runs the multi-head learner on ``seeds`` independent random black boxes
(W_h entries N(0, s^2 / d), v_h entries N(0, 1); or low-rank heads W_h = A_h B_h^T when
``rank`` is given) and summarises: the success rate (canonical error <= the goal, or
within the error bar for rounded outputs), refusals by type, wrong models (a returned
model whose error exceeds its own error bar: must be 0), median recovery queries against
the multi-head paper's count 4Hd^2 - 2H + 1 and the floor, median and worst canonical error, wall
times, first-try success (one design, no main row redesigned) and the redesigns. Used by
``attnextract bench`` (a few seeds per cell) and the repository's benchmark scripts
(benchmarks/bench_multi_head.py runs the full grid).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from .adapters.targets import random_low_rank_multi_head, random_multi_head
from .errors import AttnExtractError
from .learners.multi_head import canonical_error, extract_multi_head, paper2_count
from .learners.multi_head_low_rank import extract_multi_head_low_rank
from .oracle import Oracle, RoundedOutputs
from .plotting import REFERENCE, legend_outside, log_axes, save, series_styles

GOAL = 1e-10          # canonical error of a success, full-rank heads
LOW_RANK_GOAL = 1e-8  # the low-rank heads goal


def grid_cell(H: int, d: int, seeds: int, scale: float = 1.0, float32: bool = False,
              rank: int | None = None, learner_seeds=None, told: bool = True,
              precision: str = "full", on_run=None) -> dict:
    """One grid cell over ``seeds`` seeds; returns its summary row (see module doc).

    ``learner_seeds``: the learner's seed per target seed (default: the target seed);
    ``told``: the learner is given H (else it finds the count); ``precision``: the
    learner's option; ``on_run``: called with each run's record as it ends (progress).
    Each run records its wall and CPU seconds and the machine's 1-minute load average
    when it ended."""
    runs: list[dict[str, Any]] = []
    for seed in range(seeds):
        learner_seed = seed if learner_seeds is None else int(learner_seeds[seed])
        if rank is None:
            target = random_multi_head(H, d, seed=10_000 * H + 100 * d + seed,
                                       w_scale=scale / np.sqrt(d))
        else:
            target = random_low_rank_multi_head(H, d, rank, seed=seed, scale=scale)
        oracle = Oracle(RoundedOutputs(target) if float32 else target, d)
        start, cpu_start = time.perf_counter(), time.process_time()
        result: Any                      # the learner's result, or a refusal's (or None)
        try:
            if rank is None:
                result = extract_multi_head(oracle, heads=H if told else None,
                                            seed=learner_seed, precision=precision)
            else:
                result = extract_multi_head_low_rank(oracle, H, rank, seed=learner_seed)
            outcome = None
        except AttnExtractError as error:
            exc = error
            result, outcome = getattr(exc, "result", None), type(exc).__name__
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        run: dict[str, Any] = {"seed": seed, "learner_seed": learner_seed, "wall": wall,
                               "cpu": cpu, "load": os.getloadavg()[0], "refused": outcome,
                               "queries": oracle.queries,
                               "black_box": oracle.black_box_seconds}
        details = result.report.details if result is not None else {}
        run.update(designs=int(details.get("designs tried", 1)),
                   rows_redesigned=int(details.get("main rows redesigned", 0)),
                   message=None if outcome is None else str(exc)[:400])
        if outcome is None:
            err = canonical_error(result.model, target)
            details = result.report.details
            bar = details.get("error bar", details.get("conditioning_numbers", {})
                              .get("predicted_error", np.inf))
            goal = GOAL if rank is None else LOW_RANK_GOAL
            run.update(error=err, bar=bar, recovery=result.report.breakdown["recovery"],
                       total=result.report.queries, heads_found=result.model.heads,
                       wrong=bool(err > bar) if float32 else bool(err > max(bar, goal)),
                       success=bool(err <= bar if float32 else err <= goal))
        else:
            run.update(success=False, wrong=False)
        runs.append(run)
        if on_run is not None:
            on_run(run)
    ok = [r for r in runs if r["success"]]
    done = [r for r in runs if r["refused"] is None]
    refusals: dict[str, int] = {}
    for r in runs:
        if r["refused"]:
            refusals[r["refused"]] = refusals.get(r["refused"], 0) + 1
    fail_walls = [r["wall"] for r in runs if not r["success"]]
    floor = H * (d * d + d) if rank is None else H * (d + rank * (2 * d - rank))
    def median(key: str, rs: list) -> float | None:
        return float(np.median([r[key] for r in rs])) if rs else None
    first_try = [r for r in ok if r["designs"] == 1 and r["rows_redesigned"] == 0]
    return {"H": H, "d": d, "rank": rank, "scale": scale, "float32": float32, "seeds": seeds,
            "told": told, "precision": precision,
            "success_rate": len(ok) / seeds, "first_try_rate": len(first_try) / seeds,
            "retries": int(sum(r["designs"] - 1 for r in runs)),
            "rows_redesigned": int(sum(r["rows_redesigned"] for r in runs)),
            "wall_total": float(sum(r["wall"] for r in runs)),
            "wall_max": float(max(r["wall"] for r in runs)),
            "total_median": median("total", done),
            "runs": runs, "refusals": refusals,
            "failed_seeds": [r["seed"] for r in runs if not r["success"]],
            "wrong_models": int(sum(r["wrong"] for r in runs)),
            "recovery_median": median("recovery", done),
            "paper_count": paper2_count(H, d), "floor": floor,
            "error_median": median("error", done),
            "error_worst": float(max(r["error"] for r in done)) if done else None,
            "bar_median": median("bar", done),
            "wall_success_median": median("wall", ok),
            "black_box_median": median("black_box", ok),
            "wall_failure_max": float(max(fail_walls)) if fail_walls else None}


def grid_markdown(rows: list[dict]) -> str:
    """The cells as one markdown table."""
    out = [("| d | H | r | W scale | H told | success | first try | retries (rows) | "
            "refusals | wrong | median queries | paper's count | floor | queries / floor | "
            "median error | worst error | s (success, median) | s (cell) | "
            "s (failure, max) |"),
           "|" + "---|" * 19]
    def fmt(x: object, f: str) -> str:
        return "-" if x is None else format(x, f)
    for r in rows:
        q = r["recovery_median"]
        out.append(f"| {r['d']} | {r['H']} | {r['rank'] or 'full'} | {r['scale']:g} | "
                   f"{'yes' if r.get('told', True) else 'no'} | "
                   f"{r['success_rate']:.0%} | {fmt(r.get('first_try_rate'), '.0%')} | "
                   f"{r.get('retries', 0)} ({r.get('rows_redesigned', 0)}) | "
                   f"{', '.join(f'{k} {v}' for k, v in r['refusals'].items()) or '-'} | "
                   f"{r['wrong_models']} | {fmt(q, '.0f')} | {r['paper_count']} | {r['floor']} | "
                   f"{'-' if q is None else format(q / r['floor'], '.2f')} | "
                   f"{fmt(r['error_median'], '.1e')} | {fmt(r['error_worst'], '.1e')} | "
                   f"{fmt(r['wall_success_median'], '.1f')} | {fmt(r.get('wall_total'), '.0f')} | "
                   f"{fmt(r['wall_failure_max'], '.1f')} |")
    return "\n".join(out) + "\n"


def runs_markdown(rows: list[dict]) -> str:
    """Every run of the cells as one markdown table: outcome, error, queries, wall and CPU
    seconds, and the 1-minute load average when the run ended."""
    out = [("| d | H | W scale | target seed | learner seed | outcome | canonical error | "
            "recovery queries | designs | s (wall) | s (CPU) | load |"), "|" + "---|" * 12]
    for r in rows:
        for run in r.get("runs", []):
            outcome = run["refused"] or ("recovered" if run["success"] else "above goal")
            error = format(run["error"], ".1e") if "error" in run else "-"
            out.append(f"| {r['d']} | {r['H']} | {r['scale']:g} | {run['seed']} | "
                       f"{run['learner_seed']} | {outcome} | {error} | "
                       f"{run.get('recovery', '-')} | {run['designs']} | {run['wall']:.1f} | "
                       f"{run['cpu']:.1f} | {run['load']:.2f} |")
    return "\n".join(out) + "\n"


def queries_error_plot(rows: list[dict], path) -> list[str]:
    """Every returned run as a point: recovery queries / floor against canonical error,
    one series (colour and marker) per d, precision and whether H was told; writes
    ``path`` as SVG, PNG and PDF. Returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r["rank"] is not None:
            continue
        label = (f"d = {r['d']}, precision {r.get('precision', 'full')}"
                 f"{'' if r.get('told', True) else ', H found'}")
        series.setdefault(label, []).extend(
            (run["recovery"] / r["floor"], max(run["error"], 1e-17))
            for run in r.get("runs", []) if "error" in run)
    styles = series_styles(series)
    for label, points in series.items():
        if points:
            x, y = zip(*points)
            ax.plot(x, y, ls="none", ms=4, label=label, **styles[label])
    ax.set(xlabel="recovery queries / floor H(d^2 + d)", ylabel="canonical error")
    log_axes(ax, x=False)
    ax.axhline(GOAL, color=REFERENCE, ls=":", lw=0.8, label=f"goal {GOAL:g}")
    legend_outside(ax)
    return save(fig, path)


def grid_plot(rows: list[dict], path) -> list[str]:
    """Success rate and median canonical error against H, one series (colour and
    marker) per (d, scale); writes ``path`` as SVG, PNG and PDF. Returns the files
    written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    full = [r for r in rows if r["rank"] is None and not r["float32"]]
    cells = {}
    for d in sorted({r["d"] for r in full}):
        for scale in sorted({r["scale"] for r in full}):
            cell = sorted((r for r in full if r["d"] == d and r["scale"] == scale),
                          key=lambda r: r["H"])
            if cell:
                cells[f"d = {d}, W ~ N(0, {scale ** 2:g}/d)"] = cell
    styles = series_styles(cells)
    for label, cell in cells.items():
        ax1.plot([r["H"] for r in cell], [r["success_rate"] for r in cell], "-",
                 label=label, **styles[label])
        pts = [(r["H"], r["error_median"]) for r in cell if r["error_median"] is not None]
        if pts:
            ax2.plot(*zip(*pts), "-", label=label, **styles[label])
    ax1.set(xlabel="heads H", ylabel="success rate (canonical error <= 1e-10)",
            ylim=(-0.05, 1.05))
    ax2.set(xlabel="heads H", ylabel="median canonical error")
    log_axes(ax2, x=False)
    heads = sorted({r["H"] for r in full})
    for ax in (ax1, ax2):              # heads are whole numbers: ticks at the H measured
        ax.set_xticks(heads)
    ax2.axhline(GOAL, color=REFERENCE, ls=":", lw=0.8, label=f"goal {GOAL:g}")
    legend_outside(ax2)
    fig.tight_layout()
    return save(fig, path)
