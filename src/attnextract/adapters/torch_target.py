"""A PyTorch ``nn.MultiheadAttention`` (or one of its heads) as a black box.

:class:`TorchAttentionBlackBox` runs the real module's forward pass, with the last
token as the query and the whole sequence as keys and values, and reads the output
at the last token with a readout vector r:

    f(X) = r^T MHA(query = x_N, key = X, value = X)

or, without a readout, answers the output vectors themselves: MHA(x_N, X, X) (B, E) at
the last position, or self-attention MHA(X, X, X) (B, N, E) at every position (causal
on request), in the module's own dtype unless asked otherwise. A bare
``nn.MultiheadAttention`` handed to an :class:`~attnextract.oracle.Oracle` (or named by a
``FILE.py:NAME`` target) is served that way, at every position; any other module may
answer (B,), (B, m) or (B, N, m) (:class:`TorchModuleBlackBox`). :func:`vector_attention`
gives the :class:`~attnextract.models.VectorAttention` a module computes.

For a bias-free module (``bias=False``, no ``add_bias_kv``, no ``add_zero_attn``) one
head h with rows Q_h, K_h, V_h of ``in_proj_weight`` (head_dim x E each) and columns
O_h of ``out_proj.weight`` is a single-head attention regressor
(docs/algorithms.md, "Model") with

    W = K_h^T Q_h / sqrt(head_dim)   (rank <= head_dim),   v = V_h^T O_h^T r,

because torch scales q . k_i by 1/sqrt(head_dim), and s_i = (Q_h x_N)^T (K_h x_i) =
x_i^T K_h^T Q_h x_N. :func:`merged_head_parameters` computes this (W, v) from the
weights, for checking an extraction against the truth. ``head=h`` keeps head h
alone by zeroing the other heads' columns of ``out_proj`` in a private copy of the
module; ``head=None`` serves the whole module (H heads: a multi-head target).

Biases: PyTorch starts ``in_proj_bias`` and ``out_proj.bias`` at zero, so a module as
built is bias-free. Nonzero biases (a trained module) add the query bias's term
x_i^T b_h to the scores and a constant c to the output (the key bias cancels in the
softmax): the biased class, extracted with ``biases=True`` (``--biases``,
docs/biases.md); a bias-free learner refuses it and names ``--biases``.

torch is an optional extra (``pip install torch==2.13.0``, the CPU build), imported
only when this module is used. The copy runs in float64 by default: in float32
the outputs carry errors near 1e-7, far above what exact extraction resolves.
``dtype=None`` serves the module in its own dtype (float32 for a module built with
PyTorch's defaults): extract such a box with ``output_dtype="float32"``
(``--output-dtype float32``, docs/low-precision.md).
"""

from __future__ import annotations

import copy
import math

import numpy as np

from ..errors import InputError
from ..models import PreLayerNormAttention, VectorAttention


def _torch():
    try:
        import torch
    except ImportError as exc:       # an optional extra: say how to get it
        raise InputError("PyTorch targets need torch: pip install torch==2.13.0 "
                         "(the CPU build)") from exc
    return torch


def _check_module(module, torch):
    if not isinstance(module, torch.nn.MultiheadAttention):
        raise InputError(f"expected a torch.nn.MultiheadAttention, got {type(module).__name__}")
    if not module._qkv_same_embed_dim:
        raise InputError("keys and values must have the width of the queries "
                         "(kdim = vdim = embed_dim): one sequence is the query, keys and values")


def _batch(X, dim: int) -> np.ndarray:
    """X as a float64 batch (B, N, dim) of at least one token, else InputError."""
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 3 or X.shape[2] != dim or X.shape[1] < 1:
        raise InputError(f"expected a batch (B, N, {dim}), got shape {X.shape}")
    return X


