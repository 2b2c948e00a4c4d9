"""Targets: random and adversarial models to extract, and user black boxes from files.

A target given on the command line as ``FILE.py:NAME`` is a function, or an object
with ``__call__``, defined in FILE.py that takes a float64 array (B, N, d) and
returns B real numbers. It runs under guard (:class:`FirstBatchHint`): what it prints,
at import or while answering, goes to stderr (stdout stays the command's own, one JSON
object with ``--json``); ``sys.exit`` in it is a typed error, never the run's exit; an
optional timeout bounds every call.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import math
import sys
import threading
from pathlib import Path

import numpy as np

from ..errors import AttnExtractError, BlackBoxError, DimensionError, InputError, TargetLoadError
from ..models import (
    BiasedMultiHeadAttention,
    BiasedSingleHeadAttention,
    MultiHeadAttention,
    PreLayerNormAttention,
    SingleHeadAttention,
    TransformerLayer,
    VectorAttention,
)
from ..oracle import _is_torch_module
from .torch_target import module_black_box


def random_single_head(dim: int, seed=None, *, w_scale: float | None = None,
                       v_scale: float = 1.0) -> SingleHeadAttention:
    """A generic single head: W entries N(0, w_scale^2) (default 1/sqrt(d)), v entries N(0, v_scale^2)."""
    if dim < 1:
        raise InputError(f"dim must be >= 1, got {dim}")
    rng = np.random.default_rng(seed)
    w_scale = 1.0 / np.sqrt(dim) if w_scale is None else w_scale
    return SingleHeadAttention(w_scale * rng.standard_normal((dim, dim)),
                               v_scale * rng.standard_normal(dim))


def random_low_rank_head(dim: int, rank: int, seed=None, *,
                         scale: float = 1.0) -> SingleHeadAttention:
    """A generic rank-r head: W = scale * G1 G2^T / sqrt(d r) with G1, G2 Gaussian (d, r)."""
    if not 1 <= rank <= dim:
        raise InputError(f"rank must be in 1..{dim}, got {rank}")
    rng = np.random.default_rng(seed)
    W = scale * rng.standard_normal((dim, rank)) @ rng.standard_normal((rank, dim))
    return SingleHeadAttention(W / np.sqrt(dim * rank), rng.standard_normal(dim))


def hostile_single_heads(dim: int, seed=None) -> dict[str, SingleHeadAttention]:
    """Adversarial single heads: saturating W, zeros and tiny entries in v, tiny v, tiny W."""
    rng = np.random.default_rng(seed)
    G = rng.standard_normal((dim, dim))
    g = rng.standard_normal(dim)
    sparse_v = g.copy()
    sparse_v[rng.random(dim) < 0.5] = 0.0
    sparse_v[rng.integers(dim)] = 1.0          # not all zero
    mixed_v = g * 10.0 ** rng.uniform(-12, 0, size=dim)
    one_hot = np.zeros(dim)
    one_hot[rng.integers(dim)] = 1.0
    low_rank = np.outer(rng.standard_normal(dim), rng.standard_normal(dim))
    return {
        "large W (entries ~10)": SingleHeadAttention(10.0 * G, g),
        "huge W (entries ~1e4)": SingleHeadAttention(1e4 * G, g),
        "tiny W (entries ~1e-7)": SingleHeadAttention(1e-7 * G, g),
        "half of v zero": SingleHeadAttention(G / np.sqrt(dim), sparse_v),
        "v entries from 1e-12 to 1": SingleHeadAttention(G / np.sqrt(dim), mixed_v),
        "v one-hot": SingleHeadAttention(G / np.sqrt(dim), one_hot),
        "tiny v (~1e-9)": SingleHeadAttention(G / np.sqrt(dim), 1e-9 * g),
        "rank-one W": SingleHeadAttention(low_rank, g),
        "W = 0": SingleHeadAttention(np.zeros((dim, dim)), g),
    }


def _module_name(path: str) -> bool:
    """Whether ``path`` reads as a dotted module name (``pkg.boxes``), not a file."""
    return not path.endswith(".py") and all(part.isidentifier() for part in path.split("."))


def _import_module(dotted: str):
    """Import the module ``dotted``, with the current directory on the path (as
    ``python -m`` has it), its prints sent to stderr."""
    import importlib
    import os
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        with contextlib.redirect_stdout(sys.stderr):
            return importlib.import_module(dotted)
    except ModuleNotFoundError as exc:
        raise TargetLoadError(f"no file {dotted} and no module {dotted!r} to import "
                              f"({exc})") from None
    except SystemExit as exc:
        raise TargetLoadError(f"importing {dotted} called sys.exit({exc.code!r})") from None
    except Exception as exc:
        raise TargetLoadError(f"importing {dotted} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        if added:
            sys.path.remove(os.getcwd())


def _import_file(file: Path):
    """Import FILE.py as a fresh module (its prints sent to stderr)."""
    module_name = f"_attnextract_target_{abs(hash(str(file.resolve())))}"
    try:
        module_spec = importlib.util.spec_from_file_location(module_name, file)
        if module_spec is None or module_spec.loader is None:
            raise TargetLoadError(f"cannot import {file} as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        with contextlib.redirect_stdout(sys.stderr):     # its prints must not reach stdout
            module_spec.loader.exec_module(module)
    except TargetLoadError:
        raise
    except SystemExit as exc:
        raise TargetLoadError(f"importing {file} called sys.exit({exc.code!r})") from None
    except Exception as exc:
        raise TargetLoadError(f"importing {file} failed: {type(exc).__name__}: {exc}") from exc
    return module


def load_target(spec: str):
    """Load the callable NAME from ``"FILE.py:NAME"`` or ``"package.module:NAME"`` (an
    importable module, the current directory first). A ``torch.nn.Module`` is served as
    a black box (:func:`attnextract.adapters.torch_target.module_black_box`)."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise TargetLoadError(f"target must be FILE.py:NAME or MODULE:NAME, got {spec!r}")
    file = Path(path)           # (a module name prints as itself)
    if not file.is_file() and _module_name(path):
        module = _import_module(path)
    elif not file.is_file():
        raise TargetLoadError(f"target file {file} does not exist")
    else:
        module = _import_file(file)
    if not hasattr(module, name):
        raise TargetLoadError(f"{file} defines no {name!r}")
    target = getattr(module, name)
    if inspect.isclass(target):
        raise TargetLoadError(f"{name} in {file} is a class; export an instance or a function")
    if not callable(target):
        raise TargetLoadError(f"{name} in {file} is a {type(target).__name__}, not callable")
    if _is_torch_module(target):             # a module takes tensors: serve it as a black box
        try:
            return module_black_box(target)
        except InputError as exc:
            raise TargetLoadError(f"{name} in {file}: {exc}") from None
    return target


