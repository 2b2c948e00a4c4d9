"""``attnextract bench``: every learner's cost and accuracy, the floors, and the baseline.

One run writes into ``--out-dir DIR``:

- ``bench.json``: every measured row (labelled by learner; the baseline rows say
  ``"surrogate"``);
- ``bench.md``: the Markdown tables;
- plots, SVG (for the docs), PNG and PDF side by side (with matplotlib installed):
  queries vs d (log-log, one panel per family of learners, with the floors and the
  papers' counts, fitted slopes in the legend), parameter and output error vs d, wall
  time of the learner and of the black box, error vs noise tolerance, the surrogate
  comparison and the multi-head grid. In every axes each series has its own colour and
  marker, and the legend sits outside the data (:mod:`attnextract.plotting`).

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
from typing import Any

import numpy as np

from .adapters.targets import (
    random_low_rank_head,
    random_low_rank_multi_head,
    random_multi_head,
    random_pre_layer_norm,
    random_single_head,
    random_vector_attention,
    with_biases,
)
from .bench_grid import grid_cell, grid_markdown, grid_plot
from .learners.low_rank import low_rank_floor
from .learners.multi_head import biased_count, canonical_error
from .learners.one_layer import compare_one_layer, random_one_layer
from .learners.surrogate import train_surrogate
from .learners.transformer_layer import (
    compare_transformer_layer,
    extract_transformer_layer,
    free_parameters,
    random_transformer_layer,
)
from .learners.vector_canonical import vector_canonical_errors
from .models import BiasedSingleHeadAttention, MultiHeadAttention
from .oracle import BoundedNoise, Oracle
from .plotting import REFERENCE, legend_outside, log_axes, save, series_styles, spans_decades
from .registry import LEARNERS, extract


def _output_error(result) -> float:
    """The held-out output error of a result (every extraction here is verified)."""
    assert result.report.verification is not None
    return result.report.verification.max_relative_error


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
            "output_error": _output_error(result),
            **error(result.model), "wall_s": wall, "black_box_s": oracle.black_box_seconds,
            "learner_s": wall - oracle.black_box_seconds}


def section_single_head(quick: bool, log) -> list[dict]:
    """Exact single head (the single-head paper, Theorem 4.1): d^2 + d queries."""
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
                 "output_error": _output_error(exact),
                 "wall_s": exact.report.seconds})
    for mult in multipliers:
        oracle = Oracle(target, d)
        budget = mult * exact.queries
        result = train_surrogate(oracle, budget, seed=mult, max_iter=500 if quick else 1500)
        rows.append({"learner": "surrogate", "label": f"surrogate {mult}x", "d": d,
                     "queries": result.queries, "training_queries": budget,
                     "W_error": _rel(result.model.W, target.W),
                     "output_error": _output_error(result),
                     "wall_s": result.report.seconds,
                     "iterations": result.report.details["iterations"]})
        log(f"surrogate d={d} {mult}x: W error {rows[-1]['W_error']:.1e}, "
            f"output error {rows[-1]['output_error']:.1e}")
    return rows


def section_one_layer(quick: bool, log) -> list[dict]:
    """One-layer Transformer end to end (the single-head paper's reduction + the ReLU FFN learner), m = d."""
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
    """Rank-r heads, r = d/8: the adaptive learner (floor d + r(2d - r)) and the single-head paper's ROP."""
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


def section_multi_head_grid(quick: bool, log) -> list[dict]:
    """Issue 12's grid at a few seeds per cell: full-rank heads H = 1..8 at d = 8 and 16
    (and H = 4, 8 at d = 32), low-rank layers (d, H, r) = (64, 8, 8) and (96, 12, 8)."""
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
            f"the multi-head paper's count {r['paper_count']}), median error {r['error_median']}")
    return rows


def section_noisy(quick: bool, log) -> list[dict]:
    """Error vs noise tolerance tau: the robust default and the single-head paper's Theorem 6.1, equal queries."""
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
    """Attention + ReLU FFN with biases: queries vs the floor, bits, time."""
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
                            # the multi-head paper's count + (H + 1) d + 1: the learner's own cap
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
VectorCase = tuple[str, str, dict[str, Any], str, int, bool, tuple[list[int], list[int]]]
VECTOR_CASES: tuple[VectorCase, ...] = (("single head, biases", "single-head", {"biases": True}, "vector-single-head",
                 1, True, ([8, 16], [8, 16, 32, 64])),
                ("full-rank multi-head", "multi-head", {}, "vector-multi-head", 4, False,
                 ([8], [8, 16])))