def _readout(readout, dim: int) -> np.ndarray:
    if readout is None or isinstance(readout, (int, np.integer)):
        r = np.random.default_rng(readout).standard_normal(dim)
        return r / np.linalg.norm(r)
    r = np.asarray(readout, dtype=np.float64)
    if r.shape != (dim,) or not np.all(np.isfinite(r)):
        raise InputError(f"readout must be {dim} finite numbers, got shape {r.shape}")
    return r


def merged_head_parameters(module, readout, head: int) -> tuple[np.ndarray, np.ndarray]:
    """The (W, v) of head ``head`` read out by ``readout``: W (E, E) = K_h^T Q_h / sqrt(hd), v (E,).

    Biases are ignored (see the module docstring).
    """
    torch = _torch()
    _check_module(module, torch)
    E, H = module.embed_dim, module.num_heads
    if not 0 <= head < H:
        raise InputError(f"head must be in 0..{H - 1}, got {head}")
    hd = E // H
    with torch.no_grad():
        weights = module.in_proj_weight.detach().to(torch.float64).cpu().numpy()
        out = module.out_proj.weight.detach().to(torch.float64).cpu().numpy()
    rows = slice(head * hd, (head + 1) * hd)
    Q, K, V = (weights[i * E:(i + 1) * E][rows] for i in range(3))
    r = _readout(readout, E)
    return K.T @ Q / math.sqrt(hd), V.T @ (out[:, rows].T @ r)


TORCH_DTYPES = ("float64", "float32", "bfloat16", "float16")


def module_black_box(module):
    """A ``torch.nn.Module`` handed over as a black box, made one.

    A bare ``nn.MultiheadAttention`` answers vectors: it is served as self-attention,
    ``module(X, X, X)``, answering the output at every position (B, N, E), in its own
    dtype (:class:`TorchAttentionBlackBox` with ``readout=None, positions="all"``). Any
    other module whose ``forward`` takes a batch (B, N, d) tensor is served by
    :class:`TorchModuleBlackBox` (a copy in eval mode, inputs in its own dtype): it may
    answer B numbers, (B, m) or (B, N, m) (a tuple's first element is the answer).
    """
    torch = _torch()
    if isinstance(module, torch.nn.MultiheadAttention):
        return TorchAttentionBlackBox(module, positions="all", dtype=None)
    return TorchModuleBlackBox(module)


def _answer_tensor(out):
    """A module's answer: the first element of a tuple (``nn.MultiheadAttention`` returns
    (output, weights)), else the output itself."""
    return out[0] if isinstance(out, (tuple, list)) and out and hasattr(out[0], "detach") \
        else out


class TorchModuleBlackBox:
    """A user's ``torch.nn.Module`` as a black box: a private copy in eval mode (dropout
    off), run under ``no_grad`` on inputs (B, N, d) cast to its own dtype (its first
    parameter's, float64 when it has none); its answer, (B,), (B, m) or (B, N, m) (the
    first element of a tuple), read back as float64. The oracle finds which kind at the
    first answer."""

    kind = "torch-module"

    def __init__(self, module):
        torch = _torch()
        self.torch, self.module = torch, copy.deepcopy(module).eval()
        first = next(self.module.parameters(), None)
        self.dtype = torch.float64 if first is None else first.dtype
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        self.device = None if first is None else first.device

    def __call__(self, X):
        torch = self.torch
        with torch.no_grad():
            out = self.module(torch.as_tensor(np.asarray(X), dtype=self.dtype,
                                              device=self.device))
        return _answer_tensor(out).detach().cpu().to(torch.float64).numpy()

    def __repr__(self) -> str:
        return f"TorchModuleBlackBox({type(self.module).__name__}, {self.dtype_name})"


POSITIONS = ("last", "all")


