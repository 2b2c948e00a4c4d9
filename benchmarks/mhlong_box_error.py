"""The black box's own low-precision error against the allowance of the multi-head learners'
held-out check (``verification.verify_model``), by family and sequence length.

Each run extracts as usual (multi-head, multi-head-low-rank or transformer-layer) with
``verify_model`` wrapped: every call is recorded (oracle, model, keywords, the rng's state,
the oracle's longest probe and replay count at that moment). Then the TRUE model (zero
model error) is judged on the same held-out design (same seed, same design model, same L)
against the box's own answers, with the tolerance and error bar the run's check used.
Printed per sequence: family, N, the relative error |f_true - y| / max(|y|, s K), the
allowance tol + SENSITIVITY bar reach (relative, as _Judge). The held-out design is
replayed without the adversarial search; ``full`` is the whole check (search included, on a
fresh oracle: no own probes, no replays) of the true model with the run's keywords, as
max error / tolerance (verify_model's errors are scaled to the tolerance).

    PYTHONPATH=src nice -n 10 python benchmarks/mhlong_box_error.py --learner multi-head \
        --cells 8x2 8x4 16x2 16x4 --trials 0-9 --out /tmp/mh.json
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attnextract import verification as V  # noqa: E402
from attnextract.errors import AttnExtractError  # noqa: E402
from attnextract.oracle import Oracle, evaluate_ragged  # noqa: E402
from attnextract.registry import extract  # noqa: E402

MODULES = {"multi-head": "attnextract.learners.multi_head",
           "multi-head-low-rank": "attnextract.learners.multi_head_low_rank",
           "transformer-layer": "attnextract.learners.transformer_layer"}


def record_calls(learner):
    """Wrap the learner module's verify_model; returns the list the calls go to."""
    import importlib
    module = importlib.import_module(MODULES[learner])
    real = V.verify_model
    calls = []

    def wrapped(oracle, model, **kw):
        root = V.root_oracle(oracle)
        seed = kw.get("seed")
        calls.append(dict(oracle=oracle, model=copy.deepcopy(model),
                          kw={**kw, "seed": copy.deepcopy(seed)}, seed0=copy.deepcopy(seed),
                          longest=getattr(root, "longest", None),
                          replays=len(getattr(root, "replay", None) or []),
                          measured=V.measured_error_bar(oracle, model)
                          if kw.get("expected_error") == "measured" else None))
        return real(oracle, model, **kw)

    module.verify_model = wrapped
    return calls


def tolerance_and_bar(call):
    """(tolerance, bar) as verify_model computes them for the run's model."""
    from attnextract.report import DEFAULT_VERIFY_TOLERANCE
    kw = call["kw"]
    tolerance = kw.get("tolerance")
    tolerance = DEFAULT_VERIFY_TOLERANCE if tolerance is None else tolerance
    expected, floor = kw.get("expected_error"), V.CONSISTENCY_FLOOR
    if isinstance(expected, str):
        expected, floor = call["measured"], V.MEASURED_FLOOR
        if expected is not None and V.CONSISTENCY_FACTOR * expected > tolerance:
            expected = None
    bar = expected if expected is not None and math.isfinite(expected) \
        and 0 <= expected <= V.MAX_ERROR_BAR else None
    if bar is not None:
        floor = floor if kw.get("tolerance_floor") is None else kw["tolerance_floor"]
        tolerance = min(tolerance, max(V.CONSISTENCY_FACTOR * bar, floor))
    return tolerance, bar


