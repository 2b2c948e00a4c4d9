"""Several heads on answers with a relative error: what precision each stage needs.

Run:  python benchmarks/bench_heads_noise.py [--seeds 5] [--dims 8] [--levels 1e-14,1e-12,...]
          [--label tlf32_heads_noise]

The transformer-layer learner refuses low-precision answers for H > 1 (its H > 1 stages,
the odd part of large tokens, the multi-head learner and the per-cell head split, have
no low-precision path). To measure how much error those stages stand, the box
(random_transformer_layer(d, m = d, seed, heads=2, biases b ~ N(0, 1), c0 = 0.5)) answers
F (1 + eps u), u ~ U(-1, 1) independent per answer: not a rounding pattern, so the
learner takes the answers as float64 and runs its H > 1 stages unchanged. Per trial:
the outcome (within: returned and canonical error at most 1e-6 ... reported as the
error itself; refused: the stage that raised, from the error's message), the canonical
parameter error, and the queries.

The single-token FFN stage has a low-precision path (one head); with ``--noisy-ffn`` the
H > 1 run uses it (its thresholds from eps, ``noisy_tolerances(eps)``), so that a failure
is that of a later stage (the odd part of large tokens, the multi-head learner, the head
split), said by the refusal's message.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from attnextract import Oracle, extract
from attnextract.errors import AttnExtractError
from attnextract.learners.transformer_layer import (compare_transformer_layer,
                                                    random_transformer_layer)


class RelativeNoise:
    """The layer's answers times (1 + eps u), u ~ U(-1, 1), from its own seeded stream."""

    def __init__(self, layer, eps: float, seed: int):
        self.layer, self.eps = layer, eps
        self.rng = np.random.default_rng(seed)

    def __call__(self, X):
        F = np.asarray(self.layer(X), dtype=float)
        return F * (1.0 + self.eps * self.rng.uniform(-1.0, 1.0, F.shape))


def noisy_ffn(eps: float):
    """Make the H > 1 path's single-token stage use the low-precision thresholds."""
    from attnextract.learners import transformer_layer
    from attnextract.learners.biased_relu import extract_biased_relu, noisy_tolerances

    def stage(oracle, rng, **kw):
        if eps > 0 and "tolerances" not in kw:
            kw["tolerances"] = noisy_tolerances(max(eps, 1e-15))
        return extract_biased_relu(oracle, rng, **kw)
    transformer_layer.extract_biased_relu = stage


def trial(d: int, eps: float, seed: int, noisy: bool = False) -> dict:
    layer = random_transformer_layer(d, d, seed, bias_scale=1.0, c0=0.5, heads=2)
    oracle = Oracle(RelativeNoise(layer, eps, 1000 + seed), d)
    if noisy:
        noisy_ffn(eps)
    row = {"d": d, "eps": eps, "seed": seed, "noisy FFN stage": noisy}
    start = time.process_time()
    try:
        result = extract(oracle, "transformer-layer", seed=seed, heads=2)
        row.update(outcome="returned",
                   error=float(compare_transformer_layer(result.model, layer)["max_error"]),
                   held_out=result.report.verification.max_relative_error)
    except AttnExtractError as exc:
        row.update(outcome="refused", error_type=type(exc).__name__, reason=str(exc)[:300])
    row.update(queries=oracle.queries, cpu_seconds=round(time.process_time() - start, 2))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--dims", default="8")
    parser.add_argument("--levels", default="0,1e-14,1e-12,1e-10,1e-8,6e-8")
    parser.add_argument("--label", default="tlf32_heads_noise")
    parser.add_argument("--noisy-ffn", action="store_true")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    rows = []
    load = os.getloadavg()
    for d in [int(x) for x in args.dims.split(",")]:
        for eps in [float(x) for x in args.levels.split(",")]:
            for seed in range(args.seeds):
                rows.append(trial(d, eps, seed, args.noisy_ffn))
                print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out_dir)
    (out / f"{args.label}.json").write_text(json.dumps(
        {"command": f"OPENBLAS_NUM_THREADS=1 python benchmarks/bench_heads_noise.py --seeds "
                    f"{args.seeds} --dims {args.dims} --levels {args.levels} --label {args.label}"
                    + (" --noisy-ffn" if args.noisy_ffn else ""),
         "load average at start": load, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
