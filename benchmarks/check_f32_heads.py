"""multi-head on float32 nn.MultiheadAttention with small head dimensions (d / H = 1 or 2):
each run returns a model within its stated error bar, or refuses with a typed error; a
refusal that names ``max_error_bar=X`` is run again with that option (what a user told so
would do) and its outcome recorded beside the first.

Run:  nice -n 10 python benchmarks/check_f32_heads.py --cells 8x4 8x8 16x8 --trials 0-3
          [--modes told no-heads] [--float64] [--out FILE.md]

Box: ``torch.nn.MultiheadAttention(d, H, bias=False, batch_first=True)`` after
``torch.manual_seed(trial)``, read out by a unit vector (seed = trial), served in its own
float32 (``TorchAttentionBlackBox(dtype=None)``; ``--float64``: the same module served in
float64, the default); the learner's seed is the trial; no precision option (float32 is
detected). Outcomes: within (canonical error <= the stated bar), OUTSIDE (must never
happen), refused (the error type and message), CRASH (untyped). CPU seconds per run.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_float32_torch import float32_box  # noqa: E402
from attnextract.errors import AttnExtractError  # noqa: E402
from attnextract.learners.multi_head import canonical_error  # noqa: E402
from attnextract.oracle import Oracle  # noqa: E402
from attnextract.registry import extract  # noqa: E402

import _results


def one_run(d: int, H: int, trial: int, told: bool, float64: bool, **options) -> dict:
    box, truth = float32_box(d, H, trial)
    if float64:
        from attnextract.adapters.torch_target import TorchAttentionBlackBox
        from attnextract.adapters.torch_target import merged_head_parameters
        from attnextract.models import MultiHeadAttention
        box = TorchAttentionBlackBox(box.module, readout=trial, dtype="float64")
        # the truth with this box's readout (the float32 box's is rounded to float32)
        parts = [merged_head_parameters(box.module, box.readout, h) for h in range(H)]
        truth = MultiHeadAttention(*(np.array(x) for x in zip(*parts)))
    oracle = Oracle(box, d)
    row = {"d": d, "H": H, "trial": trial, "mode": "told" if told else "no-heads", **options}
    cpu = time.process_time()
    try:
        result = extract(oracle, "multi-head", heads=H if told else None, seed=trial, **options)
    except AttnExtractError as exc:
        row.update(outcome="refused", error_type=type(exc).__name__, message=str(exc))
    except Exception as exc:                                   # noqa: BLE001
        row.update(outcome="CRASH", message=f"{type(exc).__name__}: {exc}")
    else:
        found = result.model.heads
        error = canonical_error(result.model, truth) if found == H else float("inf")
        bar = float(result.report.details["error bar"])
        details = result.report.details
        row.update(outcome="within" if error <= bar else "OUTSIDE", error=float(error), bar=bar,
                   heads_found=int(found), notes=list(result.report.notes),
                   predicted_small_moves=details.get("predicted relative error (small moves)"),
                   residual=details.get("residual rms"), noise=details.get("noise floor"),
                   predicted=details.get("predicted relative error"),
                   predicted_rows=details.get("predicted relative error (row fits)"),
                   polish=details.get("joint polish"),
                   least_noise=details.get("least noise (error bar)"))
    row.update(queries=oracle.queries, cpu=round(time.process_time() - cpu, 2))
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=["8x4", "8x8", "16x8"], help="dxH")
    parser.add_argument("--trials", default="0-3")
    parser.add_argument("--modes", nargs="+", default=["told", "no-heads"])
    parser.add_argument("--float64", action="store_true")
    parser.add_argument("--precision", choices=["full", "fast"], default="full",
                        help="the learner's precision= (fast: no short probes on float64 "
                             "answers, the design float32 answers get)")
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as results:
        measure(args, results)


def measure(args, results) -> None:
    """Every cell, mode and trial; the results file is saved after every run."""
    import torch
    torch.set_num_threads(1)
    lo, hi = (int(x) for x in args.trials.split("-"))
    rows = []
    for cell in args.cells:
        d, H = (int(x) for x in cell.split("x"))
        for mode in args.modes:
            for trial in range(lo, hi + 1):
                extra = {"precision": args.precision} if args.precision != "full" else {}
                row = one_run(d, H, trial, mode == "told", args.float64, **extra)
                hint = re.search(r"max_error_bar=([0-9.e+-]+)", row.get("message", ""))
                if hint:
                    row["with option"] = one_run(d, H, trial, mode == "told", args.float64,
                                                 max_error_bar=float(hint.group(1)), **extra)
                rows.append(row)
                again = row.get("with option", {})
                print(f"d={d} H={H} {mode} {trial}: {row['outcome']} {row.get('error', '')} "
                      f"{row.get('bar', '')} cpu {row['cpu']}"
                      + (f" | with max_error_bar: {again['outcome']} {again.get('error', '')} "
                         f"{again.get('bar', '')}" if again else "")
                      + f" {row.get('message', '')[:160]}", flush=True)
                write(rows, args, results)


def write(rows, args, results) -> None:
    """The table of the runs so far into the results file."""
    lines = [f"multi-head on {'float64-served' if args.float64 else 'float32'} "
             f"nn.MultiheadAttention, small head dimensions (precision={args.precision}).", "",
             "| d | H | mode | trial | outcome | error | bar | predicted (small moves) "
             "| queries | CPU s | with the max_error_bar named | message |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = (lambda x: "" if x is None else f"{x:.1e}")
    for r in rows:
        again = r.get("with option")
        again_text = (f"{again['max_error_bar']:g}: {again['outcome']} "
                      f"{fmt(again.get('error'))} (bar {fmt(again.get('bar'))})" if again else "")
        message = r.get("message", "").replace("|", "/")
        lines.append(f"| {r['d']} | {r['H']} | {r['mode']} | {r['trial']} | {r['outcome']} | "
                     f"{fmt(r.get('error'))} | {fmt(r.get('bar'))} | "
                     f"{fmt(r.get('predicted_small_moves'))} | {r['queries']} | "
                     f"{r['cpu']} | {again_text} | {message[:700]} |")
    results.parts = ["\n".join(lines)]
    results.save()


if __name__ == "__main__":
    main()
