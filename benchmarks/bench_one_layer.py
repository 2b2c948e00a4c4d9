"""Benchmark: one-layer Transformer extraction end to end, and the ReLU FFN learner alone.

    PYTHONPATH=src python3 benchmarks/bench_one_layer.py [--seeds 3] [--no-large]

Prints two markdown tables (medians over seeds; worst case for errors):
1. one-layer Transformers f(X) = w^T ReLU(A X^T softmax(X W x_N)) at d = m = 16, 32, 64:
   queries (FFN, attention, verification), bits of the FFN, error of W, held-out output
   error, wall time split into black box and learner.
2. the ReLU learner alone, with and without the polish pass, including a 784-128-1
   network (100,480 parameters), the size Carlini, Jagielski and Mironov (2020) report
   2^21.5 queries and 2^-25 worst parameter error for.
Errors are measured against the secret targets (which the learners never see):
``bits`` = -log2 of the largest parameter error after aligning hidden units.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from attnextract import Oracle  # noqa: E402
from attnextract.oracle import evaluate_ragged  # noqa: E402
from attnextract.learners.one_layer import compare_one_layer, extract_one_layer, random_one_layer  # noqa: E402
from attnextract.models import ReLUNetwork  # noqa: E402
from attnextract.learners.relu_network import (align_relu_networks, extract_relu_network,  # noqa: E402
                                      random_relu_network)
from attnextract.report import held_out_sequences, relative_errors, token_scale  # noqa: E402
from attnextract.learners.residual import extract_one_layer_residual, random_residual_one_layer  # noqa: E402

import _results


def timed_extractions(make_target, learn, d: int, m: int, seeds: int):
    """(seed, truth, result, wall seconds) of ``learn(oracle, seed=...)`` on each seed's target."""
    for seed in range(seeds):
        truth = make_target(d, m, seed=seed)
        start = time.perf_counter()
        result = learn(Oracle(truth, d), seed=seed + 1000)
        yield seed, truth, result, time.perf_counter() - start


def one_layer_row(d: int, m: int, seeds: int) -> str:
    rows = []
    for seed, truth, result, wall in timed_extractions(random_one_layer, extract_one_layer,
                                                       d, m, seeds):
        cmp = compare_one_layer(result.model, truth, count=256, seed=seed)
        b = result.report.breakdown
        rows.append(dict(queries=result.queries, ffn=b["ffn"], att=b["attention"],
                         ver=b["verification"], bits=cmp["bits"], W=cmp["relative_error_W"],
                         out=cmp["max_output_error"], wall=wall,
                         bb=result.report.black_box_seconds))
    med = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
    worst_bits = min(r["bits"] for r in rows)
    worst_W = max(r["W"] for r in rows)
    worst_out = max(r["out"] for r in rows)
    params = d * d + m * d
    return (f"| {d} | {m} | {params} | {med['queries']:.0f} (2^{math.log2(med['queries']):.1f}) | "
            f"{med['ffn']:.0f} | {med['att']:.0f} | {med['ver']:.0f} | {worst_bits:.1f} | "
            f"{worst_W:.1e} | {worst_out:.1e} | {med['wall']:.2f} | {med['bb']:.2f} | "
            f"{med['wall'] - med['bb']:.2f} |")


def relu_row(d: int, m: int, seeds: int, polish: bool) -> str:
    rows = []
    learn = functools.partial(extract_relu_network, polish=polish)
    for _, truth, result, wall in timed_extractions(random_relu_network, learn, d, m, seeds):
        al = align_relu_networks(result.model, truth)
        rows.append(dict(queries=result.queries, bits=al["bits"], wall=wall,
                         out=result.report.verification.max_relative_error))
    med_q = float(np.median([r["queries"] for r in rows]))
    worst_bits = min(r["bits"] for r in rows)
    params = m * (d + 1)
    mode = "polish" if polish else "first pass"
    return (f"| {d}-{m}-1 | {params} | {mode} | {med_q:.0f} | 2^{math.log2(med_q):.1f} | "
            f"{med_q / params:.2f} | {worst_bits:.1f} | "
            f"{max(r['out'] for r in rows):.1e} | {np.median([r['wall'] for r in rows]):.2f} |")


def residual_row(d: int, m: int, seeds: int) -> str:
    rows = []
    for seed, truth, result, wall in timed_extractions(
            random_residual_one_layer, extract_one_layer_residual, d, m, seeds):
        model = result.model
        stack = lambda M: ReLUNetwork(np.hstack([M.A, M.B]), M.w)  # noqa: E731
        bits = align_relu_networks(stack(model), stack(truth))["bits"]
        seqs = held_out_sequences(d, 256, np.random.default_rng(seed), token_scale(truth))
        out = relative_errors(evaluate_ragged(model, seqs), evaluate_ragged(truth, seqs))
        rows.append(dict(queries=result.queries, bits=bits, wall=wall, out=float(out.max()),
                         W=float(np.linalg.norm(model.W - truth.W) / np.linalg.norm(truth.W))))
    med_q = float(np.median([r["queries"] for r in rows]))
    return (f"| {d} | {m} | {d * d + 2 * m * d} | {med_q:.0f} (2^{math.log2(med_q):.1f}) | "
            f"{min(r['bits'] for r in rows):.1f} | {max(r['W'] for r in rows):.1e} | "
            f"{max(r['out'] for r in rows):.1e} | {np.median([r['wall'] for r in rows]):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--no-large", action="store_true", help="skip the 784-128-1 network")
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as results:
        results.capture(markdown=True)
        tables(args)


def tables(args) -> None:
    """Print the three Markdown tables."""
    print("One-layer Transformer, end to end (median of", args.seeds, "seeds; errors: worst)\n")
    print("| d | m | parameters | queries | FFN | attention | verification | FFN bits | "
          "rel. error W | held-out output error | wall s | in black box s | learner s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for d, m in [(16, 16), (32, 32), (64, 64)]:
        print(one_layer_row(d, m, args.seeds), flush=True)

    print("\nStretch: residual one-layer Transformer, up to functional equivalence\n")
    print("| d | m | parameters (W, A, B, w) | queries | [A B] bits (worst) | rel. error W (worst) "
          "| held-out output error (worst) | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for d, m in [(16, 16), (32, 32)]:
        print(residual_row(d, m, args.seeds), flush=True)

    print("\nReLU network learner alone (single-vector queries)\n")
    print("| network d-m-1 | parameters | mode | queries | log2 | queries / parameter | "
          "bits (worst) | held-out output error | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    cases = [(32, 32, True), (32, 32, False), (64, 64, True), (64, 64, False), (32, 64, True),
             (32, 64, False)]
    for d, m, polish in cases:
        print(relu_row(d, m, args.seeds, polish), flush=True)
    if not args.no_large:
        for polish in (True, False):
            print(relu_row(784, 128, 1, polish), flush=True)


if __name__ == "__main__":
    main()
