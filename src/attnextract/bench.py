"""``attnextract bench``: every learner's cost and accuracy, the floors, and the baseline.

One run writes into ``--out-dir DIR``:

- ``bench.json``: every measured row (labelled by learner; the baseline rows say
  ``"surrogate"``);
- ``bench.md``: the Markdown tables;
- plots, PNG and SVG side by side (with matplotlib installed): queries vs d
  (log-log, with the floors and the papers' counts, fitted slopes in the legend),
  parameter and output error vs d, wall time split between the black box and the
  learner, and the surrogate comparison. A learner has one colour in every plot
  (:data:`PALETTE`); legends sit outside the data.

Learners run through :func:`attnextract.registry.extract`, the same entry point as
the CLI and the API.

Sections are small functions registered in ``SECTIONS``; each learner that has
landed adds one. ``--quick`` runs small sizes (under two minutes on 2 cores).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from .errors import InputError
from .oracle import Oracle
from .registry import extract
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
                            lambda oracle: extract(oracle, "single-head", seed=d),
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
    exact = extract(exact_oracle, "single-head", seed=1)
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
    from .learners.one_layer import compare_one_layer, random_one_layer
    rows = []
    for d in ([4, 8, 16] if quick else [4, 8, 16, 32, 64]):
        target = random_one_layer(d, d, seed=d)

        def errors(model):
            cmp = compare_one_layer(model, target, seed=d)
            return {"W_error": cmp["relative_error_W"], "bits": cmp["bits"],
                    "output_error": cmp["max_output_error"]}
        rows.append(measure("one-layer", d, target,
                            lambda oracle: extract(oracle, "one-layer", seed=d),
                            floor=d * d + d * d, paper_count=None, m=d, error=errors))
        log(f"one-layer d=m={d}: {rows[-1]['recovery_queries']} queries, "
            f"{rows[-1]['bits']:.1f} bits")
    return rows


def section_low_rank(quick: bool, log) -> list[dict]:
    """Rank-r heads, r = d/8: the adaptive learner (floor d + r(2d - r)) and paper 1's ROP."""
    from .learners.low_rank import low_rank_floor
    from .adapters.targets import random_low_rank_head
    rows = []
    for method in ("adaptive", "rop"):
        for d in ([16, 32, 64] if quick else [16, 32, 64, 128, 256, 512]):
            r = max(1, d // 8)
            target = random_low_rank_head(d, r, seed=d)
            rows.append(measure(
                f"low-rank {method}", d, target,
                lambda oracle: extract(oracle, "low-rank", rank=r if method == "rop" else None,
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
    from .learners.multi_head import canonical_error
    from .adapters.targets import random_multi_head
    rows = []
    for H, d in ([(2, 8), (2, 16)] if quick else [(2, 8), (2, 16), (2, 32), (4, 16), (4, 32)]):
        target = random_multi_head(H, d, seed=d)
        rows.append(measure(f"multi-head (H = {H})", d, target,
                            lambda oracle: extract(oracle, "multi-head", heads=H, seed=d),
                            floor=H * (d * d + d), paper_count=4 * H * d * d - 2 * H + 1,
                            heads=H,
                            error=lambda model: {"W_error": canonical_error(model, target)}))
        spent = rows[-1]["recovery_queries"]
        log(f"multi-head H={H} d={d}: {spent} queries (paper 2: {rows[-1]['paper_count']}), "
            f"canonical error {rows[-1]['W_error']:.1e}")
    return rows


def _grid_module():
    """benchmarks/multi_head_grid.py of the source checkout: the grid is a benchmark,
    not part of the library, so this section needs the repository."""
    import importlib.util
    import sys
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "multi_head_grid.py"
    if not path.exists():
        raise InputError("the multi-head-grid section runs benchmarks/multi_head_grid.py "
                         "of a source checkout, which this installation does not have")
    if "multi_head_grid" not in sys.modules:
        spec = importlib.util.spec_from_file_location("multi_head_grid", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["multi_head_grid"] = module
        spec.loader.exec_module(module)
    return sys.modules["multi_head_grid"]


def section_multi_head_grid(quick: bool, log) -> list[dict]:
    """Issue 12's grid at a few seeds per cell: full-rank heads H = 1..8 at d = 8 and 16
    (and H = 4, 8 at d = 32), low-rank layers (d, H, r) = (64, 8, 8) and (96, 12, 8)."""
    grid_cell = _grid_module().grid_cell
    cells = ([(H, 8, 1, None) for H in (2, 4)] if quick else
             [(H, d, 3, None) for d in (8, 16) for H in range(1, 9)]
             + [(4, 32, 1, None), (8, 32, 1, None), (8, 64, 1, 8), (12, 96, 1, 8)])
    rows = []
    for H, d, seeds, rank in cells:
        rows.append({"learner": "grid (multi-head)", "grid": True,
                     **grid_cell(H, d, seeds, rank=rank)})
        r = rows[-1]
        log(f"multi-head grid H={H} d={d} r={rank or 'full'}: success {r['success_rate']:.0%}"
            f" of {seeds}, median queries {r['recovery_median']} (floor {r['floor']}, paper 2 "
            f"{r['paper2']}), median error {r['error_median']}")
    return rows


def section_noisy(quick: bool, log) -> list[dict]:
    """Error vs noise tolerance tau: the robust default and paper 1's Theorem 6.1, equal queries."""
    from .oracle import BoundedNoise
    rows = []
    d = 16
    target = random_single_head(d, seed=3)
    B = float(np.linalg.norm(target.W))
    for tau in ([1e-8, 1e-6, 1e-4] if quick else [1e-10, 1e-8, 1e-6, 1e-5, 1e-4, 1e-3]):
        for method in ("robust", "paper"):
            oracle = Oracle(BoundedNoise(target, tau, "sign", seed=1), d)
            result = extract(oracle, "single-head", tolerance=tau, method=method, norm_bound=B,
                             seed=1)
            rows.append({"learner": f"noisy ({method})", "d": d, "tau": tau,
                         "queries": result.queries,
                         "W_abs_error": float(np.linalg.norm(result.model.W - target.W)),
                         "error_bar_W": float(result.report.details["error_bar_W"])})
            log(f"noisy {method} tau={tau:.0e}: |W_hat - W|_F = {rows[-1]['W_abs_error']:.1e} "
                f"(bar {rows[-1]['error_bar_W']:.1e})")
    return rows


SECTIONS = {"single-head": section_single_head, "low-rank": section_low_rank,
            "one-layer": section_one_layer, "multi-head": section_multi_head,
            "multi-head-grid": section_multi_head_grid,
            "noisy": section_noisy, "surrogate": section_surrogate}


def transformer_layer_variants(quick: bool) -> list[tuple[str, int, int, dict]]:
    """(label, d, m, random_transformer_layer options) of the Transformer-layer rows."""
    d, m = (8, 8) if quick else (16, 32)
    big = 16 if quick else 32
    return [("bias-free", d, m, {}),
            ("biases N(0,1), c0", big, big, {"bias_scale": 1.0, "c0": 0.5}),
            ("biases 1e-6", big, big, {"bias_scale": 1e-6, "c0": 0.5}),
            ("residual + biases", d, m, {"bias_scale": 1.0, "c0": 0.5, "residual": True}),
            ("bias-free, H = 3", d, m, {"heads": 3}),
            ("biases N(0,1), c0, H = 3", d, m, {"heads": 3, "bias_scale": 1.0, "c0": 0.5}),
            ("residual + biases, H = 2", d, m, {"heads": 2, "bias_scale": 1.0, "c0": 0.5,
                                                "residual": True})]


def section_transformer_layer(quick: bool, log) -> list[dict]:
    """Attention + ReLU FFN with biases (issue 14): queries vs the floor, bits, time."""
    from .learners.transformer_layer import (compare_transformer_layer, extract_transformer_layer,
                                             free_parameters, random_transformer_layer)
    rows = []
    for label, d, m, options in transformer_layer_variants(quick):
        target = random_transformer_layer(d, m, seed=d + m, **options)

        def errors(model):
            cmp = compare_transformer_layer(model, target, seed=d)
            return {"W_error": cmp["error_W"], "bits": cmp["bits"],
                    "output_error": cmp["max_output_error"]}
        rows.append(measure(f"transformer-layer ({label})", d, target,
                            lambda oracle: extract_transformer_layer(
                                oracle, heads=options.get("heads", 1), seed=d),
                            floor=free_parameters(target), paper_count=None, m=m,
                            heads=options.get("heads", 1), error=errors))
        log(f"transformer-layer {label} d={d} m={m}: {rows[-1]['recovery_queries']} queries "
            f"(floor {rows[-1]['floor']}), {rows[-1]['bits']:.1f} bits")
    return rows


SECTIONS["transformer-layer"] = section_transformer_layer


def markdown(rows: list[dict]) -> str:
    """Markdown tables: one per learner (by d), then the surrogate comparison."""
    out = []
    scaling = [r for r in rows if "floor" in r and not r.get("grid")]
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
    grid = [r for r in rows if r.get("grid")]
    if grid:
        grid_markdown = _grid_module().grid_markdown
        out += ["", "Multi-head grid (success: canonical error <= 1e-10 for full-rank heads, "
                "<= 1e-8 for low-rank; benchmarks/bench_multi_head.py runs 20 seeds per cell):",
                "", grid_markdown(grid)]
    layer = [r for r in rows if r.get("learner", "").startswith("transformer-layer")]
    if layer:
        out += ["", "Transformer layer (attention + ReLU FFN with biases): bits = -log2 of the "
                "largest canonical parameter error (Carlini et al. 2020 report 2^-25 for ReLU "
                "networks):", "", "| model | d | m | H | queries (recovery) | floor | ratio | bits "
                "| output error | wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in layer:
            out.append(f"| {r['learner'][len('transformer-layer '):]} | {r['d']} | {r['m']} | "
                       f"{r['heads']} | {r['recovery_queries']} | {r['floor']} | "
                       f"{r['recovery_queries'] / r['floor']:.2f} | {r['bits']:.1f} | "
                       f"{r['output_error']:.1e} | {r['wall_s']:.2f} |")
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


# one colour per learner in every plot (a label's longest matching prefix picks it);
# a learner added later registers its colour here
PALETTE = {"single-head": "#1f77b4", "low-rank adaptive": "#ff7f0e", "low-rank rop": "#d62728",
           "low-rank": "#ff7f0e", "one-layer": "#2ca02c", "multi-head": "#9467bd",
           "noisy (robust)": "#8c564b", "noisy (paper)": "#e377c2", "noisy": "#8c564b",
           "surrogate": "#7f7f7f", "transformer-layer": "#bcbd22",
           "multi-head low-rank": "#17becf", "floor": "#000000"}
_SPARE = ["#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d"]


def colour(learner: str) -> str:
    """The learner's colour in every plot (a stable spare colour for an unknown learner)."""
    matches = [k for k in PALETTE if learner == k or learner.startswith(k + " ")
               or learner.startswith(k + " (")]
    if matches:
        return PALETTE[max(matches, key=len)]
    return _SPARE[sum(map(ord, learner)) % len(_SPARE)]


def _log_axes(ax, x_base: int = 10) -> None:
    """Log-log axes with plain tick labels (4, 8, 16 / 10, 100, 1000) and no minor labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    ax.set_xscale("log", base=x_base)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_locator(LogLocator(base=10, numticks=12))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _legend_outside(ax) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=7,
              frameon=False)


def _save(fig, out: Path, name: str, written: list[str]) -> None:
    """PNG and SVG side by side (the legend outside the axes is kept by bbox_inches)."""
    import matplotlib.pyplot as plt
    for suffix, options in ((".png", {"dpi": 110}), (".svg", {})):
        fig.savefig(out / (name + suffix), bbox_inches="tight", **options)
    plt.close(fig)
    written += [name + ".png", name + ".svg"]


def plots(rows: list[dict], out: Path) -> list[str]:
    """Write the plots (PNG and SVG); returns their file names ([] without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written: list[str] = []
    scaling = [r for r in rows if "floor" in r and not r.get("grid")]
    learners = list(dict.fromkeys(r["learner"] for r in scaling))
    grid = [r for r in rows if r.get("grid")]
    if grid:
        grid_plot = _grid_module().grid_plot
        written += [Path(f).name for f in grid_plot(grid, out / "multi_head_grid.png")]

    if scaling:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for learner in learners:
            sub = [r for r in scaling if r["learner"] == learner]
            ds, qs = [r["d"] for r in sub], [r["recovery_queries"] for r in sub]
            label = learner + (f" (slope {fitted_slope(ds, qs):.2f})" if len(sub) >= 2 else "")
            ax.plot(ds, qs, "o-", color=colour(learner), label=label)
            if all(r["paper_count"] is not None for r in sub):
                ax.plot(ds, [r["paper_count"] for r in sub], ":", color=colour(learner),
                        label=f"paper count, {learner}")
        all_d = sorted({r["d"] for r in scaling})
        ax.plot(all_d, [d * d + d for d in all_d], "--", color=PALETTE["floor"],
                label="floor d² + d")
        _log_axes(ax, x_base=2)
        ax.set_xlabel("d"), ax.set_ylabel("queries"), ax.set_title("queries vs d")
        _legend_outside(ax)
        _save(fig, out, "queries_vs_d", written)

        fig, ax = plt.subplots(figsize=(6, 4.5))
        for learner in learners:
            sub = [r for r in scaling if r["learner"] == learner]
            ax.plot([r["d"] for r in sub], [max(r["W_error"], 1e-17) for r in sub], "o-",
                    color=colour(learner), label=f"{learner}: parameter error")
            ax.plot([r["d"] for r in sub], [max(r["output_error"], 1e-17) for r in sub], "s--",
                    color=colour(learner), alpha=0.6, label=f"{learner}: held-out output error")
        _log_axes(ax, x_base=2)
        ax.set_xlabel("d"), ax.set_ylabel("relative error"), ax.set_title("error vs d")
        _legend_outside(ax)
        _save(fig, out, "error_vs_d", written)

        fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(scaling) + 2), 4.5))
        x = np.arange(len(scaling))
        black_box = [r["black_box_s"] for r in scaling]
        ax.bar(x, black_box, color="#c7c7c7", label="inside the black box")
        ax.bar(x, [r["learner_s"] for r in scaling], bottom=black_box,
               color=[colour(r["learner"]) for r in scaling], label="learner (its colour)")
        step = max(1, len(scaling) // 24)         # at most ~24 labels, rotated: none overlap
        ax.set_xticks(x[::step], [f"{r['learner']} d={r['d']}" for r in scaling][::step],
                      rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("seconds"), ax.set_title("wall time split")
        _legend_outside(ax)
        _save(fig, out, "time_split", written)

    noisy = [r for r in rows if "tau" in r]
    if noisy:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for learner in dict.fromkeys(r["learner"] for r in noisy):
            sub = [r for r in noisy if r["learner"] == learner]
            ax.plot([r["tau"] for r in sub], [r["W_abs_error"] for r in sub], "o-",
                    color=colour(learner), label=f"{learner}: error")
            ax.plot([r["tau"] for r in sub], [r["error_bar_W"] for r in sub], "--",
                    color=colour(learner), label=f"{learner}: bound / error bar")
        _log_axes(ax)
        ax.xaxis.set_major_formatter(matplotlib.ticker.LogFormatterSciNotation())
        ax.set_xlabel("tau"), ax.set_ylabel("‖W_hat − W‖_F")
        ax.set_title(f"error vs noise tolerance, d = {noisy[0]['d']}")
        _legend_outside(ax)
        _save(fig, out, "error_vs_tau", written)

    compare = [r for r in rows if "label" in r]
    if compare:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for r in compare:
            y = max(r["output_error"], 1e-17)
            ax.plot(r["queries"], y, "*" if r["learner"] != "surrogate" else "o",
                    color=colour(r["learner"]), ms=9)
            ax.annotate(r["label"], (r["queries"], y), xytext=(7, 5),
                        textcoords="offset points", fontsize=7)
        ax.axhline(1e-3, color="gray", ls=":", label="1e-3 output error")
        _log_axes(ax)
        ax.margins(x=0.25)          # room for the labels beside the last markers
        ax.set_xlabel("queries"), ax.set_ylabel("held-out output error")
        ax.set_title(f"exact extraction vs surrogate, d = {compare[0]['d']}")
        _legend_outside(ax)
        _save(fig, out, "surrogate", written)
    return written


def run_bench(out_dir, quick: bool = False, sections=None, log=print) -> dict:
    """Run the registered sections and write bench.json, bench.md and the plots (PNG + SVG)."""
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