def random_multi_head(heads: int, dim: int, seed=None, *, w_scale: float | None = None,
                      v_scale: float = 1.0):
    """H generic heads: W_h entries N(0, w_scale^2) (default 1/sqrt(d)), v_h entries N(0, v_scale^2)."""
    if dim < 1 or heads < 0:
        raise InputError(f"need dim >= 1 and heads >= 0, got dim={dim}, heads={heads}")
    rng = np.random.default_rng(seed)
    w_scale = 1.0 / np.sqrt(dim) if w_scale is None else w_scale
    return MultiHeadAttention(w_scale * rng.standard_normal((heads, dim, dim)),
                              v_scale * rng.standard_normal((heads, dim)))


def hostile_multi_heads(heads: int, dim: int, seed=None) -> dict:
    """Multi-head targets that break naive learners, each with ``heads`` stored heads.

    Merged heads (two share W: one canonical head fewer), a dead head (v = 0), heads
    sharing v (their residues tie on every probe), non-orthogonal heads (W and v of
    the heads strongly correlated), a head 10x larger than the others, v = sum v_h = 0.
    """
    if heads < 2:
        raise InputError(f"hostile multi-head targets need heads >= 2, got {heads}")
    rng = np.random.default_rng(seed)
    base = random_multi_head(heads, dim, rng)
    W, v = base.W.copy(), base.v.copy()
    out = {}
    Wm = W.copy()
    Wm[1] = Wm[0]
    out["merged heads (W_1 = W_0)"] = MultiHeadAttention(Wm, v)
    vd = v.copy()
    vd[-1] = 0.0
    out["dead head (v = 0)"] = MultiHeadAttention(W, vd)
    vs = v.copy()
    vs[1] = vs[0]
    out["heads sharing v"] = MultiHeadAttention(W, vs)
    common_W = rng.standard_normal((dim, dim)) / np.sqrt(dim)
    common_v = rng.standard_normal(dim)
    out["non-orthogonal heads (correlated W, v)"] = MultiHeadAttention(
        0.8 * common_W[None] + 0.6 * W, 0.8 * common_v[None] + 0.6 * v)
    Wl = W.copy()
    Wl[0] *= 10.0
    out["one head 10x larger W"] = MultiHeadAttention(Wl, v)
    vz = v.copy()
    vz[-1] = -vz[:-1].sum(axis=0)
    out["v = sum of v_h = 0"] = MultiHeadAttention(W, vz)
    return out


