"""The impostor zoo against every learner: refusals over seeds at d in {8, 32}.

Each impostor (``attnextract.adapters.impostors``) is built on an honest model of the
learner's class (seeded), and the learner runs against it. A refusal is a typed
error (ModelMismatchError, NotIdentifiableError, RecoveryFailedError); anything
returned is ACCEPTED and gets its held-out error against the impostor (max relative
error on 256 fresh sequences of the verification design; for labels, the fraction
that disagree). "honest" runs the model itself: it must be accepted.

    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_impostors.py [--seeds 20] [--dims 8 32]
        [--learners single-head,noisy,...] [--out benchmarks/results/impostors.md]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from attnextract import Oracle
from attnextract.adapters.impostors import make_impostor, zoo
from attnextract.adapters.targets import (random_low_rank_head, random_low_rank_multi_head,
                                          random_multi_head, random_single_head)
from attnextract.errors import (BudgetExceededError, ModelMismatchError, NotIdentifiableError,
                                RecoveryFailedError)
from attnextract.learners.one_layer import random_one_layer
from attnextract.learners.transformer_layer import random_transformer_layer
from attnextract.oracle import SignOnly, evaluate_ragged
from attnextract.report import verification_count, verify_model
from attnextract.verification import design, scaled_relative_errors, token_norms

REFUSALS = (ModelMismatchError, NotIdentifiableError, RecoveryFailedError)
NOISY_TOLERANCE = 1e-10      # absolute output tolerance given to the noisy learner


def _extract(name, **fixed):
    def run(oracle, seed):
        import attnextract
        return attnextract.extract(oracle, model=name, seed=seed, **fixed)
    return run


def _sign_only(oracle, seed):
    from attnextract.learners.sign_only import extract_sign_only
    return extract_sign_only(oracle, seed=seed)


def _verify(oracle, seed, model, recovery):
    """``attnextract verify`` with the honest model's own parameters."""
    check = verify_model(oracle, model, count=recovery, seed=seed, measure_v=True)
    if not check.passed:
        raise ModelMismatchError("verify failed")
    return None


