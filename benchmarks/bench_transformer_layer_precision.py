"""Which answer precision the Transformer-layer learner needs: layers rounded on purpose.

Run:  python benchmarks/bench_transformer_layer_precision.py [--dim 8] [--width 8]
          [--heads 1] [--seeds 5] [--out FILE.md]

Per seed: ``random_transformer_layer(d, m, seed, heads=H)`` (float64), its answers
rounded once to float32, or to K decimals (K = 10..14), and run through the learner
with its precision gate (``MAX_RELATIVE_NOISE``, 1e-13 relative) lifted, to see what
it does below the gate: ``accepted`` (held-out verification passed; the canonical
comparison is the report's held-out error), ``refused`` (a typed error; the first
line is kept) or ``crashed``. A float32 forward pass is coarser than one rounding of
a float64 pass, so a precision the learner cannot take as one rounding it cannot take
as a forward pass either. Query counts are exact; times are wall-clock on a shared
machine.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from attnextract.errors import AttnExtractError
from attnextract.learners import transformer_layer as tl
from attnextract.oracle import Oracle
from attnextract.registry import extract

import _results


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=5)
    _results.add_out_option(parser, __file__)
    return parser.parse_args()


ROUNDINGS = ["float32", 10, 11, 12, 13, 14]


def rounded(layer, how):
    if how == "float32":
        return lambda X: layer(X).astype(np.float32).astype(np.float64)
    return lambda X: np.round(layer(X), how)


def main() -> None:
    args = parse()
    with _results.Run(__file__, args.out) as results:
        results.add(measure(args))


def measure(args) -> str:
    """Every rounding and seed (a JSON line each); returns the table."""
    tl.MAX_RELATIVE_NOISE = 1.0          # the gate lifted: what the stages do below it
    rows = []
    for how in ROUNDINGS:
        for seed in range(args.seeds):
            layer = tl.random_transformer_layer(args.dim, args.width, seed, heads=args.heads)
            oracle = Oracle(rounded(layer, how), args.dim)
            start = time.perf_counter()
            try:
                result = extract(oracle, "transformer-layer", heads=args.heads, seed=seed)
                row = {"outcome": "accepted",
                       "held_out": result.report.verification.max_relative_error}
            except AttnExtractError as exc:
                row = {"outcome": "refused", "error_type": type(exc).__name__,
                       "reason": (str(exc).splitlines() or [""])[0][:200]}
            except Exception as exc:          # noqa: BLE001 (counted apart: a bug)
                row = {"outcome": "crashed", "error_type": type(exc).__name__,
                       "reason": str(exc)[:200]}
            row.update({"rounding": str(how), "seed": seed, "queries": oracle.queries,
                        "seconds": time.perf_counter() - start})
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = ["Transformer layer: answers rounded on purpose, precision gate lifted.",
             "", f"d = {args.dim}, m = {args.width}, H = {args.heads}, {args.seeds} seeds.", "",
             "| rounding | accepted | refused | crashed | median queries | refusal (first) |",
             "|---|---|---|---|---|---|"]
    for how in ROUNDINGS:
        cell = [r for r in rows if r["rounding"] == str(how)]
        count = {k: sum(r["outcome"] == k for r in cell) for k in ("accepted", "refused", "crashed")}
        first = next((r["reason"][:90] for r in cell if r["outcome"] != "accepted"), "")
        name = how if how == "float32" else f"{how} decimals"
        lines.append(f"| {name} | {count['accepted']} | {count['refused']} | {count['crashed']} "
                     f"| {int(np.median([r['queries'] for r in cell]))} | {first} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
