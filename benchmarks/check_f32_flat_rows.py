"""multi-head on numpy float32 forward passes (Float32MultiHeadBlackBox, d = 16), told H:
each run returns a model within its stated error bar or refuses with a typed error that
does not blame the box (issue 22, items 4 and 6).

Run:  nice -n 10 python benchmarks/check_f32_flat_rows.py [--heads 2 4] [--seeds 0-39]
          [--no-heads] [--out FILE.md]

Box: Float32MultiHeadBlackBox(H, 16, seed=seed) (nn.MultiheadAttention's arithmetic in
float32, PyTorch's default initialisation); the learner's seed is the box's seed, no
output option (float32 is detected). Outcomes: within (canonical error <= the stated
bar), OUTSIDE (must never happen), refused-learner (RecoveryFailedError), refused-box
(ModelMismatchError: wrong for these in-class boxes), CRASH (untyped). CPU seconds per
run (process time, one BLAS thread). ``--no-heads``: the count is searched.
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from attnextract.adapters.targets import Float32MultiHeadBlackBox  # noqa: E402
from attnextract.errors import ModelMismatchError, RecoveryFailedError  # noqa: E402
from attnextract.learners.multi_head import canonical_error, extract_multi_head  # noqa: E402
from attnextract.oracle import Oracle  # noqa: E402

import _results  # noqa: E402


def one_run(H: int, seed: int, d: int = 16, told: bool = True) -> dict:
    box = Float32MultiHeadBlackBox(H, d, seed=seed)
    oracle = Oracle(box, d)
    row = {"H": H, "seed": seed}
    cpu = time.process_time()
    try:
        result = extract_multi_head(oracle, heads=H if told else None, seed=seed)
    except ModelMismatchError as exc:
        row.update(outcome="refused-box", message=str(exc)[:300])
    except RecoveryFailedError as exc:
        row.update(outcome="refused-learner", message=str(exc)[:300])
    except Exception as exc:                                   # noqa: BLE001
        row.update(outcome="CRASH", message=f"{type(exc).__name__}: {exc}"[:300])
    else:
        error, bar = canonical_error(result.model, box.truth), result.report.details["error bar"]
        row.update(outcome="within" if error <= bar else "OUTSIDE", error=error, bar=bar)
    row.update(queries=oracle.queries, cpu=round(time.process_time() - cpu, 2))
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seeds", default="0-39")
    parser.add_argument("--no-heads", action="store_true", help="not told H (count searched)")
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as results:
        results.add(measure(args))


def measure(args) -> str:
    """Every run (a JSON line each); returns the table."""
    lo, hi = (int(x) for x in args.seeds.split("-"))
    rows = []
    for H in args.heads:
        for seed in range(lo, hi + 1):
            rows.append(one_run(H, seed, told=not args.no_heads))
            print(json.dumps(rows[-1]), flush=True)
    lines = [f"multi-head on Float32MultiHeadBlackBox(H, 16), "
             f"{'not told H' if args.no_heads else 'told H'}.", "",
             "| H | runs | within | OUTSIDE | refused (learner) | refused (box) | crash | "
             "median error | median bar | median CPU s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for H in args.heads:
        cell = [r for r in rows if r["H"] == H]
        n = {k: sum(r["outcome"] == k for r in cell)
             for k in ("within", "OUTSIDE", "refused-learner", "refused-box", "CRASH")}
        ok = [r for r in cell if "error" in r]
        med = (lambda key: f"{np.median([r[key] for r in ok]):.1e}" if ok else "-")
        lines.append(f"| {H} | {len(cell)} | {n['within']} | {n['OUTSIDE']} | "
                     f"{n['refused-learner']} | {n['refused-box']} | {n['CRASH']} | "
                     f"{med('error')} | {med('bar')} | {np.median([r['cpu'] for r in cell]):.2f} |")
    lines += ["", "Refusals:", ""] + [f"- H = {r['H']}, seed {r['seed']}: {r['outcome']}: "
                                       f"{r['message']}" for r in rows if "message" in r]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
