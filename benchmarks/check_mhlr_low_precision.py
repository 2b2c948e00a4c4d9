"""multi-head-low-rank on bfloat16 and K-decimal answers: within the bar, or refused typed.

Run:  python benchmarks/check_mhlr_low_precision.py [--out FILE.md]

H = 2, d = 12, r = 3, seeds 0-2; one line per run: bfloat16 stated (float32 answers
truncated to bfloat16), and answers rounded to 4, 6 and 8 decimals, stated.
"""

from __future__ import annotations

import argparse

import numpy as np

from attnextract.adapters.targets import random_low_rank_multi_head
from attnextract.errors import AttnExtractError
from attnextract.learners.multi_head import canonical_error
from attnextract.oracle import Oracle
from attnextract.registry import extract

import _results


def bfloat16_box(model):
    """The model's answers in float32, cut to bfloat16 (low 16 bits cleared)."""
    def box(X):
        y = model(X).astype(np.float32)
        return (y.view(np.uint32) & 0xFFFF0000).view(np.float32).astype(np.float64)
    return box


def one_run(how, seed: int) -> tuple:
    """(outcome, error or error type, bar or message, queries) of one run."""
    model = random_low_rank_multi_head(2, 12, 3, seed=seed)
    if how == "bf16-stated":
        box, options = bfloat16_box(model), {"output_dtype": "bfloat16"}
    else:
        box, options = (lambda X, K=how: np.round(model(X), K)), {"decimals": how}
    oracle = Oracle(box, 12)
    try:
        result = extract(oracle, "multi-head-low-rank", heads=2, seed=seed, **options)
    except AttnExtractError as exc:
        return ("refused", type(exc).__name__, str(exc)[:160], oracle.queries)
    error, bar = canonical_error(result.model, model), result.report.details.get("error bar")
    return ("within" if error <= bar else "OUTSIDE", f"{error:.1e}", f"{bar:.1e}", oracle.queries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as results:
        lines = ["| answers | seed | outcome | error (or type) | bar (or message) | queries |",
                 "|---|---|---|---|---|---|"]
        for how in ["bf16-stated", 4, 6, 8]:
            for seed in range(3):
                row = one_run(how, seed)
                print(how, seed, row, flush=True)
                name = how if how == "bf16-stated" else f"{how} decimals, stated"
                lines.append(f"| {name} | {seed} | " + " | ".join(map(str, row)) + " |")
        results.add("\n".join(lines))


if __name__ == "__main__":
    main()
