"""Why the Transformer-layer learner refuses float32 answers: its single-token stage's chords.

Run:  python benchmarks/bench_transformer_layer_chords.py [--dim 8] [--width 8] [--seeds 5]
          [--out FILE.md]

The learner's first stage reads f([x]) (a biased ReLU network of x) on lines and finds
the FFN's kinks from chord slopes (F(x + h e) - F(x)) / h with h = 2^-20
(:data:`attnextract.learners.relu_network.CHORD`). Per seed: ``random_transformer_layer(d,
m, seed)`` (H = 1, float64), one random line x_0 + t e, t in [-4, 4] (4001 points); the
chord slopes from the float64 answers and from the same answers rounded once to float32
(a float32 forward pass rounds more). Reported: the rounding of a chord slope (median,
max over the line), the smallest and median kink on that line (the slope jump
|w_i p_i^T e| of each unit), and the shortest chord whose float32 rounding (its largest,
2 |F|max 2^-24 / h) stays below 1/30 of the smallest kink, the margin the learner's
thresholds use elsewhere.
"""

from __future__ import annotations

import argparse

import numpy as np

from attnextract.learners.relu_network import CHORD
from attnextract.learners.transformer_layer import random_transformer_layer

import _results


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=5)
    _results.add_out_option(parser, __file__)
    return parser.parse_args()


def one_line(dim: int, width: int, seed: int) -> dict:
    layer = random_transformer_layer(dim, width, seed=seed)
    rng = np.random.default_rng(seed)
    x0, e = rng.standard_normal(dim), rng.standard_normal(dim)
    e /= np.linalg.norm(e)
    points = x0 + np.linspace(-4.0, 4.0, 4001)[:, None] * e
    f0, f1 = layer(points[:, None, :]), layer((points + CHORD * e)[:, None, :])
    to32 = lambda y: y.astype(np.float32).astype(np.float64)
    exact = (f1 - f0) / CHORD
    rounding = np.abs((to32(f1) - to32(f0)) / CHORD - exact)
    # single tokens see pi([x]) = A V x + b (no residual term): unit i's kink on the line
    # changes the slope by w_i p_i^T e
    P = layer.A @ layer.V[0]
    kinks = np.abs(layer.w * (P @ e))
    largest = float(np.max(np.abs(f0)))
    return {"seed": seed, "rms |F|": float(np.sqrt(np.mean(f0 ** 2))),
            "slope rounding median": float(np.median(rounding)),
            "slope rounding max": float(rounding.max()),
            "smallest kink": float(kinks.min()), "median kink": float(np.median(kinks)),
            "chord needed": float(30.0 * 2.0 * largest * 2.0 ** -24 / kinks.min())}


def main() -> None:
    args = parse()
    with _results.Run(__file__, args.out) as results:
        rows = [one_line(args.dim, args.width, s) for s in range(args.seeds)]
        results.add(markdown(args, rows))


def markdown(args, rows) -> str:
    lines = ["Transformer layer, single-token stage: chord slopes on float32 answers.", "",
             f"d = {args.dim}, m = {args.width}, H = 1, chord h = 2^-20.",
             "", "| seed | rms F | slope rounding (median) | slope rounding (max) | smallest "
             "kink | median kink | chord needed (float32) |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['seed']} | {r['rms |F|']:.2f} | {r['slope rounding median']:.1e} | "
              f"{r['slope rounding max']:.1e} | {r['smallest kink']:.1e} | "
              f"{r['median kink']:.1e} | {r['chord needed']:.1e} |" for r in rows]
    print("\n".join(lines))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
