"""End-to-end extraction of a one-layer Transformer (the single-head paper's reduction).

The mathematics, in the project's words: docs/algorithms.md, "One-layer Transformer".

Model: h(X) = X^T softmax(X W x_N), f(X) = w^T ReLU(A h(X)), W (d, d), A (m, d), w (m,),
no biases, no residual connection.

Identities.
- Single tokens: h([x]) = x, so f([x]) = w^T ReLU(A x) is a bias-free ReLU network,
  recovered by :func:`attnextract.learners.relu_network.extract_relu_network` up to permutation
  and positive rescaling of the hidden units.
- Odd part: the scores x_i^T W x_N do not change under X -> -X, so h(-X) = -h(X); since
  ReLU(z) - ReLU(-z) = z,

      g(X) = f(X) - f(-X) = (A^T w)^T h(X) = softmax(X W x_N)^T X v,   v = A^T w,

  a single-head attention regressor. Theorem (the single-head paper): with v != 0 the single-head
  learner on g (two queries per probe) recovers W exactly, so (W, A, w) is
  identified up to the hidden-unit symmetries.

Algorithm: the FFN from single tokens; v = A^T w (must be non-zero); the single-head
learner of :mod:`attnextract.learners.single_head` run on g through :class:`OddPartOracle`,
which sends each probe batch X as ONE batch [X; -X] of 2B sequences and counts 2B
queries; the v it measures from g([e_i]) must agree with A^T w; the assembled model
is verified against the black box on held-out sequences of lengths 1..16.

A black box whose FFN has biases, or with a residual connection h(X) = x_N + ...,
breaks one of these identities (homogeneity of the FFN, or g being a single head
with v = A^T w); every such break ends as :class:`ModelMismatchError`.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from ..errors import ModelMismatchError, NotIdentifiableError
from ..models import OneLayerTransformer
from ..oracle import QueryAccess, evaluate_ragged
from ..report import (
    DEFAULT_VERIFY_TOLERANCE,
    ExtractionResult,
    Report,
    checked_result,
    held_out_output_error,
    token_scale,
    verification_count,
    verify_model,
)
from ..verification import safe_norm
from .relu_network import align_relu_networks, extract_relu_network
from .single_head import extract_single_head

log = logging.getLogger(__name__)


def _phase(oracle, text: str) -> None:
    show = getattr(oracle, "phase", None)      # oracle wrappers may not show phases
    if show is not None:
        show(text)

ODD_V_TOLERANCE = 1e-6     # v from g([e_i]) against A^T w from the FFN, relative


def random_one_layer(dim: int, width: int, seed=None, *, w_scale: float | None = None,
                     ffn_scale: float = 1.0) -> OneLayerTransformer:
    """A generic one-layer Transformer: W ~ N(0, w_scale^2) (default 1/d), A ~ N(0, 1/d), w ~ N(0, 1).

    ``ffn_scale`` multiplies A and w.
    """
    rng = np.random.default_rng(seed)
    w_scale = 1.0 / math.sqrt(dim) if w_scale is None else w_scale
    W = w_scale * rng.standard_normal((dim, dim))
    A = ffn_scale * rng.standard_normal((width, dim)) / math.sqrt(dim)
    w = ffn_scale * rng.standard_normal(width)
    return OneLayerTransformer(W, A, w)


class OddPartOracle:
    """The odd part g(X) = f(X) - f(-X) of a black box, behind the Oracle interface.

    Each batch X (B, N, d) goes to the underlying oracle as one batch [X; -X] of 2B
    sequences, so the underlying oracle's counters (queries, budget) stay honest;
    ``queries`` here counts probes of g (each one costs two queries).

    Parameters
    ----------
    oracle : Oracle
        The door to the black box f.
    """

    def __init__(self, oracle: QueryAccess):
        self.base = oracle
        self.dim = oracle.dim
        self.queries = 0

    @property
    def black_box_seconds(self) -> float:
        return self.base.black_box_seconds

    def require(self, n: int, what: str = "this step") -> None:
        self.base.require(2 * n, f"{what} (two queries per probe of the odd part)")

    def plan(self, n: int, what: str = "the extraction", need: int | None = None) -> None:
        self.base.plan(2 * n, f"{what} (two queries per probe of the odd part)",
                       None if need is None else 2 * need)

    def query(self, X) -> np.ndarray:
        """g on a batch (B, N, d) (or one sequence (N, d)) -> (B,); 2B queries in one batch."""
        X = np.asarray(X, dtype=np.float64)
        if X.ndim == 2:
            X = X[None]
        B = X.shape[0] if X.ndim == 3 else 0
        f = self.base.query(np.concatenate([X, -X], axis=0))
        self.queries += B
        return f[:B] - f[B:]

    def query_ragged(self, sequences) -> np.ndarray:
        """g on sequences of different lengths: one batch per length, answers in order."""
        return evaluate_ragged(self.query, [np.asarray(s, dtype=np.float64) for s in sequences])


def extract_one_layer(oracle: QueryAccess, *, seed=None,
                      verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                      polish: bool = True) -> ExtractionResult:
    """Recover (W, A, w) of a one-layer Transformer black box end to end.

    Parameters
    ----------
    oracle : Oracle
        Door to the black box; ``oracle.dim`` is the token width d >= 2.
    seed : int, optional
        Seed of the ReLU learner's random planes and of all held-out sequences.
    verify_tolerance : float
        Largest held-out relative output error accepted as a match (each stage and
        the assembled model).
    polish : bool
        Passed to the FFN learner: m d (2 m d when m > d) more single-token queries
        for about 10-15 more bits of precision in A and w.

    Returns
    -------
    ExtractionResult
        ``model`` a :class:`OneLayerTransformer` in canonical form (rows of A of unit
        norm, the scale carried by w); ``queries`` every query sent (FFN, odd-part
        probes at two queries each, all verifications).

    Raises
    ------
    NotIdentifiableError
        The FFN is zero, or A^T w = 0 (the odd part vanishes and says nothing about W).
    ModelMismatchError
        The black box is not a bias-free one-layer Transformer (FFN not a bias-free
        ReLU network, odd part not a single head with v = A^T w, or the assembled
        model fails held-out verification); ``.result`` holds the best-effort
        extraction when one was built.
    BudgetExceededError
        The budget cannot cover the next batch (checked before sending it).
    """
    start, start_queries = time.perf_counter(), oracle.queries
    start_bb = oracle.black_box_seconds
    d = oracle.dim
    sub_seed = None if seed is None else np.random.SeedSequence(seed).spawn(3)
    log.info("one-layer at d = %d: the feed-forward part from single tokens", d)
    _phase(oracle, "feed-forward part (single tokens)")
    try:
        ffn = extract_relu_network(oracle, seed=None if sub_seed is None else sub_seed[0],
                                   verify_tolerance=verify_tolerance, polish=polish)
    except ModelMismatchError as exc:
        raise ModelMismatchError(
            f"the single-token map x -> f([x]) is not a bias-free ReLU network (FFN biases?): "
            f"{exc}", result=exc.result) from exc
    ffn_queries = oracle.queries - start_queries
    A, w = ffn.model.A, ffn.model.w
    v = A.T @ w
    if not safe_norm(v) > 1e-12 * safe_norm(w):
        raise NotIdentifiableError(
            "A^T w = 0: the odd part f(X) - f(-X) vanishes, so W cannot be read from it")

    odd = OddPartOracle(oracle)
    before = oracle.queries
    log.info("%d hidden units found; the attention head from the odd part f(X) - f(-X)",
             A.shape[0])
    _phase(oracle, "attention head (odd part)")
    try:
        head = extract_single_head(odd, seed=None if sub_seed is None else sub_seed[1],
                                   verify_tolerance=verify_tolerance)
    except (ModelMismatchError, NotIdentifiableError) as exc:
        raise ModelMismatchError(
            f"the odd part f(X) - f(-X) is not a single attention head (a residual "
            f"connection or FFN biases?): {exc}",
            result=getattr(exc, "result", None)) from exc
    attention_queries = oracle.queries - before
    v_error = float(safe_norm(head.model.v - v) / safe_norm(v))

    model = OneLayerTransformer(head.model.W, A, w)
    n_verify = verification_count(d * d + A.size)
    oracle.require(n_verify, "held-out verification of the one-layer model")
    verification = verify_model(oracle, model, count=n_verify,
                                seed=None if sub_seed is None else sub_seed[2],
                                tolerance=verify_tolerance, scale=token_scale(model),
                                expected_error="measured")
    recovery = ffn.report.breakdown["recovery"] + 2 * (d * d + d) + 2 * head.report.breakdown.get(
        "rescaling", 0)
    report = Report(
        kind=OneLayerTransformer.kind, dim=d, queries=oracle.queries - start_queries,
        breakdown={"ffn": ffn_queries, "attention": attention_queries,
                   "verification": n_verify}, recovery=recovery,
        floor=d * d + model.width * d, verification=verification,
        seconds=time.perf_counter() - start, black_box_seconds=oracle.black_box_seconds - start_bb,
        notes=["ffn: single-token queries, its verification included; attention: probes of the "
               "odd part f(X) - f(-X), two queries each, its verification included",
               *ffn.report.notes],
        details={"hidden units": model.width, "FFN signs": ffn.report.details.get("signs"),
                 "FFN output bits": ffn.report.details.get("output bits"),
                 "|A^T w|": f"{safe_norm(v):.3g}",
                 "v from g vs A^T w": f"{v_error:.2e} relative"})
    result = ExtractionResult(model=model, queries=report.queries, report=report)
    if not v_error <= ODD_V_TOLERANCE:
        raise ModelMismatchError(
            f"the odd part's readout g([e_i]) differs from A^T w of the FFN by {v_error:.2e} "
            f"(relative): not a bias-free one-layer Transformer (residual connection?)",
            result=result)
    return checked_result(model, report, "a bias-free one-layer Transformer")


def compare_one_layer(recovered: OneLayerTransformer, truth: OneLayerTransformer, *,
                      count: int = 256, seed=0) -> dict:
    """Parameter and output errors of a recovered one-layer Transformer against the truth.

    Hidden units are aligned by :func:`attnextract.learners.relu_network.align_relu_networks`
    (permutation and positive scale); W is compared directly (it is identifiable).

    Parameters
    ----------
    recovered, truth : OneLayerTransformer
    count : int
        Held-out random sequences (lengths 1..16, token scale from the truth's W).
    seed : int
        Seed of the held-out sequences.

    Returns
    -------
    dict
        The FFN alignment (``bits``, ``max_error_A``, ``max_error_w``, ...), plus
        ``relative_error_W`` (Frobenius), ``max_error_W`` (largest entry error over
        max |W|) and ``max_output_error`` (largest relative output error on the
        held-out sequences, errors over max(|f|, rms f)).
    """
    out = align_relu_networks(recovered, truth)
    out["relative_error_W"] = float(safe_norm(recovered.W - truth.W)
                                    / max(safe_norm(truth.W), np.finfo(float).tiny))
    out["max_error_W"] = float(np.abs(recovered.W - truth.W).max()
                               / max(np.abs(truth.W).max(), np.finfo(float).tiny))
    out["max_output_error"] = held_out_output_error(recovered, truth, count=count, seed=seed)
    return out
