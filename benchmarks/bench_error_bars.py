"""Do the error bars hold? Low-precision and rounded black boxes, measured bars.

For each case, ``trials`` random single heads (torch ``nn.MultiheadAttention``, one
head, no biases, d = --dim) are extracted with :func:`extract_low_precision`, and the
measured W error (Frobenius, against the head's own weights in that dtype) is compared
with the reported bar ``error_bar_W``. The bars are meant to hold in >= 99% of trials.

Cases: the forward pass in float32, in bfloat16 (torch), and float64 outputs rounded
to K decimals (``RoundedOutputs(decimals=K)``).

    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_error_bars.py --trials 100 --dim 8
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from attnextract import ModelMismatchError, Oracle, SingleHeadAttention
from attnextract.learners.noisy import extract_low_precision
from attnextract.oracle import RoundedOutputs

import _results


def torch_head(d: int, seed: int, dtype: str):
    import torch
    from attnextract.adapters.torch_target import TorchAttentionBlackBox
    torch.manual_seed(seed)
    module = torch.nn.MultiheadAttention(d, 1, bias=False, batch_first=True).double()
    box = TorchAttentionBlackBox(module, seed, head=0, dtype=dtype)
    return box, SingleHeadAttention(*box.merged_parameters())


def trial(case: str, d: int, seed: int, decimals: int):
    if case == "decimals":
        box, truth = torch_head(d, seed, "float64")
        box = RoundedOutputs(box, decimals=decimals)
        options = {"decimals": decimals}
    else:
        box, truth = torch_head(d, seed, case)
        options = {"output_dtype": case}
    try:
        result = extract_low_precision(Oracle(box, d), seed=seed, **options)
        passed = True
    except ModelMismatchError as exc:        # the report still holds the bars
        result, passed = exc.result, False
    details = result.report.details
    err_W = float(np.linalg.norm(result.model.W - truth.W))
    err_v = float(np.linalg.norm(result.model.v - truth.v))
    return {"case": case, "seed": seed, "verified": passed, "error_W": err_W,
            "bar_W": details["error_bar_W"], "error_v": err_v, "bar_v": details["error_bar_v"],
            "relative_error_W": err_W / float(np.linalg.norm(truth.W)),
            "queries": result.queries}


def run(cases, d, trials, decimals, log=print):
    summary = {}
    for case in cases:
        start = time.perf_counter()
        rows = [trial(case, d, seed, decimals) for seed in range(trials)]
        held = [r["error_W"] <= r["bar_W"] for r in rows]
        held_v = [r["error_v"] <= r["bar_v"] for r in rows]
        ratio = np.array([r["bar_W"] / r["error_W"] for r in rows if r["error_W"] > 0])
        summary[case] = {
            "trials": trials, "dim": d, "W_bar_held": float(np.mean(held)),
            "v_bar_held": float(np.mean(held_v)),
            "verified": float(np.mean([r["verified"] for r in rows])),
            "median_relative_error_W": float(np.median([r["relative_error_W"] for r in rows])),
            "bar_over_error_median": float(np.median(ratio)) if ratio.size else None,
            "bar_over_error_min": float(ratio.min()) if ratio.size else None,
            "queries": rows[0]["queries"], "seconds": time.perf_counter() - start}
        log(f"{case:>9}: W bar held in {np.mean(held):.0%} of {trials}, v bar {np.mean(held_v):.0%}, "
            f"verified {summary[case]['verified']:.0%}, median rel. W error "
            f"{summary[case]['median_relative_error_W']:.2e}, bar/error median "
            f"{summary[case]['bar_over_error_median']:.2f} (min {summary[case]['bar_over_error_min']:.2f})")
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--decimals", type=int, default=6)
    parser.add_argument("--cases", nargs="+", default=["float32", "bfloat16", "decimals"])
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as results:
        results.capture()
        run(args.cases, args.dim, args.trials, args.decimals)


if __name__ == "__main__":
    main()
