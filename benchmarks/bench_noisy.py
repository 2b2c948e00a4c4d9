"""Noisy black boxes: ||W_hat - W||_F against tau, the paper's method vs the default.

Run:  python benchmarks/bench_noisy.py [--dims 16 64] [--seeds 4] [--plot FILE.svg] [--quick] [--out FILE.md]

Error-vs-tau table: for tau = 1e-10 .. 1e-3 and each d, every trial is one random
target (entries of W ~ N(0, 1/d), v ~ N(0, I)) behind one bounded-noise black box
(|eta| <= tau: uniform, random +-tau, outward tau sign(f), and two adversaries, one
impersonating W' = 1.5 W, one pushing answers away from the model with W = 0). Both
methods get the same d^2 + d recovery queries and the same knowledge B = ||W||_F; the
paper's margin is the measured min |v_hat_i| - tau. Columns: median errors, the
paper's Theorem 6.1 bound, the default's own error bar, the accuracy ratio
paper / default (median and worst trial) and how often each method's error is within
its own bar. Further tables: float32 / float16 / 4-digit outputs, Gaussian noise with
repeats, and sign-only bisection (queries and precision vs d).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from attnextract import AttnExtractError, Oracle, SingleHeadAttention
from attnextract.learners.noisy import extract_noisy, paper_bound
from attnextract.oracle import (AdversarialNoise, BoundedNoise, GaussianNoise, RoundedOutputs,
                                SignOnly)
from attnextract.learners.sign_only import extract_sign_only
from attnextract.adapters.targets import random_single_head
from attnextract.plotting import legend_outside, log_axes, save, series_styles

import _results

TAUS = [1e-10, 1e-9, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3]


def noise_kinds(target, tau, seed):
    d = target.dim
    return {
        "uniform": BoundedNoise(target, tau, "uniform", seed=seed),
        "sign": BoundedNoise(target, tau, "sign", seed=seed),
        "outward": BoundedNoise(target, tau, "outward"),
        "decoy 1.5W": AdversarialNoise(target, tau, decoy=SingleHeadAttention(1.5 * target.W, target.v)),
        "against W=0": AdversarialNoise(target, tau, against=SingleHeadAttention(np.zeros((d, d)), target.v)),
    }


def attempt(fn):
    try:
        return fn(), None
    except AttnExtractError as exc:
        result = getattr(exc, "result", None)
        return result, type(exc).__name__


def error_vs_tau(dims, seeds):
    rows = []
    for d in dims:
        for tau in TAUS:
            trials = []
            for seed in range(seeds):
                target = random_single_head(d, seed=seed)
                B = float(np.linalg.norm(target.W))
                for name, box in noise_kinds(target, tau, seed).items():
                    paper, p_fail = attempt(lambda: extract_noisy(
                        Oracle(box, d), tolerance=tau, method="paper", norm_bound=B, seed=seed))
                    robust, r_fail = attempt(lambda: extract_noisy(
                        Oracle(box, d), tolerance=tau, norm_bound=B, seed=seed))
                    t = {"kind": name, "paper_fail": p_fail, "robust_fail": r_fail}
                    mu = float(np.min(np.abs(target.v)))
                    t["paper_bound"] = paper_bound(d, tau, B, mu)[0]
                    for key, res in (("paper", paper), ("robust", robust)):
                        if res is None:
                            continue
                        t[key] = float(np.linalg.norm(res.model.W - target.W))
                        t[key + "_bar"] = res.report.details["error_bar_W"]
                        t[key + "_queries"] = res.report.breakdown["recovery"] + res.report.breakdown["rescaling"]
                    trials.append(t)
            ok = [t for t in trials if "paper" in t and "robust" in t]
            ratio = np.array([t["paper"] / t["robust"] for t in ok])
            row = {
                "d": d, "tau": tau, "trials": len(trials),
                "paper_err": float(np.median([t["paper"] for t in ok])) if ok else None,
                "paper_bound": float(np.median([t["paper_bound"] for t in trials])),
                "robust_err": float(np.median([t["robust"] for t in trials if "robust" in t])),
                "robust_bar": float(np.median([t["robust_bar"] for t in trials if "robust" in t])),
                "ratio_median": float(np.median(ratio)) if ok else None,
                "ratio_min": float(ratio.min()) if ok else None,
                "robust_within_bar": sum(t.get("robust", np.inf) <= t.get("robust_bar", -1) for t in trials),
                "paper_within_bound": sum(t.get("paper", np.inf) <= t["paper_bound"] for t in trials),
                "paper_failed": sum(t["paper_fail"] is not None for t in trials),
                "robust_failed": sum(t["robust_fail"] is not None for t in trials),
                "queries": sorted({t.get("robust_queries") for t in trials} | {t.get("paper_queries") for t in trials} - {None}),
            }
            rows.append(row)
    return rows


def rounding_table(seeds, dims=(16, 64)):
    rows = []
    cases = [("float32", 2.0 ** -150, 2.0 ** -24, 1), ("float16", 2.0 ** -25, 2.0 ** -11, 1),
             ("4 digits", 0.0, 5e-4, 1), ("4 digits", 0.0, 5e-4, 16)]
    for d in dims:
        for name, tau, rho, repeats in cases:
            precision = 4 if name == "4 digits" else name
            errs, bars, queries = [], [], []
            for seed in range(seeds):
                target = random_single_head(d, seed=seed)
                res = extract_noisy(Oracle(RoundedOutputs(target, precision), d), tolerance=tau,
                                    relative_tolerance=rho, repeats=repeats, seed=seed,
                                    noise="bounded" if repeats == 1 else "random")
                errs.append(np.linalg.norm(res.model.W - target.W) / np.linalg.norm(target.W))
                bars.append(res.report.details["error_bar_W_relative"])
                queries.append(res.queries)
            rows.append({"d": d, "outputs": name, "repeats": repeats,
                         "noise model": "bounded" if repeats == 1 else "random (dithered)",
                         "rel_err_max": float(max(errs)), "rel_bar_median": float(np.median(bars)),
                         "within_bar": int(sum(e <= b for e, b in zip(errs, bars))),
                         "trials": seeds, "queries": int(np.median(queries))})
    return rows


def gaussian_table(seeds, dims=(16, 64)):
    rows = []
    for d in dims:
        for repeats in (1, 4, 16):
            std = 1e-6
            errs, within = [], 0
            for seed in range(seeds):
                target = random_single_head(d, seed=seed)
                res = extract_noisy(Oracle(GaussianNoise(target, std, seed=seed), d), tolerance=std,
                                    noise="random", repeats=repeats, seed=seed)
                e = np.linalg.norm(res.model.W - target.W)
                errs.append(e)
                within += e <= res.report.details["error_bar_W"]
            rows.append({"d": d, "std": std, "repeats": repeats, "err_median": float(np.median(errs)),
                         "within_bar": int(within), "trials": seeds, "queries": res.queries})
    return rows


def sign_only_table(dims, thresholds=(0.0, 0.5)):
    rows = []
    for threshold in thresholds:
        for d in dims:
            target = random_single_head(d, seed=0)
            oracle = Oracle(SignOnly(target, threshold), d)
            start = time.perf_counter()
            res = extract_sign_only(oracle, seed=0, threshold=threshold)
            wall = time.perf_counter() - start
            truth_v = target.v if threshold else target.v / np.linalg.norm(target.v)
            rows.append({"d": d, "threshold": threshold, "queries": res.queries,
                         "W_rel_err": float(np.linalg.norm(res.model.W - target.W) / np.linalg.norm(target.W)),
                         "v_err": float(np.linalg.norm(res.model.v - truth_v) / np.linalg.norm(truth_v)),
                         "W_rel_bar": res.report.details["error_bar_W_relative"], "seconds": wall})
    return rows


def fmt(x):
    return "-" if x is None else f"{x:.2e}"


def plot(rows, path):
    """Error against tau (log-log): per d, the paper's error and bound and the default's
    error and bar, each its own series; written as SVG, PNG and PDF beside ``path``."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping the plot {path}")
        return
    parts = (("paper", "paper_err", "--"), ("paper bound", "paper_bound", ":"),
             ("default", "robust_err", "-"), ("default error bar", "robust_bar", "-."))
    dims = sorted({r["d"] for r in rows})
    styles = series_styles(f"{name}, d={d}" for d in dims for name, _, _ in parts)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for d in dims:
        rr = [r for r in rows if r["d"] == d]
        taus = [r["tau"] for r in rr]
        for name, key, line in parts:
            ax.plot(taus, [r[key] or np.nan for r in rr], line, label=f"{name}, d={d}",
                    **styles[f"{name}, d={d}"])
    log_axes(ax)
    ax.xaxis.set_major_formatter(matplotlib.ticker.LogFormatterSciNotation())
    ax.set_xlabel("tau (output tolerance)")
    ax.set_ylabel("||W_hat - W||_F (median)")
    ax.set_title("bounded noise, d^2 + d queries each")
    legend_outside(ax)
    print("wrote", ", ".join(save(fig, path)), file=sys.stderr)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--plot", help="also draw error vs tau here (FILE.svg or .png)")
    parser.add_argument("--quick", action="store_true",
                        help="d = 16 only, 2 seeds (3 for Gaussian noise), sign-only answers "
                             "up to d = 16")
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    if args.quick:
        args.dims, args.seeds = [16], 2
    with _results.Run(__file__, args.out) as results:
        results.capture(markdown=True)
        tables(args)


