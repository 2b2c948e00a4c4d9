"""The impostor zoo against every learner: refusals over seeds at d in {8, 32}.

Each impostor (``attnextract.testing.impostors``) is built on an honest model of the
learner's class (seeded), and the learner runs against it. A refusal is a typed
error (ModelMismatchError, NotIdentifiableError, RecoveryFailedError); anything
returned is ACCEPTED and gets its held-out error against the impostor (max relative
error on 256 fresh sequences of the verification design; for labels, the fraction
that disagree). "honest" runs the model itself: it must be accepted.

    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_impostors.py [--seeds 20] [--dims 8 32]
        [--learners single-head,noisy,...] [--out benchmarks/results/impostors.md]

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
from pathlib import Path

import numpy as np

from attnextract.testing.impostors import (LEARNER_CASES, SAME_LABELS, impostor_names,
                                            recovery_queries, run_impostor)
from attnextract.oracle import evaluate_ragged
from attnextract.verification import design, scaled_relative_errors, token_norms

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


def write_cost(rows, path, command):
    lines = ["# What verification costs each learner (honest model, seed 0)", "",
             "Measured with OPENBLAS_NUM_THREADS=1 on a shared, loaded 2-core machine "
             "(wall times inflated by the load):", "", f"    {command}", "",
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
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


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
    parser.add_argument("--out", default="benchmarks/results/impostors.md")
    parser.add_argument("--json", default="")
    parser.add_argument("--cost", action="store_true",
                        help="measure verification's cost per learner instead (honest models)")
    parser.add_argument("--merge", nargs="+", default=None,
                        help="write --out from these --json files of earlier runs (no runs)")
    args = parser.parse_args(argv)
    if args.cost:
        rows = cost_rows(args.learners.split(","), args.dims)
        command = "python benchmarks/bench_impostors.py --cost " + " ".join(
            repr(a) if " " in a else a for a in (argv if argv is not None else sys.argv[1:])
            if a != "--cost")
        write_cost(rows, Path(args.out), command)
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "command": command}, indent=1))
        return
    if args.merge:
        rows, elapsed, commands = [], 0.0, []
        for name in args.merge:
            part = json.loads(Path(name).read_text())
            rows = merge_rows(rows, part["rows"])
            elapsed += part["seconds"]
            commands += part.get("commands", [part.get("command", "")])
        order = list(LEARNERS)
        rows.sort(key=lambda r: (order.index(r["learner"]), r["d"]))
        write_markdown(rows, Path(args.out), elapsed, args, commands)
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "seconds": elapsed,
                                                   "commands": commands}))
        return
    fewer = {32: dict(item.rsplit("=", 1) for item in args.seeds_at_32.split(";") if item),
             8: dict(item.rsplit("=", 1) for item in args.seeds_at_8.split(";") if item)}
    rows, started = [], time.perf_counter()
    for learner in args.learners.split(","):
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
                if args.json:         # after every cell: a run stopped early keeps its cells
                    write_json(rows, time.perf_counter() - started, argv, args.json, done=False)
                flag = ("" if (name == "honest") == (refused == 0) and not crashes else "  <-- MISS")
                print(f"{learner:20s} d={d:3d} {name:26s} refused {refused}/{len(seeds)}"
                      f"{' accepted ' + str([(s, f'{e:.1e}') for s, e in accepted]) if accepted and name != 'honest' else ''}"
                      f"{' crashes ' + str(crashes) if crashes else ''}{flag}", flush=True)
            print(f"# {learner} d={d}: {time.perf_counter() - t0:.1f} s", flush=True)
    elapsed = time.perf_counter() - started
    write_markdown(rows, Path(args.out), elapsed, args)
    if args.json:
        write_json(rows, elapsed, argv, args.json, done=True)


def write_json(rows, elapsed, argv, path, done):
    command = "python benchmarks/bench_impostors.py " + " ".join(
        repr(a) if " " in a or "<" in a else a for a in (argv if argv is not None else sys.argv[1:]))
    if not done:
        command += " (stopped early: the cells it finished)"
    Path(path).write_text(json.dumps({"rows": rows, "seconds": elapsed, "command": command},
                                     indent=1))


def seed_ranges(row) -> list:
    """The row's seeds as [first, stop) ranges (rows of older runs: seeds 0 .. n-1)."""
    return row.get("seed_ranges", [[row.get("first_seed", 0), row.get("first_seed", 0) + row["seeds"]]])


def merge_rows(rows, new_rows) -> list:
    """Rows of a later run added to earlier ones: the same (learner, impostor, d) on other
    seeds adds up (seeds, refusals, accepted seeds, crashes); on overlapping seeds the
    later run replaces the earlier."""
    index = {(r["learner"], r["impostor"], r["d"]): i for i, r in enumerate(rows)}
    rows = list(rows)
    for r in new_rows:
        key = (r["learner"], r["impostor"], r["d"])
        if key not in index:
            index[key] = len(rows)
            rows.append(r)
            continue
        old = rows[index[key]]
        seen = {s for a, b in seed_ranges(old) for s in range(a, b)}
        if seen & {s for a, b in seed_ranges(r) for s in range(a, b)}:
            rows[index[key]] = r
            continue
        rows[index[key]] = {**old, "seeds": old["seeds"] + r["seeds"],
                            "refused": old["refused"] + r["refused"],
                            "accepted": old["accepted"] + r["accepted"],
                            "crashes": old["crashes"] + r["crashes"],
                            "refusal_kinds": sorted(set(old["refusal_kinds"]) | set(r["refusal_kinds"])),
                            "seed_ranges": seed_ranges(old) + seed_ranges(r),
                            "seconds": old.get("seconds", 0.0) + r.get("seconds", 0.0)}
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


def write_markdown(rows, path, elapsed, args, commands=None):
    if not commands:
        commands = [f"python benchmarks/bench_impostors.py --seeds {args.seeds} --dims "
                    f"{' '.join(map(str, args.dims))}"]
    lines = ["# Impostor zoo against every learner", "",
             "Run with OPENBLAS_NUM_THREADS=1 (" + f"{elapsed:.0f} s in all on a shared, loaded "
             "2-core machine):", "", *[f"    {c}" for c in commands], "",
             "refused = a typed refusal (ModelMismatchError, NotIdentifiableError, "
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
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
