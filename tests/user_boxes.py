"""Black boxes written the way a user writes them, outside the project's own targets.

Nothing here comes from ``attnextract.adapters.targets``: the heads are drawn with numpy,
the formula f(X) = sum_h softmax(X W_h x_N)^T X v_h is written out by hand, and the
PyTorch boxes call ``nn.MultiheadAttention`` directly. ``tests/test_user_boxes.py`` runs
a few of them; ``benchmarks/check_user_boxes.py`` runs all of them through the API and
the command line (results in ``benchmarks/results/check_user_boxes.md``).
"""

from __future__ import annotations

import numpy as np


# -- the formula, by hand ------------------------------------------------------------

def draw_heads(d: int, H: int, seed: int = 0, *, w_scale: float = 1.0, v_scale: float = 1.0):
    """H heads: W_h entries N(0, w_scale^2 / d), v_h entries N(0, v_scale^2); (H, d, d), (H, d)."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((H, d, d)) * (w_scale / np.sqrt(d))
    v = rng.standard_normal((H, d)) * v_scale
    return W, v


def formula(X, W, v):
    """One sequence X (N, d) -> a Python float: sum_h softmax(X W_h x_N)^T X v_h."""
    total = 0.0
    for W_h, v_h in zip(W, v):
        s = X @ (W_h @ X[-1])
        a = np.exp(s - s.max())
        a /= a.sum()
        total += a @ (X @ v_h)
    return float(total)


def formula_batched(X, W, v):
    """A batch X (B, N, d) -> (B,): the same formula with einsum."""
    s = np.einsum("bnd,hde,be->bhn", X, W, X[:, -1])
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    return np.einsum("bhn,bnd,hd->b", a, X, v)


def numpy_box(W, v, style: str = "batched"):
    """The formula as a black box that answers in ``style``.

    "batched": (B, N, d) -> (B,) float64. Per sequence, X (N, d) -> one number:
    "float" (a Python float), "0d" (a 0-d array), "(1,)" (an array of one),
    "float32" (a numpy float32, the formula run in float32).
    """
    W, v = np.asarray(W), np.asarray(v)
    if style == "batched":
        return lambda X: formula_batched(X, W, v)
    if style == "float":
        return lambda X: formula(X, W, v)
    if style == "0d":
        return lambda X: np.array(formula(X, W, v))
    if style == "(1,)":
        return lambda X: np.array([formula(X, W, v)])
    if style == "float32":
        W32, v32 = W.astype(np.float32), v.astype(np.float32)

        def f32(X):
            X = np.asarray(X, dtype=np.float32)
            total = np.float32(0)
            for W_h, v_h in zip(W32, v32):
                s = X @ (W_h @ X[-1])
                a = np.exp(s - s.max())
                a /= a.sum()
                total += a @ (X @ v_h)
            return total
        return f32
    raise ValueError(f"unknown style {style!r}")


# -- boxes outside the class -----------------------------------------------------------

def outside_box(kind: str, W, v):
    """A box outside multi-head attention (per sequence, as users write them)."""
    W, v = np.asarray(W), np.asarray(v)
    if kind == "relu after attention":
        return lambda X: max(formula(X, W, v), 0.0)
    if kind == "layernorm after attention":
        d = W.shape[1]
        r = np.random.default_rng(5).standard_normal(d)

        def ln(X):
            y = sum(_softmax(X @ (W_h @ X[-1])) @ X * v_h for W_h, v_h in zip(W, v))
            y = (y - y.mean()) / np.sqrt(y.var() + 1e-5)
            return float(y @ r)
        return ln
    if kind == "temperature per position":
        def temp(X):
            N = len(X)
            t = 1.0 + np.arange(N) / N         # a temperature that grows along the sequence
            return float(sum(_softmax((X @ (W_h @ X[-1])) / t) @ (X @ v_h)
                             for W_h, v_h in zip(W, v)))
        return temp
    if kind == "NaN once":
        calls = [0]

        def nan_once(X):
            calls[0] += 1
            return float("nan") if calls[0] == 50 else formula(X, W, v)
        return nan_once
    if kind == "two numbers":
        return lambda X: [formula(X, W, v), formula(X, W, v)]
    raise ValueError(f"unknown kind {kind!r}")


OUTSIDE = ("relu after attention", "layernorm after attention", "temperature per position",
           "NaN once", "two numbers")


def _softmax(s):
    a = np.exp(s - s.max())
    return a / a.sum()


# -- PyTorch, as users build and wrap it ---------------------------------------------------

def torch_layer(d: int, H: int, *, seed: int = 0, bias: bool = True, batch_first: bool = False,
                float64: bool = False, trained_biases: bool = False):
    """``nn.MultiheadAttention(d, H)`` with PyTorch's defaults unless told: float32, biases
    (which PyTorch initialises to zero; ``trained_biases`` draws them N(0, 1), as training
    leaves them)."""
    import torch
    torch.manual_seed(seed)
    layer = torch.nn.MultiheadAttention(d, H, bias=bias, batch_first=batch_first)
    if trained_biases:
        with torch.no_grad():
            layer.in_proj_bias.normal_()
            layer.out_proj.bias.normal_()
    return layer.double() if float64 else layer


def torch_user_box(layer, readout):
    """A user's own wrapper: self-attention over X, output at the last token read with
    ``readout``, in the module's own dtype. (B, N, d) -> (B,)."""
    import torch
    dtype = next(layer.parameters()).dtype
    r = torch.as_tensor(np.asarray(readout), dtype=dtype)

    def box(X):
        with torch.no_grad():
            x = torch.as_tensor(X, dtype=dtype)
            if not layer.batch_first:
                x = x.transpose(0, 1)
            out, _ = layer(x, x, x, need_weights=False)
            last = out[-1] if not layer.batch_first else out[:, -1]
            return (last @ r).double().numpy()
    return box


