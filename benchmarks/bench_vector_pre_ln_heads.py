"""Several pre-LayerNorm heads from vector answers (`vector-pre-ln` with heads=H) on
GPT-2 layers at their default initialisation.

For d in {16, 32, 64}, H in {2, 4, 8} (or the pairs --configs names, e.g. 48x12) and 20 seeds: a one-layer transformers
GPT2Model(n_embd=d, n_head=H) at its default initialisation (torch.manual_seed(seed);
weights N(0, 0.02), biases 0, ln_1 the identity), saved with save_pretrained and read
back as a checkpoint; its layer 0's attention sublayer (ln_1, attention, c_proj, run by
transformers in float64) is the box, answering the last position's vector. Recorded
per run: the outcome (learnt, or the refusal's type), the canonical error against the
layer's own weights folded onto the sphere (heads matched by W; W_h, b_h, O_h relative
to their own norms, c), the stated error bar, queries against the floor, the held-out
error and CPU seconds.

Run:  OPENBLAS_NUM_THREADS=1 nice -n 10 python benchmarks/bench_vector_pre_ln_heads.py
      [--seeds 20] [--widths 16 32 64] [--heads 2 4 8] [--configs 48x12 64x8 ...]
      [--out FILE.md]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from attnextract import extract
from attnextract.checkpoint import canonical_errors, pack
from attnextract.errors import AttnExtractError
from attnextract.oracle import Oracle

import _results


def gpt2_layer(folder: Path, d: int, heads: int, seed: int):
    """The box and the truth of layer 0 of a default-initialised GPT-2 saved in ``folder``."""
    import torch
    import transformers

    from attnextract.adapters.checkpoint import Checkpoint
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_embd=d, n_head=heads, n_layer=1, vocab_size=64,
                                     n_positions=64)
    transformers.GPT2Model(config).save_pretrained(folder)
    ck = Checkpoint(folder)
    return ck.black_box(0, "last"), ck.truth(0)


def one_run(d: int, heads: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        box, truth = gpt2_layer(Path(tmp) / "gpt2", d, heads, seed)
        oracle = Oracle(box, d, outputs="last", out_dim=d)
        cpu = time.process_time()
        try:
            result = extract(oracle, model="vector-pre-ln", heads=heads, seed=seed)
        except AttnExtractError as exc:
            return {"outcome": type(exc).__name__, "queries": oracle.queries,
                    "cpu": time.process_time() - cpu}
        cpu = time.process_time() - cpu
    model, report = result.model, result.report
    entry = {"heads": {"W": pack(model.W), "b": pack(model.b), "O": pack(model.O),
                       "c": pack(model.c)}, "radius": model.radius, "readout_seed": None}
    check = canonical_errors(entry, truth)
    return {"outcome": "learnt", "error": check["canonical_error"],
            "bar": report.details.get("error bar"), "queries": result.queries,
            "floor": report.floor, "held_out": report.verification.max_relative_error,
            "cpu": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--heads", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--configs", nargs="+", default=None,
                        help="d x H pairs (e.g. 32x8 48x12) instead of --widths x --heads")
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as run:
        rows = ["| d | H | learnt | refused (why) | worst canonical error | worst error bar "
                "| queries (median) | floor | worst held-out | CPU s (median) |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        if args.configs:
            configs = [tuple(int(v) for v in c.lower().split("x")) for c in args.configs]
        else:
            configs = [(d, heads) for d in args.widths for heads in args.heads]
        for d, heads in configs:
            runs = [one_run(d, heads, seed) for seed in range(args.seeds)]
            learnt = [r for r in runs if r["outcome"] == "learnt"]
            refused = {}
            for r in runs:
                if r["outcome"] != "learnt":
                    refused[r["outcome"]] = refused.get(r["outcome"], 0) + 1
            why = ", ".join(f"{v} {k}" for k, v in refused.items()) or "0"
            if learnt:
                rows.append(
                    f"| {d} | {heads} | {len(learnt)}/{len(runs)} | {why} "
                    f"| {max(r['error'] for r in learnt):.1e} "
                    f"| {max(r['bar'] for r in learnt):.1e} "
                    f"| {int(np.median([r['queries'] for r in learnt]))} "
                    f"| {learnt[0]['floor']} "
                    f"| {max(r['held_out'] for r in learnt):.1e} "
                    f"| {np.median([r['cpu'] for r in runs]):.1f} |")
            else:
                rows.append(f"| {d} | {heads} | 0/{len(runs)} | {why} | - | - | - | - | - "
                            f"| {np.median([r['cpu'] for r in runs]):.1f} |")
            print(rows[-1], flush=True)
        run.add("\n".join(rows))


if __name__ == "__main__":
    main()