def judge_truth(call, truth, box, d):
    """Per held-out sequence of the run's design: family, N, the true model's relative
    error against the box, the allowance (relative), and the accumulation term."""
    from attnextract.report import token_scale
    kw, model = call["kw"], call["model"]
    count = kw["count"]
    tolerance, bar = tolerance_and_bar(call)
    seed = kw.get("seed")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    scale = kw.get("scale") or token_scale(model)
    replays = min(call["replays"], int(V.REPLAY_FRACTION * count))
    searched = (max(V.SEARCH_MIN, int(V.SEARCH_SHARE * count))
                if kw.get("search", True) and count >= 4 * V.SEARCH_MIN else 0)
    probe = kw.get("probe_length") or call["longest"]
    held = V.design(d, count - replays - searched, rng, scale, probe_length=probe,
                    max_length=kw.get("max_length"), model=model)
    seqs = held.sequences
    own = list(call["oracle"].longest_probes) if V.keeps_own_answers(call["oracle"]) else []
    observed = np.concatenate([Oracle(box, d).query_ragged(seqs),
                               np.array([y for _, y in own])])
    family = list(held.family) + ["own"] * len(own)
    seqs = seqs + [x for x, _ in own]
    predicted = evaluate_ragged(truth, seqs)
    norms = V.token_norms(seqs)
    ref = np.array([f != "hull" for f in family])
    offset = float(model.c) if V.is_biased(model) else 0.0
    K = V.output_scale(observed[:len(held.sequences)][ref[:len(held.sequences)]] - offset,
                       norms[:len(held.sequences)][ref[:len(held.sequences)]])
    rel = V.scaled_relative_errors(predicted - offset, observed - offset, norms, K=K)
    allowance = np.full(len(seqs), tolerance)
    if bar:
        allowance = allowance + V.SENSITIVITY * bar * V.score_reach(model, seqs)
    # the whole check (adversarial search included; no own probes, no replays) of the
    # true model with the run's keywords, on a fresh oracle over the same box
    full = V.verify_model(Oracle(box, d), truth, **{**kw, "seed": copy.deepcopy(call["seed0"])})
    return dict(family=family, N=[len(s) for s in seqs], rel=rel.tolist(),
                allowance=allowance.tolist(), tolerance=tolerance, bar=bar or 0.0,
                full=full.max_relative_error / full.tolerance, full_family=full.worst_family,
                full_lengths=list(full.lengths))


def build(learner, d, H, trial, kind):
    if learner == "transformer-layer":
        from attnextract.adapters.targets import Float32TransformerLayerBlackBox
        from attnextract.learners.transformer_layer import random_transformer_layer
        box = Float32TransformerLayerBlackBox(random_transformer_layer(
            d, H, trial, bias_scale=1.0))            # cell d x m: m hidden units
        return box, box.truth
    from bench_float32_torch import float32_box
    return float32_box(d, H, trial)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--learner", default="multi-head", choices=sorted(MODULES))
    p.add_argument("--cells", nargs="+", default=["8x2"])
    p.add_argument("--trials", default="0-3")
    p.add_argument("--mode", default="told", choices=["told", "no-heads", "stated"])
    p.add_argument("--decimals", type=int, default=None,
                   help="box: the float64 truth rounded once to K decimals (stated), not float32")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    lo, hi = (int(x) for x in a.trials.split("-"))
    calls = record_calls(a.learner)
    rows = []
    for cell in a.cells:
        d, H = (int(x) for x in cell.split("x"))
        for trial in range(lo, hi + 1):
            box, truth = build(a.learner, d, H, trial, a.mode)
            if a.decimals is not None:
                from attnextract.oracle import RoundedOutputs
                box = RoundedOutputs(truth, decimals=a.decimals)
            calls.clear()
            options = {}
            if a.learner == "multi-head-low-rank":
                options = {"rank": d // H, "output_dtype": "float32"}
            elif a.learner == "transformer-layer" or a.mode == "stated":
                options = {"output_dtype": "float32"}
            if a.decimals is not None:
                options.pop("output_dtype", None)
                options["decimals"] = a.decimals
            heads = None if a.mode == "no-heads" else H
            if a.learner == "transformer-layer":
                heads = 1
            cpu = time.process_time()
            try:
                result = extract(Oracle(box, d), a.learner, heads=heads, seed=trial, **options)
                outcome, message = "returned", ""
                worst = result.report.verification.max_relative_error / \
                    result.report.verification.tolerance
            except AttnExtractError as exc:
                outcome, message, worst = type(exc).__name__, str(exc)[:300], None
            for call in calls:
                row = judge_truth(call, truth, box, d)
                row.update(learner=a.learner, d=d, H=H, trial=trial,
                           mode=a.mode if a.decimals is None else f"{a.decimals} decimals",
                           outcome=outcome, message=message, run_worst=worst,
                           cpu=round(time.process_time() - cpu, 2))
                rows.append(row)
                r = np.array(row["rel"]) / np.array(row["allowance"])
                print(f"{cell} t{trial} {outcome} tol {row['tolerance']:.2e} bar "
                      f"{row['bar']:.2e} max box/allowance {r.max():.3f} at N "
                      f"{row['N'][int(r.argmax())]} ({row['family'][int(r.argmax())]}); full check {row['full']:.3f} "
                      f"({row['full_family']})",
                      flush=True)
    Path(a.out).write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
