"""Pre-LayerNorm blocks with several heads on the sphere (issue 26, stretch):
`--model pre-ln --heads H` on a grid.

For H in {2, 4}, d in {8, 16} and 20 seeds: a random GPT-2 style block
(targets.random_pre_layer_norm(H, d, seed): gamma = 1 + 0.3 N(0, 1), beta = 0.3 N(0, 1),
eps = 1e-5, every bias, a unit residual readout), learnt at the default radius sqrt(d)
with heads=H. Recorded per run: the relative errors of the identified parts against
PreLayerNormAttention.on_sphere, heads matched by the permutation with the least error
(P W_h P, P b_h, P v_h over all heads, P r; c against max(|c|, |v|)), queries against
the identified count H (m^2 + 2m) + m + 1 (m = d - 1), the held-out error and CPU
seconds. Then boxes outside the class at the same (H, d), 20 seeds: a post-LN block, a
plain biased multi-head attention plus the residual (no LayerNorm), and a block with
2H heads told H; each must be refused. Last, the impostor zoo behind the block's
LayerNorm (impostors.BehindLayerNorm on the H-head block), d = 8, a few seeds: refused,
unless its difference never shows on LayerNorm's image.

Run:  nice -n 10 python benchmarks/bench_pre_ln_heads.py [--seeds 20] [--refusal-seeds 20]
      [--zoo-seeds 3] [--parts grid refusals zoo] [--out FILE.md]
(1 BLAS thread: OPENBLAS_NUM_THREADS=1). Each part is one section of
benchmarks/results/bench_pre_ln_heads.md (a run replaces the sections of its parts).
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np

from attnextract import extract
from attnextract.testing.impostors import zoo
from attnextract.adapters.targets import random_multi_head, random_pre_layer_norm
from attnextract.errors import AttnExtractError
from attnextract.models import BiasedMultiHeadAttention, layer_norm
from attnextract.oracle import Oracle
from bench_pre_ln import zoo_verdict

import _results

GOAL = 1e-8


def identified_errors(model, truth) -> dict:
    """Relative errors of the identified parts, heads matched by the best permutation."""
    best = None
    for perm in itertools.permutations(range(truth.heads)):
        if model.heads != truth.heads:
            break
        p = list(perm)
        errs = {name: float(np.linalg.norm(getattr(model, name)[p] - getattr(truth, name))
                            / np.linalg.norm(getattr(truth, name))) for name in "Wbv"}
        if best is None or max(errs.values()) < max(best.values()):
            best = errs
    if best is None:
        return {"heads": float("inf")}
    best["r"] = float(np.linalg.norm(model.r - truth.r) / np.linalg.norm(truth.r))
    best["c"] = abs(model.c - truth.c) / max(abs(truth.c), float(np.linalg.norm(truth.v)))
    return best


def identified_count(H: int, d: int) -> int:
    m = d - 1
    return H * (m * m + 2 * m) + m + 1


def run(H: int, d: int, seed: int) -> dict:
    box = random_pre_layer_norm(H, d, seed)
    row = {"H": H, "d": d, "seed": seed, "identified": identified_count(H, d)}
    oracle = Oracle(box, d)
    start = time.process_time()
    try:
        result = extract(oracle, "pre-ln", heads=H, seed=seed)
    except AttnExtractError as exc:
        row.update(refused=f"{type(exc).__name__}: {exc}"[:200], queries=oracle.queries,
                   cpu_s=time.process_time() - start)
        return row
    row["cpu_s"] = time.process_time() - start
    report = result.report
    errors = identified_errors(result.model, box.on_sphere(result.model.radius))
    row.update(queries=result.queries, breakdown=report.breakdown,
               held_out_error=report.verification.max_relative_error,
               worst_family=report.verification.worst_family,
               errors=errors, error=max(errors.values()))
    return row


def impostor(kind: str, H: int, d: int, seed: int):
    pre = random_pre_layer_norm(H, d, seed)
    if kind == "post-LN":
        def box(X):
            X = np.asarray(X)
            y = X[:, -1, :] + pre.attention.outputs(X)[:, None] * pre.r
            return layer_norm(y, pre.gamma, pre.beta, pre.eps) @ pre.r
        return box
    if kind == "plain attention + residual":
        rng = np.random.default_rng([seed, d, 7])
        heads = random_multi_head(H, d, seed)
        biased = BiasedMultiHeadAttention(heads.W, heads.v, rng.standard_normal((H, d)),
                                          float(rng.standard_normal()))
        return lambda X: biased(X) + np.asarray(X)[:, -1] @ pre.r
    return random_pre_layer_norm(2 * H, d, seed)


def refusal(kind: str, H: int, d: int, seed: int) -> dict:
    oracle = Oracle(impostor(kind, H, d, seed), d)
    row = {"impostor": kind, "H": H, "d": d, "seed": seed}
    try:
        result = extract(oracle, "pre-ln", heads=H, seed=seed)
        row.update(refused=False, held_out_error=result.report.verification.max_relative_error)
    except AttnExtractError as exc:
        row.update(refused=True, error=f"{type(exc).__name__}: {exc}"[:240])
    row["queries"] = oracle.queries
    return row


def in_class_on_image(box) -> bool | None:
    """Whether the impostor's difference never shows on LayerNorm's image at R = sqrt(d)
    (True), surely shows (False) or may (None). Clipping at C never engages when C is at
    least |c + beta^T sum_h v_h| + sum_h R |P A v_h| (a bound on the attention output);
    the norm trigger (tokens of norm > 20) never fires when R max|A| + |beta| <= 20.
    Every other impostor changes the block."""
    block, inner, d = box.block, box.inner, box.dim
    A = block.gamma / np.sqrt(1.0 + block.eps)
    R = np.sqrt(d)
    if type(inner).__name__ == "Clipping":
        middle = block.c + block.beta @ block.v.sum(axis=0)
        spread = sum(R * np.linalg.norm(A * v - np.mean(A * v)) for v in block.v)
        return True if inner.clip >= abs(middle) + spread else None
    if type(inner).__name__ == "NormTrigger":
        return bool(R * np.abs(A).max() + np.linalg.norm(block.beta) <= 20.0)
    return False


def zoo_run(name: str, H: int, d: int, seed: int) -> dict:
    from attnextract.testing.impostors import BehindLayerNorm
    rng = np.random.default_rng([seed, d, sum(map(ord, name))])
    block = random_pre_layer_norm(H, d, seed)
    # the switches land inside the run: this seed's own recovery count on the honest block
    recovery = int(extract(Oracle(block, d), "pre-ln", heads=H, seed=seed).report.details[
        "recovery queries"]) if "switch" in name else 0
    box = BehindLayerNorm(block, name, rng, recovery)
    row = {"zoo": name, "H": H, "d": d, "seed": seed, "in_class": in_class_on_image(box)}
    return zoo_verdict(row, box, d, heads=H, seed=seed)


def table(rows: list) -> list[str]:
    lines = ["| H | d | runs | recovered (error < 1e-8) | max error | median error | "
             "queries / identified (median, max) | queries (median) | max held-out | "
             "CPU s (median, max) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for H, d in sorted({(r["H"], r["d"]) for r in rows}):
        cell = [r for r in rows if r["H"] == H and r["d"] == d]
        ok = [r for r in cell if "error" in r]
        if not ok:
            lines.append(f"| {H} | {d} | {len(cell)} | 0 | - | - | - | - | - | - |")
            continue
        errs = [r["error"] for r in ok]
        ratio = [(r["queries"] - r["breakdown"]["verification"]) / r["identified"] for r in ok]
        cpu = [r["cpu_s"] for r in ok]
        lines.append(f"| {H} | {d} | {len(cell)} | {sum(e < GOAL for e in errs)} | "
                     f"{max(errs):.1e} | {np.median(errs):.1e} | "
                     f"{np.median(ratio):.2f}, {max(ratio):.2f} | "
                     f"{int(np.median([r['queries'] for r in ok]))} | "
                     f"{max(r['held_out_error'] for r in ok):.1e} | "
                     f"{np.median(cpu):.2f}, {max(cpu):.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--heads", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dims", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--refusal-seeds", type=int, default=20)
    parser.add_argument("--zoo-seeds", type=int, default=3)
    parser.add_argument("--parts", nargs="+", default=["grid", "refusals", "zoo"],
                        choices=["grid", "refusals", "zoo"])
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    cells = [(H, d) for H in args.heads for d in args.dims]
    for part in args.parts:          # one section of the results file per part
        with _results.Run(__file__, args.out, section=part) as results:
            data = {"runs": [], "refusals": [], "zoo": []}
            if part == "grid":
                data["runs"] = [run(H, d, s) for H, d in cells for s in range(args.seeds)]
            elif part == "refusals":
                data["refusals"] = [refusal(k, H, d, s) for k in
                                    ("post-LN", "plain attention + residual",
                                     "twice the heads told")
                                    for H, d in cells for s in range(args.refusal_seeds)]
            else:
                names = list(zoo(BiasedMultiHeadAttention(
                    np.stack([np.eye(4)] * 2), np.ones((2, 4)), np.ones((2, 4)), 0.0)))
                data["zoo"] = [zoo_run(n, H, 8, s) for n in names for H in args.heads
                               for s in range(args.zoo_seeds)]
            text = render(data)
            print(text)
            results.add(text)


def render(data: dict) -> str:
    """The markdown of the parts run (runs, refusals, zoo); parts not run are left out."""
    rows, refusals, zoo_rows = data["runs"], data["refusals"], data["zoo"]
    what = []
    if rows:
        what.append(f"{len({r['seed'] for r in rows})} seeds per cell")
    if refusals:
        what.append(f"boxes outside the class ({len({r['seed'] for r in refusals})} seeds "
                    f"per cell)")
    if zoo_rows:
        what.append("the impostor zoo")
    lines = [f"Pre-LayerNorm blocks with several heads on the sphere "
             f"(`--model pre-ln --heads H`): {', '.join(what)}. CPU seconds are process "
             "time, one BLAS thread, verification included.", ""]
    if rows:
        lines += ["Errors: the largest relative error of P W_h P, P b_h, P v_h (heads "
                  "matched), P r and c against `PreLayerNormAttention.on_sphere`; queries / "
                  "identified counts the recovery (verification apart) against "
                  "H (m^2 + 2m) + m + 1.", ""] + table(rows)
        failed = [r for r in rows if "refused" in r]
        if failed:
            lines += ["", "Refused in-class runs:", ""]
            lines += [f"- H = {r['H']}, d = {r['d']}, seed {r['seed']}: {r['refused']}"
                      for r in failed]
    if refusals:
        refused = {}
        for r in refusals:
            refused.setdefault((r["impostor"], r["H"], r["d"]), []).append(r)
        lines += ["", "Boxes outside the class (each must be refused), and the refusals' "
                  "types:", "", "| impostor | H | d | refused | as |", "|---|---|---|---|---|"]
        for (k, H, d), cell in refused.items():
            kinds = sorted({r["error"].split(":")[0] for r in cell if r["refused"]})
            lines.append(f"| {k} | {H} | {d} | {sum(r['refused'] for r in cell)} of "
                         f"{len(cell)} | {', '.join(kinds)} |")
    if zoo_rows:
        heads = sorted({r["H"] for r in zoo_rows})
        names = list(dict.fromkeys(r["zoo"] for r in zoo_rows))
        seeds = len({r["seed"] for r in zoo_rows})
        lines += ["", f"The impostor zoo behind the block's LayerNorm, d = 8, {seeds} "
                  "seed(s) per H: refused of runs; outside = the impostor surely changes the "
                  "block on LayerNorm's image (clipping whose level may engage is left "
                  "undecided). Wrong verdicts: accepted while surely outside, or refused "
                  "while surely inside.", "",
                  "| impostor | " + " | ".join(f"H = {H} refused | H = {H} outside"
                                                for H in heads) + " | wrong verdicts |",
                  "|---|" + "---|---|" * len(heads) + "---|"]
        for name in names:
            cells = [[r for r in zoo_rows if r["zoo"] == name and r["H"] == H] for H in heads]
            wrong = sum((r["in_class"] is False and not r["refused"])
                        or (r["in_class"] is True and r["refused"]) for c in cells for r in c)
            lines.append(f"| {name} | " + " | ".join(
                f"{sum(r['refused'] for r in c)} of {len(c)} | "
                f"{sum(r['in_class'] is False for r in c)}" for c in cells) + f" | {wrong} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
