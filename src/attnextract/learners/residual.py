"""One-layer Transformer WITH a residual connection, recovered up to functional equivalence.

Model: h(X) = x_N + V^T X^T softmax(X W x_N), f(X) = w^T ReLU(A h(X)). With B = A V^T,

    f(X) = w^T ReLU(A x_N + B z(X)),   z(X) = X^T softmax(X W x_N),

which is what :class:`ResidualOneLayer` (W, A, B, w) computes; (W, A, B, w) is identified
up to permutation and positive rescaling of the hidden units, and V = (A^+ B)^T when A
has full column rank (m >= d).

Identities (all exact; alpha = softmax(X W x_N)):
1. Single tokens: z([x]) = x, so f([x]) = w^T ReLU((A + B) x): a bias-free ReLU network.
2. Last token zero: the scores all vanish, alpha is uniform, so f([p; 0]) = w^T ReLU(B p / 2).
3. Odd part: z(-X) = -z(X), so g(X) = f(X) - f(-X) = u^T x_N + alpha^T X v' with
   u = A^T w and v' = B^T w, both known from 1 and 2 (v' = B^T w from 2, u from 1 minus v').
   g(X) - u^T x_N is a single head (W, v'): the single-head learner recovers W
   (docs/algorithms.md, "Single head").
4. Matching the units of 1 and 2: for q = T s (s in R^k, T (d, k) orthonormal) and
   p = q + Q c with Q (d, d - k) an orthonormal basis of (W T)^perp, the two scores of
   [p; q] are equal, alpha = (1/2, 1/2), and
       f([p; q]) = w^T ReLU((A + B) T s + B Q c / 2),
   a bias-free ReLU network in (s, c) whose unit rows carry T^T (a_i + b_i) and
   Q^T b_i: their directions match each unit of 1 to its unit of 2.
The scale of a_i + b_i against b_i comes from the output weights of 1 and 2:
w_1i / w_2i = 2 |a_i + b_i| / |b_i| for matched units.

Unlike 1 and 2, identity 4 holds only as well as the recovered W: under the black
box's own W the two scores differ by c^T Q^T (W_true - W) T s, which grows like |y|^2
(y = (s, c)), plus float64 rounding of scores of that size. So 4 is not a ReLU network
at every scale: it is probed where the scores are of order one (tokens scaled by
1 / sqrt(|W|_2)) and checked held-out out to scores TIE_SCORE, where the tie still
holds to TIE_SCORE times the relative error of W. The black box at large norms is
checked by 1, 2 and the held-out verification of the whole model.
"""

from __future__ import annotations

import math
import time

import numpy as np

from ..errors import InputError, ModelMismatchError, NotIdentifiableError
from ..models import ResidualOneLayer
from ..oracle import OracleView, QueryAccess
from ..report import (
    DEFAULT_VERIFY_TOLERANCE,
    ExtractionResult,
    Report,
    token_scale,
    verification_count,
    verify_model,
)
from ..verification import safe_norm
from .one_layer import OddPartOracle
from .relu_network import extract_relu_network
from .single_head import extract_single_head

MATCH_TOLERANCE = 1e-6      # 1 - cos of matched unit directions must stay below this
RATIO_TOLERANCE = 1e-6      # the unit scale ratio from net 3 must agree this well (relative)
TIE_SCORE = 100.0           # net 3 is checked held-out out to scores this large (see 4 above)




class _MappedOracle(OracleView):
    """Length-1 queries [y] sent as the sequences ``build(y)`` (B, N, d): one query each."""

    def __init__(self, oracle, build, what: str):
        super().__init__(oracle, what)
        self.build = build

    def query(self, X) -> np.ndarray:
        X = np.asarray(X, dtype=np.float64)
        if X.ndim == 2:
            X = X[None]
        if X.ndim != 3 or X.shape[1] != 1:
            raise InputError(f"{self.what}: expects length-1 queries (B, 1, d), got {X.shape}")
        return self.base.query(self.build(X[:, 0, :]))

    def query_ragged(self, sequences) -> np.ndarray:
        return self.query(np.stack([np.asarray(s, dtype=np.float64)[-1:] for s in sequences]))


class _ResidualOddOracle(OddPartOracle):
    """g(X) - u^T x_N = alpha^T X v': the attention part of the odd part, a single head."""

    def __init__(self, oracle, u: np.ndarray):
        super().__init__(oracle)
        self.u = u

    def query(self, X) -> np.ndarray:
        X = np.asarray(X, dtype=np.float64)
        if X.ndim == 2:
            X = X[None]
        return super().query(X) - X[:, -1, :] @ self.u


