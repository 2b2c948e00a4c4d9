"""``attnextract bench``: every learner's cost and accuracy, the floors, and the baseline.

One run writes into ``--out-dir DIR``:

- ``bench.json``: every measured row (labelled by learner; the baseline rows say
  ``"surrogate"``);
- ``bench.md``: the Markdown tables;
- plots, PNG and SVG side by side (with matplotlib installed): queries vs d
  (log-log, with the floors and the papers' counts, fitted slopes in the legend),
  parameter and output error vs d, wall time split between the black box and the
  learner, and the surrogate comparison. A learner has one colour in every plot
  (:data:`PALETTE`); legends sit outside the data.

Learners run through :func:`attnextract.registry.extract`, the same entry point as
the CLI and the API.

Sections are small functions registered in ``SECTIONS``; each learner that has
landed adds one. ``--quick`` runs small sizes (under two minutes on 2 cores).
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import numpy as np

from .errors import InputError
from .oracle import Oracle
from .registry import LEARNERS, extract
from .learners.surrogate import train_surrogate
from .adapters.targets import random_single_head, random_vector_attention


def _rel(a, b) -> float:
    nb = float(np.linalg.norm(b))
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / nb) if nb > 0 else float("nan")


def fitted_slope(xs, ys) -> float:
    """Least-squares slope of log(y) against log(x)."""
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def measure(learner: str, d: int, target, extract, *, floor: int, paper_count, error,
            **extra) -> dict:
    """One scaling row: run ``extract(oracle)`` on ``target`` and time it.

    ``error(model)`` returns the row's error fields (at least ``W_error``; it may
    override ``output_error``, which defaults to the held-out verification error).
    Recovery queries are all queries but the held-out verification.
    """
    oracle = Oracle(target, d)
    start = time.perf_counter()
    result = extract(oracle)
    wall = time.perf_counter() - start
    return {"learner": learner, "d": d, **extra, "queries": result.queries,
            "recovery_queries": result.queries - result.report.breakdown["verification"],
            "floor": floor, "paper_count": paper_count,
            "output_error": result.report.verification.max_relative_error,
            **error(result.model), "wall_s": wall, "black_box_s": oracle.black_box_seconds,
            "learner_s": wall - oracle.black_box_seconds}


def section_single_head(quick: bool, log) -> list[dict]:
    """Exact single head (paper 1, Theorem 4.1): d^2 + d queries."""
    rows = []
    for d in ([4, 8, 16, 32, 64] if quick else [4, 8, 16, 32, 64, 128, 256, 512]):
        target = random_single_head(d, seed=d)
        rows.append(measure("single-head", d, target,
                            lambda oracle: extract(oracle, "single-head", seed=d),
                            floor=d * d + d, paper_count=d * d + d,
                            error=lambda model: {"W_error": _rel(model.W, target.W),
                                                 "v_error": _rel(model.v, target.v)}))
        log(f"single-head d={d}: {rows[-1]['recovery_queries']} queries, "
            f"W error {rows[-1]['W_error']:.1e}")
    return rows


def section_surrogate(quick: bool, log) -> list[dict]:
    """The baseline: L-BFGS fit of a single head on random query/answer pairs."""
    rows = []
    d = 8 if quick else 64
    multipliers = [1, 10] if quick else [1, 3, 10]
    target = random_single_head(d, seed=d)
    exact_oracle = Oracle(target, d)
    exact = extract(exact_oracle, "single-head", seed=1)
    rows.append({"learner": "single-head", "label": "attnextract", "d": d,
                 "queries": exact.queries, "W_error": _rel(exact.model.W, target.W),
                 "output_error": exact.report.verification.max_relative_error,
                 "wall_s": exact.report.seconds})
    for mult in multipliers:
        oracle = Oracle(target, d)
        budget = mult * exact.queries
        result = train_surrogate(oracle, budget, seed=mult, max_iter=500 if quick else 1500)
        rows.append({"learner": "surrogate", "label": f"surrogate {mult}x", "d": d,
                     "queries": result.queries, "training_queries": budget,
                     "W_error": _rel(result.model.W, target.W),
                     "output_error": result.report.verification.max_relative_error,
                     "wall_s": result.report.seconds,
                     "iterations": result.report.details["iterations"]})
        log(f"surrogate d={d} {mult}x: W error {rows[-1]['W_error']:.1e}, "
            f"output error {rows[-1]['output_error']:.1e}")
    return rows


def section_one_layer(quick: bool, log) -> list[dict]:
    """One-layer Transformer end to end (paper 1 reduction + the ReLU FFN learner), m = d."""
    from .learners.one_layer import compare_one_layer, random_one_layer
    rows = []
    for d in ([4, 8, 16] if quick else [4, 8, 16, 32, 64]):
        target = random_one_layer(d, d, seed=d)

        def errors(model):
            cmp = compare_one_layer(model, target, seed=d)
            return {"W_error": cmp["relative_error_W"], "bits": cmp["bits"],
                    "output_error": cmp["max_output_error"]}
        rows.append(measure("one-layer", d, target,
                            lambda oracle: extract(oracle, "one-layer", seed=d),
                            floor=d * d + d * d, paper_count=None, m=d, error=errors))
        log(f"one-layer d=m={d}: {rows[-1]['recovery_queries']} queries, "
            f"{rows[-1]['bits']:.1f} bits")
    return rows


def section_low_rank(quick: bool, log) -> list[dict]:
    """Rank-r heads, r = d/8: the adaptive learner (floor d + r(2d - r)) and paper 1's ROP."""
    from .learners.low_rank import low_rank_floor
    from .adapters.targets import random_low_rank_head
    rows = []
    for method in ("adaptive", "rop"):
        for d in ([16, 32, 64] if quick else [16, 32, 64, 128, 256, 512]):
            r = max(1, d // 8)
            target = random_low_rank_head(d, r, seed=d)
            rows.append(measure(
                f"low-rank {method}", d, target,
                lambda oracle: extract(oracle, "low-rank", rank=r if method == "rop" else None,
                                       method=method, seed=d),
                floor=low_rank_floor(d, r), rank=r,
                paper_count=d + int(np.ceil(2 * r * 2 * d)) if method == "rop" else None,
                error=lambda model: {"W_error": _rel(model.W, target.W)}))
            spent = rows[-1]["recovery_queries"]
            log(f"low-rank {method} d={d} r={r}: {spent} queries (floor "
                f"{rows[-1]['floor']}), W error {rows[-1]['W_error']:.1e}")
    return rows


def section_multi_head(quick: bool, log) -> list[dict]:
    """Canonical multi-head recovery (copy probes at designed steps), H = 2 and 4 heads.

    The full grid (H <= 8, d in {8, 16, 32}, 20 seeds) is benchmarks/bench_multi_head.py.
    """
    from .learners.multi_head import canonical_error
    from .adapters.targets import random_multi_head
    rows = []
    for H, d in ([(2, 8), (2, 16)] if quick else [(2, 8), (2, 16), (2, 32), (4, 16), (4, 32)]):
        target = random_multi_head(H, d, seed=d)
        rows.append(measure(f"multi-head (H = {H})", d, target,
                            lambda oracle: extract(oracle, "multi-head", heads=H, seed=d),
                            floor=H * (d * d + d), paper_count=4 * H * d * d - 2 * H + 1,
                            heads=H,
                            error=lambda model: {"W_error": canonical_error(model, target)}))
        spent = rows[-1]["recovery_queries"]
        log(f"multi-head H={H} d={d}: {spent} queries (the multi-head paper's count: "
            f"{rows[-1]['paper_count']}), "
            f"canonical error {rows[-1]['W_error']:.1e}")
    return rows


def _grid_module():
    """benchmarks/multi_head_grid.py of the source checkout: the grid is a benchmark,
    not part of the library, so this section needs the repository."""
    import importlib.util
    import sys
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "multi_head_grid.py"
    if not path.exists():
        raise InputError("the multi-head-grid section runs benchmarks/multi_head_grid.py "
                         "of a source checkout, which this installation does not have")
    if "multi_head_grid" not in sys.modules:
        spec = importlib.util.spec_from_file_location("multi_head_grid", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["multi_head_grid"] = module
        spec.loader.exec_module(module)
    return sys.modules["multi_head_grid"]


def section_multi_head_grid(quick: bool, log) -> list[dict]:
    """Issue 12's grid at a few seeds per cell: full-rank heads H = 1..8 at d = 8 and 16
    (and H = 4, 8 at d = 32), low-rank layers (d, H, r) = (64, 8, 8) and (96, 12, 8)."""
    grid_cell = _grid_module().grid_cell
    cells = ([(H, 8, 1, None) for H in (2, 4)] if quick else
             [(H, d, 3, None) for d in (8, 16) for H in range(1, 9)]
             + [(4, 32, 1, None), (8, 32, 1, None), (8, 64, 1, 8), (12, 96, 1, 8)])
    rows = []
    for H, d, seeds, rank in cells:
        rows.append({"learner": "grid (multi-head)", "grid": True,
                     **grid_cell(H, d, seeds, rank=rank)})
        r = rows[-1]
        log(f"multi-head grid H={H} d={d} r={rank or 'full'}: success {r['success_rate']:.0%}"
            f" of {seeds}, median queries {r['recovery_median']} (floor {r['floor']}, "
            f"the multi-head paper's count {r['paper2']}), median error {r['error_median']}")
    return rows


def section_noisy(quick: bool, log) -> list[dict]:
    """Error vs noise tolerance tau: the robust default and paper 1's Theorem 6.1, equal queries."""
    from .oracle import BoundedNoise
    rows = []
    d = 16
    target = random_single_head(d, seed=3)
    B = float(np.linalg.norm(target.W))
    for tau in ([1e-8, 1e-6, 1e-4] if quick else [1e-10, 1e-8, 1e-6, 1e-5, 1e-4, 1e-3]):
        for method in ("robust", "paper"):
            oracle = Oracle(BoundedNoise(target, tau, "sign", seed=1), d)
            result = extract(oracle, "single-head", tolerance=tau, method=method, norm_bound=B,
                             seed=1)
            rows.append({"learner": f"noisy ({method})", "d": d, "tau": tau,
                         "queries": result.queries,
                         "W_abs_error": float(np.linalg.norm(result.model.W - target.W)),
                         "error_bar_W": float(result.report.details["error_bar_W"])})
            log(f"noisy {method} tau={tau:.0e}: |W_hat - W|_F = {rows[-1]['W_abs_error']:.1e} "
                f"(bar {rows[-1]['error_bar_W']:.1e})")
    return rows


SECTIONS = {"single-head": section_single_head, "low-rank": section_low_rank,
            "one-layer": section_one_layer, "multi-head": section_multi_head,
            "multi-head-grid": section_multi_head_grid,
            "noisy": section_noisy, "surrogate": section_surrogate}


def transformer_layer_variants(quick: bool) -> list[tuple[str, int, int, dict]]:
    """(label, d, m, random_transformer_layer options) of the Transformer-layer rows."""
    d, m = (8, 8) if quick else (16, 32)
    big = 16 if quick else 32
    return [("bias-free", d, m, {}),
            ("biases N(0,1), c0", big, big, {"bias_scale": 1.0, "c0": 0.5}),
            ("biases 1e-6", big, big, {"bias_scale": 1e-6, "c0": 0.5}),
            ("residual + biases", d, m, {"bias_scale": 1.0, "c0": 0.5, "residual": True}),
            ("bias-free, H = 3", d, m, {"heads": 3}),
            ("biases N(0,1), c0, H = 3", d, m, {"heads": 3, "bias_scale": 1.0, "c0": 0.5}),
            ("residual + biases, H = 2", d, m, {"heads": 2, "bias_scale": 1.0, "c0": 0.5,
                                                "residual": True})]


def section_transformer_layer(quick: bool, log) -> list[dict]:
    """Attention + ReLU FFN with biases (issue 14): queries vs the floor, bits, time."""
    from .learners.transformer_layer import (compare_transformer_layer, extract_transformer_layer,
                                             free_parameters, random_transformer_layer)
    rows = []
    for label, d, m, options in transformer_layer_variants(quick):
        target = random_transformer_layer(d, m, seed=d + m, **options)

        def errors(model):
            cmp = compare_transformer_layer(model, target, seed=d)
            return {"W_error": cmp["error_W"], "bits": cmp["bits"],
                    "output_error": cmp["max_output_error"]}
        rows.append(measure(f"transformer-layer ({label})", d, target,
                            lambda oracle: extract_transformer_layer(
                                oracle, heads=options.get("heads", 1), seed=d),
                            floor=free_parameters(target), paper_count=None, m=m,
                            heads=options.get("heads", 1), error=errors))
        log(f"transformer-layer {label} d={d} m={m}: {rows[-1]['recovery_queries']} queries "
            f"(floor {rows[-1]['floor']}), {rows[-1]['bits']:.1f} bits")
    return rows


SECTIONS["transformer-layer"] = section_transformer_layer


def section_biases(quick: bool, log) -> list[dict]:
    """Biased rows (query, value and output biases, as deployed layers have; --biases):
    the single head at d^2 + 2d + 1, the low-rank head at d + r(2d - r) + r + 1,
    low-rank heads at sum_h (d + r_h (2d - r_h) + r_h) + 1 and full-rank heads against
    H(d^2 + 2d) + 1. ``W_error`` is the largest of
    the W, b and v errors (b measured against |W| where b is 0)."""
    from .adapters.targets import (random_low_rank_head, random_low_rank_multi_head,
                                   random_multi_head, with_biases)
    from .learners.low_rank import low_rank_floor
    from .learners.multi_head import biased_count

    def errors(target):
        def run(model):
            W = np.reshape(model.W, (-1,) + model.W.shape[-2:])
            true_W = np.reshape(target.W, W.shape)
            order = [int(np.argmin([np.linalg.norm(W[g] - t) for g in range(len(W))]))
                     for t in true_W]
            b, v = np.reshape(model.b, (len(W), -1)), np.reshape(model.v, (len(W), -1))
            tb, tv = np.reshape(target.b, b.shape), np.reshape(target.v, v.shape)
            parts = [(_rel(W[o], true_W[h]), _rel(v[o], tv[h]),
                      float(np.linalg.norm(b[o] - tb[h]) / max(np.linalg.norm(tb[h]),
                                                               np.linalg.norm(true_W[h]))))
                     for h, o in enumerate(order)]
            return {"W_error": max(max(p) for p in parts),
                    "b_error": max(p[2] for p in parts),
                    "c_error": abs(model.c - target.c) / max(abs(target.c), 1e-300)}
        return run

    rows = []
    for d in ([8, 16, 32] if quick else [8, 16, 32, 64, 128, 256]):
        target = with_biases(random_single_head(d, seed=d), d)
        rows.append(measure("single-head (biases)", d, target,
                            lambda oracle: extract(oracle, "single-head", biases=True, seed=d),
                            floor=d * d + 2 * d + 1, paper_count=None, error=errors(target)))
        log(f"single-head --biases d={d}: {rows[-1]['recovery_queries']} queries, "
            f"error {rows[-1]['W_error']:.1e}")
    for d in ([16, 32] if quick else [16, 32, 64, 128, 256]):
        r = max(1, d // 8)
        target = with_biases(random_low_rank_head(d, r, seed=d), d)
        rows.append(measure("low-rank adaptive (biases)", d, target,
                            lambda oracle: extract(oracle, "low-rank", biases=True, seed=d),
                            floor=low_rank_floor(d, r) + r + 1, paper_count=None, rank=r,
                            error=errors(target)))
        log(f"low-rank --biases d={d} r={r}: {rows[-1]['recovery_queries']} queries "
            f"(floor {rows[-1]['floor']}), error {rows[-1]['W_error']:.1e}")
    for H, d in ([(2, 16), (4, 32)] if quick else [(2, 16), (4, 32), (4, 64), (8, 64)]):
        r = max(1, d // (2 * H))
        target = with_biases(random_low_rank_multi_head(H, d, r, seed=d), d)
        rows.append(measure(f"multi-head low-rank (biases, H = {H})", d, target,
                            lambda oracle: extract(oracle, "multi-head-low-rank", heads=H,
                                                   rank=r, biases=True, seed=d),
                            floor=H * (d + r * (2 * d - r) + r) + 1,
                            paper_count=4 * H * d * d - 2 * H + 1, heads=H, rank=r,
                            error=errors(target)))
        log(f"multi-head-low-rank --biases H={H} d={d} r={r}: "
            f"{rows[-1]['recovery_queries']} queries (floor {rows[-1]['floor']}), "
            f"error {rows[-1]['W_error']:.1e}")
    for H, d in ([(2, 8), (4, 16)] if quick else [(2, 8), (4, 8), (8, 8), (2, 16), (4, 16),
                                                  (8, 16)]):
        target = with_biases(random_multi_head(H, d, seed=d), d)
        rows.append(measure(f"multi-head (biases, H = {H})", d, target,
                            lambda oracle: extract(oracle, "multi-head", heads=H, biases=True,
                                                   seed=d),
                            floor=H * (d * d + 2 * d) + 1,
                            # paper 2's count + (H + 1) d + 1: the learner's own cap
                            paper_count=biased_count(H, d), heads=H,
                            error=errors(target)))
        log(f"multi-head --biases H={H} d={d}: {rows[-1]['recovery_queries']} queries "
            f"(floor {rows[-1]['floor']}), error {rows[-1]['W_error']:.1e}")
    return rows


SECTIONS["biases"] = section_biases


def section_pre_ln(quick: bool, log) -> list[dict]:
    """Pre-LayerNorm blocks (GPT-2 style, every bias) on the sphere where LayerNorm is
    affine (--model pre-ln [--heads H]): what is identified there, P W_h P, P b_h, P v_h
    (heads matched), P r and c, against H (m^2 + 2m) + m + 1 (m = d - 1; d^2 + d - 1
    for one head). ``W_error`` is the largest of those relative errors."""
    import itertools
    from .adapters.targets import random_pre_layer_norm

    def errors(target):
        truth = target.on_sphere(np.sqrt(target.dim))

        def run(model):
            if model.heads != truth.heads:
                return {"W_error": float("inf")}
            best = min((max(_rel(model.W[list(p)], truth.W), _rel(model.b[list(p)], truth.b),
                            _rel(model.v[list(p)], truth.v))
                        for p in itertools.permutations(range(truth.heads))))
            return {"W_error": max(best, _rel(model.r, truth.r)),
                    "c_error": abs(model.c - truth.c) / max(abs(truth.c),
                                                           float(np.linalg.norm(truth.v)))}
        return run

    rows = []
    cells = ([(1, 8), (1, 16), (2, 8), (4, 16)] if quick else
             [(1, 8), (1, 16), (1, 32), (1, 64), (2, 8), (2, 16), (4, 8), (4, 16)])
    for H, d in cells:
        target = random_pre_layer_norm(H, d, seed=d)
        m = d - 1
        rows.append(measure("pre-ln" if H == 1 else f"pre-ln (H = {H})", d, target,
                            lambda oracle: extract(oracle, "pre-ln", heads=H, seed=d),
                            floor=H * (m * m + 2 * m) + m + 1, paper_count=None, heads=H,
                            error=errors(target)))
        log(f"pre-ln H={H} d={d}: {rows[-1]['recovery_queries']} queries "
            f"(identified {rows[-1]['floor']}), error {rows[-1]['W_error']:.1e}")
    return rows


SECTIONS["pre-ln"] = section_pre_ln


# The scalar learner and its vector twin, on the same boxes: the vector learner asks the
# layer's output vector, the scalar one its readout r^T F (what one number per sequence
# shows). (label, scalar learner and options, vector learner, heads, biases, sizes).
VECTOR_CASES = (("single head, biases", "single-head", {"biases": True}, "vector-single-head",
                 1, True, ([8, 16], [8, 16, 32, 64])),
                ("full-rank multi-head", "multi-head", {}, "vector-multi-head", 4, False,
                 ([8], [8, 16])))


def _readout_box(truth, r):
    """The scalar box r^T F of a VectorAttention at the last position, as the scalar
    model class it is (a biased single head, or H bias-free heads)."""
    from .models import BiasedSingleHeadAttention, MultiHeadAttention
    v = truth.O.transpose(0, 2, 1) @ r                                   # (H, d)
    if truth.heads == 1 and (truth.b.any() or truth.c.any()):
        return BiasedSingleHeadAttention(truth.W[0], v[0], truth.b[0], float(truth.c @ r))
    return MultiHeadAttention(truth.W, v)


def _vector_row(label: str, d: int, heads: int, target, learner: str, options: dict,
                error, parameters: int, per_query: int) -> dict:
    """One row of the scalar/vector comparison: queries, numbers received, floor in
    queries (parameters / numbers per query), canonical error."""
    oracle = Oracle(target, d)
    start = time.perf_counter()
    result = extract(oracle, learner, seed=d, **options)
    wall = time.perf_counter() - start
    return {"vector_compare": label, "learner": learner, "d": d, "heads": heads,
            "queries": result.queries, "numbers": oracle.numbers, "tokens": oracle.tokens,
            "floor_queries": -(-parameters // per_query),
            "canonical_error": error(result.model),
            "output_error": result.report.verification.max_relative_error, "wall_s": wall}


def _scalar_error(truth, model) -> float:
    """A scalar learner's error: canonical (heads matched) for several heads, else the
    largest relative error of W, v and b."""
    from .learners.multi_head import canonical_error
    if getattr(truth, "heads", 1) > 1:
        return canonical_error(model, truth)
    return max(_rel(model.W, truth.W), _rel(model.v, truth.v), _rel(model.b, truth.b))


def _vector_error(truth, model) -> float:
    """A vector learner's canonical error (heads matched): the largest of W, b, O, c."""
    from .learners.vector_canonical import vector_canonical_errors
    return vector_canonical_errors(model, truth)["max"]


def section_vector(quick: bool, log) -> list[dict]:
    """Scalar and vector learners on the same boxes: a VectorAttention answering its
    output at the last position (m = d), and its readout r^T F for the scalar learner.
    Runs when the vector learners are registered; skipped with a message otherwise."""
    missing = sorted({case[3] for case in VECTOR_CASES} - set(LEARNERS))
    if missing:
        message = (f"skipped: the vector learners {', '.join(missing)} are not registered "
                   f"in this version")
        log(f"vector vs scalar: {message}")
        return [{"vector_skipped": message}]
    rows = []
    for label, scalar, options, vector, H, biases, sizes in VECTOR_CASES:
        for d in sizes[0] if quick else sizes[1]:
            truth = random_vector_attention(H, d, d, seed=d, biases=biases)
            r = np.random.default_rng(d).standard_normal(d)
            box = _readout_box(truth, r / np.linalg.norm(r))
            # free parameters: W, O (m x d) and, with biases, b and c, per head
            parameters = H * (d * d + d * d + (d if biases else 0)) + (d if biases else 0)
            scalar_parameters = H * (d * d + d + (d if biases else 0)) + int(biases)
            rows.append(_vector_row(label, d, H, box, scalar,
                                    {"heads": H} if H > 1 else options,
                                    functools.partial(_scalar_error, box),
                                    scalar_parameters, 1))
            rows.append(_vector_row(label, d, H, truth, vector, {},
                                    functools.partial(_vector_error, truth), parameters, d))
            log(f"vector vs scalar, {label} d={d}: {rows[-2]['queries']} scalar queries, "
                f"{rows[-1]['queries']} vector queries ({rows[-1]['numbers']} numbers), "
                f"error {rows[-1]['canonical_error']:.1e}")
    return rows


SECTIONS["vector"] = section_vector


def markdown(rows: list[dict]) -> str:
    """Markdown tables: one per learner (by d), then the surrogate comparison."""
    out = []
    scaling = [r for r in rows if "floor" in r and not r.get("grid")]
    if scaling:
        out += ["| learner | d | queries (recovery) | floor | paper | W error | output error "
                "| wall s | black box s | learner s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in scaling:
            paper = "-" if r["paper_count"] is None else r["paper_count"]
            out.append(f"| {r['learner']} | {r['d']} | {r['recovery_queries']} | {r['floor']} | "
                       f"{paper} | {r['W_error']:.1e} | {r['output_error']:.1e} | "
                       f"{r['wall_s']:.3f} | {r['black_box_s']:.3f} | {r['learner_s']:.3f} |")
        out.append("\npaper: d^2 + d (the single-head paper, Thm 4.1); d + C r 2d with the "
                   "measured C = 2 (the single-head paper, Thm 5.1 states no C); 4Hd^2 - 2H + 1 "
                   "(the multi-head paper; with biases "
                   "4Hd^2 - 2H + 1 + (H + 1) d + 1, its count plus c and H + 1 per "
                   "short-probe row); - where no count is stated. floor: free parameters.")
        for learner in dict.fromkeys(r["learner"] for r in scaling):
            sub = [r for r in scaling if r["learner"] == learner]
            if len(sub) >= 2:
                out.append(f"\nFitted slope of log(queries) vs log(d), {learner}: "
                           f"{fitted_slope([r['d'] for r in sub], [r['recovery_queries'] for r in sub]):.3f}")
    grid = [r for r in rows if r.get("grid")]
    if grid:
        grid_markdown = _grid_module().grid_markdown
        out += ["", "Multi-head grid (success: canonical error <= 1e-10 for full-rank heads, "
                "<= 1e-8 for low-rank; benchmarks/bench_multi_head.py runs 20 seeds per cell):",
                "", grid_markdown(grid)]
    layer = [r for r in rows if r.get("learner", "").startswith("transformer-layer")]
    if layer:
        out += ["", "Transformer layer (attention + ReLU FFN with biases): bits = -log2 of the "
                "largest canonical parameter error (Carlini et al. 2020 report 2^-25 for ReLU "
                "networks):", "", "| model | d | m | H | queries (recovery) | floor | ratio | bits "
                "| output error | wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in layer:
            out.append(f"| {r['learner'][len('transformer-layer '):]} | {r['d']} | {r['m']} | "
                       f"{r['heads']} | {r['recovery_queries']} | {r['floor']} | "
                       f"{r['recovery_queries'] / r['floor']:.2f} | {r['bits']:.1f} | "
                       f"{r['output_error']:.1e} | {r['wall_s']:.2f} |")
    noisy = [r for r in rows if "tau" in r]
    if noisy:
        out += ["", f"Noisy outputs, |eta| <= tau (random signs), d = {noisy[0]['d']}, equal "
                "queries:", "", "| method | tau | queries | ‖W_hat − W‖_F | error bar |",
                "|---|---|---|---|---|"]
        for r in noisy:
            out.append(f"| {r['learner']} | {r['tau']:.0e} | {r['queries']} | "
                       f"{r['W_abs_error']:.1e} | {r['error_bar_W']:.1e} |")
    out += _vector_markdown(rows)
    compare = [r for r in rows if "label" in r]
    if compare:
        out += ["", f"Exact extraction vs the surrogate baseline (d = {compare[0]['d']}):", "",
                "| method | queries | W error | held-out output error | wall s |",
                "|---|---|---|---|---|"]
        for r in compare:
            out.append(f"| {r['label']} | {r['queries']} | {r['W_error']:.1e} | "
                       f"{r['output_error']:.1e} | {r['wall_s']:.2f} |")
        reached = [r for r in compare if r["learner"] == "surrogate" and r["output_error"] <= 1e-3]
        out.append("")
        out.append(f"Surrogate reaches 1e-3 held-out output error with {reached[0]['queries']} "
                   "queries." if reached else "Surrogate does not reach 1e-3 held-out output "
                   f"error with up to {max(r['queries'] for r in compare)} queries.")
    return "\n".join(out) + "\n"


def _vector_markdown(rows: list[dict]) -> list[str]:
    """The scalar/vector comparison table (or the reason it was skipped)."""
    skipped = [r["vector_skipped"] for r in rows if "vector_skipped" in r]
    vector = [r for r in rows if "vector_compare" in r]
    if skipped:
        return ["", f"Scalar and vector learners on the same boxes: {skipped[0]}."]
    if not vector:
        return []
    out = ["", ("Scalar and vector learners on the same boxes (the vector learner reads the "
                "output at the last position, m = d; the scalar one its readout r^T F): "
                "floor = free parameters / numbers per query."), "",
           ("| box | learner | d | queries | numbers received | tokens sent | floor (queries) "
            "| canonical error | output error | wall s |"),
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in vector:
        out.append(f"| {r['vector_compare']} | {r['learner']} | {r['d']} | {r['queries']} | "
                   f"{r['numbers']} | {r['tokens']} | {r['floor_queries']} | "
                   f"{r['canonical_error']:.1e} | {r['output_error']:.1e} | {r['wall_s']:.2f} |")
    return out


# one colour per learner in every plot (a label's longest matching prefix picks it);
# a learner added later registers its colour here
PALETTE = {"single-head": "#1f77b4", "low-rank adaptive": "#ff7f0e", "low-rank rop": "#d62728",
           "low-rank": "#ff7f0e", "one-layer": "#2ca02c", "multi-head": "#9467bd",
           "noisy (robust)": "#8c564b", "noisy (paper)": "#e377c2", "noisy": "#8c564b",
           "surrogate": "#7f7f7f", "transformer-layer": "#bcbd22",
           "multi-head low-rank": "#17becf", "floor": "#000000"}
_SPARE = ["#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d"]
# matplotlib's tab20 and tab20b: colours for series beyond the palette's
_DISTINCT = ["#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728",
             "#ff9896", "#9467bd", "#c5b0d5", "#8c564b", "#c49c94", "#e377c2", "#f7b6d2",
             "#7f7f7f", "#c7c7c7", "#bcbd22", "#dbdb8d", "#17becf", "#9edae5", "#393b79",
             "#637939", "#8c6d31", "#843c39", "#7b4173", "#5254a3", "#8ca252", "#bd9e39",
             "#ad494a", "#a55194"]


def colour(learner: str) -> str:
    """The learner's colour in every plot (a stable spare colour for an unknown learner)."""
    matches = [k for k in PALETTE if learner == k or learner.startswith(k + " ")
               or learner.startswith(k + " (")]
    if matches:
        return PALETTE[max(matches, key=len)]
    return _SPARE[sum(map(ord, learner)) % len(_SPARE)]


def _log_axes(ax, x_base: int = 10) -> None:
    """Log-log axes with plain tick labels (4, 8, 16 / 10, 100, 1000) and no minor labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    ax.set_xscale("log", base=x_base)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_locator(LogLocator(base=10, numticks=12))
    ax.yaxis.set_minor_formatter(NullFormatter())


def series_colours(names) -> dict[str, str]:
    """One colour per series: the learner's own (:func:`colour`) unless an earlier series
    took it (variants of one learner, e.g. seven transformer-layer models), then the next
    unused one of a 20-colour qualitative palette."""
    spare = [c for c in _DISTINCT if c not in PALETTE.values()]
    taken, out = set(), {}
    for name in dict.fromkeys(names):
        wanted = colour(name)
        if wanted in taken:
            wanted = next((c for c in spare if c not in taken), wanted)
        taken.add(wanted)
        out[name] = wanted
    return out


def _legend_outside(ax, extra=()) -> None:
    """The legend right of the axes; the figure grows taller when it would not fit."""
    handles, labels = ax.get_legend_handles_labels()
    handles, labels = handles + [h for h, _ in extra], labels + [t for _, t in extra]
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0),
              borderaxespad=0.0, fontsize=7, frameon=False)
    fig = ax.figure
    needed = 0.16 * len(labels) + 0.9          # inches: 7-point entries and the margins
    width, height = fig.get_size_inches()
    if needed > height:
        fig.set_size_inches(width, needed)


def _save(fig, out: Path, name: str, written: list[str]) -> None:
    """PNG, SVG and PDF side by side (the legend outside the axes is kept by bbox_inches)."""
    import matplotlib.pyplot as plt
    for suffix, options in ((".png", {"dpi": 110}), (".svg", {}), (".pdf", {})):
        fig.savefig(out / (name + suffix), bbox_inches="tight", **options)
    plt.close(fig)
    written += [name + ".png", name + ".svg", name + ".pdf"]


def plots(rows: list[dict], out: Path) -> list[str]:
    """Write the plots (PNG and SVG); returns their file names ([] without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written: list[str] = []
    scaling = [r for r in rows if "floor" in r and not r.get("grid")]
    learners = list(dict.fromkeys(r["learner"] for r in scaling))
    grid = [r for r in rows if r.get("grid")]
    if grid:
        grid_plot = _grid_module().grid_plot
        written += [Path(f).name for f in grid_plot(grid, out / "multi_head_grid.png")]

    if scaling:
        from matplotlib.lines import Line2D
        colours = series_colours(learners)
        fig, ax = plt.subplots(figsize=(6, 4.5))
        papers = False
        for learner in learners:
            sub = [r for r in scaling if r["learner"] == learner]
            ds, qs = [r["d"] for r in sub], [r["recovery_queries"] for r in sub]
            label = learner + (f" (slope {fitted_slope(ds, qs):.2f})" if len(sub) >= 2 else "")
            ax.plot(ds, qs, "o-", color=colours[learner], label=label)
            if all(r["paper_count"] is not None for r in sub):
                papers = True          # one legend entry for every paper count (dotted)
                ax.plot(ds, [r["paper_count"] for r in sub], ":", color=colours[learner])
        all_d = sorted({r["d"] for r in scaling})
        ax.plot(all_d, [d * d + d for d in all_d], "--", color=PALETTE["floor"],
                label="floor d² + d")
        _log_axes(ax, x_base=2)
        ax.set_xlabel("d"), ax.set_ylabel("queries"), ax.set_title("queries vs d")
        _legend_outside(ax, [(Line2D([], [], ls=":", color="gray"),
                              "dotted: the paper's count (same colour)")] if papers else [])
        _save(fig, out, "queries_vs_d", written)

        fig, ax = plt.subplots(figsize=(6, 4.5))
        for learner in learners:
            sub = [r for r in scaling if r["learner"] == learner]
            ax.plot([r["d"] for r in sub], [max(r["W_error"], 1e-17) for r in sub], "o-",
                    color=colours[learner], label=learner)
            ax.plot([r["d"] for r in sub], [max(r["output_error"], 1e-17) for r in sub], "s--",
                    color=colours[learner], alpha=0.6)
        _log_axes(ax, x_base=2)
        ax.set_xlabel("d"), ax.set_ylabel("relative error"), ax.set_title("error vs d")
        _legend_outside(ax, [(Line2D([], [], marker="o", color="gray"), "solid: parameter error"),
                             (Line2D([], [], marker="s", ls="--", color="gray", alpha=0.6),
                              "dashed: held-out output error")])
        _save(fig, out, "error_vs_d", written)

        fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(scaling) + 2), 4.5))
        x = np.arange(len(scaling))
        black_box = [r["black_box_s"] for r in scaling]
        ax.bar(x, black_box, color="#c7c7c7", label="inside the black box")
        ax.bar(x, [r["learner_s"] for r in scaling], bottom=black_box,
               color=[colours[r["learner"]] for r in scaling], label="learner (its colour)")
        step = max(1, len(scaling) // 24)         # at most ~24 labels, rotated: none overlap
        ax.set_xticks(x[::step], [f"{r['learner']} d={r['d']}" for r in scaling][::step],
                      rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("seconds"), ax.set_title("wall time split")
        _legend_outside(ax)
        _save(fig, out, "time_split", written)

    noisy = [r for r in rows if "tau" in r]
    if noisy:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        noisy_colours = series_colours(r["learner"] for r in noisy)
        for learner in noisy_colours:
            sub = [r for r in noisy if r["learner"] == learner]
            ax.plot([r["tau"] for r in sub], [r["W_abs_error"] for r in sub], "o-",
                    color=noisy_colours[learner], label=f"{learner}: error")
            ax.plot([r["tau"] for r in sub], [r["error_bar_W"] for r in sub], "--",
                    color=noisy_colours[learner], label=f"{learner}: bound / error bar")
        _log_axes(ax)
        ax.xaxis.set_major_formatter(matplotlib.ticker.LogFormatterSciNotation())
        ax.set_xlabel("tau"), ax.set_ylabel("‖W_hat − W‖_F")
        ax.set_title(f"error vs noise tolerance, d = {noisy[0]['d']}")
        _legend_outside(ax)
        _save(fig, out, "error_vs_tau", written)

    compare = [r for r in rows if "label" in r]
    if compare:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for r in compare:
            y = max(r["output_error"], 1e-17)
            ax.plot(r["queries"], y, "*" if r["learner"] != "surrogate" else "o",
                    color=colour(r["learner"]), ms=9)
            ax.annotate(r["label"], (r["queries"], y), xytext=(7, 5),
                        textcoords="offset points", fontsize=7)
        ax.axhline(1e-3, color="gray", ls=":", label="1e-3 output error")
        _log_axes(ax)
        ax.margins(x=0.25)          # room for the labels beside the last markers
        ax.set_xlabel("queries"), ax.set_ylabel("held-out output error")
        ax.set_title(f"exact extraction vs surrogate, d = {compare[0]['d']}")
        _legend_outside(ax)
        _save(fig, out, "surrogate", written)
    return written


def run_bench(out_dir, quick: bool = False, sections=None, log=print,
              command: str | None = None) -> dict:
    """Run the registered sections and write bench.json, bench.md and the plots (PNG, SVG, PDF).

    ``command`` (the command line that ran it) heads bench.md with the date, so every
    table says where its numbers come from.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows = []
    for name in sections or SECTIONS:
        rows += SECTIONS[name](quick, log)
    images = plots(rows, out)
    seconds = time.perf_counter() - start
    date = time.strftime("%Y-%m-%d", time.gmtime())
    table = (provenance(command, date, seconds) + "\n\n" if command else "") + markdown(rows)
    summary = {"quick": quick, "seconds": seconds, "rows": rows, "plots": images,
               "date": date, "command": command}
    (out / "bench.json").write_text(json.dumps(summary, indent=2, default=_json_default))
    (out / "bench.md").write_text(table)
    return summary


def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(type(obj).__name__)


def provenance(command: str, date: str, seconds: float) -> str:
    """The line heading bench.md: when, by which command, how long."""
    return (f"Measured on {date} (UTC) by `{command}` in {seconds:.0f} s "
            "(wall times depend on the machine and its load).")


def readme_summary(bench_md: str) -> str:
    """What the README shows of bench.md: its provenance line and its first table."""
    blocks = bench_md.strip("\n").split("\n\n")
    head = blocks[:1] if blocks[0].startswith("Measured on") else []
    table = next(b for b in blocks if b.startswith("|"))
    note = next((b for b in blocks if b.startswith("paper:")), None)
    return "\n\n".join(head + [table] + ([note] if note else [])) + "\n"


def update_readme(readme, table: str, image: str | None) -> None:
    """Replace the text between the bench markers in the README with the new table."""
    path = Path(readme)
    text = path.read_text()
    begin, end = "<!-- bench:begin -->", "<!-- bench:end -->"
    if begin not in text or end not in text:
        raise ValueError(f"{readme} has no {begin} ... {end} markers")
    body = table + (f"\n![queries vs d]({image})\n" if image else "")
    head, rest = text.split(begin, 1)
    path.write_text(head + begin + "\n" + body + end + rest.split(end, 1)[1])