class TorchAttentionBlackBox:
    """A ``torch.nn.MultiheadAttention`` as a black box, batched (B, N, E).

    With a readout r, one number per sequence: f(X) = r^T MHA(x_N, X, X), (B,).
    Without one (``readout=None``), the output vectors themselves: at the last position
    MHA(x_N, X, X), (B, E), or (``positions="all"``) self-attention MHA(X, X, X) at every
    position, (B, N, E) (``causal=True``: position j attends to i <= j only).

    Parameters
    ----------
    module : torch.nn.MultiheadAttention
        The layer to query (``batch_first`` either way). It is copied, never changed.
    readout : array (E,) or int, optional
        The readout vector r, or a seed for a random unit r; None (default): no readout,
        the box answers vectors.
    head : int, optional
        Serve head ``head`` alone (the other heads' output columns zeroed in the copy);
        None serves every head.
    dtype : str or None, optional
        ``"float64"``, ``"float32"``, ``"bfloat16"`` or ``"float16"``: the precision of the
        copy's forward pass (inputs are cast to it, the output read back as float64);
        None: the module's own dtype (``self.dtype_name`` says which). Default: float64
        with a readout (exact extraction), the module's own dtype for vectors (the
        layer answers as it is deployed). In low precision every output is off by the
        rounding of the whole forward pass, not one rounding of the output: extract such
        a target with ``output_dtype=`` (``--output-dtype``).
    positions : {"last", "all"}
        Vector answers at the last position or at every position (no readout only).
    causal : bool
        Every-position answers under a causal mask.

    ``output_kind`` ("scalar", "last" or "all"), ``out_dim`` and ``causal`` declare what
    the box answers to an :class:`~attnextract.oracle.Oracle`.
    """

    kind = "torch-multihead-attention"

    def __init__(self, module, readout=None, *, head: int | None = None, dtype: str | None = "default",
                 positions: str = "last", causal: bool = False):
        torch = _torch()
        _check_module(module, torch)
        if positions not in POSITIONS:
            raise InputError(f"positions must be one of {POSITIONS}, got {positions!r}")
        if readout is not None and (positions != "last" or causal):
            raise InputError("a readout gives one number per sequence, read at the last "
                             "position: positions='all' and causal=True go with readout=None")
        if dtype == "default":        # exact extraction reads numbers; vectors as deployed
            dtype = "float64" if readout is not None else None
        if dtype is None:                 # the module's own dtype (its first parameter's)
            dtype = str(next(module.parameters()).dtype).removeprefix("torch.")
        if dtype not in TORCH_DTYPES:
            raise InputError(f"dtype must be one of {TORCH_DTYPES} or None, got {dtype!r}")
        self.dtype_name = dtype
        E, H = module.embed_dim, module.num_heads
        if head is not None and not 0 <= head < H:
            raise InputError(f"head must be in 0..{H - 1}, got {head}")
        self.torch, self.dtype = torch, getattr(torch, dtype)
        self.module = copy.deepcopy(module).to(self.dtype).eval()
        if head is not None:
            hd = E // H
            with torch.no_grad():
                keep = torch.zeros(E, dtype=torch.bool)
                keep[head * hd:(head + 1) * hd] = True
                self.module.out_proj.weight[:, ~keep] = 0.0
        self.head = head
        self.dim = E
        self.positions, self.causal = positions, bool(causal)
        if readout is None:
            self._r = self.readout = None
            self.output_kind, self.out_dim = positions, E
            return
        # the readout as the forward pass holds it (rounded to the dtype), so that
        # merged_parameters() describes what the box computes
        self._r = torch.from_numpy(_readout(readout, E)).to(self.dtype)
        self.readout = self._r.to(torch.float64).numpy()
        self.output_kind, self.out_dim = "scalar", 1

    def __call__(self, X) -> np.ndarray:
        X = _batch(X, self.dim)
        torch = self.torch
        every = self.output_kind == "all"
        with torch.no_grad():
            seq = torch.tensor(X, dtype=self.dtype)      # a copy, cast to the module's dtype
            query = seq if every else seq[:, -1:, :]
            if not self.module.batch_first:          # torch wants (N, B, E) then
                seq, query = seq.transpose(0, 1), query.transpose(0, 1)
            mask = None
            if self.causal:                          # True where j may not see i > j
                N = X.shape[1]
                mask = torch.ones(N, N, dtype=torch.bool).triu(1)
            out, _ = self.module(query, seq, seq, need_weights=False, attn_mask=mask)
            if not self.module.batch_first:
                out = out.transpose(0, 1)
            if every:
                return out.to(torch.float64).numpy()
            if self._r is None:
                return out[:, 0, :].to(torch.float64).numpy()
            return (out[:, 0, :] @ self._r).to(torch.float64).numpy()

    def merged_parameters(self) -> tuple[np.ndarray, np.ndarray]:
        """(W, v) of the served head, from the weights (for checking; needs ``head``)."""
        if self.head is None and self.module.num_heads > 1:
            raise InputError("the whole module has several heads; give head= to get one (W, v)")
        if self.readout is None:
            raise InputError("this box answers vectors (no readout): vector_model() gives "
                             "what it computes")
        return merged_head_parameters(self.module, self.readout, self.head or 0)

    def vector_model(self):
        """What the box computes, as a :class:`attnextract.models.VectorAttention` (every
        served head, biases included, in float64 from the copy's weights)."""
        return vector_attention(self.module, positions=self.positions, causal=self.causal,
                                heads=None if self.head is None else [self.head])

    def __repr__(self) -> str:
        which = "all heads" if self.head is None else f"head {self.head}"
        what = "" if self._r is not None else f", vectors at {self.positions} position" + (
            "s" if self.positions == "all" else "")
        return f"TorchAttentionBlackBox(E={self.dim}, {which}{what})"