def _match(directions: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, float]:
    """Assignment of rows of ``targets`` to rows of ``directions`` by cosine; (perm, worst 1 - cos)."""
    from scipy.optimize import linear_sum_assignment

    unit = lambda M: M / np.linalg.norm(M, axis=1, keepdims=True)  # noqa: E731
    cost = 1.0 - unit(directions) @ unit(targets).T
    rows, cols = linear_sum_assignment(cost)
    perm = np.empty(len(rows), dtype=int)
    perm[rows] = cols
    return perm, float(cost[rows, cols].max())


def counted_stage(oracle, counts: dict, name: str, run, what: str):
    """Run one stage of a layer learner: its queries added to ``counts[name]``, a
    mismatch inside it reported as the model's (``what``), naming the stage."""
    before = oracle.queries
    try:
        return run()
    except ModelMismatchError as exc:
        raise ModelMismatchError(f"not {what} ({name}): {exc}", result=exc.result) from exc
    finally:
        counts[name] = counts.get(name, 0) + oracle.queries - before


def extract_one_layer_residual(oracle: QueryAccess, *, seed=None,
                               verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                               polish: bool = True) -> ExtractionResult:
    """Recover a one-layer Transformer with a residual connection up to functional equivalence.

    Parameters
    ----------
    oracle : Oracle
        Door to the black box; ``oracle.dim`` is d >= 4.
    seed : int, optional
        Seed of the random choices (planes, subspaces) and held-out sequences.
    verify_tolerance : float
        Largest held-out relative output error accepted as a match.
    polish : bool
        Passed to the two FFN extractions whose precision ends in the model.

    Returns
    -------
    ExtractionResult
        ``model`` a :class:`ResidualOneLayer` (W, A, B, w) with [a_i, b_i] of unit norm
        and the scale carried by w.

    Raises
    ------
    NotIdentifiableError
        B^T w = 0 (W invisible in the odd part), or units that read only the residual
        stream or only the attention output (not matched across the three networks).
    ModelMismatchError
        The black box is not of this class (some stage fails, or held-out verification).
    BudgetExceededError
        The budget cannot cover the next batch.
    """
    start, start_queries = time.perf_counter(), oracle.queries
    start_bb = oracle.black_box_seconds
    d = oracle.dim
    if d < 4:
        raise InputError("the residual learner needs d >= 4 (it splits R^d into two subspaces)")
    seeds = np.random.SeedSequence(seed).spawn(5)
    counts: dict[str, int] = {}

    def stage(name, run):
        return counted_stage(oracle, counts, name, run, "a residual one-layer Transformer")

    # 1. single tokens: w^T ReLU((A + B) x)
    net1 = stage("single tokens", lambda: extract_relu_network(
        oracle, seed=seeds[0], verify_tolerance=verify_tolerance, polish=polish)).model
    # 2. [p; 0]: w^T ReLU(B p / 2)
    zero_last = _MappedOracle(oracle, lambda P: np.stack([P, np.zeros_like(P)], axis=1),
                              "sequences [p; 0]")
    try:
        net2 = stage("last token zero", lambda: extract_relu_network(
            zero_last, seed=seeds[1], verify_tolerance=verify_tolerance, polish=polish)).model
    except NotIdentifiableError as exc:
        raise NotIdentifiableError(f"B = 0: the attention output never reaches the FFN, "
                                   f"W cannot be identified ({exc})") from exc
    if net1.width != net2.width:
        raise NotIdentifiableError(
            f"{net1.width} units see single tokens but {net2.width} see the attention output: "
            f"units that read only one of the two streams are not supported")
    v_prime = 2.0 * net2.A.T @ net2.w                    # B^T w
    u = net1.A.T @ net1.w - v_prime                      # A^T w
    if not safe_norm(v_prime) > 1e-12 * safe_norm(net2.w):
        raise NotIdentifiableError("B^T w = 0: the odd part does not depend on W")
    # 3. W from the odd part minus the residual term: a single head (W, B^T w)
    head = stage("odd part", lambda: extract_single_head(
        _ResidualOddOracle(oracle, u), seed=seeds[2], verify_tolerance=verify_tolerance)).model
    v_error = float(safe_norm(head.v - v_prime) / safe_norm(v_prime))
    W = head.W
    # 4. match units: sequences [T s + Q c; T s] have uniform attention
    rng = np.random.default_rng(seeds[3])
    k = d // 2
    T = np.linalg.qr(rng.standard_normal((d, k)))[0]
    Q = np.linalg.svd((W @ T).T)[2][k:].T                # (d, d - k): basis of (W T)^perp
    # the tie is exact only for the recovered W: |y| = 1 at scores of order one, and
    # held-out checks out to |y| = sqrt(TIE_SCORE) (scores <= TIE_SCORE), not beyond
    norm_W = float(np.linalg.norm(W, 2))
    unit_score = 1.0 / math.sqrt(norm_W) if norm_W > 0 else 1.0

    def uniform_pairs(Y):
        q = unit_score * Y[:, :k] @ T.T
        return np.stack([q + unit_score * Y[:, k:] @ Q.T, q], axis=1)
    net3 = stage("matching", lambda: extract_relu_network(
        _MappedOracle(oracle, uniform_pairs, "sequences with uniform attention"), seed=seeds[4],
        verify_tolerance=verify_tolerance, polish=False, max_norm=math.sqrt(TIE_SCORE))).model
    if net3.width != net1.width:
        raise ModelMismatchError(
            f"not a residual one-layer Transformer: {net3.width} units under uniform attention, "
            f"{net1.width} on single tokens")
    to1, cos1 = _match(net3.A[:, :k], net1.A @ T)        # net3 unit -> net1 unit
    to2, cos2 = _match(net3.A[:, k:], net2.A @ Q)        # net3 unit -> net2 unit
    # per unit i (indexed by net3): a + b = lam n, b = mu b_hat with w1 = w lam, w2 = w mu / 2
    n, w1 = net1.A[to1], net1.w[to1]
    b_hat, w2 = net2.A[to2], net2.w[to2]
    ratio = w1 / (2.0 * w2)                               # lam / mu
    # net3's rows check the ratio: |T^T (a + b)| / |Q^T b / 2| = 2 lam |T^T n| / (mu |Q^T b_hat|)
    measured = (safe_norm(net3.A[:, :k], axis=1) / safe_norm(n @ T, axis=1)) / (
        2.0 * safe_norm(net3.A[:, k:], axis=1) / safe_norm(b_hat @ Q, axis=1))
    ratio_error = float(np.max(np.abs(measured - ratio) / np.abs(ratio)))
    A = ratio[:, None] * n - b_hat                       # units with mu = 1
    B = b_hat
    w = 2.0 * w2
    scale = safe_norm(np.hstack([A, B]), axis=1)   # canonical: [a_i, b_i] unit norm
    model = ResidualOneLayer(W, A / scale[:, None], B / scale[:, None], w * scale)

    n_verify = verification_count(d * d + 2 * model.width * d)
    oracle.require(n_verify, "held-out verification of the residual model")
    verification = verify_model(oracle, model, count=n_verify, seed=seed,
                                tolerance=verify_tolerance, scale=token_scale(model),
                                expected_error="measured")
    report = Report(
        kind=ResidualOneLayer.kind, dim=d, queries=oracle.queries - start_queries,
        breakdown={**counts, "verification": n_verify},
        floor=d * d + model.width * (2 * d), verification=verification,
        seconds=time.perf_counter() - start, black_box_seconds=oracle.black_box_seconds - start_bb,
        notes=["single tokens: w^T ReLU((A + B) x); last token zero: w^T ReLU(B p / 2); odd "
               "part: two queries per probe; matching: sequences with uniform attention"],
        details={"hidden units": model.width,
                 "matching": f"1 - cos up to {max(cos1, cos2):.1e}",
                 "scale ratio check": f"{ratio_error:.1e} relative",
                 "v' from g vs B^T w": f"{v_error:.2e} relative"})
    result = ExtractionResult(model=model, queries=report.queries, report=report)
    problems = []
    if not max(cos1, cos2) <= MATCH_TOLERANCE:
        problems.append(f"units do not match across streams (1 - cos {max(cos1, cos2):.1e})")
    if not ratio_error <= RATIO_TOLERANCE:
        problems.append(f"unit scales disagree ({ratio_error:.1e} relative)")
    if not v_error <= 1e-6:
        problems.append(f"the odd part's value vector differs from B^T w by {v_error:.1e}")
    if not verification.passed:
        problems.append(f"held-out relative error {verification.max_relative_error:.2e} > "
                        f"tolerance {verify_tolerance:.0e}")
    if problems:
        raise ModelMismatchError("not a residual one-layer Transformer: " + "; ".join(problems),
                                 result=result)
    return result


def random_residual_one_layer(dim: int, width: int, seed=None) -> ResidualOneLayer:
    """h(X) = x_N + V^T X^T softmax(X W x_N), f = w^T ReLU(A h): W, V ~ N(0, 1/d), A ~ N(0, 1/d), w ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((dim, dim)) / math.sqrt(dim)
    V = rng.standard_normal((dim, dim)) / math.sqrt(dim)
    A = rng.standard_normal((width, dim)) / math.sqrt(dim)
    return ResidualOneLayer.from_value_matrix(W, V, A, rng.standard_normal(width))
