"""float32 PyTorch attention: nn.MultiheadAttention in float32 behind a fixed readout.

Run:  python benchmarks/bench_float32_torch.py [--heads 2 4] [--dim 16] [--trials 100] [--first-trial 0]
          [--trial-list T ...] [--learner multi-head] [--modes auto stated] [--out FILE.md]

Per trial: a fresh ``torch.nn.MultiheadAttention(d, H, bias=False)`` with PyTorch's own
random initialisation (``torch.manual_seed(trial)``), in float32 (PyTorch's default
dtype, kept: :class:`TorchAttentionBlackBox` with ``dtype=None``), read out by a fixed
unit vector r (seed = trial): f(X) = r^T MHA(x_N, X, X). The truth is every head's
(W_h, v_h) = (K_h^T Q_h / sqrt(hd), V_h^T O_h^T r) computed in float64 from the float32
weights; the black box's forward pass runs in float32, so its answers are off from that
truth by the rounding of the whole forward pass.

Modes: ``auto`` runs the learner with no precision option (it may detect float32
answers by itself); ``stated`` passes ``output_dtype="float32"`` (``--output-dtype
float32``), only when the learner accepts it (otherwise the row says "not accepted");
``no-heads`` is ``auto`` without the head count (``heads=None``, no ``--heads``): the
learner finds the count itself, and the row also counts the trials whose count came
out right (a model of another count is never "within").

Outcomes per trial: ``within`` (a model came back and its canonical error, the worst
head's relative error after matching, is at most the learner's stated error bar
``report.details["error bar"]``), ``outside`` (a model came back with an error above its
bar: must never happen), ``refused`` (a typed refusal; its first line is kept, and whether
it names the precision option), ``crashed`` (an untyped exception escaped the learner: a
bug, counted apart). Times are wall-clock on a shared machine.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import time

import numpy as np

from attnextract.errors import AttnExtractError, InputError
from attnextract.learners.multi_head import canonical_error
from attnextract.models import MultiHeadAttention
from attnextract.oracle import Oracle
from attnextract.registry import extract, get_learner

import _results


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--first-trial", type=int, default=0,
                        help="trials first .. first + trials - 1 (to split a run over processes)")
    parser.add_argument("--trial-list", type=int, nargs="+", metavar="TRIAL",
                        help="run these trials (e.g. earlier refusals) instead of a range")
    parser.add_argument("--learner", default="multi-head",
                        choices=["multi-head", "multi-head-low-rank"])
    parser.add_argument("--modes", nargs="+", default=["auto", "stated"],
                        choices=["auto", "stated", "no-heads"])
    _results.add_out_option(parser, __file__)
    return parser.parse_args()


def float32_box(dim: int, heads: int, trial: int):
    """(black box, truth) for one trial: a float32 module with torch's default init."""
    import torch
    from attnextract.adapters.torch_target import TorchAttentionBlackBox, merged_head_parameters
    torch.manual_seed(trial)
    module = torch.nn.MultiheadAttention(dim, heads, bias=False, batch_first=True)
    assert next(module.parameters()).dtype == torch.float32
    box = TorchAttentionBlackBox(module, readout=trial, dtype=None)     # served in float32
    parts = [merged_head_parameters(module, box.readout, h) for h in range(heads)]
    truth = MultiHeadAttention(np.array([W for W, _ in parts]), np.array([v for _, v in parts]))
    return box, truth


def reason_kind(message: str) -> str:
    """A refusal's first line with its numbers blanked, to count alike refusals together."""
    return re.sub(r"[-+]?\d[\d.]*(e[-+]?\d+)?", "#", message.split(";")[0])[:150]


