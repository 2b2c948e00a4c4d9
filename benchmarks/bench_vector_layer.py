"""vector-layer: a standard attention layer from vector answers.

1. all-MiniLM-L6-v2, every layer asked: the layer's attention sublayer with its biases
   (W_h = K_h^T Q_h / sqrt(32), b_h = K_h^T b_q,h / sqrt(32), O_h = W_o,h V_h,
   c = W_o b_v + b_o, from the bundled weights) as a numpy VectorAttention box answering
   last-position vectors (m = 384). Recorded: queries against the floor (parameters / 384
   numbers per query), the canonical errors against the real weights
   (vector_canonical_errors), the stated error bar, the held-out check, CPU seconds.
2. Random standard layers, d = 16..64, H = 2..8, r_h = d / H, with and without biases,
   SEEDS seeds each: the largest canonical error, refusals, queries / floor.
3. Impostors (tests/test_vector_layer.py's zoo): ReLU and sigmoid attention, soft-capped
   logits, a hidden fifth head writing into another head's range, a causal box told
   bidirectional: each must be refused (ModelMismatchError / RecoveryFailedError).
4. torch.nn.MultiheadAttention(64, 8, batch_first=True) in float32 with its default
   initialisation, asked through its own forward pass (last position), output_dtype=
   "float32": seeds within the stated bar, refused, errors, bars, queries.
5. Every position (``--every``): the same MiniLM layers as boxes answering every position
   (bidirectional, and causal with ``--causal-layers``), random standard layers with both
   masks, and the impostors of every position (a causal mask stated wrongly either way, a
   position-dependent term added to the answers or to the tokens): queries, canonical
   errors, refusals.

Run:  OPENBLAS_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_vector_layer.py
      [--layers 0 1 2 3 4 5] [--seeds 20] [--float32-seeds 20] [--every]
      [--causal-layers 0] [--only-every]
Writes benchmarks/results/bench_vector_layer.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from test_vector_layer import IMPOSTORS, standard_layer, torch_layer
from test_vector_layer_positions import MAX_LENGTH, PositionTerm

from attnextract.adapters.minilm import minilm_vector_layer
from attnextract.errors import ModelMismatchError, RecoveryFailedError
from attnextract.learners.vector_canonical import vector_canonical_errors
from attnextract.learners.vector_layer import extract_vector_layer
from attnextract.learners.vector_layer_positions import extract_vector_layer_positions
from attnextract.models import VectorAttention
from attnextract.oracle import Oracle

import _results

GRID = [(16, 2), (16, 4), (32, 4), (32, 8), (64, 4), (64, 8)]


def run_minilm(layer: int) -> dict:
    box = minilm_vector_layer(layer)
    oracle = Oracle(box, box.dim)
    cpu = time.process_time()
    result = extract_vector_layer(oracle, seed=0)
    cpu = time.process_time() - cpu
    errors = vector_canonical_errors(result.model, box)
    report = result.report
    return {"layer": layer, "queries": result.queries, "floor": report.floor,
            "recovery": report.breakdown["recovery"], "errors": errors, "cpu": cpu,
            "bar": report.details["error bar"], "heads": report.details["heads found"],
            "check": report.verification.max_relative_error, "numbers": oracle.numbers,
            "tokens": oracle.tokens, "breakdown": report.breakdown}


def run_grid(seeds: int) -> list[dict]:
    rows = []
    for d, H in GRID:
        for biases in (True, False):
            worst, refused, ratios = 0.0, 0, []
            for seed in range(seeds):
                box = standard_layer(seed, d, H, biases=biases)
                try:
                    result = extract_vector_layer(Oracle(box, d), seed=seed)
                except (ModelMismatchError, RecoveryFailedError):
                    refused += 1
                    continue
                worst = max(worst, vector_canonical_errors(result.model, box)["max"])
                ratios.append(result.queries / result.report.floor)
            rows.append({"d": d, "H": H, "biases": biases, "seeds": seeds, "worst": worst,
                         "refused": refused, "ratio": (min(ratios), max(ratios))})
    return rows


def run_impostors(seeds: int) -> list[dict]:
    rows = []
    zoo = {**IMPOSTORS, "hidden head in another's range": hidden_head,
           "causal box told bidirectional": None}
    for name, make in zoo.items():
        refused = 0
        for seed in range(seeds):
            if make is None:
                box = standard_layer(seed, 16, 4, positions="all", causal=True)
                oracle = Oracle(box, 16, causal=False, max_length=48)
            else:
                oracle = Oracle(make(standard_layer(seed, 16, 4)), 16, outputs="last")
            try:
                extract_vector_layer(oracle, seed=seed)
            except (ModelMismatchError, RecoveryFailedError):
                refused += 1
        rows.append({"name": name, "seeds": seeds, "refused": refused})
    return rows


def run_float32(seeds: int) -> dict:
    errors, bars, queries, cpu, refused, within, held = [], [], [], [], [], 0, []
    for seed in range(seeds):
        box, truth = torch_layer(seed, 64, 8)
        start = time.process_time()
        try:
            result = extract_vector_layer(Oracle(box, 64, outputs="last"), seed=seed,
                                          output_dtype="float32")
        except (ModelMismatchError, RecoveryFailedError) as exc:
            refused.append(f"{seed} ({type(exc).__name__})")
            continue
        cpu.append(time.process_time() - start)
        e = vector_canonical_errors(result.model, truth)["max"]
        bar = result.report.details["error bar"]
        within += e <= bar
        errors.append(e)
        bars.append(bar)
        queries.append(result.queries)
        held.append(result.report.details["measured rounding"])
    return {"seeds": seeds, "within": within, "refused": refused, "errors": errors,
            "bars": bars, "queries": queries, "cpu": cpu, "rounding": held}


def hidden_head(box: VectorAttention) -> VectorAttention:
    """``box`` with a fifth head writing into head 0's range (ranges not independent)."""
    rng = np.random.default_rng(100)
    d = box.dim
    R0 = np.linalg.svd(box.O[0])[0][:, : np.linalg.matrix_rank(box.O[0])]
    extra_O = R0 @ rng.standard_normal((R0.shape[1], d)) / 4
    return VectorAttention(np.concatenate([box.W, rng.standard_normal((1, d, d)) / 4]),
                           np.concatenate([box.O, extra_O[None]]),
                           np.concatenate([box.b, np.zeros((1, d))]), box.c)