def tables(args) -> None:
    """Run the four measurements and print their Markdown tables."""
    start = time.perf_counter()
    rows = error_vs_tau(args.dims, args.seeds)
    rounding = rounding_table(args.seeds, args.dims)
    gauss = gaussian_table(3 if args.quick else max(args.seeds, 10), args.dims)
    signs = sign_only_table([2, 4, 8, 16] if args.quick else [2, 4, 8, 16, 32, 64])
    print("Bounded noise |eta| <= tau, 5 noise kinds (2 adversarial) x seeds; equal queries "
          "(d^2 + d recovery each)\n")
    print("| d | tau | paper err | paper bound | default err | default bar | ratio median | ratio worst "
          "| default within bar | paper failed | queries |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['d']} | {r['tau']:.0e} | {fmt(r['paper_err'])} | {fmt(r['paper_bound'])} | "
              f"{fmt(r['robust_err'])} | {fmt(r['robust_bar'])} | {r['ratio_median'] or 0:.0f}x | "
              f"{r['ratio_min'] or 0:.0f}x | {r['robust_within_bar']}/{r['trials']} | "
              f"{r['paper_failed']}/{r['trials']} | {', '.join(map(str, r['queries']))} |")
    within = sum(r["robust_within_bar"] for r in rows)
    total = sum(r["trials"] for r in rows)
    print(f"\ndefault within its own bar: {within}/{total} trials")
    print("\nRounded outputs (relative W error)\n")
    print("| d | outputs | repeats | noise model | rel err (max) | rel bar (median) | within bar | queries |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rounding:
        print(f"| {r['d']} | {r['outputs']} | {r['repeats']} | {r['noise model']} | {r['rel_err_max']:.2e} | "
              f"{r['rel_bar_median']:.2e} | {r['within_bar']}/{r['trials']} | {r['queries']} |")
    print("\nGaussian noise (std 1e-6), repeats in dithered bases\n")
    print("| d | repeats | ||W_hat - W||_F (median) | within bar | queries |")
    print("|---|---|---|---|---|")
    for r in gauss:
        print(f"| {r['d']} | {r['repeats']} | {r['err_median']:.2e} | {r['within_bar']}/{r['trials']} | {r['queries']} |")
    print("\nSign-only answers (bisection, 40 bits per entry of W, 48 + 24 per coordinate of v)\n")
    print("| threshold | d | queries | W rel err | W rel bar | v rel err (t = 0: direction) | seconds |")
    print("|---|---|---|---|---|---|---|")
    for r in signs:
        print(f"| {r['threshold']:g} | {r['d']} | {r['queries']} | {r['W_rel_err']:.1e} | "
              f"{r['W_rel_bar']:.1e} | {r['v_err']:.1e} | {r['seconds']:.2f} |")
    print(f"\ntotal {time.perf_counter() - start:.1f} s")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
