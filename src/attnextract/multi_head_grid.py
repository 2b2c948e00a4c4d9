"""The multi-head benchmark grid: success rate, queries, error and time per (H, d) cell.

One cell runs the multi-head learner on ``seeds`` independent random black boxes
(W_h entries N(0, s^2 / d), v_h entries N(0, 1); or low-rank heads W_h = A_h B_h^T when
``rank`` is given) and summarises: the success rate (canonical error <= the goal, or
within the error bar for rounded outputs), refusals by type, wrong models (a returned
model whose error exceeds its own error bar: must be 0), median recovery queries against
paper 2's count 4Hd^2 - 2H + 1 and the floor, median and worst canonical error, and wall
times. Used by ``attnextract bench`` (a few seeds) and benchmarks/bench_multi_head.py (the
full grid).
"""

from __future__ import annotations

import time

import numpy as np

from .errors import AttnExtractError
from .oracle import Oracle, RoundedOutputs

GOAL = 1e-10          # canonical error of a success, full-rank heads
LOW_RANK_GOAL = 1e-8  # ... low-rank heads (issue 12, item 2)


def grid_cell(H: int, d: int, seeds: int, scale: float = 1.0, float32: bool = False,
              rank: int | None = None) -> dict:
    """One grid cell over ``seeds`` seeds; returns its summary row (see module doc)."""
    from .adapters.targets import random_low_rank_multi_head, random_multi_head
    from .learners.multi_head import canonical_error, extract_multi_head, paper2_count
    runs = []
    for seed in range(seeds):
        if rank is None:
            target = random_multi_head(H, d, seed=10_000 * H + 100 * d + seed,
                                       w_scale=scale / np.sqrt(d))
        else:
            target = random_low_rank_multi_head(H, d, rank, seed=seed, scale=scale)
        oracle = Oracle(RoundedOutputs(target) if float32 else target, d)
        start = time.perf_counter()
        try:
            if rank is None:
                result = extract_multi_head(oracle, heads=H, seed=seed)
            else:
                from .learners.multi_head_low_rank import extract_multi_head_low_rank
                result = extract_multi_head_low_rank(oracle, H, rank, seed=seed)
            outcome = None
        except AttnExtractError as exc:
            result, outcome = getattr(exc, "result", None), type(exc).__name__
        wall = time.perf_counter() - start
        run = {"seed": seed, "wall": wall, "refused": outcome, "queries": oracle.queries,
               "black_box": oracle.black_box_seconds}
        if outcome is None:
            err = canonical_error(result.model, target)
            details = result.report.details
            bar = details.get("error bar", details.get("conditioning_numbers", {})
                              .get("predicted_error", np.inf))
            goal = GOAL if rank is None else LOW_RANK_GOAL
            run.update(error=err, bar=bar, recovery=result.report.breakdown["recovery"],
                       wrong=bool(err > bar) if float32 else bool(err > max(bar, goal)),
                       success=bool(err <= bar if float32 else err <= goal))
        else:
            run.update(success=False, wrong=False)
        runs.append(run)
    ok = [r for r in runs if r["success"]]
    done = [r for r in runs if r["refused"] is None]
    refusals: dict[str, int] = {}
    for r in runs:
        if r["refused"]:
            refusals[r["refused"]] = refusals.get(r["refused"], 0) + 1
    fail_walls = [r["wall"] for r in runs if not r["success"]]
    floor = H * (d * d + d) if rank is None else H * (d + rank * (2 * d - rank))
    median = lambda key, rs: float(np.median([r[key] for r in rs])) if rs else None
    return {"H": H, "d": d, "rank": rank, "scale": scale, "float32": float32, "seeds": seeds,
            "success_rate": len(ok) / seeds, "refusals": refusals,
            "failed_seeds": [r["seed"] for r in runs if not r["success"]],
            "wrong_models": int(sum(r["wrong"] for r in runs)),
            "recovery_median": median("recovery", done),
            "paper2": paper2_count(H, d), "floor": floor,
            "error_median": median("error", done),
            "error_worst": float(max(r["error"] for r in done)) if done else None,
            "bar_median": median("bar", done),
            "wall_success_median": median("wall", ok),
            "black_box_median": median("black_box", ok),
            "wall_failure_max": float(max(fail_walls)) if fail_walls else None}


def grid_markdown(rows: list[dict]) -> str:
    """The cells as one markdown table."""
    out = ["| d | H | r | W scale | success | refusals | wrong | median queries | paper 2 | "
           "floor | queries / floor | median error | worst error | s (success, median) | "
           "s (failure, max) |", "|" + "---|" * 15]
    fmt = lambda x, f: "-" if x is None else format(x, f)
    for r in rows:
        q = r["recovery_median"]
        out.append(f"| {r['d']} | {r['H']} | {r['rank'] or 'full'} | {r['scale']:g} | "
                   f"{r['success_rate']:.0%} | "
                   f"{', '.join(f'{k} {v}' for k, v in r['refusals'].items()) or '-'} | "
                   f"{r['wrong_models']} | {fmt(q, '.0f')} | {r['paper2']} | {r['floor']} | "
                   f"{'-' if q is None else format(q / r['floor'], '.2f')} | "
                   f"{fmt(r['error_median'], '.1e')} | {fmt(r['error_worst'], '.1e')} | "
                   f"{fmt(r['wall_success_median'], '.1f')} | {fmt(r['wall_failure_max'], '.1f')} |")
    return "\n".join(out) + "\n"


def grid_plot(rows: list[dict], path) -> list[str]:
    """Success rate and median canonical error against H, one line per (d, scale);
    writes ``path`` (PNG) and the same with .svg and .pdf. Returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pathlib import Path
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    full = [r for r in rows if r["rank"] is None and not r["float32"]]
    for d in sorted({r["d"] for r in full}):
        for scale in sorted({r["scale"] for r in full}):
            cell = sorted((r for r in full if r["d"] == d and r["scale"] == scale),
                          key=lambda r: r["H"])
            if not cell:
                continue
            label = f"d = {d}, W ~ N(0, {scale ** 2:g}/d)"
            ax1.plot([r["H"] for r in cell], [r["success_rate"] for r in cell], "o-",
                     label=label)
            pts = [(r["H"], r["error_median"]) for r in cell if r["error_median"] is not None]
            if pts:
                ax2.semilogy(*zip(*pts), "o-", label=label)
    ax1.set(xlabel="heads H", ylabel="success rate (canonical error <= 1e-10)",
            ylim=(-0.05, 1.05))
    ax2.set(xlabel="heads H", ylabel="median canonical error")
    heads = sorted({r["H"] for r in full})
    for ax in (ax1, ax2):              # heads are whole numbers: ticks at the H measured
        ax.set_xticks(heads)
    ax2.axhline(GOAL, color="gray", ls=":", label="goal 1e-10")
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    path = Path(path)
    written = []
    for out in (path, path.with_suffix(".svg"), path.with_suffix(".pdf")):
        fig.savefig(out, dpi=120, bbox_inches="tight")
        written.append(str(out))
    plt.close(fig)
    return written