def one_trial(learner: str, dim: int, heads: int, trial: int, options: dict) -> dict:
    box, truth = float32_box(dim, heads, trial)
    oracle = Oracle(box, dim)
    start, cpu = time.perf_counter(), time.process_time()
    extra = {"rank": dim // heads} if learner == "multi-head-low-rank" else {}
    try:
        result = extract(oracle, learner, heads=None if options.pop("no_heads", False)
                         else heads, seed=trial, **extra, **options)
    except InputError:
        raise
    except Exception as exc:           # a typed refusal, or the learner crashed
        message = (str(exc).splitlines() or [""])[0]
        return {"trial": trial,
                "outcome": "refused" if isinstance(exc, AttnExtractError) else "crashed",
                "error_type": type(exc).__name__,
                "reason": message, "names_option": bool(re.search(
                    r"--output-dtype|output_dtype", message)),
                "queries": oracle.queries, "seconds": time.perf_counter() - start,
                "cpu_seconds": time.process_time() - cpu}
    found = result.model.heads
    error = canonical_error(result.model, truth) if found == heads else float("inf")
    bar = float(result.report.details.get("error bar") or np.nan)
    return {"trial": trial, "outcome": "within" if error <= bar else "outside",
            "error": float(error), "bar": bar, "queries": oracle.queries,
            "held_out": result.report.verification.max_relative_error,
            "notes": list(result.report.notes), "heads found": int(found),
            "base row counts": result.report.details.get("head counts of the base rows"),
            "seconds": time.perf_counter() - start,
            "cpu_seconds": time.process_time() - cpu}


def summarise(rows: list[dict]) -> dict:
    count = collections.Counter(r["outcome"] for r in rows)
    done = [r for r in rows if r["outcome"] in ("within", "outside")]
    refusals = collections.Counter((r["error_type"], reason_kind(r["reason"]))
                                   for r in rows if r["outcome"] in ("refused", "crashed"))
    return {"trials": len(rows), "within": count["within"], "outside": count["outside"],
            "refused": count["refused"], "crashed": count["crashed"],
            "count right": sum(r.get("heads found") == r.get("heads") for r in rows),
            "refusals naming the option": sum(r.get("names_option", False) for r in rows),
            "median error": float(np.median([r["error"] for r in done])) if done else None,
            "largest error": max((r["error"] for r in done), default=None),
            "median bar": float(np.median([r["bar"] for r in done])) if done else None,
            "median queries": float(np.median([r["queries"] for r in rows])),
            "median seconds": float(np.median([r["seconds"] for r in rows])),
            "median cpu seconds": float(np.median([r.get("cpu_seconds", np.nan)
                                                   for r in rows])),
            "refusal reasons": [{"type": t, "reason": k, "count": c}
                                for (t, k), c in refusals.most_common()]}


def main() -> None:
    args = parse()
    with _results.Run(__file__, args.out) as results:
        measure(args, results)


def measure(args, results) -> None:
    """Every cell's trials; the results file is saved after every trial."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(1)
    accepts = "output_dtype" in get_learner(args.learner).options
    cells = []
    for heads in args.heads:
        for mode in args.modes:
            if mode == "stated" and not accepts:
                cells.append({"heads": heads, "mode": mode, "accepted": False})
                print(f"H = {heads} {mode}: {args.learner} does not accept output_dtype",
                      flush=True)
                continue
            rows = []
            for t in (args.trial_list or range(args.first_trial, args.first_trial + args.trials)):
                options = ({"output_dtype": "float32"} if mode == "stated" else
                           {"no_heads": True} if mode == "no-heads" else {})
                rows.append({"heads": heads,
                             **one_trial(args.learner, args.dim, heads, t, options)})
                # written after every trial: a run stopped early keeps what it measured
                write(results, args, cells + [{"heads": heads, "mode": mode, "accepted": True,
                                      **summarise(rows), "rows": rows}])
            cell = {"heads": heads, "mode": mode, "accepted": True, **summarise(rows),
                    "rows": rows}
            cells.append(cell)
            print(f"H = {heads} {mode}: within {cell['within']}, outside {cell['outside']}, "
                  f"refused {cell['refused']}, crashed {cell['crashed']} of {cell['trials']}",
                  flush=True)
    write(results, args, cells)


def write(results, args, cells: list[dict]) -> None:
    """The Markdown table of ``cells`` into the results file (a cell's "trials" counts
    those run)."""
    import torch
    lines = [f"float32 nn.MultiheadAttention (torch {torch.__version__}), d = {args.dim}, "
             f"learner {args.learner}: {args.trials} trials per row asked (the table counts "
             f"those run; torch.manual_seed(trial), default init, bias=False, readout seed = "
             f"trial).", "",
             "| H | mode | within bar | outside bar | refused | crashed (untyped error) "
             "| refusals naming the option | count right | median error | median bar "
             "| median queries | median s | median CPU s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        if not c["accepted"]:
            lines.append(f"| {c['heads']} | {c['mode']} | (output_dtype not accepted by "
                         f"this learner) | | | | | | | | | | |")
            continue
        fmt = (lambda x: "-" if x is None else f"{x:.1e}")
        lines.append(f"| {c['heads']} | {c['mode']} | {c['within']} | {c['outside']} | "
                     f"{c['refused']} | {c['crashed']} | {c['refusals naming the option']} | "
                     f"{c.get('count right', '-')} | "
                     f"{fmt(c['median error'])} | {fmt(c['median bar'])} | "
                     f"{c['median queries']:.0f} | {c['median seconds']:.1f} | "
                     f"{c.get('median cpu seconds', float('nan')):.1f} |")
    for c in cells:
        told = next((t for t in cells if t["heads"] == c["heads"] and t["mode"] == "auto"
                     and t.get("accepted", True)), None)
        if c["mode"] != "no-heads" or told is None:
            continue
        pairs = [(r, t) for r in c["rows"] for t in told["rows"] if t["trial"] == r["trial"]]
        if pairs:
            queries = [r["queries"] / t["queries"] for r, t in pairs]
            cpu = [r["cpu_seconds"] / t["cpu_seconds"] for r, t in pairs
                   if r.get("cpu_seconds") and t.get("cpu_seconds")]
            lines += ["", f"H = {c['heads']}, no-heads against auto (told H), same trials "
                      f"({len(pairs)}): queries median {np.median(queries):.2f}x, largest "
                      f"{max(queries):.2f}x"
                      + (f"; CPU seconds median {np.median(cpu):.2f}x, largest {max(cpu):.2f}x"
                         if cpu else "")]
    lines += ["", "Refusals and crashes (numbers blanked as #):", ""]
    for c in cells:
        for r in c.get("refusal reasons", []):
            lines.append(f"- H = {c['heads']} {c['mode']}: {r['count']} x {r['type']}: "
                         f"{r['reason']}")
    results.parts = ["\n".join(lines)]
    results.save()


if __name__ == "__main__":
    main()
