"""The impostor zoo against every learner: refusals over seeds at d in {8, 32}.

Each impostor (``attnextract.testing.impostors``) is built on an honest model of the
learner's class (seeded), and the learner runs against it. A refusal is a typed
error (ModelMismatchError, NotIdentifiableError, RecoveryFailedError); anything
returned is ACCEPTED and gets its held-out error against the impostor (max relative
error on 256 fresh sequences of the verification design; for labels, the fraction
that disagree). "honest" runs the model itself: it must be accepted.

    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_impostors.py [--seeds 20] [--dims 8 32]
        [--learners single-head,noisy,...] [--out FILE.md]

Each learner is one section of benchmarks/results/bench_impostors.md (``--cost`` one more),
so learners may be run one at a time.

``--cost`` instead measures what verification costs each learner on its honest model
(seed 0): recovery queries, verification queries (the adversarial search's share
among them), the lengths and token norms covered and the wall time of the check.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

from attnextract.testing.impostors import (LEARNER_CASES, SAME_LABELS, impostor_names,
                                            recovery_queries, run_impostor)
from attnextract.oracle import evaluate_ragged
from attnextract.verification import design, scaled_relative_errors, token_norms

import _results

LEARNERS = LEARNER_CASES


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
    """(outcome, held-out error of an accepted model or None)."""
    outcome, result, box = run_impostor(learner, impostor, d, seed, recovery)
    if outcome != "accepted" or result is None:
        return outcome, (0.0 if outcome == "accepted" else None)
    return outcome, held_out_error(result.model, box, d, LEARNERS[learner][2], seed)


def cost_rows(learners, dims):
    """Verification's cost per learner and d on the honest model (seed 0)."""
    from attnextract.oracle import Oracle, SignOnly
    rows = []
    for learner in learners:
        honest, run, labels = LEARNERS[learner]
        if run is None:
            continue
        for d in dims:
            model = honest(d, 0)
            oracle = Oracle(SignOnly(model) if labels else model, d)
            t0 = time.perf_counter()
            result = run(oracle, 0)
            seconds = time.perf_counter() - t0
            report = result.report
            check = report.verification
            verification = report.breakdown.get("verification", 0)
            row = {"learner": learner, "d": d, "recovery": report.recovery_queries,
                   "verification": verification, "seconds": seconds}
            if check is not None:
                row.update(search=check.search_queries, own=check.own_probes,
                           lengths=list(check.lengths), norms=list(check.norms),
                           max_length=check.max_length, tolerance=check.tolerance,
                           error=check.max_relative_error)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def cost_markdown(rows) -> str:
    lines = ["What verification costs each learner (honest model, seed 0).", "",
             "search = queries of the adversarial search (part of the verification count); "
             "own = the learner's longest probes compared with the model (no query); "
             "share = search / recovery; check = verification / recovery (the whole check).", "",
             "| learner | d | recovery | verification | check | search | share | own | lengths | "
             "token norms | tolerance | max error | run s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        whole = r["verification"] / max(r["recovery"], 1)
        if "search" not in r:
            lines.append(f"| {r['learner']} | {r['d']} | {r['recovery']} | {r['verification']} | "
                         f"{100 * whole:.1f}% | (own check) | | | | | | | {r['seconds']:.1f} |")
            continue
        share = r["search"] / max(r["recovery"], 1)
        lines.append(f"| {r['learner']} | {r['d']} | {r['recovery']} | {r['verification']} | "
                     f"{100 * whole:.1f}% | "
                     f"{r['search']} | {100 * share:.1f}% | {r['own']} | {r['lengths'][0]}-"
                     f"{r['lengths'][1]} (L {r['max_length']}) | {r['norms'][0]:.1e} .. "
                     f"{r['norms'][1]:.1e} | {r['tolerance']:.0e} | {r['error']:.1e} | "
                     f"{r['seconds']:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--dims", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--learners", default=",".join(LEARNERS))
    parser.add_argument("--impostors", default="")
    parser.add_argument("--seeds-at-32", type=str, default="",
                        help="learner=N;...: fewer seeds for slow learners at d >= 32")
    parser.add_argument("--seeds-at-8", type=str, default="",
                        help="learner=N;...: fewer seeds for slow learners at d < 32")
    parser.add_argument("--cost", action="store_true",
                        help="measure verification's cost per learner instead (honest models)")
    _results.add_out_option(parser, __file__)
    args = parser.parse_args(argv)
    if args.cost:
        with _results.Run(__file__, args.out, section="verification cost") as results:
            results.add(cost_markdown(cost_rows(args.learners.split(","), args.dims)))
        return
    fewer = {32: dict(item.rsplit("=", 1) for item in args.seeds_at_32.split(";") if item),
             8: dict(item.rsplit("=", 1) for item in args.seeds_at_8.split(";") if item)}
    for learner in args.learners.split(","):      # one section per learner
        with _results.Run(__file__, args.out, section=f"zoo: {learner}") as results:
            results.add(zoo_markdown(zoo_rows(learner, args, fewer)))


def zoo_rows(learner, args, fewer) -> list[dict]:
    """The learner against every impostor of its class, at every d."""
    rows = []
    for d in args.dims:
        t0 = time.perf_counter()
        recovery = recovery_queries(learner, d)
        names = ["honest"] + impostor_names(learner, d)
        if args.impostors:
            names = [n for n in names if n in args.impostors.split(",")]
        n_seeds = int(fewer[32 if d >= 32 else 8].get(learner, args.seeds))
        seeds = range(args.first_seed, args.first_seed + n_seeds)
        for name in names:
            t_cell = time.perf_counter()
            outcomes = [one_run(learner, name, d, s, recovery) for s in seeds]
            refused = sum(o[0].startswith("refused") for o in outcomes)
            accepted = [(s, o[1]) for s, o in zip(seeds, outcomes) if o[0] == "accepted"]
            crashes = [(s, o[0]) for s, o in zip(seeds, outcomes) if o[0].startswith("crash")]
            kinds = sorted({o[0][9:] for o in outcomes if o[0].startswith("refused")})
            row = {"learner": learner, "impostor": name, "d": d, "seeds": len(seeds),
                   "refused": refused, "accepted": accepted, "crashes": crashes,
                   "refusal_kinds": kinds, "seed_ranges": [[seeds.start, seeds.stop]],
                   "seconds": time.perf_counter() - t_cell}
            rows.append(row)
            flag = ("" if (name == "honest") == (refused == 0) and not crashes else "  <-- MISS")
            print(f"{learner:20s} d={d:3d} {name:26s} refused {refused}/{len(seeds)}"
                  f"{' accepted ' + str([(s, f'{e:.1e}') for s, e in accepted]) if accepted and name != 'honest' else ''}"
                  f"{' crashes ' + str(crashes) if crashes else ''}{flag}", flush=True)
        print(f"# {learner} d={d}: {time.perf_counter() - t0:.1f} s", flush=True)
    return rows


def summary_lines(rows) -> list:
    """One line per learner and d: seeds per impostor, impostors refused on every seed
    run, impostor runs refused, honest runs accepted, crashes."""
    lines = ["| learner | d | seeds per impostor | impostors refused on every seed | "
             "impostor runs refused | honest runs accepted | crashes |",
             "|---|---|---|---|---|---|---|"]
    groups = {}
    for r in rows:
        groups.setdefault((r["learner"], r["d"]), []).append(r)
    for (learner, d), group in groups.items():
        fakes = [r for r in group if r["impostor"] != "honest"
                 and not (LEARNERS[learner][2] and r["impostor"] in SAME_LABELS)]
        honest = [r for r in group if r["impostor"] == "honest"]
        seeds = sorted({r["seeds"] for r in fakes})
        span = f"{seeds[0]}" if len(seeds) == 1 else f"{seeds[0]}-{seeds[-1]}"
        lines.append(
            f"| {learner} | {d} | {span} | {sum(r['refused'] == r['seeds'] for r in fakes)} of "
            f"{len(fakes)} | {sum(r['refused'] for r in fakes)} / {sum(r['seeds'] for r in fakes)} | "
            f"{sum(r['seeds'] - r['refused'] for r in honest)} / {sum(r['seeds'] for r in honest)} | "
            f"{sum(len(r['crashes']) for r in group)} |")
    return lines


def zoo_markdown(rows) -> str:
    lines = ["refused = a typed refusal (ModelMismatchError, NotIdentifiableError, "
             "RecoveryFailedError); an ACCEPTED impostor is listed with its seed and the "
             "accepted model's held-out error against it (labels: fraction that disagree). "
             "`honest` is the model itself: it must be accepted (refused 0). The sign-only "
             "learner (labels 1{f > 0}) does not face " + " and ".join(sorted(SAME_LABELS)) +
             ": both keep the sign of f, so their labels are the honest head's.", "",
             *summary_lines(rows), "",
             "| learner | impostor | d | refused | accepted (seed: held-out error) |",
             "|---|---|---|---|---|"]
    for r in rows:
        acc = ", ".join(f"{s}: {e:.1e}" for s, e in r["accepted"]) if r["impostor"] != "honest" else ""
        if LEARNERS[r["learner"]][2] and r["impostor"] in SAME_LABELS:
            acc = "in the class for labels (same labels as the head): not an impostor here"
        if r["crashes"]:
            acc += (" " if acc else "") + "CRASH " + "; ".join(f"{s}: {c}" for s, c in r["crashes"])
        lines.append(f"| {r['learner']} | {r['impostor']} | {r['d']} | {r['refused']}/{r['seeds']} "
                     f"| {acc} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
