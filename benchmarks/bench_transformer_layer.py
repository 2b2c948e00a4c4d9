"""Benchmark: Transformer layer (attention + ReLU FFN with biases, issue 14) over seeds.

    PYTHONPATH=src python3 benchmarks/bench_transformer_layer.py [--seeds 20] [--quick]
        [--out FILE.md]

One row per case of issue 14's "Done means" items 1-3 (bias-free H = 1..4, d = 16,
m = 16 and 32; biases N(0, 1) and 1e-6 with c0, one head at d = m = 32 and H = 3 at
d = 16, m = 32; residual + biases, one head, d = 16, m = 32). For each: the success
rate over the seeds (no refusal, held-out output error <= 1e-8 and attention
canonically equal to the truth, error_W <= 1e-8), the median queries of the recovery
(verification excluded) against the free-parameter floor of the canonical form, bits
= -log2 of the largest canonical parameter error (W_h, A V_h, residual A, b, w, c0,
measured against the secret target the learner never sees; Carlini, Jagielski and
Mironov 2020 report 2^-25 for ReLU networks), the worst held-out output error, and
the median wall time. Failures (any exception) are counted and listed, never hidden.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from attnextract import Oracle  # noqa: E402
from attnextract.learners.transformer_layer import (compare_transformer_layer,  # noqa: E402
                                                    extract_transformer_layer, free_parameters,
                                                    random_transformer_layer)

import _results

TOL = 1e-8

CASES = (
    [(f"1. bias-free, H = {H}", 16, m, {"heads": H}) for H in (1, 2, 3, 4) for m in (16, 32)]
    + [("2. biases N(0,1), c0, H = 1", 32, 32, {"bias_scale": 1.0, "c0": 0.5}),
       ("2. biases 1e-6, c0, H = 1", 32, 32, {"bias_scale": 1e-6, "c0": 0.5}),
       ("2. biases N(0,1), c0, H = 3", 16, 32, {"heads": 3, "bias_scale": 1.0, "c0": 0.5}),
       ("2. biases 1e-6, c0, H = 3", 16, 32, {"heads": 3, "bias_scale": 1e-6, "c0": 0.5}),
       ("3. residual + biases N(0,1), c0, H = 1", 16, 32,
        {"bias_scale": 1.0, "c0": 0.5, "residual": True}),
       ("3. residual + biases 1e-6, c0, H = 1", 16, 32,
        {"bias_scale": 1e-6, "c0": 0.5, "residual": True}),
       ("beyond: residual + biases N(0,1), c0, H = 3", 16, 32,
        {"heads": 3, "bias_scale": 1.0, "c0": 0.5, "residual": True})])


def run(d, m, options, seeds):
    rows, failures = [], []
    heads = options.get("heads", 1)
    for seed in range(seeds):
        truth = random_transformer_layer(d, m, seed=seed, **options)
        oracle = Oracle(truth, d)
        start = time.perf_counter()
        try:
            result = extract_transformer_layer(oracle, heads=heads, seed=seed)
        except Exception as exc:                        # counted, reported
            failures.append(f"seed {seed}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        wall = time.perf_counter() - start
        cmp = compare_transformer_layer(result.model, truth, seed=seed)
        row = {"seed": seed, "queries": result.queries - result.report.breakdown["verification"],
               "floor": free_parameters(truth), "bits": cmp["bits"], "W": cmp["error_W"],
               "max_error": cmp["max_error"], "out": cmp["max_output_error"], "wall": wall,
               "bb": oracle.black_box_seconds}
        if not (row["out"] <= TOL and row["W"] <= TOL):
            failures.append(f"seed {seed}: recovered but output error {row['out']:.1e}, "
                            f"W error {row['W']:.1e} (over {TOL:.0e})")
            row["ok"] = False
        else:
            row["ok"] = True
        rows.append(row)
    return rows, failures


def table(results, seeds) -> list[str]:
    lines = ["| case | d | m | H | success | queries (median) | floor | ratio | bits (median / "
             "worst) | output error (worst) | W error (worst) | wall s (median) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, d, m, options, rows, failures in results:
        ok = sum(r["ok"] for r in rows)
        H = options.get("heads", 1)
        if not rows:
            lines.append(f"| {label} | {d} | {m} | {H} | 0/{seeds} | - | - | - | - | - | - | - |")
            continue
        med = lambda k: float(np.median([r[k] for r in rows]))  # noqa: E731
        worst = lambda k: float(max(r[k] for r in rows))         # noqa: E731
        floor = rows[0]["floor"]
        lines.append(
            f"| {label} | {d} | {m} | {H} | {ok}/{seeds} | {med('queries'):.0f} | {floor} | "
            f"{med('queries') / floor:.2f} | {med('bits'):.1f} / {min(r['bits'] for r in rows):.1f}"
            f" | {worst('out'):.1e} | {worst('W'):.1e} | {med('wall'):.2f} |")
    return lines


HEADER = """Per case, seeds 0..{last} of `random_transformer_layer` (W_h, V_h, A ~ N(0, 1/d),
w ~ N(0, 1), b ~ N(0, bias^2)); the learner never sees them. Success: no refusal,
held-out output error <= 1e-8 and attention canonically equal to the truth (W error
<= 1e-8). Queries: the recovery (held-out verification excluded), median, against the
floor H d^2 + H m d (+ m d with the residual term) + m + 1 (free parameters of the
canonical form). Bits: -log2 of the largest canonical parameter error over W_h, A V_h,
A, b, w, c0 (Carlini, Jagielski and Mironov 2020 report 2^-25 for ReLU networks). Wall
times depend on the machine's load. Every seed's numbers: the .json next to this file.

"""


def render(results, seeds) -> str:
    lines = table(results, seeds)
    notes = [f"- {label} (d = {d}, m = {m}): {f}" for label, d, m, _, _, fs in results for f in fs]
    return (HEADER.format(seeds=seeds, last=seeds - 1) + "\n".join(lines)
            + ("\n\nFailures:\n\n" + "\n".join(notes) if notes else "\n\nNo failures.") + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="2 seeds, the first case of each item")
    parser.add_argument("--only", help="run only the cases whose label contains this")
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as results:
        results.add(measure(args))


def measure(args) -> str:
    """Every case over the seeds; returns the table."""
    cases = CASES if not args.quick else [CASES[0], CASES[8], CASES[10], CASES[12]]
    if args.only:
        cases = [c for c in cases if args.only in c[0]]
    seeds = 2 if args.quick else args.seeds
    results = []
    for label, d, m, options in cases:
        rows, failures = run(d, m, options, seeds)
        results.append((label, d, m, options, rows, failures))
        print(table([results[-1]], seeds)[-1], flush=True)
    text = render(results, seeds)
    print(text)
    return text


if __name__ == "__main__":
    main()