def run_minilm_every(layer: int, causal: bool) -> dict:
    """A MiniLM layer answering at every position (the same numpy truth)."""
    last = minilm_vector_layer(layer)
    box = VectorAttention(last.W, last.O, last.b, last.c, positions="all", causal=causal)
    oracle = Oracle(box, box.dim, causal=causal, max_length=MAX_LENGTH)
    cpu = time.process_time()
    result = extract_vector_layer_positions(oracle, seed=0)
    cpu = time.process_time() - cpu
    report = result.report
    return {"layer": layer, "causal": causal, "queries": result.queries,
            "recovery": report.breakdown["recovery"], "floor": report.floor,
            "errors": vector_canonical_errors(result.model, box), "cpu": cpu,
            "bar": report.details["error bar"], "heads": report.details["heads found"],
            "check": report.verification.max_relative_error, "numbers": oracle.numbers,
            "tokens": oracle.tokens, "breakdown": report.breakdown}


EVERY_GRID = [(16, 4), (32, 4), (32, 8), (48, 6), (64, 4), (64, 8), (96, 8)]


def run_grid_every(seeds: int) -> list[dict]:
    rows = []
    for d, H in EVERY_GRID:
        for causal in (False, True):
            worst, refused, queries = 0.0, 0, []
            for seed in range(seeds):
                box = standard_layer(seed, d, H, biases=seed % 2 == 0, positions="all",
                                     causal=causal)
                try:
                    result = extract_vector_layer_positions(
                        Oracle(box, d, causal=causal, max_length=MAX_LENGTH), seed=seed)
                except (ModelMismatchError, RecoveryFailedError):
                    refused += 1
                    continue
                worst = max(worst, vector_canonical_errors(result.model, box)["max"])
                queries.append(result.report.breakdown["recovery"])
            rows.append({"d": d, "H": H, "causal": causal, "seeds": seeds, "worst": worst,
                         "refused": refused, "queries": (min(queries), max(queries))
                         if queries else (0, 0)})
    return rows