def torch_truth(layer, readout):
    """The layer's heads in float64 from its weights: W_h = K_h^T Q_h / sqrt(hd),
    b_h = K_h^T b_q,h / sqrt(hd), v_h = V_h^T O_h^T r, c = (O b_v + b_o)^T r.
    Returns (W (H, d, d), v (H, d), b (H, d), c)."""
    d, H = layer.embed_dim, layer.num_heads
    hd = d // H
    P = layer.in_proj_weight.detach().double().numpy()
    O = layer.out_proj.weight.detach().double().numpy()
    pb = (np.zeros(3 * d) if layer.in_proj_bias is None
          else layer.in_proj_bias.detach().double().numpy())
    ob = np.zeros(d) if layer.out_proj.bias is None else layer.out_proj.bias.detach().double().numpy()
    r = np.asarray(readout, dtype=np.float64)
    Q, K, V = P[:d], P[d:2 * d], P[2 * d:]
    W, v, b = [], [], []
    for h in range(H):
        rows = slice(h * hd, (h + 1) * hd)
        W.append(K[rows].T @ Q[rows] / np.sqrt(hd))
        b.append(K[rows].T @ pb[:d][rows] / np.sqrt(hd))
        v.append(V[rows].T @ (O[:, rows].T @ r))
    c = float((O @ pb[2 * d:] + ob) @ r)
    return np.array(W), np.array(v), np.array(b), c


def unit_readout(d: int, seed: int = 0) -> np.ndarray:
    r = np.random.default_rng(seed).standard_normal(d)
    return r / np.linalg.norm(r)


def canonical_errors(model, W, v, b=None, c=0.0) -> dict:
    """Relative errors of a recovered model against the truth in canonical form: heads
    with equal [W_h | b_h] merged, v_h = 0 dropped, matched in any order."""
    H, d = np.shape(v)
    b = np.zeros((H, d)) if b is None else np.asarray(b)

    def canon(W, v, b):
        Wb = [np.concatenate([W_h, b_h[:, None]], 1) for W_h, b_h in zip(W, b)]
        keep_W, keep_v = [], []
        for Wb_h, v_h in zip(Wb, v):
            for i, K in enumerate(keep_W):
                if np.linalg.norm(K - Wb_h) <= 1e-9 * max(np.linalg.norm(K), 1e-300):
                    keep_v[i] = keep_v[i] + v_h
                    break
            else:
                keep_W.append(Wb_h)
                keep_v.append(np.array(v_h, dtype=float))
        scale = max(np.linalg.norm(x) for x in keep_v) if keep_v else 0.0
        pairs = [(K, x) for K, x in zip(keep_W, keep_v) if np.linalg.norm(x) > 1e-9 * scale]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    rb = getattr(model, "b", None)
    rb = np.zeros(np.shape(model.v)) if rb is None else np.asarray(rb)
    tW, tv = canon(W, v, b)
    mW, mv = canon(np.asarray(model.W).reshape(-1, d, d), np.asarray(model.v).reshape(-1, d),
                   rb.reshape(-1, d))
    if len(tW) != len(mW):
        return {"heads": (len(mW), len(tW)), "W": np.inf, "v": np.inf, "c": np.inf}
    from scipy.optimize import linear_sum_assignment
    eW = np.array([[np.linalg.norm(m - t) / np.linalg.norm(t) for m in mW] for t in tW])
    ev = np.array([[np.linalg.norm(m - t) / np.linalg.norm(t) for m in mv] for t in tv])
    rows, cols = linear_sum_assignment(np.maximum(eW, ev))
    best = (float(eW[rows, cols].max(initial=0.0)), float(ev[rows, cols].max(initial=0.0)))
    mc = float(getattr(model, "c", 0.0) or 0.0)
    scale = max(abs(c), max(np.linalg.norm(x) for x in tv))
    return {"heads": (len(mW), len(tW)), "W": best[0], "v": best[1], "c": abs(mc - c) / scale}
