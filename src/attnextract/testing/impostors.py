"""An impostor zoo: black boxes just outside a model class, each with the reason it is.

Every impostor is built on an honest model of one of the learners' classes (a single
head, H heads, a one-layer Transformer, a Transformer layer) and changes one thing.
It answers like the honest model on the short, ordinary sequences a learner probes
and differs somewhere else: on long sequences, on tiny or huge tokens, on sparse
tokens, by 1e-8 of the output, or after some number of queries. Some classes
differ only beyond some length (truncation at 257 or 1,000 tokens, ln N score scaling
or an offset beyond a length drawn per seed), only where every score is far below zero
(a sink logit at -8 .. -20), by small smooth terms that grow with length or norm (a slow
rotation of the keys, a cubic term in the scores, a quadratic term in the values), or
at output scales where squaring overflows (x 1e200 with one more head). A learner, or
``attnextract verify``, must refuse each one (:class:`ModelMismatchError` or a failed
check), never return it as a success. ``benchmarks/bench_impostors.py`` and
``tests/test_impostors*.py`` run the zoo against every learner.

An honest model is seen as attention heads W_h (H, d, d) and a readout of the heads'
attention outputs z_h = X^T alpha_h (B, H, d):

    single head      f = v^T z
    H heads          f = sum_h v_h^T z_h
    one layer        f = w^T ReLU(A z)
    Transformer      f = w^T ReLU(A ([x_N] + sum_h V_h z_h) + b) + c0

An impostor changes the attention weights alpha_h (:meth:`Impostor.weights`), the
tokens the values are read from (:meth:`Impostor.values`), the readout, or the answer.

Use::

    box = make_impostor("sliding window 16", model, rng, recovery_queries)
    box.reason        # why it is not in the class
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from ..adapters import targets
from ..adapters.targets import random_vector_attention
from ..errors import (
    BudgetExceededError,
    InputError,
    ModelMismatchError,
    NotIdentifiableError,
    RecoveryFailedError,
)
from ..learners.one_layer import random_one_layer
from ..learners.sign_only import extract_sign_only
from ..learners.transformer_layer import random_transformer_layer
from ..models import (
    MODEL_CLASSES,
    BiasedMultiHeadAttention,
    BiasedSingleHeadAttention,
    MultiHeadAttention,
    OneLayerTransformer,
    SingleHeadAttention,
    TransformerLayer,
    VectorAttention,
    layer_norm,
    softmax,
)
from ..oracle import Oracle, SignOnly
from ..registry import extract
from ..report import verification_count, verify_model

BIASED = (BiasedSingleHeadAttention, BiasedMultiHeadAttention)


def _heads(model) -> np.ndarray:
    W = np.asarray(model.W, dtype=np.float64)
    return W[None] if W.ndim == 2 else W


def readout(model, Z: np.ndarray, X: np.ndarray, ffn=None) -> np.ndarray:
    """The honest model's answer from its heads' attention outputs Z (B, H, d); (B,).

    ``ffn`` (optional) replaces the ReLU of models with a feed-forward layer, and may
    normalise its input (the issue-14 impostors)."""
    if isinstance(model, SingleHeadAttention):
        return Z[:, 0] @ model.v
    if isinstance(model, MultiHeadAttention):
        return np.einsum("bhd,hd->b", Z, model.v)
    if isinstance(model, BIASED):           # biased heads: values read out, plus c
        return np.einsum("bhd,hd->b", Z, np.reshape(model.v, (-1, Z.shape[2]))) + model.c
    if isinstance(model, OneLayerTransformer):
        pre = Z[:, 0] @ model.A.T
        return (ffn or _relu)(pre) @ model.w
    if isinstance(model, TransformerLayer):
        y = np.einsum("hed,bhd->be", model.V, Z)
        if model.residual:
            y = y + X[:, -1, :]
        if ffn is not None and getattr(ffn, "normalises", False):
            y = (y - y.mean(axis=1, keepdims=True)) / np.sqrt(y.var(axis=1, keepdims=True) + 1e-5)
        return (ffn or _relu)(y @ model.A.T + model.b) @ model.w + model.c0
    raise InputError(f"no impostors for a {type(model).__name__}")


def _relu(z):
    return np.maximum(z, 0.0)


def _gelu(z):
    from scipy.special import erf
    return 0.5 * z * (1.0 + erf(z / math.sqrt(2.0)))


def token_scale_of(model) -> float:
    """Per-coordinate token scale where the heads' scores are of order one: 2 / sqrt(|W|)."""
    return 2.0 / math.sqrt(max(float(np.linalg.norm(_heads(model), axis=(1, 2)).max()), 1e-300))


def redraw(model, rng: np.random.Generator):
    """Another member of the model's class: every array redrawn at its own spread."""
    params: dict[str, Any] = {}
    for name, p in model.parameters().items():
        p = np.asarray(p)
        if p.dtype == bool or p.ndim == 0 and name == "residual":
            params[name] = p
            continue
        spread = float(np.std(p)) or 1.0
        params[name] = spread * rng.standard_normal(p.shape) if p.ndim else spread * rng.standard_normal()
    return MODEL_CLASSES[model.kind](**params)


class Impostor:
    """The honest ``model`` as a black box; subclasses change one thing (``reason``)."""

    reason = "the honest model itself (not an impostor)"
    ffn = None

    def __init__(self, model, rng: np.random.Generator):
        self.model = model
        self.heads = _heads(model)
        self.dim = self.heads.shape[1]
        self.rng = rng
        # the heads as fixed arrays, so that a biased model's query bias b_h is found by
        # the head matrix a score is computed with (an impostor's own extra heads have none)
        self._head_list = list(self.heads)
        biases = (np.reshape(model.b, self.heads.shape[:2]) if isinstance(model, BIASED)
                  else np.zeros(self.heads.shape[:2]))
        self._query_bias = {id(W): b for W, b in zip(self._head_list, biases)}

    def scores(self, X, W):
        return np.einsum("bnd,bd->bn", X, X[:, -1, :] @ W.T + self._query_bias.get(id(W), 0.0))

    def weights(self, X, W):
        return softmax(self.scores(X, W))

    def values(self, X):
        return X

    def honest(self, X):
        """What the honest model answers on the modified weights/values."""
        values = self.values(X)
        Z = np.stack([np.einsum("bn,bnd->bd", self.weights(X, W), values)
                      for W in self._head_list], axis=1)
        return readout(self.model, Z, X, self.ffn)

    def __call__(self, X):
        return self.honest(np.asarray(X, dtype=np.float64))


class SlidingWindow(Impostor):
    reason = ("attends only to the last `window` tokens: identical on every sequence up to "
              "that length, different on longer ones")

    def __init__(self, model, rng, window):
        super().__init__(model, rng)
        self.window = window

    def scores(self, X, W):
        s = super().scores(X, W)
        s[:, :max(0, X.shape[1] - self.window)] = -np.inf
        return s


class TopK(Impostor):
    reason = ("attends only to the `k` tokens of largest score (sparse attention): identical "
              "on sequences up to k tokens")

    def __init__(self, model, rng, k):
        super().__init__(model, rng)
        self.k = k

    def scores(self, X, W):
        s = super().scores(X, W)
        if s.shape[1] > self.k:
            kth = np.sort(s, axis=1)[:, -self.k][:, None]
            s = np.where(s >= kth, s, -np.inf)
        return s


class LengthTemperature(Impostor):
    reason = ("scores multiplied by (1 + ln N) / (1 + ln 2): exactly the model on the "
              "length-2 probes, sharper attention on long sequences")

    def scores(self, X, W):
        return super().scores(X, W) * (1.0 + math.log(X.shape[1])) / (1.0 + math.log(2))


class Clipping(Impostor):
    reason = ("clips outputs to +-c, c the 98th percentile of |f| on ordinary inputs: a "
              "different function wherever outputs are large")

    def __init__(self, model, rng):
        super().__init__(model, rng)
        X = token_scale_of(model) * rng.standard_normal((2000, 8, self.dim))
        self.clip = float(np.quantile(np.abs(self.honest(X)), 0.98))

    def __call__(self, X):
        return np.clip(super().__call__(X), -self.clip, self.clip)


class NormTrigger(Impostor):
    reason = "tokens of norm > 20 are read through a different value map (a hidden trigger)"

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.R = rng.standard_normal((self.dim, self.dim)) / math.sqrt(self.dim)

    def values(self, X):
        big = np.linalg.norm(X, axis=2, keepdims=True) > 20.0
        return np.where(big, X @ self.R.T, X)


class ALiBi(Impostor):
    reason = "scores get -m (N - i), a linear penalty by distance: position-dependent"

    def scores(self, X, W):
        N = X.shape[1]
        return super().scores(X, W) - 0.25 * (N - 1 - np.arange(N))[None, :]