def run_impostors_every(seeds: int) -> list[dict]:
    zoo = {"causal box told bidirectional": ("mask", True),
           "bidirectional box told causal": ("mask", False),
           "position term on the answers (1e-3)": ("output", 1e-3),
           "positional encoding on the tokens (1e-2)": ("input", 1e-2)}
    rows = []
    for d in (16, 32):
        for name, (kind, arg) in zoo.items():
            refused = 0
            for seed in range(seeds):
                if kind == "mask":
                    box = standard_layer(seed, d, 4, positions="all", causal=arg)
                    oracle = Oracle(box, d, causal=not arg, max_length=MAX_LENGTH)
                else:
                    box = PositionTerm(standard_layer(seed, d, 4, positions="all"), kind,
                                       arg, seed)
                    oracle = Oracle(box, d, causal=False, max_length=MAX_LENGTH)
                try:
                    extract_vector_layer_positions(oracle, seed=seed)
                except (ModelMismatchError, RecoveryFailedError):
                    refused += 1
            rows.append({"name": name, "d": d, "seeds": seeds, "refused": refused})
    return rows


def render_every(minilm, grid, impostors) -> list[str]:
    out = ["", "## Every position: all-MiniLM-L6-v2 layers answering (B, N, 384)", "",
           ("| layer | mask | queries (recovery + check) | W err | b err | O err | c err | "
            "error bar | held-out | numbers | tokens | CPU s |"),
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in minilm:
        e = r["errors"]
        out.append(f"| {r['layer']} | {'causal' if r['causal'] else 'bidirectional'} | "
                   f"{r['queries']} ({r['recovery']} + {r['queries'] - r['recovery']}) | "
                   f"{e['W']:.1e} | {e['b']:.1e} | {e['O']:.1e} | {e['c']:.1e} | "
                   f"{r['bar']:.1e} | {r['check']:.1e} | {r['numbers']:,} | "
                   f"{r['tokens']:,} | {r['cpu']:.1f} |")
    if minilm:
        out += ["", f"Breakdown (layer {minilm[0]['layer']}): {minilm[0]['breakdown']}"]
    if grid:
        out += ["", (f"## Every position: random standard layers (r_h = d / H, biases on "
                     f"even seeds), {grid[0]['seeds']} seeds each"), "",
                "| d | H | mask | worst canonical error | refused | recovery queries |",
                "|---|---|---|---|---|---|"]
        out += [f"| {r['d']} | {r['H']} | {'causal' if r['causal'] else 'bidirectional'} | "
                f"{r['worst']:.1e} | {r['refused']} / {r['seeds']} | {r['queries'][0]} .. "
                f"{r['queries'][1]} |" for r in grid]
    if impostors:
        out += ["", "## Every position: impostors (H = 4)", "",
                "| impostor | d | refused |", "|---|---|---|"]
        out += [f"| {r['name']} | {r['d']} | {r['refused']} / {r['seeds']} |"
                for r in impostors]
    return out


def render(args, minilm, grid, impostors, f32, every=()) -> str:
    header = ("| layer | queries (recovery + check) | floor | x floor | heads | W err | b err | "
              "O err | c err | error bar | held-out | numbers | tokens | CPU s |")
    out = ["vector-layer: a standard attention layer from vector answers."]
    if minilm:
        out += ["", ("## all-MiniLM-L6-v2 attention layers, biases kept, last-position "
                     "vectors (m = 384)"), "", header,
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in minilm:
        e = r["errors"]
        out.append(f"| {r['layer']} | {r['queries']} ({r['recovery']} + "
                   f"{r['queries'] - r['recovery']}) | {r['floor']} | "
                   f"{r['queries'] / r['floor']:.2f} | {r['heads']} | {e['W']:.1e} | "
                   f"{e['b']:.1e} | {e['O']:.1e} | {e['c']:.1e} | {r['bar']:.1e} | "
                   f"{r['check']:.1e} | {r['numbers']:,} | {r['tokens']:,} | {r['cpu']:.1f} |")
    if minilm:
        out += ["", f"Breakdown (layer {minilm[0]['layer']}): {minilm[0]['breakdown']}"]
    if grid:
        out += ["", f"## Random standard layers (r_h = d / H), {args.seeds} seeds each", "",
                "| d | H | biases | worst canonical error | refused | queries / floor |",
                "|---|---|---|---|---|---|"]
    for r in grid:
        out.append(f"| {r['d']} | {r['H']} | {r['biases']} | {r['worst']:.1e} | "
                   f"{r['refused']} / {r['seeds']} | {r['ratio'][0]:.2f} .. "
                   f"{r['ratio'][1]:.2f} |")
    if impostors:
        out += ["", "## Impostors (d = 16, H = 4)", "", "| impostor | refused |",
                "|---|---|"]
    out += [f"| {r['name']} | {r['refused']} / {r['seeds']} |" for r in impostors]
    if f32 and f32["seeds"]:
        e, b = np.array(f32["errors"] or [np.nan]), np.array(f32["bars"] or [np.nan])
        q = f32["queries"] or [0]
        title = ("## torch.nn.MultiheadAttention(64, 8) in float32, default initialisation, "
                 "output_dtype=\"float32\"")
        header = ("| seeds | within bar | refused | median error | worst error | median bar | "
                  "largest bar | queries (with check) | measured rounding | CPU s (median) |")
        row = (f"| {f32['seeds']} | {f32['within']} | {len(f32['refused'])} "
               f"{', '.join(f32['refused'])} | {np.median(e):.1e} | {e.max():.1e} | "
               f"{np.median(b):.1e} | {b.max():.1e} | {min(q)} .. {max(q)} | "
               f"{min(f32['rounding'] or [0]):.1e} .. {max(f32['rounding'] or [0]):.1e} | "
               f"{np.median(f32['cpu'] or [0]):.1f} |")
        out += ["", title, "", header, "|---|---|---|---|---|---|---|---|---|---|", row]
    out += render_every(*every) if every else []
    return "\n".join(out) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="*", default=list(range(6)))
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--float32-seeds", type=int, default=20)
    parser.add_argument("--every", action="store_true",
                        help="also every-position answers (section 5)")
    parser.add_argument("--causal-layers", type=int, nargs="*", default=[],
                        help="MiniLM layers also asked as causal every-position boxes")
    parser.add_argument("--only-every", action="store_true",
                        help="section 5 only (implies --every)")
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    args.every = args.every or args.only_every
    with _results.Run(__file__, args.out) as results:
        results.add(measure(args))


def measure(args) -> str:
    """MiniLM's layers, the random grid, the impostors, float32 and every position;
    returns the tables."""
    minilm = []
    for layer in [] if args.only_every else args.layers:
        minilm.append(run_minilm(layer))
        print(f"layer {layer}: {minilm[-1]['queries']} queries, max error "
              f"{minilm[-1]['errors']['max']:.1e}, {minilm[-1]['cpu']:.1f} s CPU", flush=True)
    grid = [] if args.only_every else run_grid(args.seeds)
    impostors = [] if args.only_every else run_impostors(max(5, args.seeds // 4))
    f32 = None if args.only_every else run_float32(args.float32_seeds)
    every = ()
    if args.every:
        runs = [(layer, False) for layer in args.layers] + \
            [(layer, True) for layer in args.causal_layers]
        every_minilm = []
        for layer, causal in runs:
            every_minilm.append(run_minilm_every(layer, causal))
            r = every_minilm[-1]
            e = r["errors"]
            print(f"every position, layer {layer}{' causal' if causal else ''}: "
                  f"{r['queries']} queries ({r['recovery']} recovery), errors W {e['W']:.1e} "
                  f"b {e['b']:.1e} O {e['O']:.1e} c {e['c']:.1e}, bar {r['bar']:.1e}, "
                  f"held-out {r['check']:.1e}, {r['cpu']:.1f} s CPU; {r['breakdown']}",
                  flush=True)
        every = (every_minilm, run_grid_every(args.seeds),
                 run_impostors_every(max(5, args.seeds // 4)))
    text = render(args, minilm, grid, impostors, f32, every)
    print(text)
    return text


if __name__ == "__main__":
    main()
