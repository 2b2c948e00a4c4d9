"""Multi-head extraction (copy probes at designed steps): the grid of issue 12, item 1.

Run:  python benchmarks/bench_multi_head.py [--heads 1 2 4 6 8] [--dims 8 16 32]
                                           [--seeds 20] [--scales 1 3] [--float32]
                                           [--threads 1] [--json FILE] [--markdown FILE]
                                           [--plot FILE.png]

Targets: independent numpy black boxes, W_h entries N(0, s^2 / d) (s in --scales),
v_h entries N(0, 1). Each cell: success rate (canonical error <= 1e-10, or within the
error bar for --float32), refusals by type, wrong models (a success whose error exceeds
its own error bar: must be 0), median recovery queries against paper 2's count
4Hd^2 - 2H + 1 and the floor H(d^2 + d), median and worst canonical error, median and
longest wall time (success and failure). --plot draws success rate and median error
against H (matplotlib, imported only then).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from attnextract import Oracle
from attnextract.adapters.targets import random_multi_head
from attnextract.errors import AttnExtractError
from attnextract.learners.multi_head import canonical_error, extract_multi_head, paper2_count
from attnextract.oracle import RoundedOutputs

GOAL = 1e-10


def run_cell(H: int, d: int, seeds: int, scale: float, float32: bool = False) -> dict:
    """One grid cell over ``seeds`` seeds; returns the summary row."""
    runs = []
    for seed in range(seeds):
        target = random_multi_head(H, d, seed=10_000 * H + 100 * d + seed,
                                   w_scale=scale / np.sqrt(d))
        oracle = Oracle(RoundedOutputs(target) if float32 else target, d)
        start = time.perf_counter()
        try:
            result = extract_multi_head(oracle, heads=H, seed=seed)
            outcome = None
        except AttnExtractError as exc:
            result, outcome = getattr(exc, "result", None), type(exc).__name__
        wall = time.perf_counter() - start
        run = {"seed": seed, "wall": wall, "refused": outcome, "queries": oracle.queries}
        if outcome is None:
            err = canonical_error(result.model, target)
            bar = result.report.details["error bar"]
            run.update(error=err, bar=bar, recovery=result.report.breakdown["recovery"],
                       wrong=bool(err > bar),
                       success=bool(err <= bar if float32 else err <= GOAL))
        else:
            run.update(success=False, wrong=False)
        runs.append(run)
    ok = [r for r in runs if r["success"]]
    done = [r for r in runs if r["refused"] is None]
    refusals: dict[str, int] = {}
    for r in runs:
        if r["refused"]:
            refusals[r["refused"]] = refusals.get(r["refused"], 0) + 1
    fail_walls = [r["wall"] for r in runs if not r["success"]]
    return {"H": H, "d": d, "scale": scale, "float32": float32, "seeds": seeds,
            "success_rate": len(ok) / seeds, "refusals": refusals,
            "wrong_models": int(sum(r["wrong"] for r in runs)),
            "recovery_median": float(np.median([r["recovery"] for r in done])) if done else None,
            "paper2": paper2_count(H, d), "floor": H * (d * d + d),
            "error_median": float(np.median([r["error"] for r in done])) if done else None,
            "error_worst": float(max(r["error"] for r in done)) if done else None,
            "bar_median": float(np.median([r["bar"] for r in done])) if done else None,
            "wall_success_median": float(np.median([r["wall"] for r in ok])) if ok else None,
            "wall_failure_max": float(max(fail_walls)) if fail_walls else None}


def markdown(rows: list[dict]) -> str:
    out = ["| d | H | W scale | success | refusals | wrong | median queries | paper 2 | floor "
           "| queries / floor | median error | worst error | s (success, median) "
           "| s (failure, max) |", "|" + "---|" * 14]
    for r in rows:
        q = r["recovery_median"]
        fmt = lambda x, f: "-" if x is None else format(x, f)
        ratio = "-" if q is None else f"{q / r['floor']:.2f}"
        out.append(f"| {r['d']} | {r['H']} | {r['scale']:g} | {r['success_rate']:.0%} | "
                   f"{', '.join(f'{k} {v}' for k, v in r['refusals'].items()) or '-'} | "
                   f"{r['wrong_models']} | {fmt(q, '.0f')} | {r['paper2']} | {r['floor']} | "
                   f"{ratio} | "
                   f"{fmt(r['error_median'], '.1e')} | {fmt(r['error_worst'], '.1e')} | "
                   f"{fmt(r['wall_success_median'], '.1f')} | {fmt(r['wall_failure_max'], '.1f')} |")
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for d in sorted({r["d"] for r in rows}):
        for scale in sorted({r["scale"] for r in rows}):
            cell = sorted((r for r in rows if r["d"] == d and r["scale"] == scale),
                          key=lambda r: r["H"])
            if not cell:
                continue
            label = f"d = {d}, W ~ N(0, {scale ** 2:g}/d)"
            ax1.plot([r["H"] for r in cell], [r["success_rate"] for r in cell], "o-", label=label)
            pts = [(r["H"], r["error_median"]) for r in cell if r["error_median"] is not None]
            if pts:
                ax2.semilogy(*zip(*pts), "o-", label=label)
    ax1.set(xlabel="heads H", ylabel="success rate", ylim=(-0.05, 1.05))
    ax2.set(xlabel="heads H", ylabel="median canonical error")
    ax2.axhline(GOAL, color="gray", ls=":")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8])
    parser.add_argument("--dims", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--float32", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--plot")
    args = parser.parse_args()
    from threadpoolctl import threadpool_limits
    rows = []
    with threadpool_limits(args.threads):
        for d in args.dims:
            for H in args.heads:
                if H > d:
                    continue
                for scale in args.scales:
                    rows.append(run_cell(H, d, args.seeds, scale, args.float32))
                    r = rows[-1]
                    print(f"d={d} H={H} scale={scale:g}: success {r['success_rate']:.0%}, "
                          f"refusals {r['refusals']}, wrong {r['wrong_models']}, queries "
                          f"{r['recovery_median']} (paper {r['paper2']}, floor {r['floor']}), "
                          f"error {r['error_median']}, {r['wall_success_median']} s", flush=True)
    table = markdown(rows)
    print(table)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(table + "\n")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
