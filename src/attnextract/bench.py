"""``attnextract bench``: every learner's cost and accuracy, the floors, and the baseline.

One run writes into ``--out DIR``:

- ``bench.json``: every measured row (labelled by learner; the baseline rows say
  ``"surrogate"``);
- ``bench.md``: the Markdown tables;
- PNG plots (with matplotlib installed): queries vs d (log-log, with the floors
  and the papers' counts, fitted slopes in the legend), parameter and output
  error vs d, wall time split between the black box and the learner, and the
  surrogate comparison.

Sections are small functions registered in ``SECTIONS``; each learner that has
landed adds one. ``--quick`` runs small sizes (under two minutes on 2 cores).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from .oracle import Oracle
from .learners.single_head import extract_single_head
from .learners.surrogate import train_surrogate
from .adapters.targets import random_single_head


def _rel(a, b) -> float:
    nb = float(np.linalg.norm(b))
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / nb) if nb > 0 else float("nan")


def fitted_slope(xs, ys) -> float:
    """Least-squares slope of log(y) against log(x)."""
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def measure(learner: str, d: int, target, extract, *, floor: int, paper_count, error,
            **extra) -> dict:
    """One scaling row: run ``extract(oracle)`` on ``target`` and time it.

    ``error(model)`` returns the row's error fields (at least ``W_error``; it may
    override ``output_error``, which defaults to the held-out verification error).
    Recovery queries are all queries but the held-out verification.
    """
    oracle = Oracle(target, d)
    start = time.perf_counter()
    result = extract(oracle)
    wall = time.perf_counter() - start
    return {"learner": learner, "d": d, **extra, "queries": result.queries,
            "recovery_queries": result.queries - result.report.breakdown["verification"],
            "floor": floor, "paper_count": paper_count,
            "output_error": result.report.verification.max_relative_error,
            **error(result.model), "wall_s": wall, "black_box_s": oracle.black_box_seconds,
            "learner_s": wall - oracle.black_box_seconds}


def section_single_head(quick: bool, log) -> list[dict]:
    """Exact single head (paper 1, Theorem 4.1): d^2 + d queries."""
    rows = []
    for d in ([4, 8, 16, 32, 64] if quick else [4, 8, 16, 32, 64, 128, 256, 512]):
        target = random_single_head(d, seed=d)
        rows.append(measure("single-head", d, target,
                            lambda oracle: extract_single_head(oracle, seed=d),
                            floor=d * d + d, paper_count=d * d + d,
                            error=lambda model: {"W_error": _rel(model.W, target.W),
                                                 "v_error": _rel(model.v, target.v)}))
        log(f"single-head d={d}: {rows[-1]['recovery_queries']} queries, "
            f"W error {rows[-1]['W_error']:.1e}")
    return rows


def section_surrogate(quick: bool, log) -> list[dict]:
    """The baseline: L-BFGS fit of a single head on random query/answer pairs."""
    rows = []
    d = 8 if quick else 64
    multipliers = [1, 10] if quick else [1, 3, 10]
    target = random_single_head(d, seed=d)
    exact_oracle = Oracle(target, d)
    exact = extract_single_head(exact_oracle, seed=1)
    rows.append({"learner": "single-head", "label": "attnextract", "d": d,
                 "queries": exact.queries, "W_error": _rel(exact.model.W, target.W),
                 "output_error": exact.report.verification.max_relative_error,
                 "wall_s": exact.report.seconds})
    for mult in multipliers:
        oracle = Oracle(target, d)
        budget = mult * exact.queries
        result = train_surrogate(oracle, budget, seed=mult, max_iter=500 if quick else 1500)
        rows.append({"learner": "surrogate", "label": f"surrogate {mult}x", "d": d,
                     "queries": result.queries, "training_queries": budget,
                     "W_error": _rel(result.model.W, target.W),
                     "output_error": result.report.verification.max_relative_error,
                     "wall_s": result.report.seconds,
                     "iterations": result.report.details["iterations"]})
        log(f"surrogate d={d} {mult}x: W error {rows[-1]['W_error']:.1e}, "
            f"output error {rows[-1]['output_error']:.1e}")
    return rows


def section_one_layer(quick: bool, log) -> list[dict]:
    """One-layer Transformer end to end (paper 1 reduction + the ReLU FFN learner), m = d."""
    from .learners.one_layer import compare_one_layer, extract_one_layer, random_one_layer
    rows = []
    for d in ([4, 8, 16] if quick else [4, 8, 16, 32, 64]):
        target = random_one_layer(d, d, seed=d)

        def errors(model):
            cmp = compare_one_layer(model, target, seed=d)
            return {"W_error": cmp["relative_error_W"], "bits": cmp["bits"],
                    "output_error": cmp["max_output_error"]}
        rows.append(measure("one-layer", d, target,
                            lambda oracle: extract_one_layer(oracle, seed=d),
                            floor=d * d + d * d, paper_count=None, m=d, error=errors))
        log(f"one-layer d=m={d}: {rows[-1]['recovery_queries']} queries, "
            f"{rows[-1]['bits']:.1f} bits")
    return rows


def section_low_rank(quick: bool, log) -> list[dict]:
    """Rank-r heads, r = d/8: the adaptive learner (floor d + r(2d - r)) and paper 1's ROP."""
    from .learners.low_rank import extract_low_rank, low_rank_floor
    from .adapters.targets import random_low_rank_head
    rows = []
    for method in ("adaptive", "rop"):
        for d in ([16, 32, 64] if quick else [16, 32, 64, 128, 256, 512]):
            r = max(1, d // 8)
            target = random_low_rank_head(d, r, seed=d)
            rows.append(measure(
                f"low-rank {method}", d, target,
                lambda oracle: extract_low_rank(oracle, rank=r if method == "rop" else None,
                                                method=method, seed=d),
                floor=low_rank_floor(d, r), rank=r,
                paper_count=d + int(np.ceil(2 * r * 2 * d)) if method == "rop" else None,
                error=lambda model: {"W_error": _rel(model.W, target.W)}))
            spent = rows[-1]["recovery_queries"]
            log(f"low-rank {method} d={d} r={r}: {spent} queries (floor "
                f"{rows[-1]['floor']}), W error {rows[-1]['W_error']:.1e}")
    return rows


def section_multi_head(quick: bool, log) -> list[dict]:
    """Canonical multi-head recovery (copy probes at designed steps), H = 2 and 4 heads.

    The full grid (H <= 8, d in {8, 16, 32}, 20 seeds) is benchmarks/bench_multi_head.py.
    """
    from .learners.multi_head import canonical_error, extract_multi_head
    from .adapters.targets import random_multi_head
    rows = []
    for H, d in ([(2, 8), (2, 16)] if quick else [(2, 8), (2, 16), (2, 32), (4, 16), (4, 32)]):
        target = random_multi_head(H, d, seed=d)
        rows.append(measure(f"multi-head (H = {H})", d, target,
                            lambda oracle: extract_multi_head(oracle, heads=H, seed=d),
                            floor=H * (d * d + d), paper_count=4 * H * d * d - 2 * H + 1,
                            heads=H,
                            error=lambda model: {"W_error": canonical_error(model, target)}))
        spent = rows[-1]["recovery_queries"]
        log(f"multi-head H={H} d={d}: {spent} queries (paper 2: {rows[-1]['paper_count']}), "
            f"canonical error {rows[-1]['W_error']:.1e}")
    return rows


def section_noisy(quick: bool, log) -> list[dict]:
    """Error vs noise tolerance tau: the robust default and paper 1's Theorem 6.1, equal queries."""
    from .learners.noisy import extract_noisy
    from .oracle import BoundedNoise
    rows = []
    d = 16
    target = random_single_head(d, seed=3)
    B = float(np.linalg.norm(target.W))
    for tau in ([1e-8, 1e-6, 1e-4] if quick else [1e-10, 1e-8, 1e-6, 1e-5, 1e-4, 1e-3]):
        for method in ("robust", "paper"):
            oracle = Oracle(BoundedNoise(target, tau, "sign", seed=1), d)
            result = extract_noisy(oracle, tolerance=tau, method=method, norm_bound=B, seed=1)
            rows.append({"learner": f"noisy ({method})", "d": d, "tau": tau,
                         "queries": result.queries,
                         "W_abs_error": float(np.linalg.norm(result.model.W - target.W)),
                         "error_bar_W": float(result.report.details["error_bar_W"])})
            log(f"noisy {method} tau={tau:.0e}: |W_hat - W|_F = {rows[-1]['W_abs_error']:.1e} "
                f"(bar {rows[-1]['error_bar_W']:.1e})")
    return rows


SECTIONS = {"single-head": section_single_head, "low-rank": section_low_rank,
            "one-layer": section_one_layer, "multi-head": section_multi_head,
            "noisy": section_noisy, "surrogate": section_surrogate}


def markdown(rows: list[dict]) -> str:
    """Markdown tables: one per learner (by d), then the surrogate comparison."""
    out = []
    scaling = [r for r in rows if "floor" in r]
    if scaling:
        out += ["| learner | d | queries (recovery) | floor | paper | W error | output error "
                "| wall s | black box s | learner s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in scaling:
            paper = "-" if r["paper_count"] is None else r["paper_count"]
            out.append(f"| {r['learner']} | {r['d']} | {r['recovery_queries']} | {r['floor']} | "
                       f"{paper} | {r['W_error']:.1e} | {r['output_error']:.1e} | "
                       f"{r['wall_s']:.3f} | {r['black_box_s']:.3f} | {r['learner_s']:.3f} |")
        out.append("\npaper: d^2 + d (paper 1, Thm 4.1); d + C r 2d with the measured C = 2 "
                   "(paper 1, Thm 5.1 states no C); 4Hd^2 - 2H + 1 (paper 2); - where no count "
                   "is stated. floor: free parameters.")
        for learner in dict.fromkeys(r["learner"] for r in scaling):
            sub = [r for r in scaling if r["learner"] == learner]
            if len(sub) >= 2:
                out.append(f"\nFitted slope of log(queries) vs log(d), {learner}: "
                           f"{fitted_slope([r['d'] for r in sub], [r['recovery_queries'] for r in sub]):.3f}")
    noisy = [r for r in rows if "tau" in r]
    if noisy:
        out += ["", f"Noisy outputs, |eta| <= tau (random signs), d = {noisy[0]['d']}, equal "
                "queries:", "", "| method | tau | queries | ‖W_hat − W‖_F | error bar |",
                "|---|---|---|---|---|"]
        for r in noisy:
            out.append(f"| {r['learner']} | {r['tau']:.0e} | {r['queries']} | "
                       f"{r['W_abs_error']:.1e} | {r['error_bar_W']:.1e} |")
    compare = [r for r in rows if "label" in r]
    if compare:
        out += ["", f"Exact extraction vs the surrogate baseline (d = {compare[0]['d']}):", "",
                "| method | queries | W error | held-out output error | wall s |",
                "|---|---|---|---|---|"]
        for r in compare:
            out.append(f"| {r['label']} | {r['queries']} | {r['W_error']:.1e} | "
                       f"{r['output_error']:.1e} | {r['wall_s']:.2f} |")
        reached = [r for r in compare if r["learner"] == "surrogate" and r["output_error"] <= 1e-3]
        out.append("")
        out.append(f"Surrogate reaches 1e-3 held-out output error with {reached[0]['queries']} "
                   "queries." if reached else "Surrogate does not reach 1e-3 held-out output "
                   f"error with up to {max(r['queries'] for r in compare)} queries.")
    return "\n".join(out) + "\n"


def plots(rows: list[dict], out: Path) -> list[str]:
    """Write the PNG plots; returns their file names ([] without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    scaling = [r for r in rows if "floor" in r]
    learners = list(dict.fromkeys(r["learner"] for r in scaling))

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for learner in learners:
        sub = [r for r in scaling if r["learner"] == learner]
        ds, qs = [r["d"] for r in sub], [r["recovery_queries"] for r in sub]
        label = learner + (f" (slope {fitted_slope(ds, qs):.2f})" if len(sub) >= 2 else "")
        ax.loglog(ds, qs, "o-", label=label)
        if all(r["paper_count"] is not None for r in sub):
            ax.loglog(ds, [r["paper_count"] for r in sub], ":", label=f"paper count, {learner}")
    all_d = sorted({r["d"] for r in scaling})
    ax.loglog(all_d, [d * d + d for d in all_d], "k--", label="floor d² + d")
    ax.set_xlabel("d"), ax.set_ylabel("queries"), ax.legend(fontsize=7)
    ax.set_title("queries vs d")
    fig.tight_layout(), fig.savefig(out / "queries_vs_d.png", dpi=110), plt.close(fig)
    written.append("queries_vs_d.png")

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for learner in learners:
        sub = [r for r in scaling if r["learner"] == learner]
        ax.loglog([r["d"] for r in sub], [r["W_error"] for r in sub], "o-",
                  label=f"{learner}: parameter error")
        ax.loglog([r["d"] for r in sub], [r["output_error"] for r in sub], "s--",
                  label=f"{learner}: held-out output error")
    ax.set_xlabel("d"), ax.set_ylabel("relative error"), ax.legend(fontsize=7)
    ax.set_title("error vs d")
    fig.tight_layout(), fig.savefig(out / "error_vs_d.png", dpi=110), plt.close(fig)
    written.append("error_vs_d.png")

    fig, ax = plt.subplots(figsize=(6, 4.5))
    labels = [f"{r['learner']}\nd={r['d']}" for r in scaling]
    x = np.arange(len(scaling))
    ax.bar(x, [r["black_box_s"] for r in scaling], label="inside the black box")
    ax.bar(x, [r["learner_s"] for r in scaling], bottom=[r["black_box_s"] for r in scaling],
           label="learner")
    ax.set_xticks(x, labels, fontsize=6), ax.set_ylabel("seconds"), ax.legend()
    ax.set_title("wall time split")
    fig.tight_layout(), fig.savefig(out / "time_split.png", dpi=110), plt.close(fig)
    written.append("time_split.png")

    noisy = [r for r in rows if "tau" in r]
    if noisy:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for learner in dict.fromkeys(r["learner"] for r in noisy):
            sub = [r for r in noisy if r["learner"] == learner]
            line, = ax.loglog([r["tau"] for r in sub], [r["W_abs_error"] for r in sub], "o-",
                              label=f"{learner}: error")
            ax.loglog([r["tau"] for r in sub], [r["error_bar_W"] for r in sub], "--",
                      color=line.get_color(), label=f"{learner}: bound / error bar")
        ax.set_xlabel("tau"), ax.set_ylabel("‖W_hat − W‖_F"), ax.legend(fontsize=7)
        ax.set_title(f"error vs noise tolerance, d = {noisy[0]['d']}")
        fig.tight_layout(), fig.savefig(out / "error_vs_tau.png", dpi=110), plt.close(fig)
        written.append("error_vs_tau.png")

    compare = [r for r in rows if "label" in r]
    if compare:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for r in compare:
            ax.loglog(r["queries"], max(r["output_error"], 1e-17),
                      "r*" if r["learner"] != "surrogate" else "bo", ms=9)
            ax.annotate(r["label"], (r["queries"], max(r["output_error"], 1e-17)), fontsize=7)
        ax.axhline(1e-3, color="gray", ls=":")
        ax.set_xlabel("queries"), ax.set_ylabel("held-out output error")
        ax.set_title(f"exact extraction vs surrogate, d = {compare[0]['d']}")
        fig.tight_layout(), fig.savefig(out / "surrogate.png", dpi=110), plt.close(fig)
        written.append("surrogate.png")
    return written


def run_bench(out_dir, quick: bool = False, sections=None, log=print) -> dict:
    """Run the registered sections and write bench.json, bench.md and the plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows = []
    for name in sections or SECTIONS:
        rows += SECTIONS[name](quick, log)
    table = markdown(rows)
    images = plots(rows, out)
    summary = {"quick": quick, "seconds": time.perf_counter() - start, "rows": rows,
               "plots": images}
    (out / "bench.json").write_text(json.dumps(summary, indent=2, default=_json_default))
    (out / "bench.md").write_text(table)
    return summary


def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(type(obj).__name__)


def update_readme(readme, table: str, image: str | None) -> None:
    """Replace the text between the bench markers in the README with the new table."""
    path = Path(readme)
    text = path.read_text()
    begin, end = "<!-- bench:begin -->", "<!-- bench:end -->"
    if begin not in text or end not in text:
        raise ValueError(f"{readme} has no {begin} ... {end} markers")
    body = table + (f"\n![queries vs d]({image})\n" if image else "")
    head, rest = text.split(begin, 1)
    path.write_text(head + begin + "\n" + body + end + rest.split(end, 1)[1])
