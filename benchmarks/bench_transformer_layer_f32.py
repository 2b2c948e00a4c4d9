"""The Transformer-layer learner on float32 (and K-decimal) answers: one head, with or without a residual term.

Run:  python benchmarks/bench_transformer_layer_f32.py [--seeds 20] [--first-seed 0] [--out FILE.md]
          [--cells NAME,...]

Cells (random_transformer_layer(d, m, seed), W, V, A ~ N(0, 1/d), w ~ N(0, 1); "biases":
b ~ N(0, 1) and c0 = 0.5):

- ``rounded``: float64 answers rounded once to float32, rounding detected (no option);
- ``forward``: a float32 forward pass (``Float32TransformerLayerBlackBox``, numpy: every
  product, exponential and sum in float32), ``output_dtype="float32"`` stated; the truth
  is the layer with float32 parameters;
- ``torch``: the same layer as torch float32 operations (PyTorch's default dtype), stated;
- ``decimals K``: answers rounded to K decimals, detected;
- ``residual``: the layer with its residual connection (the float32 path takes it when
  the FFN has biases; without biases it is refused);
- ``H2``: two heads, ``heads=2`` (refused in low precision, with the reason).

Per trial: ``within`` (a model came back, verified on held-out sequences, and its
canonical parameter error, :func:`compare_transformer_layer`'s max_error, is at most
the error bar the report states; a true unit not returned counts as a zero weight, its
|w_i| / max |w| against the bar, which the report also states as its detection limit),
``outside`` (a model whose error exceeds its bar: must
not happen), ``refused`` (a typed error; its first 160 characters kept). Query counts
are exact; CPU seconds are process time with one BLAS thread.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from attnextract import Oracle, extract
from attnextract.adapters.targets import Float32TransformerLayerBlackBox
from attnextract.errors import AttnExtractError
from attnextract.learners.transformer_layer import (compare_transformer_layer,
                                                    random_transformer_layer)
from attnextract.oracle import RoundedOutputs

import _results

CELLS = {   # name: (d, m, biases, box kind[, residual, heads])
    "rounded d8 m8": (8, 8, False, "rounded"),
    "rounded d8 m8 biases": (8, 8, True, "rounded"),
    "forward d8 m8": (8, 8, False, "forward"),
    "forward d8 m8 biases": (8, 8, True, "forward"),
    "torch d8 m8 biases": (8, 8, True, "torch"),
    "rounded d16 m16 biases": (16, 16, True, "rounded"),
    "forward d16 m16 biases": (16, 16, True, "forward"),
    "rounded d16 m32 biases": (16, 32, True, "rounded"),
    "decimals 6 d8 m8 biases": (8, 8, True, 6),
    "decimals 8 d8 m8 biases": (8, 8, True, 8),
    "rounded d8 m8 biases residual": (8, 8, True, "rounded", True, 1),
    "forward d8 m8 biases residual": (8, 8, True, "forward", True, 1),
    "rounded d16 m16 biases residual": (16, 16, True, "rounded", True, 1),
    "forward d16 m16 biases residual": (16, 16, True, "forward", True, 1),
    "rounded d8 m8 residual": (8, 8, False, "rounded", True, 1),
    "rounded d8 m8 biases H2": (8, 8, True, "rounded", False, 2),
    "forward d16 m16 biases H2": (16, 16, True, "forward", False, 2),
}


def torch_box(truth):
    import torch
    W, A, b, w = (torch.tensor(a, dtype=torch.float32) for a in
                  (truth.W[0], truth.A @ truth.V[0], truth.b, truth.w))
    c0 = torch.tensor(truth.c0, dtype=torch.float32)

    def box(X):
        with torch.no_grad():
            X = torch.as_tensor(X, dtype=torch.float32)
            alpha = torch.softmax(torch.einsum("bnd,de,be->bn", X, W, X[:, -1]), dim=1)
            y = torch.einsum("bn,bnd->bd", alpha, X)
            return (torch.relu(y @ A.T + b) @ w + c0).double().numpy()
    return box


def trial(cell: str, seed: int) -> dict:
    d, m, biases, kind, residual, heads = (CELLS[cell] + (False, 1))[:6]
    layer = random_transformer_layer(d, m, seed, bias_scale=1.0 if biases else 0.0,
                                     c0=0.5 if biases else 0.0, residual=residual,
                                     heads=heads)
    options = {"heads": heads}
    if kind == "rounded":
        box, truth = RoundedOutputs(layer), layer
    elif isinstance(kind, int):
        box, truth = RoundedOutputs(layer, decimals=kind), layer
    else:
        f32 = Float32TransformerLayerBlackBox(layer)
        truth = f32.truth
        box = f32 if kind == "forward" else torch_box(truth)
        options["output_dtype"] = "float32"
    oracle = Oracle(box, d)
    start = time.process_time()
    row = {"cell": cell, "seed": seed}
    try:
        result = extract(oracle, "transformer-layer", seed=seed, **options)
        bar = float(result.report.details["error bar"])
        compared = compare_transformer_layer(result.model, truth)
        error = float(compared["max_error"])
        row.update(outcome="within" if error <= bar else "outside", error=error, bar=bar,
                   units=list(compared["units"]),
                   unseen_w=[float(x) for x in compared.get("unseen units |w|", [])],
                   detection_limit=result.report.details.get("detection limit"),
                   noise=result.report.details.get("measured noise"),
                   held_out=result.report.verification.max_relative_error,
                   tolerance=result.report.verification.tolerance)
    except AttnExtractError as exc:
        row.update(outcome="refused", error_type=type(exc).__name__, reason=str(exc)[:400])
    row.update(queries=oracle.queries, cpu_seconds=round(time.process_time() - start, 2))
    return row


def summary(rows, cell):
    mine = [r for r in rows if r["cell"] == cell]
    ok = [r for r in mine if r["outcome"] == "within"]
    med = lambda k: float(np.median([r[k] for r in ok])) if ok else float("nan")   # noqa: E731
    worst = max((r["error"] / r["bar"] for r in ok), default=float("nan"))
    return (f"| {cell} | {len(mine)} | {len(ok)} | "
            f"{sum(r['outcome'] == 'outside' for r in mine)} | "
            f"{sum(r['outcome'] == 'refused' for r in mine)} | {med('error'):.1e} | "
            f"{med('bar'):.1e} | {worst:.2f} | "
            f"{int(np.median([r['queries'] for r in mine]))} | "
            f"{np.median([r['cpu_seconds'] for r in mine]):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--seed-list", default=None,
                        help="comma-separated seeds, in this order (instead of --seeds)")
    parser.add_argument("--cells", default=",".join(CELLS))
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as results:
        results.add(measure(args))


def measure(args) -> str:
    """Every cell and seed (a JSON line each); returns the table."""
    cells = args.cells.split(",")
    rows = []
    for cell in cells:
        seeds = ([int(x) for x in args.seed_list.split(",")] if args.seed_list else
                 range(args.first_seed, args.first_seed + args.seeds))
        for seed in seeds:
            rows.append(trial(cell, seed))
            print(json.dumps(rows[-1]), flush=True)
    lines = ["Transformer layer on float32 answers; CPU seconds are process time.", "",
             "| cell | trials | within bar | outside | refused | median error | median bar | "
             "worst error/bar | median queries | median CPU s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [summary(rows, cell) for cell in cells]
    refused = [r for r in rows if r["outcome"] != "within"]
    if refused:
        lines += ["", "Not within the bar:", ""]
        lines += [f"- {r['cell']}, seed {r['seed']}: {r['outcome']} "
                  f"({r.get('error_type', '')}: {r.get('reason', '')})" for r in refused]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