# learner -> (honest model factory (d, seed), run (oracle, seed) -> result, labels?)
LEARNERS = {
    "single-head": (lambda d, s: random_single_head(d, s), _extract("single-head"), False),
    "low-rank": (lambda d, s: random_low_rank_head(d, max(1, d // 4), s), _extract("low-rank"), False),
    "verify": (lambda d, s: random_single_head(d, s), None, False),
    "noisy": (lambda d, s: random_single_head(d, s),
              _extract("single-head", tolerance=NOISY_TOLERANCE), False),
    "sign-only": (lambda d, s: random_single_head(d, s), _sign_only, True),
    "multi-head H<=1": (lambda d, s: random_single_head(d, s), _extract("multi-head", heads=1), False),
    "multi-head H<=2": (lambda d, s: random_multi_head(2, d, s), _extract("multi-head", heads=2), False),
    "multi-head-low-rank": (lambda d, s: random_low_rank_multi_head(2, d, max(1, d // 4), s),
                            lambda o, s: _extract("multi-head-low-rank", heads=2,
                                                  rank=max(1, o.dim // 4))(o, s), False),
    "one-layer": (lambda d, s: random_one_layer(d, d, s), _extract("one-layer"), False),
    "transformer-layer": (lambda d, s: random_transformer_layer(d, 2 * d, s, bias_scale=0.5, c0=0.2),
                          _extract("transformer-layer"), False),
}


def held_out_error(model, box, d, labels, seed):
    """The accepted model's error against the impostor on fresh design sequences."""
    held = design(d, 256, np.random.default_rng([seed, 99]), 1.0 / math.sqrt(d) ** 0.5,
                  probe_length=2, model=model)
    # labels: the hull family's outputs are ~0 by design, their signs mean nothing
    seqs = [x for x, f in zip(held.sequences, held.family) if not labels or f != "hull"]
    observed = np.concatenate([np.atleast_1d(box(s[None])) for s in seqs])
    predicted = evaluate_ragged(model, seqs)
    if labels:
        return float(np.mean((predicted > 0) != (observed > 0)))
    return float(scaled_relative_errors(predicted, observed, token_norms(seqs)).max())


def one_run(learner, impostor, d, seed, recovery):
    """'refused: <Error>', 'accepted <err>' or 'crash: <text>'."""
    honest_of, run, labels = LEARNERS[learner]
    model = honest_of(d, seed)
    rng = np.random.default_rng([seed, d, sum(map(ord, impostor))])
    box = model if impostor == "honest" else make_impostor(impostor, model, rng, recovery)
    if learner == "verify" and impostor == "switch at verification":
        box.after = 1
    target = SignOnly(box) if labels else box
    oracle = Oracle(target, d)
    try:
        if run is None:
            _verify(oracle, seed, model, recovery)
            return "accepted", 0.0, oracle.queries
        result = run(oracle, seed)
    except REFUSALS as exc:
        return f"refused: {type(exc).__name__}", None, oracle.queries
    except BudgetExceededError as exc:
        return f"refused: {type(exc).__name__}", None, oracle.queries
    except Exception as exc:                       # a bug: shown, not counted as a refusal
        return f"crash: {type(exc).__name__}: {exc}"[:200], None, oracle.queries
    err = held_out_error(result.model, box if not labels else box, d, labels, seed)
    return "accepted", err, oracle.queries


def recovery_queries(learner, d):
    """Recovery queries of the learner on an honest model (where the switches happen)."""
    honest_of, run, labels = LEARNERS[learner]
    if run is None:
        return verification_count(d * d + d)
    model = honest_of(d, 0)
    oracle = Oracle(SignOnly(model) if labels else model, d)
    result = run(oracle, 0)
    return int(result.report.recovery_queries)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--dims", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--learners", default=",".join(LEARNERS))
    parser.add_argument("--impostors", default="")
    parser.add_argument("--seeds-at-32", type=str, default="",
                        help="learner=N,...: fewer seeds for slow learners at d = 32")
    parser.add_argument("--out", default="benchmarks/results/impostors.md")
    parser.add_argument("--json", default="")
    parser.add_argument("--merge", nargs="+", default=None,
                        help="write --out from these --json files of earlier runs (no runs)")
    args = parser.parse_args(argv)
    if args.merge:
        rows, elapsed = [], 0.0
        for name in args.merge:
            part = json.loads(Path(name).read_text())
            rows += part["rows"]
            elapsed += part["seconds"]
        write_markdown(rows, Path(args.out), elapsed, args)
        return
    fewer = dict(item.split("=") for item in args.seeds_at_32.split(",") if item)
    rows, started = [], time.perf_counter()
    for learner in args.learners.split(","):
        for d in args.dims:
            t0 = time.perf_counter()
            recovery = recovery_queries(learner, d)
            model = LEARNERS[learner][0](d, 0)
            names = ["honest"] + list(zoo(model))
            if args.impostors:
                names = [n for n in names if n in args.impostors.split(",")]
            n_seeds = int(fewer.get(learner, args.seeds)) if d >= 32 else args.seeds
            seeds = range(args.first_seed, args.first_seed + n_seeds)
            for name in names:
                outcomes = [one_run(learner, name, d, s, recovery) for s in seeds]
                refused = sum(o[0].startswith("refused") for o in outcomes)
                accepted = [(s, o[1]) for s, o in zip(seeds, outcomes) if o[0] == "accepted"]
                crashes = [(s, o[0]) for s, o in zip(seeds, outcomes) if o[0].startswith("crash")]
                kinds = sorted({o[0][9:] for o in outcomes if o[0].startswith("refused")})
                row = {"learner": learner, "impostor": name, "d": d, "seeds": len(seeds),
                       "refused": refused, "accepted": accepted, "crashes": crashes,
                       "refusal_kinds": kinds}
                rows.append(row)
                flag = ("" if (name == "honest") == (refused == 0) and not crashes else "  <-- MISS")
                print(f"{learner:20s} d={d:3d} {name:26s} refused {refused}/{len(seeds)}"
                      f"{' accepted ' + str([(s, f'{e:.1e}') for s, e in accepted]) if accepted and name != 'honest' else ''}"
                      f"{' crashes ' + str(crashes) if crashes else ''}{flag}", flush=True)
            print(f"# {learner} d={d}: {time.perf_counter() - t0:.1f} s", flush=True)
    elapsed = time.perf_counter() - started
    write_markdown(rows, Path(args.out), elapsed, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "seconds": elapsed}, indent=1))


def write_markdown(rows, path, elapsed, args):
    lines = ["# Impostor zoo against every learner", "",
             f"`OPENBLAS_NUM_THREADS=1 python benchmarks/bench_impostors.py "
             f"--seeds {args.seeds} --dims {' '.join(map(str, args.dims))}"
             f"{' --seeds-at-32 ' + args.seeds_at_32 if args.seeds_at_32 else ''}` "
             f"({elapsed:.0f} s on a shared, loaded 2-core machine).", "",
             "refused = a typed refusal (ModelMismatchError, NotIdentifiableError, "
             "RecoveryFailedError); an ACCEPTED impostor is listed with its seed and the "
             "accepted model's held-out error against it (labels: fraction that disagree). "
             "`honest` is the model itself: it must be accepted (refused 0).", "",
             "| learner | impostor | d | refused | accepted (seed: held-out error) |",
             "|---|---|---|---|---|"]
    for r in rows:
        acc = ", ".join(f"{s}: {e:.1e}" for s, e in r["accepted"]) if r["impostor"] != "honest" else ""
        if r["crashes"]:
            acc += (" " if acc else "") + "CRASH " + "; ".join(f"{s}: {c}" for s, c in r["crashes"])
        lines.append(f"| {r['learner']} | {r['impostor']} | {r['d']} | {r['refused']}/{r['seeds']} "
                     f"| {acc} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