# -- a hint when a Python target fails on its first batch ---------------------------------

def expected_width(target) -> int | None:
    """The token width a Python target expects, when it can be read off (else None).

    Looks at ``target.dim``, ``target.embed_dim``, the last axis of ``target.W`` and,
    for a plain function, the ``W``/``v`` arrays or a ``d``/``dim`` integer of its module.
    """
    for name in ("dim", "embed_dim", "d"):
        value = getattr(target, name, None)
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0:
            return int(value)
    W = getattr(target, "W", None)
    if isinstance(W, np.ndarray) and W.ndim >= 2:
        return int(W.shape[-1])
    scope = getattr(target, "__globals__", None) or {}
    for name in ("W", "v"):
        value = scope.get(name)
        if isinstance(value, np.ndarray) and value.ndim >= 1:
            return int(value.shape[-1])
    for name in ("dim", "DIM", "d", "D"):
        value = scope.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def guarded_call(target, X, timeout: float | None = None):
    """``target(X)`` with its stdout sent to stderr and, if ``timeout`` (seconds) is given,
    :class:`BlackBoxError` when no answer came in time (the call is left running in a
    daemon thread: Python cannot stop it, the run goes on or ends without it)."""
    with contextlib.redirect_stdout(sys.stderr):
        if timeout is None:
            return target(X)
        box: dict = {}

        def run():
            try:
                box["out"] = target(X)
            except BaseException as exc:         # SystemExit too: re-raised below
                box["error"] = exc

        worker = threading.Thread(target=run, name="attnextract-target", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            raise BlackBoxError(f"the target did not answer a batch of {len(X)} sequences "
                                f"within {timeout:g} s (--target-timeout)")
        if "error" in box:
            raise box["error"]
        return box["out"]


class FirstBatchHint:
    """A Python target under guard (:func:`guarded_call`: stdout to stderr, an optional
    ``timeout`` in seconds per call) whose first batch failing names ``--dim``.

    A wrong ``--dim`` reaches a target as a numpy broadcast or shape error ("operands
    could not be broadcast together ..."), which says nothing about the cause. If the
    very first batch fails and :func:`expected_width` reads another width off the
    target, that is a usage error (:class:`DimensionError`, one line naming the width);
    if it fails with ValueError, IndexError or TypeError and the width is unknown, the
    error says to check ``--dim``. Later failures pass through unchanged (the oracle
    types them as :class:`BlackBoxError`).
    """

    def __init__(self, target, spec: str, timeout: float | None = None):
        if timeout is not None and not timeout > 0:
            raise InputError(f"the target timeout must be positive, got {timeout!r}")
        self.target, self.spec, self.answered, self.timeout = target, spec, False, timeout

    def __call__(self, X):
        if self.answered:
            return guarded_call(self.target, X, self.timeout)
        try:
            out = guarded_call(self.target, X, self.timeout)
        except Exception as exc:
            width, sent = expected_width(self.target), np.shape(X)[-1]
            if width and width != sent:
                # a usage error, in one short line: the target's own text says no more
                raise DimensionError(f"--dim {sent} does not match the target, which answers "
                                     f"for d = {width}: give --dim {width}",
                                     expected=width) from exc
            if isinstance(exc, AttnExtractError) or not isinstance(
                    exc, (ValueError, IndexError, TypeError)) or width == sent:
                raise
            # the cause first, in one line; the target's own (numpy) text last and short
            own = " ".join(f"{type(exc).__name__}: {exc}".split())
            own = own if len(own) <= 100 else own[:97] + "..."
            error = BlackBoxError(f"the target failed on its first batch, tokens of width "
                                  f"{sent}: check --dim against the target (it raised {own})")
            error.first_batch = True          # says what to fix: nothing to add to it
            raise error from exc
        self.answered = True
        return out

    def __getattr__(self, name):
        return getattr(self.target, name)
def random_vector_attention(heads: int, dim: int, out_dim: int | None = None, seed=None, *,
                            positions: str = "last", causal: bool = False,
                            biases: bool = True):
    """A random :class:`~attnextract.models.VectorAttention`: W (H, d, d) entries
    N(0, 9/d) (scores of order one for unit tokens), O (H, m, d) entries
    N(0, 1/d), b (H, d) and c (m,) N(0, 1) (zero without ``biases``); m = d by default."""
    rng = np.random.default_rng(seed)
    m = dim if out_dim is None else int(out_dim)
    W = 3.0 * rng.standard_normal((heads, dim, dim)) / math.sqrt(dim)
    O = rng.standard_normal((heads, m, dim)) / math.sqrt(dim)
    b = rng.standard_normal((heads, dim)) if biases else None
    c = rng.standard_normal(m) if biases else None
    return VectorAttention(W, O, b, c, positions=positions, causal=causal)


def random_low_rank_multi_head(heads: int, dim: int, rank: int, seed=None, *,
                               scale: float = 1.0, v_scale: float = 1.0):
    """H generic rank-r heads like a real layer: W_h = scale * A_h B_h^T / sqrt(d r) with
    A_h, B_h Gaussian (d, r) (as :func:`random_low_rank_head`), v_h entries N(0, v_scale^2)."""
    if heads < 1 or not 1 <= rank <= dim:
        raise InputError(f"need heads >= 1 and rank in 1..{dim}, got heads={heads}, rank={rank}")
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((heads, dim, rank))
    B = rng.standard_normal((heads, dim, rank))
    W = scale * np.einsum("hdr,her->hde", A, B) / np.sqrt(dim * rank)
    return MultiHeadAttention(W, v_scale * rng.standard_normal((heads, dim)))


def with_biases(model, seed=None, *, bias_scale: float = 1.0, c: float | None = None):
    """``model`` (a single head or H heads) with query biases and an output constant,
    as deployed layers have: b_h = W_h p_h (p_h Gaussian, so b_h lies in W_h's column
    space, as b_h = W_k,h^T b_q,h does) scaled to |b_h| = bias_scale, and c ~ N(0, 1)
    unless given. Returns a BiasedSingleHeadAttention or BiasedMultiHeadAttention."""
    rng = np.random.default_rng(seed)
    W = np.asarray(model.W, dtype=float)
    heads = W[None] if W.ndim == 2 else W
    b = np.einsum("hde,he->hd", heads, rng.standard_normal(heads.shape[:2]))
    norms = np.linalg.norm(b, axis=1, keepdims=True)
    b = bias_scale * b / np.where(norms > 0, norms, 1.0)
    c = float(rng.standard_normal()) if c is None else float(c)
    if W.ndim == 2:
        return BiasedSingleHeadAttention(W, model.v, b[0], c)
    return BiasedMultiHeadAttention(W, model.v, b, c)


class Float32MultiHeadBlackBox:
    """A multi-head attention layer computed in float32, as PyTorch computes
    ``nn.MultiheadAttention(d, H, bias=False)`` by default, in numpy (no torch needed).

    Per head, with projections Q_h, K_h, V_h (hd, d), hd = d / H, an output projection O
    (d, d) and a readout r (d,): f(X) = r^T O concat_h(softmax(X K_h^T Q_h x_N / sqrt(hd))^T
    X V_h^T), every product, the softmax and the sums (one token at a time) in float32; the answers are float32
    numbers returned as float64 (B,) for X (B, N, d). The parameters are drawn as
    PyTorch's default initialisation draws them (in-projection Xavier-uniform over
    (3d, d), output projection uniform +-1/sqrt(d)) and r is a random unit vector: the
    heads' W_h = K_h^T Q_h / sqrt(hd) have rank hd. :attr:`truth` is the canonical
    model in float64 (W_h, v_h = V_h^T O_h^T r).
    """

    def __init__(self, heads: int, dim: int, seed=None):
        if heads < 1 or dim % heads:
            raise InputError(f"need heads >= 1 dividing dim, got heads={heads}, dim={dim}")
        rng = np.random.default_rng(seed)
        bound = np.sqrt(6.0 / (4 * dim))
        self.Q, self.K, self.V = (rng.uniform(-bound, bound, (heads, dim // heads, dim))
                                  .astype(np.float32) for _ in range(3))
        self.O = rng.uniform(-1, 1, (dim, dim)).astype(np.float32) / np.float32(np.sqrt(dim))
        r = rng.standard_normal(dim)
        self.r = (r / np.linalg.norm(r)).astype(np.float32)
        hd = dim // heads
        O_h = self.O.astype(np.float64).reshape(dim, heads, hd).transpose(1, 0, 2)  # (H, d, hd)
        W = np.einsum("hai,haj->hij", self.K.astype(np.float64),
                      self.Q.astype(np.float64)) / np.sqrt(hd)
        v = np.einsum("hai,hba,b->hi", self.V.astype(np.float64), O_h,
                      self.r.astype(np.float64))
        self.truth = MultiHeadAttention(W, v)
        self.scale = np.float32(1.0 / np.sqrt(hd))

    def __call__(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X, dtype=np.float32)
        q = np.einsum("had,bd->bha", self.Q, X[:, -1]) * self.scale          # (B, H, hd)
        k = np.einsum("had,bnd->bhna", self.K, X)                            # (B, H, N, hd)
        scores = np.einsum("bhna,bha->bhn", k, q)
        scores -= scores.max(axis=2, keepdims=True)
        weights = np.exp(scores)
        # sums over the tokens accumulated one token at a time, in float32 (as a plain
        # loop would): their rounding grows with N like a real forward pass's, where
        # numpy's pairwise sums would be the most accurate float32 can be
        weights /= np.cumsum(weights, axis=2)[:, :, -1:]
        values = np.einsum("had,bnd->bhna", self.V, X)
        heads = np.cumsum(weights[..., None] * values, axis=2)[:, :, -1].reshape(X.shape[0], -1)
        return ((heads @ self.O.T) @ self.r).astype(np.float64)


def random_pre_layer_norm(heads: int, dim: int, seed=None, *, eps: float = 1e-5,
                          ln_spread: float = 0.3):
    """A generic pre-LayerNorm block like GPT-2's (heads of width d / H, every bias):
    gamma = 1 + ln_spread N(0, 1), beta = ln_spread N(0, 1); per head Q_h, K_h, V_h
    (d / H, d) and the output projection with entries N(0, 1 / d) (scores of order one on
    LN's unit-variance tokens), query and value biases N(0, 1), a unit residual readout r
    and c ~ N(0, 1). Returns a :class:`attnextract.models.PreLayerNormAttention`."""
    if heads < 1 or dim < 2 or dim % heads:
        raise InputError(f"need heads >= 1 dividing dim >= 2, got heads={heads}, dim={dim}")
    rng = np.random.default_rng(seed)
    hd = dim // heads
    Q, K, V, O = (rng.standard_normal((heads, hd, dim)) / np.sqrt(dim) for _ in range(4))
    b_q = rng.standard_normal((heads, hd))
    r = rng.standard_normal(dim)
    r /= np.linalg.norm(r)
    W = np.einsum("hai,haj->hij", K, Q) / np.sqrt(hd)
    b = np.einsum("hai,ha->hi", K, b_q) / np.sqrt(hd)
    v = np.einsum("hai,haj,j->hi", V, O, r)          # O_h (hd, d) maps the head to d
    return PreLayerNormAttention(1.0 + ln_spread * rng.standard_normal(dim),
                                 ln_spread * rng.standard_normal(dim), W, b, v,
                                 float(rng.standard_normal()), r, eps)


class Float32TransformerLayerBlackBox:
    """A Transformer layer (:class:`attnextract.models.TransformerLayer`) computed in
    float32, in numpy: the parameters of ``layer`` rounded to float32 and every product,
    exponential and sum of the forward pass in float32 (sums over the tokens one token at
    a time); the answers are float32 numbers returned as float64 (B,) for X (B, N, d).
    :attr:`truth` is the layer with the float32 parameters, in float64.
    """

    def __init__(self, layer):
        single = lambda a: np.asarray(a, dtype=np.float32)            # noqa: E731
        self.W, self.V, self.A, self.b, self.w = (single(layer.W), single(layer.V),
                                                  single(layer.A), single(layer.b),
                                                  single(layer.w))
        self.c0, self.residual = np.float32(layer.c0), bool(layer.residual)
        wide = lambda a: a.astype(np.float64)                          # noqa: E731
        self.truth = TransformerLayer(wide(self.W), wide(self.V), wide(self.A), wide(self.b),
                                      wide(self.w), float(self.c0), self.residual)

    def __call__(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X, dtype=np.float32)
        last = X[:, -1]
        scores = np.einsum("bnd,hde,be->bhn", X, self.W, last)
        scores -= scores.max(axis=2, keepdims=True)
        weights = np.exp(scores)
        weights /= np.cumsum(weights, axis=2)[:, :, -1:]
        mixed = np.cumsum(weights[..., None] * X[:, None], axis=2)[:, :, -1]     # (B, H, d)
        y = np.einsum("hed,bhd->be", self.V, mixed)
        if self.residual:
            y = y + last
        hidden = np.maximum(y @ self.A.T + self.b, np.float32(0.0))
        return (hidden @ self.w + self.c0).astype(np.float64)