class PositionEmbedding(Impostor):
    reason = ("token i gets + p_i (learned absolute positions, |p_i| ~ 1e-2 of a token): "
              "the output depends on where a token sits")

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.size = 1e-2 * token_scale_of(model)
        self.P = rng.standard_normal((4096, self.dim))

    def __call__(self, X):
        X = np.asarray(X, dtype=np.float64)
        return self.honest(X + self.size * self.P[:X.shape[1]][None])


class RotaryPositions(Impostor):
    reason = ("keys rotated by angles proportional to their distance from the query (RoPE): "
              "the score of a token depends on where it sits")

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.freq = 0.3 * 10.0 ** -np.linspace(0, 2, self.dim // 2)

    def scores(self, X, W):
        N, half = X.shape[1], self.dim // 2
        if half == 0:                       # d = 1: nothing to rotate
            return super().scores(X, W)
        angle = (N - 1 - np.arange(N))[:, None] * self.freq[None, :]        # (N, d/2)
        c, s = np.cos(angle), np.sin(angle)
        K = X.copy()
        a, b = X[:, :, 0:2 * half:2], X[:, :, 1:2 * half:2]
        K[:, :, 0:2 * half:2] = c * a - s * b
        K[:, :, 1:2 * half:2] = s * a + c * b
        return np.einsum("bnd,bd->bn", K, X[:, -1, :] @ W.T)


class BatchDependent(Impostor):
    reason = ("subtracts 1e-3 x the batch's mean answer: an answer depends on the other "
              "sequences sent with it (not a function of the sequence)")

    def __call__(self, X):
        out = super().__call__(X)
        return out - 1e-3 * out.mean()


class Float32AboveBatch(Impostor):
    reason = ("batches of more than `largest` sequences are computed in float32 (another "
              "kernel), smaller ones in float64: an answer depends on the batch it is sent "
              "in, so no precision describes the box")

    def __init__(self, model, rng, largest: int = 8):
        super().__init__(model, rng)
        self.largest = largest

    def __call__(self, X):
        X = np.asarray(X, dtype=np.float64)
        out = self.honest(X)
        return out.astype(np.float32).astype(np.float64) if len(X) > self.largest else out


class AttentionSink(Impostor):
    reason = ("an extra key with score 0 and value 0 in the softmax: f = sum e^s v^T x / "
              "(1 + sum e^s), not a convex combination of the values")

    def weights(self, X, W):
        s = self.scores(X, W)
        m = np.maximum(s.max(axis=1, keepdims=True), 0.0)
        e = np.exp(s - m)
        return e / (np.exp(-m) + e.sum(axis=1, keepdims=True))


class SigmoidAttention(Impostor):
    reason = "attention weights sigmoid(s_i) / N instead of a softmax: no normalisation across tokens"

    def weights(self, X, W):
        s = self.scores(X, W)
        return 2.0 / (1.0 + np.exp(-np.clip(s, -700, 700))) / X.shape[1]


class QueryBias(Impostor):
    reason = "scores x_i^T W (x_N + b): a term linear in the tokens, shows at small norms"

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.b = rng.standard_normal(self.dim) / math.sqrt(self.dim)

    def scores(self, X, W):
        return np.einsum("bnd,bd->bn", X, (X[:, -1, :] + self.b) @ W.T)


class ValueBias(Impostor):
    reason = ("every value gets + b: attention outputs no longer vanish with the tokens "
              "(a constant output offset for attention; a hidden-layer bias for a bias-free FFN)")

    def __init__(self, model, rng):
        super().__init__(model, rng)
        v = getattr(model, "v", None)
        if v is not None:           # an output offset 0.05 |v| / sqrt(d), as for one head
            v = np.asarray(v, dtype=np.float64).reshape(-1, self.dim).sum(axis=0)
            self.b = 0.05 * v / (np.linalg.norm(v) * math.sqrt(self.dim))
        else:
            self.b = 0.3 * token_scale_of(model) * rng.standard_normal(self.dim)

    def values(self, X):
        return X + self.b


class DeployedBiases(Impostor):
    reason = ("query, value and output biases as a deployed layer has them: scores "
              "x_i^T (W x_N + b), outputs + c; outside the bias-free class (learn it with "
              "--biases)")

    def __init__(self, model, rng):
        super().__init__(model, rng)
        size = 0.5 * float(np.linalg.norm(self.heads, axis=(1, 2)).max()) * token_scale_of(model)
        biases = np.einsum("hde,he->hd", self.heads, rng.standard_normal(self.heads.shape[:2]))
        norms = np.linalg.norm(biases, axis=1, keepdims=True)
        biases = size * biases / np.where(norms > 0, norms, 1.0)
        self._query_bias = {id(W): b for W, b in zip(self._head_list, biases)}
        v = np.reshape(getattr(model, "v", np.ones(self.dim)), (-1, self.dim)).sum(axis=0)
        self.c = 0.05 * float(np.linalg.norm(v)) * token_scale_of(model)

    def __call__(self, X):
        return super().__call__(X) + self.c


class LayerNormTokens(Impostor):
    reason = "tokens normalised (x - mean) / std before the model: invariant to token scale"

    def __call__(self, X):
        X = np.asarray(X, dtype=np.float64)
        Z = X - X.mean(axis=2, keepdims=True)
        return self.honest(Z / np.sqrt((Z ** 2).mean(axis=2, keepdims=True) + 1e-5))


class SecondHead(Impostor):
    reason = ("plus one more head at relative size eps: one head more than the class "
              "allows; at eps = 1e-8 its outputs differ by ~1e-8 relative")

    def __init__(self, model, rng, eps):
        super().__init__(model, rng)
        d = self.dim
        self.eps = eps
        self.W2 = rng.standard_normal((d, d)) / math.sqrt(d)
        v = getattr(model, "v", None)
        if v is not None:           # a head with value eps |v| / sqrt(d) per entry
            self.v2 = eps * float(np.linalg.norm(v)) / math.sqrt(np.size(v)) * rng.standard_normal(d)
        else:                       # a head with its own value map eps R
            self.R = eps * rng.standard_normal((d, d)) / math.sqrt(d)

    def honest(self, X):
        if getattr(self.model, "v", None) is not None:
            return super().honest(X) + (softmax(super().scores(X, self.W2))[:, :, None]
                                        * X).sum(axis=1) @ self.v2
        # an extra head inside the attention output the FFN reads (value map eps R)
        values = self.values(X)
        extra = np.einsum("bn,bnd->bd", softmax(super().scores(X, self.W2)), values) @ self.R.T
        Z = np.stack([np.einsum("bn,bnd->bd", self.weights(X, W), values) for W in self.heads],
                     axis=1)
        Z[:, 0] += extra            # a Transformer layer reads it through V_1
        return readout(self.model, Z, X, self.ffn)


class Stateful(Impostor):
    reason = "answers as one model, then after `after` queries as another: not a fixed function"

    def __init__(self, model, rng, after):
        super().__init__(model, rng)
        self.after, self.seen = after, 0
        self.other = redraw(model, rng)

    def __call__(self, X):
        X = np.asarray(X, dtype=np.float64)
        out = self.model(X)         # the model's own answers, bit for bit, before the switch
        late = self.seen + np.arange(len(X)) >= self.after
        self.seen += len(X)
        return np.where(late, self.other(X), out) if late.any() else out


class GeluFFN(Impostor):
    reason = "GELU in place of the ReLU: smooth, no linear pieces"

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.ffn = _gelu


class _NormalisedReLU:
    normalises = True

    def __call__(self, z):
        return np.maximum(z, 0.0)


class LayerNormBeforeFFN(Impostor):
    reason = "a LayerNorm between the attention output and the FFN"

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.ffn = _NormalisedReLU()


class StackedLayers(Impostor):
    reason = ("two stacked layers: a residual attention + ReLU layer at every position first "
              "(causal, over the last 8 tokens), then the model")

    LOOKBACK = 8            # layer 1 attends to the last 8 tokens: O(N) per sequence

    def __init__(self, model, rng):
        super().__init__(model, rng)
        d = self.dim
        m = 2 * d
        self.W1 = rng.standard_normal((d, d)) / math.sqrt(d)
        self.V1 = rng.standard_normal((d, d)) / math.sqrt(d)
        self.A1 = rng.standard_normal((m, d)) / math.sqrt(d)
        self.b1 = 0.5 * rng.standard_normal(m)
        self.O1 = rng.standard_normal((d, m)) / math.sqrt(m)

    def __call__(self, X):
        return self.honest(self.first_layer(np.asarray(X, dtype=np.float64)))

    def first_layer(self, X):
        """The first layer's output at every position, (B, N, d)."""
        B, N, d = X.shape
        k = min(self.LOOKBACK, N)
        Q = X @ self.W1.T                                   # position i's query W1 x_i
        # token i - j for j = 0..k-1 (zero-padded before the start, masked out)
        padded = np.concatenate([np.zeros((B, k - 1, d)), X], axis=1)
        back = np.stack([padded[:, k - 1 - j:k - 1 - j + N] for j in range(k)], axis=2)
        s = np.einsum("bnjd,bnd->bnj", back, Q)
        s = np.where((np.arange(N)[:, None] >= np.arange(k)[None, :])[None], s, -np.inf)
        s -= s.max(axis=2, keepdims=True)
        a = np.exp(s)
        a /= a.sum(axis=2, keepdims=True)
        Y = X + np.einsum("bnj,bnjd->bnd", a, back) @ self.V1.T
        return Y + np.maximum(Y @ self.A1.T + self.b1, 0.0) @ self.O1.T


class Truncation(Impostor):
    reason = ("reads only the last `keep` tokens of a longer sequence (a truncated context): "
              "identical on every sequence of up to `keep` tokens, however long the probes")

    def __init__(self, model, rng, keep):
        super().__init__(model, rng)
        self.keep = keep

    def __call__(self, X):
        X = np.asarray(X, dtype=np.float64)
        return self.honest(X[:, -self.keep:] if X.shape[1] > self.keep else X)


class LogLengthScaling(Impostor):
    reason = ("scores multiplied by ln N / ln n0 beyond n0 tokens (n0 drawn in 200..500), as "
              "long-context models do: the model itself up to n0, sharper attention beyond")

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.n0 = int(rng.integers(200, 501))

    def scores(self, X, W):
        s = super().scores(X, W)
        N = X.shape[1]
        return s * (math.log(N) / math.log(self.n0)) if N > self.n0 else s


class LengthOffset(Impostor):
    reason = ("adds a constant (1e-3 of a typical output) to every answer on sequences longer "
              "than n0 (drawn in 300..2000): the model itself on everything shorter")

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.n0 = int(rng.integers(300, 2001))
        X = token_scale_of(model) * rng.standard_normal((256, 8, self.dim))
        self.offset = 1e-3 * float(np.sqrt(np.mean(self.honest(X) ** 2))) * rng.choice([-1.0, 1.0])

    def __call__(self, X):
        out = super().__call__(X)
        return out + self.offset if np.shape(X)[-2] > self.n0 else out


class SinkFarBelow(Impostor):
    reason = ("an attention sink: an extra key of value 0 whose logit -b (b drawn in 8..20) "
              "lies far below the typical scores; it takes weight only where every score is "
              "below about -b, and 1e-4 .. 1e-9 of it on ordinary sequences")

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.logit = -float(rng.uniform(8.0, 20.0))

    def weights(self, X, W):
        s = self.scores(X, W)
        m = np.maximum(s.max(axis=1, keepdims=True), self.logit)
        e = np.exp(s - m)
        return e / (np.exp(self.logit - m) + e.sum(axis=1, keepdims=True))


class SmallRotation(RotaryPositions):
    reason = ("keys rotated by a small angle proportional to their distance from the query "
              "(1e-4 .. 1e-3 rad per position, a slow RoPE): a smooth effect that grows with "
              "length")

    def __init__(self, model, rng):
        Impostor.__init__(self, model, rng)
        self.freq = 10.0 ** rng.uniform(-4, -3) * np.ones(self.dim // 2)


class CubicScores(Impostor):
    reason = ("scores s + g s^3 (g drawn in 1e-6 .. 1e-5): a small smooth term, largest where "
              "scores are large")

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.g = 10.0 ** rng.uniform(-6, -5)

    def scores(self, X, W):
        s = super().scores(X, W)
        return s + self.g * s ** 3


class QuadraticValues(Impostor):
    reason = ("values x + c |x| x / s0 (c drawn in 1e-6 .. 1e-5, s0 the typical token norm): "
              "a small term quadratic in the tokens, largest at large norms")

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.c = 10.0 ** rng.uniform(-6, -5)
        self.s0 = token_scale_of(model) * math.sqrt(self.dim)

    def values(self, X):
        return X + self.c * np.linalg.norm(X, axis=2, keepdims=True) / self.s0 * X


class HugeTwoHeads(SecondHead):
    reason = ("outputs scaled by 1e200 with one more head (relative size 0.3): squared "
              "outputs overflow float64, so only scale-safe comparisons see the extra head")

    SCALE = 1e200

    def __init__(self, model, rng):
        super().__init__(model, rng, 0.3)

    def __call__(self, X):
        return self.SCALE * super().__call__(X)


class LargeTokenClip(Impostor):
    reason = ("the values of tokens longer than `factor` (100) x an ordinary token are "
              "clipped to that norm (a norm clip in the value path): the same model wherever "
              "such tokens carry no attention weight")

    def __init__(self, model, rng, factor: float = 100.0):
        super().__init__(model, rng)
        self.limit = factor * token_scale_of(model) * math.sqrt(self.dim)

    def values(self, X):
        norms = np.linalg.norm(X, axis=2, keepdims=True)
        return X * np.minimum(1.0, self.limit / np.maximum(norms, 1e-300))


class TinyPadding(Impostor):
    reason = ("tokens shorter than `factor` (1e-2) x an ordinary token are taken for padding "
              "and masked out of the softmax (unless every token is): the same model on "
              "sequences without such tokens")

    def __init__(self, model, rng, factor: float = 1e-2):
        super().__init__(model, rng)
        self.limit = factor * token_scale_of(model) * math.sqrt(self.dim)

    def scores(self, X, W):
        s = super().scores(X, W)
        pad = np.linalg.norm(X, axis=2) < self.limit
        pad &= ~pad.all(axis=1, keepdims=True)
        return np.where(pad, -np.inf, s)


class SoftCap(Impostor):
    reason = ("soft-capped logits cap tanh(s / cap) (cap drawn in 10..30, as Gemma caps "
              "them): the model where scores are small, flattened where they are large")

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.cap = float(rng.uniform(10.0, 30.0))

    def scores(self, X, W):
        return self.cap * np.tanh(super().scores(X, W) / self.cap)


class LargeTokenDrift(Impostor):
    reason = ("the values of tokens longer than `factor` (30) x an ordinary token are read "
              "1 + `drift` (1e-4) times too long (a value path that loses relative precision "
              "on large entries): a small deviation where such tokens carry attention weight, "
              "the model everywhere else")

    def __init__(self, model, rng, factor: float = 30.0, drift: float = 1e-4):
        super().__init__(model, rng)
        self.limit = factor * token_scale_of(model) * math.sqrt(self.dim)
        self.drift = drift

    def values(self, X):
        large = np.linalg.norm(X, axis=2, keepdims=True) > self.limit
        return np.where(large, (1.0 + self.drift) * X, X)


class MeanPoolHead(Impostor):
    reason = ("a hidden extra head of relative size `size` that attends evenly (mean "
              "pooling) and shares the heads' value path: outside the class by `size`")

    def __init__(self, model, rng, size: float):
        super().__init__(model, rng)
        self.size = float(size)

    def honest(self, X):
        values = self.values(X)
        pooled = values.mean(axis=1)
        Z = np.stack([np.einsum("bn,bnd->bd", self.weights(X, W), values) + self.size * pooled
                      for W in self._head_list], axis=1)
        return readout(self.model, Z, X, self.ffn)


class Cone(Impostor):
    reason = ("answers differ by 1e-3 of their size where the query token lies in a cone "
              "holding `share` of Gaussian directions: a region of the domain, not a "
              "measure-zero trigger, that a small sample can miss")

    def __init__(self, model, rng, share: float = 0.05):
        super().__init__(model, rng)
        self.u = rng.standard_normal(self.dim)
        self.u /= np.linalg.norm(self.u)
        sample = rng.standard_normal((20000, self.dim))
        cosines = sample @ self.u / np.linalg.norm(sample, axis=1)
        self.cos = float(np.quantile(cosines, 1.0 - share))

    def __call__(self, X):
        X = np.asarray(X, dtype=np.float64)
        out = self.honest(X)
        last = X[:, -1, :]
        norms = np.linalg.norm(last, axis=1)
        inside = (last @ self.u) > self.cos * np.where(norms > 0, norms, np.inf)
        return np.where(inside, out * (1.0 + 1e-3), out)


def zoo(model=None) -> dict:
    """name -> factory (model, rng, recovery_queries) -> impostor, for this kind of model.

    The issue-14 impostors (GELU, LayerNorm before the FFN) apply to models with an FFN;
    ``value bias`` is in the class of a Transformer layer with biases (b absorbs it) and
    is left out there.
    """
    out = {
        **{f"sliding window {w}": (lambda m, r, q, w=w: SlidingWindow(m, r, w)) for w in (8, 16, 24, 64)},
        "top-16 attention": lambda m, r, q: TopK(m, r, 16),
        "length temperature": lambda m, r, q: LengthTemperature(m, r),
        "output clipping": lambda m, r, q: Clipping(m, r),
        "norm trigger": lambda m, r, q: NormTrigger(m, r),
        "ALiBi": lambda m, r, q: ALiBi(m, r),
        "position embedding": lambda m, r, q: PositionEmbedding(m, r),
        "rotary positions": lambda m, r, q: RotaryPositions(m, r),
        "batch-dependent": lambda m, r, q: BatchDependent(m, r),
        "float32 above batch 8": lambda m, r, q: Float32AboveBatch(m, r, 8),
        "attention sink": lambda m, r, q: AttentionSink(m, r),
        "sigmoid attention": lambda m, r, q: SigmoidAttention(m, r),
        "query bias": lambda m, r, q: QueryBias(m, r),
        "value bias": lambda m, r, q: ValueBias(m, r),
        "LayerNorm": lambda m, r, q: LayerNormTokens(m, r),
        "second head 1e-6": lambda m, r, q: SecondHead(m, r, 1e-6),
        "second head 1e-8": lambda m, r, q: SecondHead(m, r, 1e-8),
        "switch mid-recovery": lambda m, r, q: Stateful(m, r, q // 2),
        "switch at verification": lambda m, r, q: Stateful(m, r, q),
        "two stacked layers": lambda m, r, q: StackedLayers(m, r),
        # effects beyond the probes' lengths, far scores, small smooth terms
        "truncation 257": lambda m, r, q: Truncation(m, r, 257),
        "truncation 1000": lambda m, r, q: Truncation(m, r, 1000),
        "log-length scaling": lambda m, r, q: LogLengthScaling(m, r),
        "offset above length": lambda m, r, q: LengthOffset(m, r),
        "sink far below": lambda m, r, q: SinkFarBelow(m, r),
        "small rotation": lambda m, r, q: SmallRotation(m, r),
        "cubic scores": lambda m, r, q: CubicScores(m, r),
        "quadratic values": lambda m, r, q: QuadraticValues(m, r),
        "two heads x1e200": lambda m, r, q: HugeTwoHeads(m, r),
        # the verified domain: tokens outside the ordinary norms, with weight on them
        "large-token clip": lambda m, r, q: LargeTokenClip(m, r),
        "tiny tokens as padding": lambda m, r, q: TinyPadding(m, r),
    }
    if model is None or isinstance(model, (OneLayerTransformer, TransformerLayer)):
        out["GELU FFN"] = lambda m, r, q: GeluFFN(m, r)
    if model is None or isinstance(model, TransformerLayer):
        out["LayerNorm before the FFN"] = lambda m, r, q: LayerNormBeforeFFN(m, r)
    if isinstance(model, TransformerLayer):
        del out["value bias"]
    if model is None or isinstance(model, (SingleHeadAttention, MultiHeadAttention)):
        out["deployed biases"] = lambda m, r, q: DeployedBiases(m, r)
    if isinstance(model, BIASED):       # a query bias in W's column space and a value bias
        del out["query bias"], out["value bias"]    # (an output constant) are in the class
    return out


# the zoo's classes of the verified domain at other sizes (norm limits, a batch size, a
# region's share): not in :func:`zoo` (its sweeps stay as they are), reached by name
SIZED = {
    **{f"large-token clip x{f:g}": (lambda m, r, q, f=f: LargeTokenClip(m, r, f))
       for f in (3.0, 30.0, 300.0)},
    **{f"tiny tokens as padding x{f:g}": (lambda m, r, q, f=f: TinyPadding(m, r, f))
       for f in (1e-1, 1e-4, 1e-6)},
    **{f"float32 above batch {n}": (lambda m, r, q, n=n: Float32AboveBatch(m, r, n))
       for n in (2, 4)},
}

# deviations only where the scores' reach is large (large tokens, large scores), where a
# model's error bar widens the check most: not in :func:`zoo`, reached by name
REACH = {
    "soft-capped logits": lambda m, r, q: SoftCap(m, r),
    **{f"large-token drift {e:g}": (lambda m, r, q, e=e: LargeTokenDrift(m, r, 30.0, e))
       for e in (1e-3, 1e-5)},
}


def make_impostor(name: str, model, rng: np.random.Generator, recovery_queries: int) -> Impostor:
    """The impostor ``name`` of :func:`zoo` (or :data:`SIZED`, :data:`REACH`) built on
    ``model``."""
    table = {**zoo(model), **SIZED, **REACH}
    if name not in table:
        raise InputError(f"no impostor {name!r} for a {type(model).__name__} "
                         f"(known: {', '.join(table)})")
    return table[name](model, rng, recovery_queries)


# -- every learner against the zoo (benchmarks/bench_impostors.py, tests) ----------------

NOISY_TOLERANCE = 1e-10       # absolute output tolerance given to the noisy learner
# a label-only black box (threshold 0) answers these exactly as the honest head does:
# clipping and an attention sink keep the sign of f, so they are in the class there; so
# does rounding f to float32 (in any batch: a float32 number has the sign of the float64
# it rounds, down to |f| ~ 1e-45)
SAME_LABELS = {"output clipping", "attention sink", "sink far below", "float32 above batch 8"}


def _extract(name, **fixed):
    def run(oracle, seed):
        options = {k: (v(oracle.dim) if callable(v) else v) for k, v in fixed.items()}
        return extract(oracle, model=name, seed=seed, **options)
    return run


def _sign_only(oracle, seed):
    return extract_sign_only(oracle, seed=seed)


def _honest(kind):
    def make(d, seed):
        if kind == "single":
            return targets.random_single_head(d, seed)
        if kind == "low-rank":
            return targets.random_low_rank_head(d, max(1, d // 4), seed)
        if kind == "two heads":
            return targets.random_multi_head(2, d, seed)
        if kind == "two low-rank heads":
            return targets.random_low_rank_multi_head(2, d, max(1, d // 4), seed)
        if kind == "biased single":
            return targets.with_biases(targets.random_single_head(d, seed), seed)
        if kind == "two biased heads":
            return targets.with_biases(targets.random_multi_head(2, d, seed), seed)
        if kind == "two biased low-rank heads":
            return targets.with_biases(
                targets.random_low_rank_multi_head(2, d, max(1, d // 4), seed), seed)
        if kind == "one layer":
            return random_one_layer(d, d, seed)
        return random_transformer_layer(d, 2 * d, seed, bias_scale=0.5, c0=0.2)
    return make


# learner -> (honest model (d, seed), run (oracle, seed) -> result or None for verify, labels)
LEARNER_CASES = {
    "single-head": (_honest("single"), _extract("single-head"), False),
    "low-rank": (_honest("low-rank"), _extract("low-rank"), False),
    "verify": (_honest("single"), None, False),
    "noisy": (_honest("single"), _extract("single-head", tolerance=NOISY_TOLERANCE), False),
    "sign-only": (_honest("single"), _sign_only, True),
    "multi-head H<=1": (_honest("single"), _extract("multi-head", heads=1), False),
    "multi-head H<=2": (_honest("two heads"), _extract("multi-head", heads=2), False),
    "multi-head-low-rank": (_honest("two low-rank heads"),
                            _extract("multi-head-low-rank", heads=2, rank=lambda d: max(1, d // 4)),
                            False),
    "one-layer": (_honest("one layer"), _extract("one-layer"), False),
    "transformer-layer": (_honest("layer"), _extract("transformer-layer"), False),
    "single-head --biases": (_honest("biased single"), _extract("single-head", biases=True),
                             False),
    "multi-head H<=2 --biases": (_honest("two biased heads"),
                                 _extract("multi-head", heads=2, biases=True), False),
    "multi-head-low-rank --biases": (_honest("two biased low-rank heads"),
                                     _extract("multi-head-low-rank", heads=2, biases=True,
                                              rank=lambda d: max(1, d // 4)), False),
}


def impostor_names(learner: str, d: int = 8) -> list:
    """The impostors of :func:`zoo` that lie outside ``learner``'s class."""
    names = list(zoo(LEARNER_CASES[learner][0](d, 0)))
    if LEARNER_CASES[learner][2]:
        names = [n for n in names if n not in SAME_LABELS]
    return names


def recovery_queries(learner: str, d: int) -> int:
    """The learner's recovery queries on an honest model (where the switches happen)."""
    honest, run, labels = LEARNER_CASES[learner]
    if run is None:
        return verification_count(d * d + d)
    model = honest(d, 0)
    return int(run(Oracle(SignOnly(model) if labels else model, d), 0).report.recovery_queries)


def run_impostor(learner: str, name: str, d: int, seed: int, recovery: int):
    """Run ``learner`` against impostor ``name`` ("honest": the model itself) built on
    its honest model (seed). Returns (outcome, result, box): outcome "refused: <Error>",
    "accepted" or "crash: <text>"; result the ExtractionResult when accepted."""
    honest, run, labels = LEARNER_CASES[learner]
    model = honest(d, seed)
    if "switch" in name and run is not None:
        # this seed's own recovery count: the switch lands inside this run
        first = Oracle(SignOnly(model) if labels else model, d)
        recovery = int(run(first, seed).report.recovery_queries)
    rng = np.random.default_rng([seed, d, sum(map(ord, name))])
    box = model if name == "honest" else make_impostor(name, model, rng, recovery)
    if run is None and name == "switch at verification":
        assert isinstance(box, Stateful)
        box.after = 1                   # verify alone: a switch in the middle of the check
    oracle = Oracle(SignOnly(box) if labels else box, d)
    try:
        if run is None:                 # `attnextract verify` with the honest parameters
            check = verify_model(oracle, model, count=recovery, seed=seed, measure_v=True)
            if not check.passed:
                raise ModelMismatchError("verification failed")
            return "accepted", None, box
        return "accepted", run(oracle, seed), box
    except (ModelMismatchError, NotIdentifiableError, RecoveryFailedError,
            BudgetExceededError) as exc:
        return f"refused: {type(exc).__name__}", None, box
    except Exception as exc:            # a bug: reported, never counted as a refusal
        return f"crash: {type(exc).__name__}: {exc}"[:200], None, box


class BehindLayerNorm:
    """A zoo impostor as the attention of a pre-LayerNorm block (one head or several):
    f(X) = r^T x_N + impostor(LN(X)), with the block's LN and residual readout. An
    impostor whose difference never shows on LayerNorm's image (tokens of norm about
    sqrt(d) |gamma|) is then the block itself, and is in the ``pre-ln`` class."""

    def __init__(self, block, name: str, rng: np.random.Generator, recovery_queries: int):
        head = (BiasedSingleHeadAttention(block.W[0], block.v[0], block.b[0], block.c)
                if block.W.shape[0] == 1 else
                BiasedMultiHeadAttention(block.W, block.v, block.b, block.c))
        self.block, self.layer_norm, self.dim = block, layer_norm, block.dim
        self.inner = make_impostor(name, head, rng, recovery_queries)
        self.reason = self.inner.reason

    def __call__(self, X):
        X = np.asarray(X, dtype=np.float64)
        b = self.block
        return X[:, -1] @ b.r + self.inner(self.layer_norm(X, b.gamma, b.beta, b.eps))


# -- the zoo with vector answers ---------------------------------------------------------
#
# The same deviations built on a VectorAttention (heads W_h, b_h, O_h and c), answering
# the output vector at the last position (B, m) or at every position (B, N, m), causal
# or not. A head's scores are computed for query rows j (the last position, or every
# position) against every key i; an impostor changes the scores, the keys a row may see
# (:meth:`VectorImpostor.keys`), the weights, the values or the answer, as in the scalar
# zoo above. ``benchmarks/bench_impostors.py`` and ``tests/test_impostors_vector.py``
# run it against the vector learners.

def vector_token_scale(model) -> float:
    """Per-coordinate token scale where a vector model's scores are of order one:
    2 / sqrt(max_h |W_h|)."""
    return 2.0 / math.sqrt(max(float(np.linalg.norm(model.W, axis=(1, 2)).max()), 1e-300))


def _ordinary_norm(model) -> float:
    """The norm of an ordinary token: the token scale times sqrt(d)."""
    return vector_token_scale(model) * math.sqrt(model.dim)


class VectorImpostor:
    """The honest VectorAttention ``model`` as a black box; subclasses change one thing."""

    reason = "the honest model itself (not an impostor)"
    ROWS = 128              # query rows per step at every position (bounds the score arrays)

    def __init__(self, model, rng: np.random.Generator):
        self.model, self.rng = model, rng
        self.W, self.O, self.b, self.c = model.W, model.O, model.b, model.c
        self.dim, self.out_dim = model.dim, model.out_dim
        self.positions, self.causal = model.positions, model.causal

    @property
    def output_kind(self) -> str:
        return self.positions

    def rows(self, N: int) -> np.ndarray:
        """The query positions answered: the last one, or every one."""
        return np.array([N - 1]) if self.positions == "last" else np.arange(N)

    def query(self, X, rows, h):
        """Head h's queries W_h x_j + b_h at the rows, (B, R, d)."""
        return X[:, rows] @ self.W[h].T + self.b[h]

    def scores(self, X, rows, h):
        """Head h's scores x_i^T (W_h x_j + b_h), (B, R, N), before any mask."""
        return self.query(X, rows, h) @ X.transpose(0, 2, 1)

    def keys(self, X, rows):
        """Which keys each row sees, (B or 1, R, N) booleans, or None for every key: a
        causal row j sees i <= j."""
        if self.positions == "all" and self.causal:
            return (np.arange(X.shape[1])[None, :] <= rows[:, None])[None]
        return None

    def masked_scores(self, X, rows, h):
        s = self.scores(X, rows, h)
        seen = self.keys(X, rows)
        return s if seen is None else np.where(seen, s, -np.inf)

    def weights(self, X, rows, h):
        return softmax(self.masked_scores(X, rows, h))

    def values(self, X):
        return X

    def heads_output(self, X, rows):
        """sum_h O_h (values weighted by head h's attention) + c at the rows, (B, R, m)."""
        values = self.values(X)
        out = np.broadcast_to(self.c, (len(X), len(rows), self.out_dim)).copy()
        for h in range(len(self.W)):
            out += (self.weights(X, rows, h) @ values) @ self.O[h].T
        return out

    def honest(self, X):
        """The answers of the heads as this impostor computes them: (B, m) or (B, N, m)."""
        rows = self.rows(X.shape[1])
        out = np.concatenate([self.heads_output(X, rows[k:k + self.ROWS])
                              for k in range(0, len(rows), self.ROWS)], axis=1)
        return out[:, 0] if self.positions == "last" else out

    def __call__(self, X):
        return self.honest(np.asarray(X, dtype=np.float64))


class VectorSlidingWindow(VectorImpostor):
    reason = ("a row attends only to the `window` tokens up to it (a local window, both "
              "sides at every position of a bidirectional box): identical on every "
              "sequence up to that length")

    def __init__(self, model, rng, window):
        super().__init__(model, rng)
        self.window = window

    def keys(self, X, rows):
        i, j = np.arange(X.shape[1])[None, :], rows[:, None]
        near = (np.abs(i - j) < self.window)[None]
        seen = super().keys(X, rows)
        return near if seen is None else near & seen


class VectorTopK(VectorImpostor):
    reason = "a row attends only to the `k` keys of largest score: identical up to k tokens"

    def __init__(self, model, rng, k):
        super().__init__(model, rng)
        self.k = k

    def masked_scores(self, X, rows, h):
        s = super().masked_scores(X, rows, h)
        if s.shape[-1] > self.k:
            kth = np.sort(s, axis=-1)[..., -self.k][..., None]
            s = np.where(s >= kth, s, -np.inf)
        return s


class VectorLengthTemperature(VectorImpostor):
    reason = "scores x (1 + ln N) / (1 + ln 2): the model at length 2, sharper beyond"

    def scores(self, X, rows, h):
        return super().scores(X, rows, h) * (1.0 + math.log(X.shape[1])) / (1.0 + math.log(2))


class VectorNormClipping(VectorImpostor):
    reason = ("each answer's |F - c| clipped to its 98th percentile on ordinary inputs (a "
              "norm clip of the output): another function wherever outputs are large")

    def __init__(self, model, rng):
        super().__init__(model, rng)
        X = vector_token_scale(model) * rng.standard_normal((500, 8, self.dim))
        self.clip = float(np.quantile(np.linalg.norm(self.honest(X) - self.c, axis=-1), 0.98))

    def __call__(self, X):
        out = super().__call__(X) - self.c
        norms = np.linalg.norm(out, axis=-1, keepdims=True)
        return self.c + out * np.minimum(1.0, self.clip / np.maximum(norms, 1e-300))


class VectorNormTrigger(VectorImpostor):
    reason = ("tokens longer than 10 ordinary ones are read through another value map "
              "(a hidden trigger)")

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.R = rng.standard_normal((self.dim, self.dim)) / math.sqrt(self.dim)
        self.limit = 10.0 * _ordinary_norm(model)

    def values(self, X):
        return np.where(np.linalg.norm(X, axis=-1, keepdims=True) > self.limit, X @ self.R.T, X)


class VectorALiBi(VectorImpostor):
    reason = "scores get -0.25 |j - i|, a linear penalty by distance: position-dependent"

    def scores(self, X, rows, h):
        return super().scores(X, rows, h) - 0.25 * np.abs(rows[:, None]
                                                          - np.arange(X.shape[1])[None, :])


class VectorPositionEmbedding(VectorImpostor):
    reason = "token i gets + p_i (learned absolute positions, 1e-2 of a token)"

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.size = 1e-2 * vector_token_scale(model)
        self.P = rng.standard_normal((4096, self.dim))

    def __call__(self, X):
        X = np.asarray(X, dtype=np.float64)
        return self.honest(X + self.size * self.P[:X.shape[1]][None])


class VectorRotary(VectorImpostor):
    reason = ("queries and keys rotated by angles proportional to their positions (RoPE): "
              "a score depends on the distance j - i")

    def __init__(self, model, rng, freq=None):
        super().__init__(model, rng)
        self.freq = 0.3 * 10.0 ** -np.linspace(0, 2, self.dim // 2) if freq is None else freq

    def rotate(self, Y, positions):
        half = self.dim // 2
        angle = positions[:, None] * self.freq[None, :]             # (n, d/2)
        c, s = np.cos(angle), np.sin(angle)
        out = Y.copy()
        a, b = Y[..., 0:2 * half:2], Y[..., 1:2 * half:2]
        out[..., 0:2 * half:2] = c * a - s * b
        out[..., 1:2 * half:2] = s * a + c * b
        return out

    def scores(self, X, rows, h):
        K = self.rotate(X, np.arange(X.shape[1]))
        return self.rotate(self.query(X, rows, h), rows) @ K.transpose(0, 2, 1)


class VectorSmallRotation(VectorRotary):
    reason = "RoPE at 1e-4 .. 1e-3 rad per position: a small smooth effect growing with length"

    def __init__(self, model, rng):
        super().__init__(model, rng, 10.0 ** rng.uniform(-4, -3) * np.ones(model.dim // 2))


class VectorBatchDependent(VectorImpostor):
    reason = "subtracts 1e-3 x the batch's mean answer: an answer depends on the batch"

    def __call__(self, X):
        out = super().__call__(X)
        return out - 1e-3 * out.mean(axis=0)


class VectorFloat32AboveBatch(VectorImpostor):
    reason = ("batches of more than `largest` sequences computed in float32, smaller ones "
              "in float64: no precision describes the box")

    def __init__(self, model, rng, largest: int = 8):
        super().__init__(model, rng)
        self.largest = largest
        self.seen = 0               # the largest batch asked (a box never asked above
                                    # ``largest`` answered as its honest model)

    def __call__(self, X):
        out = super().__call__(X)
        self.seen = max(self.seen, len(out))
        return out.astype(np.float32).astype(np.float64) if len(out) > self.largest else out


class VectorAttentionSink(VectorImpostor):
    reason = "an extra key of score `logit` and value 0 in the softmax: not a convex combination"

    def __init__(self, model, rng, logit: float = 0.0):
        super().__init__(model, rng)
        self.logit = logit

    def weights(self, X, rows, h):
        s = self.masked_scores(X, rows, h)
        m = np.maximum(s.max(axis=-1, keepdims=True), self.logit)
        e = np.exp(s - m)
        return e / (np.exp(self.logit - m) + e.sum(axis=-1, keepdims=True))


class VectorSinkFarBelow(VectorAttentionSink):
    reason = ("an attention sink whose logit -b (b drawn in 8..20) lies far below the "
              "typical scores: weight only where every score is below about -b")

    def __init__(self, model, rng):
        super().__init__(model, rng, -float(rng.uniform(8.0, 20.0)))


class VectorSigmoidAttention(VectorImpostor):
    reason = "weights 2 sigmoid(s_i) / n (n keys seen) instead of a softmax"

    def weights(self, X, rows, h):
        s = self.masked_scores(X, rows, h)
        seen = np.isfinite(s).sum(axis=-1, keepdims=True)
        return 2.0 / (1.0 + np.exp(-np.clip(s, -700, 700))) / seen


class VectorLayerNormTokens(VectorImpostor):
    reason = "tokens normalised (x - mean) / std before the heads: invariant to token scale"

    def __call__(self, X):
        X = np.asarray(X, dtype=np.float64)
        Z = X - X.mean(axis=2, keepdims=True)
        return self.honest(Z / np.sqrt((Z ** 2).mean(axis=2, keepdims=True) + 1e-5))


class VectorSecondHead(VectorImpostor):
    reason = ("plus one more head (no bias) whose O is eps of the model's: one head more "
              "than the class (or the stated count) allows")

    def __init__(self, model, rng, eps):
        super().__init__(model, rng)
        d, m = self.dim, self.out_dim
        spread = float(np.std(model.W)) or 1.0
        W2 = spread * rng.standard_normal((d, d))
        O2 = eps * float(np.std(model.O)) * rng.standard_normal((m, d))
        self.W = np.concatenate([self.W, W2[None]])
        self.O = np.concatenate([self.O, O2[None]])
        self.b = np.concatenate([self.b, np.zeros((1, d))])


class VectorHugeTwoHeads(VectorSecondHead):
    reason = ("answers x 1e200 with one more head at 0.3: squared answers overflow, only "
              "scale-safe comparisons see the extra head")

    def __init__(self, model, rng):
        super().__init__(model, rng, 0.3)

    def __call__(self, X):
        return 1e200 * super().__call__(X)


class VectorStateful(VectorImpostor):
    reason = "answers as one model, then after `after` queries as another: not a fixed function"

    def __init__(self, model, rng, after):
        super().__init__(model, rng)
        self.after, self.seen = after, 0
        spread = {k: float(np.std(getattr(model, k))) or 1.0 for k in "WObc"}
        self.other = VectorAttention(*(spread[k] * rng.standard_normal(getattr(model, k).shape)
                                       for k in "WObc"), positions=model.positions,
                                     causal=model.causal)

    def __call__(self, X):
        X = np.asarray(X, dtype=np.float64)
        out = self.model(X)
        late = self.seen + np.arange(len(X)) >= self.after
        self.seen += len(X)
        if not late.any():
            return out
        late = late.reshape((-1,) + (1,) * (out.ndim - 1))
        return np.where(late, self.other(X), out)


class VectorStackedLayers(VectorImpostor):
    reason = ("two stacked layers: a residual attention + ReLU layer at every position "
              "first (causal, over the last 8 tokens), then the model")

    def __init__(self, model, rng):
        super().__init__(model, rng)
        d = self.dim
        self.first = StackedLayers(SingleHeadAttention(np.zeros((d, d)), np.zeros(d)), rng)

    def __call__(self, X):
        return self.honest(self.first.first_layer(np.asarray(X, dtype=np.float64)))


class VectorTruncation(VectorImpostor):
    reason = ("reads a context of the last `keep` tokens only (a row j the `keep` up to j "
              "when causal): identical on every sequence of up to `keep` tokens")

    def __init__(self, model, rng, keep):
        super().__init__(model, rng)
        self.keep = keep

    def keys(self, X, rows):
        N, i = X.shape[1], np.arange(X.shape[1])[None, :]
        end = rows[:, None] if self.positions == "last" or self.causal else N - 1
        kept = (i > end - self.keep)[None] & np.ones((1, len(rows), 1), dtype=bool)
        seen = super().keys(X, rows)
        return kept if seen is None else kept & seen


class VectorLogLengthScaling(VectorImpostor):
    reason = "scores x ln N / ln n0 beyond n0 tokens (n0 drawn in 200..500)"

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.n0 = int(rng.integers(200, 501))

    def scores(self, X, rows, h):
        s, N = super().scores(X, rows, h), X.shape[1]
        return s * (math.log(N) / math.log(self.n0)) if N > self.n0 else s


class VectorLengthOffset(VectorImpostor):
    reason = ("adds a constant vector (1e-3 of a typical |F - c|) to every answer of "
              "sequences longer than n0 (drawn in 300..2000)")

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.n0 = int(rng.integers(300, 2001))
        X = vector_token_scale(model) * rng.standard_normal((128, 8, self.dim))
        typical = float(np.sqrt(np.mean(np.sum((self.honest(X) - self.c) ** 2, axis=-1))))
        u = rng.standard_normal(self.out_dim)
        self.offset = 1e-3 * typical * u / np.linalg.norm(u)

    def __call__(self, X):
        out = super().__call__(X)
        return out + self.offset if np.shape(X)[-2] > self.n0 else out


class VectorCubicScores(VectorImpostor):
    reason = "scores s + g s^3 (g drawn in 1e-6 .. 1e-5): a small term, largest at large scores"

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.g = 10.0 ** rng.uniform(-6, -5)

    def scores(self, X, rows, h):
        s = super().scores(X, rows, h)
        return s + self.g * s ** 3


class VectorSoftCap(VectorImpostor):
    reason = ("soft-capped logits cap tanh(s / cap) (cap drawn in 10..30, as Gemma caps "
              "them): the model where scores are small, flattened where they are large")

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.cap = float(rng.uniform(10.0, 30.0))

    def scores(self, X, rows, h):
        return self.cap * np.tanh(super().scores(X, rows, h) / self.cap)


class VectorQKNorm(VectorImpostor):
    reason = ("QK-norm: queries and keys normalised before their product (score tau "
              "cos(k_i, q_j)): invariant to the scale of each token")

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.factors, self.tau = [], []
        X = vector_token_scale(model) * rng.standard_normal((64, 8, self.dim))
        for W, b in zip(self.W, self.b):
            U, S, Vt = np.linalg.svd(W)
            root = np.sqrt(np.maximum(S, 1e-300))
            Wk, Wq = root[:, None] * U.T, root[:, None] * Vt       # W = Wk^T Wq
            beta = U.T @ b / root                                    # Wk^T beta = b
            self.factors.append((Wk, Wq, beta))
            q, k = X[:, -1] @ Wq.T + beta, X @ Wk.T
            self.tau.append(float(np.median(np.linalg.norm(k, axis=-1)
                                            * np.linalg.norm(q, axis=-1)[:, None])))

    def scores(self, X, rows, h):
        Wk, Wq, beta = self.factors[h]
        q, k = X[:, rows] @ Wq.T + beta, X @ Wk.T
        q = q / np.maximum(np.linalg.norm(q, axis=-1, keepdims=True), 1e-300)
        k = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-300)
        return self.tau[h] * (q @ k.transpose(0, 2, 1))


class VectorInt8Cache(VectorImpostor):
    reason = ("keys and values read from an int8 cache (each token rounded to 127 steps of "
              "its largest entry): ~0.4% of a token off, the query exact")

    @staticmethod
    def int8(X):
        top = np.max(np.abs(X), axis=-1, keepdims=True)
        step = np.where(top > 0, top / 127.0, 1.0)
        return np.round(X / step) * step

    def scores(self, X, rows, h):
        return self.query(X, rows, h) @ self.int8(X).transpose(0, 2, 1)

    def values(self, X):
        return self.int8(X)


class VectorQuadraticValues(VectorImpostor):
    reason = "values x + c |x| x / s0 (c drawn in 1e-6 .. 1e-5): a term quadratic in the tokens"

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.c2 = 10.0 ** rng.uniform(-6, -5)
        self.s0 = _ordinary_norm(model)

    def values(self, X):
        return X + self.c2 * np.linalg.norm(X, axis=-1, keepdims=True) / self.s0 * X


class VectorLargeTokenClip(VectorImpostor):
    reason = ("values of tokens longer than `factor` (100) ordinary ones clipped to that "
              "norm: the model wherever such tokens carry no weight")

    def __init__(self, model, rng, factor: float = 100.0):
        super().__init__(model, rng)
        self.limit = factor * _ordinary_norm(model)

    def values(self, X):
        norms = np.linalg.norm(X, axis=-1, keepdims=True)
        return X * np.minimum(1.0, self.limit / np.maximum(norms, 1e-300))


class VectorTinyPadding(VectorImpostor):
    reason = ("tokens shorter than `factor` (1e-2) of an ordinary one taken for padding and "
              "masked out (unless every token a row sees is)")

    def __init__(self, model, rng, factor: float = 1e-2):
        super().__init__(model, rng)
        self.limit = factor * _ordinary_norm(model)

    def masked_scores(self, X, rows, h):
        s = super().masked_scores(X, rows, h)
        pad = (np.linalg.norm(X, axis=-1) < self.limit)[:, None, :] & np.isfinite(s)
        pad &= ~(pad == np.isfinite(s)).all(axis=-1, keepdims=True)
        return np.where(pad, -np.inf, s)


class VectorLargeTokenDrift(VectorImpostor):
    reason = ("values of tokens longer than `factor` (30) ordinary ones read 1 + `drift` "
              "(1e-4) times too long: a small deviation where such tokens carry weight")

    def __init__(self, model, rng, factor: float = 30.0, drift: float = 1e-4):
        super().__init__(model, rng)
        self.limit = factor * _ordinary_norm(model)
        self.drift = drift

    def values(self, X):
        large = np.linalg.norm(X, axis=-1, keepdims=True) > self.limit
        return np.where(large, (1.0 + self.drift) * X, X)


class VectorMeanPoolHead(VectorImpostor):
    reason = ("a hidden extra head of relative size `size` that attends evenly to the keys "
              "a row sees (mean pooling), sharing the heads' value paths")

    def __init__(self, model, rng, size: float):
        super().__init__(model, rng)
        self.size = float(size)

    def weights(self, X, rows, h):
        seen = np.isfinite(self.masked_scores(X, rows, h))
        return super().weights(X, rows, h) + self.size * seen / seen.sum(axis=-1, keepdims=True)


class VectorCone(VectorImpostor):
    reason = ("answers' F - c x (1 + 1e-3) where the query token lies in a cone holding "
              "`share` of Gaussian directions: a region a small sample can miss")

    def __init__(self, model, rng, share: float = 0.05):
        super().__init__(model, rng)
        self.share = share
        self.u = rng.standard_normal(self.dim)
        self.u /= np.linalg.norm(self.u)
        sample = rng.standard_normal((20000, self.dim))
        self.cos = float(np.quantile(sample @ self.u / np.linalg.norm(sample, axis=1),
                                     1.0 - share))

    def __call__(self, X):
        X = np.asarray(X, dtype=np.float64)
        out = self.honest(X)
        Q = X[:, -1] if self.positions == "last" else X                 # the query tokens
        norms = np.linalg.norm(Q, axis=-1)
        inside = (Q @ self.u) > self.cos * np.where(norms > 0, norms, np.inf)
        return np.where(inside[..., None], self.c + (out - self.c) * (1.0 + 1e-3), out)


class VectorCausalFlip(VectorImpostor):
    reason = ("answers every position under the other mask than the one stated (causal "
              "told bidirectional, or the reverse)")

    def keys(self, X, rows):
        if self.causal:                  # stated causal: every key seen
            return None
        return (np.arange(X.shape[1])[None, :] <= rows[:, None])[None]


class VectorFloat32Forward(VectorImpostor):
    reason = ("the honest model computed in float32 (tokens, parameters and every step): "
              "a member of the class answering at float32 precision, in every batch")

    def __init__(self, model, rng):
        super().__init__(model, rng)
        self.W, self.O, self.b, self.c = (np.asarray(a, dtype=np.float32)
                                          for a in (self.W, self.O, self.b, self.c))

    def __call__(self, X):
        return self.honest(np.asarray(X, dtype=np.float32)).astype(np.float64)


def vector_zoo(model=None) -> dict:
    """name -> factory (model, rng, recovery_queries) -> impostor, for a VectorAttention
    ``model``; the causal flips only for one answering every position. Biases (query,
    value, output) are in the vector class and have no entry. :class:`VectorCone` is not
    here: a region of 5% of the query tokens is one a check must state it could miss
    (its coverage), not one it always catches."""
    out = {
        **{f"sliding window {w}": (lambda m, r, q, w=w: VectorSlidingWindow(m, r, w))
           for w in (8, 16, 24, 64)},
        "top-16 attention": lambda m, r, q: VectorTopK(m, r, 16),
        "length temperature": lambda m, r, q: VectorLengthTemperature(m, r),
        "norm clipping": lambda m, r, q: VectorNormClipping(m, r),
        "norm trigger": lambda m, r, q: VectorNormTrigger(m, r),
        "ALiBi": lambda m, r, q: VectorALiBi(m, r),
        "position embedding": lambda m, r, q: VectorPositionEmbedding(m, r),
        "rotary positions": lambda m, r, q: VectorRotary(m, r),
        "batch-dependent": lambda m, r, q: VectorBatchDependent(m, r),
        "float32 above batch 8": lambda m, r, q: VectorFloat32AboveBatch(m, r, 8),
        "attention sink": lambda m, r, q: VectorAttentionSink(m, r),
        "sigmoid attention": lambda m, r, q: VectorSigmoidAttention(m, r),
        "LayerNorm": lambda m, r, q: VectorLayerNormTokens(m, r),
        "second head 1e-6": lambda m, r, q: VectorSecondHead(m, r, 1e-6),
        "second head 1e-8": lambda m, r, q: VectorSecondHead(m, r, 1e-8),
        "switch mid-recovery": lambda m, r, q: VectorStateful(m, r, q // 2),
        "switch at verification": lambda m, r, q: VectorStateful(m, r, q),
        "two stacked layers": lambda m, r, q: VectorStackedLayers(m, r),
        "truncation 257": lambda m, r, q: VectorTruncation(m, r, 257),
        "truncation 1000": lambda m, r, q: VectorTruncation(m, r, 1000),
        "log-length scaling": lambda m, r, q: VectorLogLengthScaling(m, r),
        "offset above length": lambda m, r, q: VectorLengthOffset(m, r),
        "sink far below": lambda m, r, q: VectorSinkFarBelow(m, r),
        "small rotation": lambda m, r, q: VectorSmallRotation(m, r),
        "cubic scores": lambda m, r, q: VectorCubicScores(m, r),
        "soft-capped logits": lambda m, r, q: VectorSoftCap(m, r),
        "QK-norm": lambda m, r, q: VectorQKNorm(m, r),
        "int8 KV cache": lambda m, r, q: VectorInt8Cache(m, r),
        "quadratic values": lambda m, r, q: VectorQuadraticValues(m, r),
        "two heads x1e200": lambda m, r, q: VectorHugeTwoHeads(m, r),
        "large-token clip": lambda m, r, q: VectorLargeTokenClip(m, r),
        "tiny tokens as padding": lambda m, r, q: VectorTinyPadding(m, r),
        "mean-pool head 1e-5": lambda m, r, q: VectorMeanPoolHead(m, r, 1e-5),
    }
    if model is None or model.positions == "all":
        out["causal mask flipped"] = lambda m, r, q: VectorCausalFlip(m, r)
    return out


# the vector zoo's classes at other sizes (norm limits, a hidden head near the
# tolerance, batch sizes, a region's share): not in :func:`vector_zoo`, reached by name
VECTOR_SIZED = {
    **{f"large-token clip x{f:g}": (lambda m, r, q, f=f: VectorLargeTokenClip(m, r, f))
       for f in (10.0, 30.0, 300.0)},
    **{f"tiny tokens as padding x{f:g}": (lambda m, r, q, f=f: VectorTinyPadding(m, r, f))
       for f in (1e-1, 1e-4)},
    **{f"mean-pool head {e:g}": (lambda m, r, q, e=e: VectorMeanPoolHead(m, r, e))
       for e in (1e-6, 3e-7)},
    **{f"float32 above batch {n}": (lambda m, r, q, n=n: VectorFloat32AboveBatch(m, r, n))
       for n in (2, 32)},
    **{f"cone of query tokens {p:g}": (lambda m, r, q, p=p: VectorCone(m, r, p))
       for p in (0.02, 0.25)},
}
# as :data:`REACH`, with vector answers (soft-capped logits are in :func:`vector_zoo`)
VECTOR_REACH = {
    f"large-token drift {e:g}": (lambda m, r, q, e=e: VectorLargeTokenDrift(m, r, 30.0, e))
    for e in (1e-3, 1e-5)
}


class VectorBehindLayerNorm:
    """A vector impostor as the attention of a pre-LayerNorm block answering at the last
    position: F(X) = x_N + impostor(LN(X)) (m = d, residual R = I), LN with gamma ~ 1 +
    0.3 N(0, 1), beta ~ 0.2 N(0, 1). The honest block is ``vector-pre-ln``'s class."""

    output_kind = "last"

    def __init__(self, inner, rng: np.random.Generator):
        d = inner.dim
        self.dim, self.inner = d, inner
        self.gamma = 1.0 + 0.3 * rng.standard_normal(d)
        self.beta = 0.2 * rng.standard_normal(d)
        self.reason = getattr(inner, "reason", "the honest block (not an impostor)")

    def __call__(self, X):
        X = np.asarray(X, dtype=np.float64)
        return X[:, -1] + self.inner(layer_norm(X, self.gamma, self.beta, 1e-5))


def random_vector_layer(heads: int, dim: int, seed=None, *, positions="last", causal=False):
    """A standard layer as deployed (heads of rank d / H with independent output ranges,
    biases): W_h = K_h^T Q_h / sqrt(r), b_h = K_h^T b_q,h / sqrt(r), O_h = W_o,h V_h,
    c = W_o b_v + b_o; the query and key maps scaled so that ordinary scores are of
    order one."""
    rng = np.random.default_rng(seed)
    r = dim // heads
    Wq, Wk, Wv, Wo = (rng.standard_normal((dim, dim)) / math.sqrt(dim) for _ in range(4))
    Wq = 3.0 * Wq
    bq, bv, bo = (0.5 * rng.standard_normal(dim) for _ in range(3))
    rows = [slice(h * r, (h + 1) * r) for h in range(heads)]
    return VectorAttention(np.stack([Wk[s].T @ Wq[s] / math.sqrt(r) for s in rows]),
                           np.stack([Wo[:, s] @ Wv[s] for s in rows]),
                           np.stack([Wk[s].T @ bq[s] / math.sqrt(r) for s in rows]),
                           Wo @ bv + bo, positions=positions, causal=causal)


# held-out lengths of the every-position runs stop here (every-position answers cost N^2
# per sequence); impostors that differ only beyond it are members of the class there
# (vector-multi-head's copy scans are 1,024 tokens long)
VECTOR_ALL_LENGTH = 1100
BEYOND_ALL_LENGTH = {"offset above length"}
# on LayerNorm's image (tokens of norm about sqrt(d) |gamma|) these change nothing, or
# nothing but a smooth function of the token that the block's class holds
IN_PRE_LN_CLASS = {"norm trigger", "LayerNorm", "quadratic values", "large-token clip",
                   "tiny tokens as padding"}


def _vector_honest(kind):
    def make(d, seed, positions="last", causal=False):
        if kind == "layer":
            return random_vector_layer(2, d, seed, positions=positions, causal=causal)
        return random_vector_attention(2 if kind == "two heads" else 1, d, seed=seed,
                                       positions=positions, causal=causal)
    return make


# vector learner -> (honest model (d, seed, positions, causal), options, the zoo at every
# position too: vector-multi-head reads the last position of its 1,024-token copy scans,
# so every position costs it minutes a run; vector-pre-ln reads the last position only)
VECTOR_CASES: dict[str, tuple[Callable[..., Any], dict[str, Any], bool]] = {
    "vector-single-head": (_vector_honest("one head"), {}, True),
    "vector-multi-head": (_vector_honest("two heads"), {"heads": 2}, False),
    "vector-layer": (_vector_honest("layer"), {}, True),
    "vector-pre-ln": (_vector_honest("one head"), {}, False),
}


def vector_impostor_names(learner: str, positions: str = "last") -> list:
    """The impostors of :func:`vector_zoo` that lie outside ``learner``'s class."""
    names = list(vector_zoo(VECTOR_CASES[learner][0](8, 0, positions)))
    if positions == "all":
        names = [n for n in names if n not in BEYOND_ALL_LENGTH]
    if learner == "vector-pre-ln":
        names = [n for n in names if n not in IN_PRE_LN_CLASS]
    return names


class ScaledAnswers:
    """A black box's answers times ``factor`` (a member of its class when the box is)."""

    def __init__(self, box, factor: float):
        self.box, self.factor, self.dim = box, factor, box.dim
        self.output_kind = getattr(box, "output_kind", None)

    def __call__(self, X):
        return self.factor * self.box(X)


def _vector_box(learner, name, model, rng, recovery):
    if learner == "vector-pre-ln" and name != "honest x1e200":
        return VectorBehindLayerNorm(_vector_box("", name, model, rng, recovery), rng)
    if name == "honest":
        return model
    if name == "honest through the impostor code":
        return VectorImpostor(model, rng)
    if name == "honest float32":
        return VectorFloat32Forward(model, rng)
    if name == "cone of query tokens":
        return VectorCone(model, rng)
    if name in VECTOR_SIZED or name in VECTOR_REACH:
        return {**VECTOR_SIZED, **VECTOR_REACH}[name](model, rng, recovery)
    if name == "honest x1e200":
        return ScaledAnswers(_vector_box(learner, "honest", model, rng, recovery), 1e200)
    return vector_zoo(model)[name](model, rng, recovery)


def run_vector_impostor(learner: str, name: str, d: int, seed: int, recovery: int | None = None,
                        positions: str = "last", causal: bool = False):
    """Run vector ``learner`` (through :func:`attnextract.registry.extract`) against
    vector impostor ``name`` built on its honest model (seed), or an honest control:
    "honest" (the model), "honest through the impostor code" (:class:`VectorImpostor`),
    "honest float32" (:class:`VectorFloat32Forward`, the learner told so), "honest
    x1e200" (the model with O and c scaled by 1e200: squares overflow).
    ``recovery``: where the switches happen (default: this seed's own recovery count).
    Returns (outcome, result, box) as :func:`run_impostor`."""
    honest, options, _ = VECTOR_CASES[learner]
    model = honest(d, seed, positions, causal)
    length = VECTOR_ALL_LENGTH if positions == "all" else None
    stated: dict[str, Any] = {"outputs": positions, "max_length": length,
              **({"causal": causal} if positions == "all" else {})}
    options = {**options, **({"output_dtype": "float32"} if name == "honest float32" else {})}

    def run(box):
        return extract(Oracle(box, d, **stated), model=learner, seed=seed, **options)

    if recovery is None and "switch" in name:
        first = run(_vector_box(learner, "honest", model, np.random.default_rng(0), 0))
        recovery = int(first.report.recovery_queries)
    rng = np.random.default_rng([seed, d, sum(map(ord, name))])
    box = _vector_box(learner, name, model, rng, recovery or 0)
    try:
        return "accepted", run(box), box
    except (ModelMismatchError, NotIdentifiableError, RecoveryFailedError,
            BudgetExceededError) as exc:
        return f"refused: {type(exc).__name__}", None, box
    except Exception as exc:            # a bug: reported, never counted as a refusal
        return f"crash: {type(exc).__name__}: {exc}"[:200], None, box