def vector_attention(module, *, positions: str = "last", causal: bool = False,
                     heads=None):
    """A ``torch.nn.MultiheadAttention`` as the :class:`attnextract.models.VectorAttention`
    it computes, in float64: per head h with rows Q_h, K_h, V_h of ``in_proj_weight``
    (hd x E), query bias b_q,h and output columns W_o,h,

        W_h = K_h^T Q_h / sqrt(hd),  b_h = K_h^T b_q,h / sqrt(hd),  O_h = W_o,h V_h (E x E),

    and c = W_o b_v + b_o (the key bias cancels in the softmax). ``heads`` keeps only
    those heads (default: all). ``add_bias_kv`` and ``add_zero_attn`` are outside the
    class (InputError)."""
    torch = _torch()
    _check_module(module, torch)
    if module.bias_k is not None or module.add_zero_attn:
        raise InputError("add_bias_kv and add_zero_attn are outside the VectorAttention class")
    E, H = module.embed_dim, module.num_heads
    hd = E // H
    with torch.no_grad():
        weights = module.in_proj_weight.detach().to(torch.float64).cpu().numpy()
        out = module.out_proj.weight.detach().to(torch.float64).cpu().numpy()
        bias = (np.zeros(3 * E) if module.in_proj_bias is None
                else module.in_proj_bias.detach().to(torch.float64).cpu().numpy())
        out_bias = (np.zeros(E) if module.out_proj.bias is None
                    else module.out_proj.bias.detach().to(torch.float64).cpu().numpy())
    W, b, O = [], [], []
    for h in (range(H) if heads is None else heads):
        rows = slice(h * hd, (h + 1) * hd)
        Q, K, V = (weights[i * E:(i + 1) * E][rows] for i in range(3))
        W.append(K.T @ Q / math.sqrt(hd))
        b.append(K.T @ bias[:E][rows] / math.sqrt(hd))
        O.append(out[:, rows] @ V)
    # a served head alone keeps only its own share of the value bias
    kept = np.zeros(E, dtype=bool)
    for h in (range(H) if heads is None else heads):
        kept[h * hd:(h + 1) * hd] = True
    c = out[:, kept] @ bias[2 * E:][kept] + out_bias
    return VectorAttention(np.array(W), np.array(O), np.array(b), c, positions, causal)