def _readout_box(truth, r):
    """The scalar box r^T F of a VectorAttention at the last position, as the scalar
    model class it is (a biased single head, or H bias-free heads)."""
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
            "output_error": _output_error(result), "wall_s": wall}


def _scalar_error(truth, model) -> float:
    """A scalar learner's error: canonical (heads matched) for several heads, else the
    largest relative error of W, v and b."""
    if getattr(truth, "heads", 1) > 1:
        return canonical_error(model, truth)
    return max(_rel(model.W, truth.W), _rel(model.v, truth.v), _rel(model.b, truth.b))


def _vector_error(truth, model) -> float:
    """A vector learner's canonical error (heads matched): the largest of W, b, O, c."""
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


# The scaling plots have one panel per family of learners, so that no axes holds more
# series than stay distinguishable (every --quick row at once made 23 legend entries).
FAMILIES = (("one head", ("single-head", "one-layer", "noisy")),
            ("low rank", ("low-rank", "multi-head low-rank")),
            ("several heads", ("multi-head",)),
            ("pre-LayerNorm", ("pre-ln",)),
            ("Transformer layer", ("transformer-layer",)))


def family(learner: str) -> str:
    """The panel of a learner's rows: the family whose longest name prefixes its label."""
    best, length = "other", 0
    for name, prefixes in FAMILIES:
        for prefix in prefixes:
            if (learner == prefix or learner.startswith(prefix + " ")) and len(prefix) > length:
                best, length = name, len(prefix)
    return best


def _panels(rows: list[dict]) -> list[tuple[str, list[str]]]:
    """(family, its learners in order) for the families present in ``rows``."""
    learners = list(dict.fromkeys(r["learner"] for r in rows))
    order = [name for name, _ in FAMILIES] + ["other"]
    return [(name, [lr for lr in learners if family(lr) == name]) for name in order
            if any(family(lr) == name for lr in learners)]


def _scaling_figure(rows: list[dict], draw, ylabel: str, title: str, extra=()):
    """One panel per family (stacked, a shared d axis, log-log), each with its legend
    outside; ``draw(ax, learner, sub, style)`` plots one learner's rows."""
    import matplotlib.pyplot as plt
    panels = _panels(rows)
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.5, 2.4 * len(panels)), sharex=True,
                             squeeze=False, layout="constrained")
    all_d = sorted({r["d"] for r in rows})
    for i, (ax, (name, learners)) in enumerate(zip(axes[:, 0], panels)):
        styles = series_styles(learners)
        for learner in learners:
            draw(ax, learner, [r for r in rows if r["learner"] == learner], styles[learner])
        log_axes(ax, x_base=2)
        ax.set_ylabel(ylabel)
        ax.set_title(name, fontsize=9, loc="left")
        legend_outside(ax, extra if i == 0 else ())     # the line styles explained once
    axes[-1, 0].set_xticks(all_d)
    axes[-1, 0].set_xlabel("d")
    fig.suptitle(title)
    return fig


