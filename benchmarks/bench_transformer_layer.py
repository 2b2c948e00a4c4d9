"""Benchmark: Transformer layer (attention + ReLU FFN with biases, issue 14) end to end.

    PYTHONPATH=src python3 benchmarks/bench_transformer_layer.py [--seeds 5] [--no-heads]

Prints one markdown table, one row per model variant (medians over seeds for queries and
time, the worst seed for errors): queries for the recovery against the free-parameter
floor of the canonical form, bits = -log2 of the largest canonical parameter error
(W_h, A V_h, residual A, b, w, c0 after aligning units and heads, measured against the
secret target the learner never sees; Carlini, Jagielski and Mironov 2020 report 2^-25
for ReLU networks), the held-out output error, and the wall time split into black box
and learner. Failures (any exception) are counted, never hidden.
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

VARIANTS = [
    ("bias-free", 16, 16, {}),
    ("bias-free", 16, 32, {}),
    ("c0 only", 16, 32, {"c0": 0.5}),
    ("biases N(0,1), c0", 32, 32, {"bias_scale": 1.0, "c0": 0.5}),
    ("biases 1e-3", 32, 32, {"bias_scale": 1e-3, "c0": 0.5}),
    ("biases 1e-6", 32, 32, {"bias_scale": 1e-6, "c0": 0.5}),
    ("residual, bias-free", 16, 32, {"c0": 0.5, "residual": True}),
    ("residual + biases", 16, 32, {"bias_scale": 1.0, "c0": 0.5, "residual": True}),
]
HEAD_VARIANTS = ([(f"bias-free, H = {H}", 16, m, {"heads": H}) for H in (2, 3, 4) for m in (16, 32)]
                 + [(f"residual, bias-free, H = {H}", 16, m, {"heads": H, "residual": True,
                                                            "c0": 0.3})
                    for H, m in ((2, 32), (3, 16), (3, 32))])


def run(label, d, m, options, seeds):
    rows, failures = [], []
    heads = options.get("heads", 1)
    for seed in range(seeds):
        truth = random_transformer_layer(d, m, seed=seed, **options)
        oracle = Oracle(truth, d)
        start = time.perf_counter()
        try:
            result = extract_transformer_layer(oracle, heads=heads, seed=seed)
        except Exception as exc:                        # counted, reported
            failures.append(f"seed {seed}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        wall = time.perf_counter() - start
        cmp = compare_transformer_layer(result.model, truth, seed=seed)
        rows.append({"queries": result.queries - result.report.breakdown["verification"],
                     "floor": free_parameters(truth), "bits": cmp["bits"],
                     "W": cmp["error_W"], "out": cmp["max_output_error"], "wall": wall,
                     "bb": oracle.black_box_seconds})
    return rows, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--no-heads", action="store_true", help="skip the H > 1 rows (slow)")
    args = parser.parse_args()
    variants = VARIANTS + ([] if args.no_heads else HEAD_VARIANTS)
    print("| model | d | m | H | queries (recovery) | floor | ratio | bits (worst) | W error "
          "(worst) | output error (worst) | wall s | black box s | failed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    notes = []
    for label, d, m, options in variants:
        rows, failures = run(label, d, m, options, args.seeds)
        notes += [f"{label} d={d} m={m}: {f}" for f in failures]
        if not rows:
            print(f"| {label} | {d} | {m} | {options.get('heads', 1)} | - | - | - | - | - | - | - "
                  f"| - | {len(failures)}/{args.seeds} |")
            continue
        med = lambda k: float(np.median([r[k] for r in rows]))  # noqa: E731
        worst = lambda k: float(max(r[k] for r in rows))         # noqa: E731
        print(f"| {label} | {d} | {m} | {options.get('heads', 1)} | {med('queries'):.0f} | "
              f"{rows[0]['floor']} | {med('queries') / rows[0]['floor']:.2f} | "
              f"{min(r['bits'] for r in rows):.1f} | {worst('W'):.1e} | {worst('out'):.1e} | "
              f"{med('wall'):.2f} | {med('bb'):.2f} | {len(failures)}/{args.seeds} |", flush=True)
    for note in notes:
        print(f"\nfailure: {note}")


if __name__ == "__main__":
    main()