class TorchPreLayerNormBlackBox:
    """A pre-LayerNorm (GPT-2 style) block as a black box, in float64:

        f(X) = r^T (x_N + MultiheadAttention(LN(x_N), LN(X), LN(X))),

    the residual stream plus attention on the normalised tokens, read at the last token.
    ``layer_norm`` is a ``torch.nn.LayerNorm(E)`` (affine), ``attention`` a
    ``torch.nn.MultiheadAttention`` (biases allowed, no ``add_bias_kv``); both are
    copied. :meth:`merged_parameters` is the same block as a
    :class:`attnextract.models.PreLayerNormAttention` (docs/algorithms.md,
    "Pre-LayerNorm layer").
    """

    kind = "torch-pre-ln-attention"

    def __init__(self, layer_norm, attention, readout=None):
        torch = _torch()
        _check_module(attention, torch)
        if not isinstance(layer_norm, torch.nn.LayerNorm) or tuple(
                layer_norm.normalized_shape) != (attention.embed_dim,) or layer_norm.weight is None:
            raise InputError(f"expected an affine torch.nn.LayerNorm({attention.embed_dim})")
        if attention.bias_k is not None or attention.add_zero_attn:
            raise InputError("add_bias_kv and add_zero_attn are outside the class")
        self.torch, self.dim = torch, attention.embed_dim
        self.norm = copy.deepcopy(layer_norm).to(torch.float64).eval()
        self.attention = copy.deepcopy(attention).to(torch.float64).eval()
        self.readout = _readout(readout, self.dim)
        self._r = torch.from_numpy(self.readout)

    def __call__(self, X) -> np.ndarray:
        X = _batch(X, self.dim)
        torch = self.torch
        with torch.no_grad():
            seq = torch.tensor(X)
            Y = self.norm(seq)
            query = Y[:, -1:, :]
            if not self.attention.batch_first:
                Y, query = Y.transpose(0, 1), query.transpose(0, 1)
            out, _ = self.attention(query, Y, Y, need_weights=False)
            if not self.attention.batch_first:
                out = out.transpose(0, 1)
            return ((seq[:, -1, :] + out[:, 0, :]) @ self._r).numpy()

    def merged_parameters(self):
        """The block as a :class:`attnextract.models.PreLayerNormAttention`: per head
        W_h = K_h^T Q_h / sqrt(hd), b_h = K_h^T b_q,h / sqrt(hd), v_h = V_h^T O_h^T r,
        c = (O b_v + b_o)^T r (the key bias cancels in the softmax)."""
        torch, module = self.torch, self.attention
        E, H = self.dim, module.num_heads
        hd, r = E // H, self.readout
        with torch.no_grad():
            weights, out = (t.detach().numpy() for t in (module.in_proj_weight,
                                                         module.out_proj.weight))
            zero = np.zeros(3 * E)
            bias = zero if module.in_proj_bias is None else module.in_proj_bias.detach().numpy()
            out_bias = (np.zeros(E) if module.out_proj.bias is None
                        else module.out_proj.bias.detach().numpy())
            gamma, beta = (t.detach().numpy() for t in (self.norm.weight, self.norm.bias))
        W, b, v = [], [], []
        for h in range(H):
            rows = slice(h * hd, (h + 1) * hd)
            Q, K, V = (weights[i * E:(i + 1) * E][rows] for i in range(3))
            W.append(K.T @ Q / math.sqrt(hd))
            b.append(K.T @ bias[:E][rows] / math.sqrt(hd))
            v.append(V.T @ (out[:, rows].T @ r))
        c = float((out @ bias[2 * E:] + out_bias) @ r)
        return PreLayerNormAttention(gamma, beta, np.array(W), np.array(b), np.array(v), c, r,
                                     self.norm.eps)

    def __repr__(self) -> str:
        return f"TorchPreLayerNormBlackBox(E={self.dim}, H={self.attention.num_heads})"
