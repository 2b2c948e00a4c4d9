"""Low-rank multi-head attention with large query biases (issue 26): success, error, queries.

Run:  python benchmarks/bench_mhlr_large_biases.py [--cases 16:2:2 16:4:2 ...] [--seeds 10]
          [--bias-scales 1 5 10] [--out FILE.md]

Targets: ``random_low_rank_multi_head(H, d, r, seed)`` with
``with_biases(m, seed + 100, bias_scale=s |W_0|)``: b_h = W_h p_h (in W_h's column space,
as b_h = W_k,h^T b_q,h / sqrt(d_h) is in a real layer), |b_h| = s |W_0|_F, c ~ N(0, 1).
Each run: ``extract(Oracle(box, d), "multi-head-low-rank", heads=H, rank=r, seed=seed,
biases=True)``. A run is "recovered" when the learner returns a model (held-out
verification passed) whose worst canonical error over W_h, b_h, v_h and c is <= 1e-9;
"returned" when the model is returned but worse; "refused" when the learner refuses
(the reason is kept). Rows give the counts, the worst error, the learner's largest
predicted error (its stated bar), the recovery queries against the biased floor
sum_h (d + r_h (2d - r_h) + r_h) + 1, and the median wall time (a shared machine).

Run it with another checkout's src first on PYTHONPATH to measure that version.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from attnextract import Oracle, extract
from attnextract.adapters.targets import random_low_rank_multi_head, with_biases
from attnextract.errors import ModelMismatchError, RecoveryFailedError
from attnextract.learners.multi_head.canonical import biased_canonical_errors

import _results

TARGET = 1e-9


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+",
                        default=["16:2:2", "16:2:4", "16:4:2", "16:4:4",
                                 "32:2:2", "32:2:4", "32:4:2", "32:4:4"], help="d:H:r")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--bias-scales", type=float, nargs="+", default=[1.0, 5.0, 10.0])
    _results.add_out_option(parser, __file__)
    return parser.parse_args()


def one_run(d, H, r, scale, seed):
    heads = random_low_rank_multi_head(H, d, r, seed)
    box = with_biases(heads, seed + 100, bias_scale=scale * float(np.linalg.norm(heads.W[0])))
    oracle = Oracle(box, d)
    start = time.perf_counter()
    row = {"d": d, "H": H, "r": r, "bias_scale": scale, "seed": seed}
    try:
        result = extract(oracle, "multi-head-low-rank", heads=H, rank=r, seed=seed,
                         biases=True)
    except (ModelMismatchError, RecoveryFailedError) as exc:
        return {**row, "outcome": "refused", "reason": str(exc).splitlines()[0][:200],
                "seconds": time.perf_counter() - start}
    errors = biased_canonical_errors(result.model, box)
    worst = max(errors["W"], errors["b"], errors["v"], errors["c"])
    numbers = result.report.details.get("conditioning_numbers", {})
    return {**row, "outcome": "recovered" if worst <= TARGET else "returned",
            "error": worst, "errors": {k: errors[k] for k in ("W", "b", "v", "c")},
            "predicted": numbers.get("predicted_error"),
            "recovery": result.report.breakdown["recovery"], "floor": result.report.floor,
            "held_out": result.report.verification.max_relative_error,
            "seconds": time.perf_counter() - start}


def summary(rows):
    lines = ["Targets: random_low_rank_multi_head(H, d, r, seed), with_biases(m, seed + 100, "
             "bias_scale = s |W_0|). Recovered: verified and W_h, b_h, v_h, c all within "
             f"{TARGET:.0e} (canonical, relative). Floor: sum_h (d + r(2d - r) + r) + 1. Wall "
             "times on a shared, loaded 2-core machine.", "",
             "| d | H | r | s | recovered | returned | refused | worst error | largest predicted "
             "| median recovery / floor | median s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(x["d"], x["H"], x["r"], x["bias_scale"]) for x in rows})
    for key in keys:
        cell = [x for x in rows if (x["d"], x["H"], x["r"], x["bias_scale"]) == key]
        count = {k: sum(x["outcome"] == k for x in cell) for k in ("recovered", "returned",
                                                                   "refused")}
        done = [x for x in cell if "error" in x]
        worst = f"{max(x['error'] for x in done):.1e}" if done else "-"
        predicted = (f"{max(x['predicted'] for x in done):.1e}"
                     if done and all(x.get("predicted") is not None for x in done) else "-")
        ratio = (f"{np.median([x['recovery'] for x in done]):.0f} / {done[0]['floor']} = "
                 f"{np.median([x['recovery'] / x['floor'] for x in done]):.2f}x"
                 if done else "-")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]:g} | {count['recovered']} | "
                     f"{count['returned']} | {count['refused']} | {worst} | {predicted} | "
                     f"{ratio} | {np.median([x['seconds'] for x in cell]):.2f} |")
    reasons = sorted({x["reason"] for x in rows if x["outcome"] == "refused"})
    if reasons:
        lines += ["", "Refusals:", ""] + [f"- {r}" for r in reasons]
    return "\n".join(lines) + "\n"


def main():
    args = parse()
    with _results.Run(__file__, args.out) as results:
        results.add(measure(args))


def measure(args) -> str:
    """Every run (a JSON line each); returns the summary."""
    rows = []
    for case in args.cases:
        d, H, r = (int(x) for x in case.split(":"))
        for scale in args.bias_scales:
            for seed in range(args.seeds):
                rows.append(one_run(d, H, r, scale, seed))
                print(json.dumps(rows[-1]), flush=True)
    text = summary(rows)
    print(text)
    return text


if __name__ == "__main__":
    main()