def plots(rows: list[dict], out: Path) -> list[str]:
    """Write the plots (SVG, PNG and PDF); returns their file names ([] without matplotlib).

    Every axes gives each series its own colour and marker, keeps its legend outside the
    data and uses log scales where the values span decades."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        return []
    written: list[str] = []
    scaling = [r for r in rows if "floor" in r and not r.get("grid")]
    grid = [r for r in rows if r.get("grid")]
    if grid:
        written += grid_plot(grid, out / "multi_head_grid.png")

    if scaling:
        def queries(ax, learner, sub, style):
            ds, qs = [r["d"] for r in sub], [r["recovery_queries"] for r in sub]
            label = learner + (f" (slope {fitted_slope(ds, qs):.2f})" if len(sub) >= 2 else "")
            ax.plot(ds, qs, "-", label=label, **style)
            if all(r["paper_count"] is not None for r in sub):
                ax.plot(ds, [r["paper_count"] for r in sub], ":", color=style["color"])
            ax.plot(ds, [r["floor"] for r in sub], "--", color=style["color"], lw=0.8,
                    marker="_", ms=10)
        fig = _scaling_figure(scaling, queries, "queries", "recovery queries against d",
                              [(Line2D([], [], ls="--", color="gray", lw=0.8, marker="_"),
                                "dashed, bars: the free parameters (floor)"),
                               (Line2D([], [], ls=":", color="gray"),
                                "dotted: the paper's count (the series' colour)")])
        written += save(fig, out / "queries_vs_d")

        def errors(ax, learner, sub, style):
            ds = [r["d"] for r in sub]
            ax.plot(ds, [max(r["W_error"], 1e-17) for r in sub], "-", label=learner, **style)
            ax.plot(ds, [max(r["output_error"], 1e-17) for r in sub], "--",
                    color=style["color"], marker=style["marker"], mfc="none", alpha=0.7)
        fig = _scaling_figure(scaling, errors, "relative error", "parameter and output error "
                              "against d",
                              [(Line2D([], [], marker="o", color="gray"),
                                "solid, filled: parameter error"),
                               (Line2D([], [], marker="o", mfc="none", ls="--", color="gray"),
                                "dashed, open: held-out output error")])
        written += save(fig, out / "error_vs_d")

        fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * len(scaling) + 2), 4.5))
        x = np.arange(len(scaling))
        black_box = [max(r["black_box_s"], 1e-6) for r in scaling]
        learner_s = [max(r["learner_s"], 1e-6) for r in scaling]
        styles = series_styles(["learner", "inside the black box"])
        ax.bar(x - 0.2, learner_s, width=0.4, color=styles["learner"]["color"],
               label="learner")
        ax.bar(x + 0.2, black_box, width=0.4, color=styles["inside the black box"]["color"],
               label="inside the black box", hatch="//", edgecolor="white")
        if spans_decades(black_box + learner_s):
            log_axes(ax, x=False)
        step = max(1, len(scaling) // 30)         # at most ~30 labels, rotated: none overlap
        ax.set_xticks(x[::step], [f"{r['learner']} d={r['d']}" for r in scaling][::step],
                      rotation=70, ha="right", fontsize=6)
        ax.set_ylabel("seconds"), ax.set_title("wall time: the learner and the black box")
        legend_outside(ax)
        written += save(fig, out / "time_split")

    noisy = [r for r in rows if "tau" in r]
    if noisy:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        learners = list(dict.fromkeys(r["learner"] for r in noisy))
        names = [f"{lr}: {part}" for lr in learners for part in ("error", "bound / error bar")]
        styles = series_styles(names)
        for learner in learners:
            sub = [r for r in noisy if r["learner"] == learner]
            taus = [r["tau"] for r in sub]
            ax.plot(taus, [r["W_abs_error"] for r in sub], "-", label=f"{learner}: error",
                    **styles[f"{learner}: error"])
            ax.plot(taus, [r["error_bar_W"] for r in sub], "--",
                    label=f"{learner}: bound / error bar",
                    **styles[f"{learner}: bound / error bar"])
        log_axes(ax)
        ax.xaxis.set_major_formatter(matplotlib.ticker.LogFormatterSciNotation())
        ax.set_xlabel("tau"), ax.set_ylabel("‖W_hat − W‖_F")
        ax.set_title(f"error against the noise tolerance, d = {noisy[0]['d']}")
        legend_outside(ax)
        written += save(fig, out / "error_vs_tau")

    compare = [r for r in rows if "label" in r]
    if compare:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        styles = series_styles(r["label"] for r in compare)
        for r in compare:
            ax.plot(r["queries"], max(r["output_error"], 1e-17), ls="none", ms=8,
                    label=r["label"], **styles[r["label"]])
        ax.axhline(1e-3, color=REFERENCE, ls=":", lw=0.8, label="1e-3 output error")
        log_axes(ax)
        ax.margins(x=0.15)
        ax.set_xlabel("queries"), ax.set_ylabel("held-out output error")
        ax.set_title(f"exact extraction against the surrogate, d = {compare[0]['d']}")
        legend_outside(ax)
        written += save(fig, out / "surrogate")
    return [Path(f).name for f in written]


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
