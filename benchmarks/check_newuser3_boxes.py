"""A new user's own black boxes (issue 22, newuser3 audit), written from the user docs only.

Adds to benchmarks/check_user_boxes.py: answers rounded to K decimals (stated and not),
boxes answering lists / torch tensors / float32 casts, a float32 module post-processed in
float64, a head 1000 times weaker, more heads than d, two heads sharing W and a dead head,
and out-of-class boxes with ReLU or sigmoid attention, a residual, or output noise. Each
case runs in this process (they take seconds at d = 8 and 16), one BLAS thread:

    OPENBLAS_NUM_THREADS=1 nice -n 10 python benchmarks/check_newuser3_boxes.py \
        --markdown benchmarks/results/newuser3_boxes.md

Outcome per case: "recovered" (canonical error against the box's own weights, within the
learner's error bar or OUTSIDE IT), the refusal's type and the start of its message, or a
crash. An in-class box refused, or an out-of-class box returned, is marked.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import attnextract
from attnextract import Oracle
from attnextract.learners.multi_head import canonical_error


def draw(H, d, seed, s=1.0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((H, d, d)) * s / np.sqrt(d), rng.standard_normal((H, d))


def numpy_box(W, v, act="softmax", residual=False, noise=0.0, decimals=None, cast=None,
              answer="array"):
    """(B, N, d) -> (B,): sum over heads of act(X W_h x_N)-weighted X v_h."""
    rng = np.random.default_rng(1000)
    r = np.random.default_rng(7).standard_normal(W.shape[1])

    def box(X):
        out = np.zeros(len(X))
        for W_h, v_h in zip(W, v):
            s = np.einsum("bnd,de,be->bn", X, W_h, X[:, -1])
            if act == "softmax":
                a = np.exp(s - s.max(1, keepdims=True))
                a /= a.sum(1, keepdims=True)
            elif act == "relu":
                a = np.maximum(s, 0) / X.shape[1]
            else:                                  # sigmoid attention
                a = 1 / (1 + np.exp(-s)) / X.shape[1]
            out += np.einsum("bn,bn->b", a, X @ v_h)
        if residual:
            out += X[:, -1] @ r
        out += noise * rng.standard_normal(len(out))
        if decimals is not None:
            out = np.round(out, decimals)
        if cast is not None:
            out = out.astype(cast)
        if answer == "list":
            return out.tolist()
        if answer == "torch":
            import torch
            return torch.as_tensor(out)
        return out
    return box


def per_sequence_box(W, v):
    def box(X):                                    # (N, d) -> a float
        out = 0.0
        for W_h, v_h in zip(W, v):
            s = X @ W_h @ X[-1]
            a = np.exp(s - s.max())
            out += float(a @ (X @ v_h) / a.sum())
        return out
    return box


def torch_box(d, H, seed, dtype, post=None):
    """nn.MultiheadAttention(bias=False), last token as query, a unit readout; truth from
    its weights: W_h = K_h^T Q_h / sqrt(d/H), v_h = V_h^T O_h^T r."""
    import torch
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(d, H, bias=False, batch_first=True).to(dtype)
    r = torch.nn.functional.normalize(torch.randn(d, dtype=dtype), dim=0)

    def box(X):
        x = torch.as_tensor(X, dtype=dtype)
        with torch.no_grad():
            out, _ = mha(x[:, -1:], x, x, need_weights=False)
        y = (out[:, -1] @ r).double().numpy()
        return y if post is None else post(y)
    hd = d // H
    Wi = mha.in_proj_weight.detach().double().numpy()
    Q, K, V = Wi[:d], Wi[d:2 * d], Wi[2 * d:]
    O = mha.out_proj.weight.detach().double().numpy()
    rr = r.detach().double().numpy()
    W = np.array([K[h * hd:(h + 1) * hd].T @ Q[h * hd:(h + 1) * hd] / np.sqrt(hd)
                  for h in range(H)])
    v = np.array([V[h * hd:(h + 1) * hd].T @ O[:, h * hd:(h + 1) * hd].T @ rr
                  for h in range(H)])
    return box, (W, v)


def cases():
    import torch
    out = []
    for H, d, s in ((2, 8, 1.0), (3, 8, 3.0), (4, 16, 1.0), (2, 16, 3.0)):
        W, v = draw(H, d, 10 + H, s)
        for heads in (H, None):
            out.append((f"numpy H={H} d={d} s={s:g}", numpy_box(W, v), d, (W, v), heads, {}))
    W, v = draw(2, 8, 1)
    for label, kw in (("float32 cast", dict(cast=np.float32)), ("list", dict(answer="list")),
                      ("torch tensor", dict(answer="torch"))):
        out.append((f"numpy 8x2, answers {label}", numpy_box(W, v, **kw), 8, (W, v), None, {}))
    for k in (6, 4):
        out.append((f"numpy 8x2 rounded to {k} decimals, not stated",
                    numpy_box(W, v, decimals=k), 8, (W, v), 2, {}))
        out.append((f"numpy 8x2 rounded to {k} decimals, stated",
                    numpy_box(W, v, decimals=k), 8, (W, v), None, {"decimals": k}))
    out.append(("per-sequence numpy 8x2", per_sequence_box(W, v), 8, (W, v), None, {}))
    Wc, vc = draw(4, 8, 7)
    Wc[1], vc[3] = Wc[0], 0.0
    for heads in (4, None):
        out.append(("4 heads, 2 share W, 1 has v = 0 (canonical 2)", numpy_box(Wc, vc), 8,
                    (Wc, vc), heads, {}))
    Ww, vw = draw(2, 8, 2)
    vw[1] *= 1e-3
    for heads in (2, None):
        out.append(("2 heads, one 1e-3 weaker", numpy_box(Ww, vw), 8, (Ww, vw), heads, {}))
    W5, v5 = draw(5, 4, 2)
    out.append(("5 heads at d = 4 (beyond the learner)", numpy_box(W5, v5), 4, (W5, v5), None,
                {}))
    for d, H in ((8, 2), (16, 2), (8, 4), (16, 4)):
        for dtype in (torch.float64, torch.float32):
            box, truth = torch_box(d, H, 5, dtype)
            tag = "float64" if dtype == torch.float64 else "float32"
            for heads in (H, None):
                out.append((f"torch MHA d={d} H={H} {tag}", box, d, truth, heads, {}))
    box, truth = torch_box(8, 2, 3, torch.float32, post=lambda y: y * (1 + 1e-7))
    out.append(("torch MHA 8x2 float32, readout post-processed in float64", box, 8, truth,
                None, {}))
    out.append(("torch MHA 8x2 float32, readout post-processed in float64", box, 8, truth,
                None, {"output_dtype": "float32"}))
    for label, kw in (("ReLU attention", dict(act="relu")),
                      ("sigmoid attention", dict(act="sigmoid")),
                      ("residual x_N^T r added", dict(residual=True)),
                      ("output noise 1e-6", dict(noise=1e-6)),
                      ("output noise 1e-3", dict(noise=1e-3))):
        for heads in (2, None):
            out.append((f"OUTSIDE: {label}", numpy_box(W, v, **kw), 8, None, heads, {}))
    return out


def run(case, seed):
    name, box, d, truth, heads, options = case
    kw = dict(options, seed=seed)
    if heads is not None:
        kw["heads"] = heads
    start, cpu = time.time(), time.process_time()
    row = dict(name=name, d=d, told="yes" if heads else "no",
               options=", ".join(f"{k}={v}" for k, v in options.items()) or "-")
    oracle = Oracle(box, d)
    try:
        result = attnextract.extract(oracle, "multi-head", **kw)
    except attnextract.errors.AttnExtractError as exc:
        text = " ".join(str(exc).split())
        row["outcome"] = f"{type(exc).__name__}: {text[:160]}{'...' if len(text) > 160 else ''}"
        row["flag"] = "in-class refused" if truth is not None else ""
        if truth is not None and isinstance(exc, attnextract.errors.ModelMismatchError):
            row["flag"] = "IN-CLASS REFUSED AS A MISMATCH"
    except Exception as exc:                     # an untyped error is a crash
        row["outcome"], row["flag"] = f"CRASH {type(exc).__name__}: {exc}"[:200], "CRASH"
    else:
        bar = result.report.details.get("error bar")
        if truth is None:
            row["outcome"], row["flag"] = f"returned {result.model.heads} heads", "OUTSIDE RETURNED"
        else:
            err = canonical_error(result.model, attnextract.MultiHeadAttention(*truth))
            row["outcome"] = (f"recovered {result.model.heads} heads, error {err:.1e}, "
                              f"bar {bar:.1e}")
            row["flag"] = "" if err <= bar else "OUTSIDE ITS BAR"
    row["queries"] = oracle.queries
    row["cpu"], row["wall"] = time.process_time() - cpu, time.time() - start
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1, help="learner seed (default 1)")
    parser.add_argument("--markdown", help="write the table to this file")
    args = parser.parse_args(argv)
    rows = []
    for case in cases():
        rows.append(run(case, args.seed))
        r = rows[-1]
        print(f"{r['name']} | told {r['told']} | {r['options']} | {r['outcome']} | "
              f"{r['queries']} q | {r['cpu']:.1f} s CPU | {r['flag']}", flush=True)
    lines = ["| box | d | told H | options | outcome | queries | CPU s | wall s | flag |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['d']} | {r['told']} | {r['options']} | "
              f"{r['outcome'].replace('|', '/')} | {r['queries']} | {r['cpu']:.1f} | "
              f"{r['wall']:.1f} | {r['flag']} |" for r in rows]
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
