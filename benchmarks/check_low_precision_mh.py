"""multi-head and multi-head-low-rank on bfloat16 and K-decimal answers: each run returns
a model within its stated error bar or refuses with a typed error naming the option.

Run:  nice -n 10 python benchmarks/check_low_precision_mh.py [--dims 8 16] [--heads 2 4]
          [--seeds 0] [--out FILE.md]

Boxes: random_multi_head(H, d) (multi-head) and random_low_rank_multi_head(H, d, d / H)
(multi-head-low-rank, rank d / H as in nn.MultiheadAttention), seed = seed. Answers:
``bf16-stated`` the float64 answer cut to bfloat16 (float32, low 16 bits cleared) with
``output_dtype="bfloat16"``; ``bf16-auto`` the same answers, no option (the learner sees
numbers that float16 holds exactly); ``decimals K`` rounded to K decimals with
``decimals=K``. Told H. Outcomes: within (error <= the stated bar), OUTSIDE (must never
happen), refused (typed; whether the message names --output-dtype / --decimals), CRASH
(an untyped exception: a bug). CPU seconds per run (one BLAS thread).
"""
from __future__ import annotations

import argparse
import os
import re
import time

import numpy as np

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from attnextract.adapters.targets import random_low_rank_multi_head, random_multi_head  # noqa: E402
from attnextract.errors import AttnExtractError  # noqa: E402
from attnextract.learners.multi_head import canonical_error  # noqa: E402
from attnextract.oracle import Oracle  # noqa: E402
from attnextract.registry import extract  # noqa: E402

import _results

MODES = ["bf16-stated", "bf16-auto", "decimals 4", "decimals 6", "decimals 8"]


def bfloat16(y: np.ndarray) -> np.ndarray:
    """float64 answers truncated to bfloat16 (as float64)."""
    y = np.asarray(y, dtype=np.float64).astype(np.float32)
    return (y.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)


def one_run(learner: str, d: int, H: int, seed: int, mode: str) -> dict:
    M = (random_multi_head(H, d, seed=seed) if learner == "multi-head"
         else random_low_rank_multi_head(H, d, d // H, seed=seed))
    if mode.startswith("bf16"):
        box = lambda X: bfloat16(M(X))                      # noqa: E731
        options = {"output_dtype": "bfloat16"} if mode == "bf16-stated" else {}
    else:
        K = int(mode.split()[1])
        box = lambda X: np.round(M(X), K)                   # noqa: E731
        options = {"decimals": K}
    extra = {"rank": d // H} if learner == "multi-head-low-rank" else {}
    oracle = Oracle(box, d)
    cpu = time.process_time()
    row = {"learner": learner, "d": d, "H": H, "seed": seed, "mode": mode}
    try:
        result = extract(oracle, learner, heads=H, seed=seed, **extra, **options)
    except AttnExtractError as exc:
        message = str(exc)
        return {**row, "outcome": "refused", "type": type(exc).__name__,
                "names option": bool(re.search(r"--output-dtype|output_dtype|--decimals|"
                                               r"decimals", message)),
                "reason": message[:240], "queries": oracle.queries,
                "cpu": time.process_time() - cpu}
    except Exception as exc:                                 # a bug: counted apart
        return {**row, "outcome": "CRASH", "reason": repr(exc)[:240],
                "queries": oracle.queries, "cpu": time.process_time() - cpu}
    error = float(canonical_error(result.model, M))
    bar = float(result.report.details.get("error bar") or np.nan)
    return {**row, "outcome": "within" if error <= bar else "OUTSIDE", "error": error,
            "bar": bar, "queries": oracle.queries, "cpu": time.process_time() - cpu,
            "notes": list(result.report.notes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--heads", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--learners", nargs="+", default=["multi-head", "multi-head-low-rank"])
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as results:
        measure(args, results)


def measure(args, results) -> None:
    """Every learner, size, seed and answer mode; saved after every run."""
    rows = []
    for learner in args.learners:
        for d in args.dims:
            for H in args.heads:
                for seed in args.seeds:
                    for mode in MODES:
                        rows.append(one_run(learner, d, H, seed, mode))
                        print({k: v for k, v in rows[-1].items() if k != "notes"}, flush=True)
                        results.parts = [markdown(rows)]
                        results.save()


def markdown(rows: list[dict]) -> str:
    lines = ["Low precision, multi-head and multi-head-low-rank (CPU seconds).", "",
             "| learner | d | H | seed | answers | outcome | error | bar | names the option "
             "| queries | CPU s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: "-" if x is None else f"{x:.1e}"          # noqa: E731
    for r in rows:
        lines.append(f"| {r['learner']} | {r['d']} | {r['H']} | {r['seed']} | {r['mode']} | "
                     f"{r['outcome']} | {fmt(r.get('error'))} | {fmt(r.get('bar'))} | "
                     f"{'yes' if r.get('names option') else '-' if r['outcome'] != 'refused' else 'NO'} | "
                     f"{r['queries']} | {r['cpu']:.1f} |")
    lines += ["", "Refusals:", ""]
    lines += [f"- {r['learner']} d = {r['d']}, H = {r['H']}, {r['mode']}: {r.get('type', '')}: "
              f"{r['reason']}" for r in rows if r["outcome"] in ("refused", "CRASH")]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
