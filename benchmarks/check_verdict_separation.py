"""Separation of in-class and out-of-class boxes by the multi-head learner's mismatch tests
(issue 22, verdict): the single-token misfit (:meth:`_Extraction.single_token_misfit`, asked
at a refusal; here also after every run, to measure it on in-class boxes) and the base rows'
relative misfit of a "no base row fits" refusal (the float32 hint).

    OPENBLAS_NUM_THREADS=1 nice -n 10 python benchmarks/check_verdict_separation.py \
        [--quick] [--out FILE.md]

Each run's outcome type, the single-token misfit and, where measured, the base rows'
relative misfit are printed; the summary gives the largest in-class single-token misfit
and the smallest out-of-class one (the margin).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import attnextract
from attnextract import Oracle
from attnextract.adapters.targets import random_multi_head
from attnextract.learners import multi_head

import _results



def draw(H, d, seed, s=1.0):
    """H random heads: W_h entries N(0, s^2 / d), v_h entries N(0, 1)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((H, d, d)) * s / np.sqrt(d), rng.standard_normal((H, d))


def numpy_box(W, v, act="softmax", residual=False, noise=0.0):
    """(B, N, d) -> (B,): the sum over heads of act(X W_h x_N)-weighted X v_h, written
    as a user writes it; ``act`` relu or sigmoid (divided by N), a residual x_N^T r or
    Gaussian output noise put the box outside the class."""
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
        return out + noise * rng.standard_normal(len(out))
    return box


def torch_box(d, H, seed, dtype, post=None):
    """nn.MultiheadAttention(bias=False), the last token as query, a unit readout;
    returns the box and the truth from its weights: W_h = K_h^T Q_h / sqrt(d/H),
    v_h = V_h^T O_h^T r."""
    import torch                         # optional: only the torch boxes need it
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


_seen = {}
_run = multi_head._Extraction.run


def _measuring_run(self):
    """The learner's run, then (succeeded or not) the single-token misfit of this box."""
    try:
        return _run(self)
    finally:
        if ("single-token misfit" not in self.details and hasattr(self, "precision")
                and hasattr(self, "single_token_misfit")):   # (not on the code before)
            self.single_token_misfit()
        _seen.update(self.details)


multi_head._Extraction.run = _measuring_run


def boxes(quick: bool):
    seeds = range(2) if quick else range(4)
    for d, H in ((8, 1), (8, 2), (8, 4), (8, 8), (16, 2), (16, 4), (16, 8)):
        for s in (1.0, 3.0):
            for seed in seeds:
                m = random_multi_head(H, d, seed, w_scale=s / np.sqrt(d))
                yield "in", f"numpy H={H} d={d} s={s:g}", m, d, H, seed, {}
    for seed in seeds:
        W, v = draw(2, 8, seed)
        v[1] *= 1e-3                         # a head 1000 times weaker (refused in-class)
        for told in (2, None):
            yield "in", "numpy 2 heads, one 1e-3 weaker", numpy_box(W, v), 8, told, seed, {}
        W, v = draw(2, 8, seed)
        v[1] = -v[0] * (1 + 1e-9)            # values cancel in v = v_1 + v_2 (|v| 1e-9)
        for told in (2, None):
            yield "in", "numpy 2 heads, v_2 = -v_1 (1 + 1e-9)", numpy_box(W, v), 8, told, seed, {}
    import torch
    for d, H in ((8, 2), (8, 4), (16, 2), (16, 4), (8, 8), (16, 8)):
        for dtype in (torch.float64, torch.float32):
            for seed in seeds if not (d == 16 and H == 8) else range(1):
                box, _ = torch_box(d, H, seed, dtype)
                tag = "float64" if dtype == torch.float64 else "float32"
                for told in (H, None):
                    yield "in", f"torch MHA d={d} H={H} {tag}", box, d, told, seed, {}
                if dtype == torch.float32 and H <= 4:
                    post, _ = torch_box(d, H, seed, dtype, post=lambda y: y * (1 + 1e-7))
                    for told in (H, None):
                        yield ("in", f"torch MHA d={d} H={H} float32 post float64", post, d,
                               told, seed, {})
    kinds = (("ReLU", dict(act="relu")), ("sigmoid", dict(act="sigmoid")),
             ("residual", dict(residual=True)), ("noise 1e-6", dict(noise=1e-6)),
             ("noise 1e-3", dict(noise=1e-3)))
    for d, H in ((8, 2), (8, 4), (16, 2)):
        for seed in range(1, 3 if quick else 4):
            W, v = draw(H, d, seed)
            for label, kw in kinds:
                for told in (H, None):
                    yield "out", f"{label} H={H} d={d}", numpy_box(W, v, **kw), d, told, seed, {}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--where", choices=("in", "out"), help="only in-class or out-of-class boxes")
    _results.add_out_option(parser, __file__)
    args = parser.parse_args(argv)
    with _results.Run(__file__, args.out, argv=argv) as results:
        results.capture()
        measure(args)
    return 0


def measure(args) -> None:
    """Every box (a line each), then the margin and the outcomes."""
    rows = []
    for where, name, box, d, told, seed, options in boxes(args.quick):
        if args.where and where != args.where:
            continue
        _seen.clear()
        oracle = Oracle(box, d)
        start = time.process_time()
        kw = dict(options, seed=seed, **({"heads": told} if told else {}))
        try:
            attnextract.extract(oracle, "multi-head", **kw)
            outcome, message = "recovered", ""
        except attnextract.errors.AttnExtractError as exc:
            outcome, message = type(exc).__name__, " ".join(str(exc).split())
        row = dict(where=where, name=name, d=d, told=told, seed=seed, outcome=outcome,
                   single=_seen.get("single-token misfit"),
                   base=_seen.get("base rows' relative misfit"),
                   base_f32=_seen.get("base rows' misfit in float32 noise"),
                   f32_hint="--output-dtype float32" in message,
                   biases_hint="--biases" in message, may_be_outside="may also end here" in message,
                   queries=oracle.queries, cpu=time.process_time() - start,
                   message=message[:300])
        rows.append(row)
        print(f"{where} | {name} | told {told} | seed {seed} | {outcome} | single "
              f"{row['single']} | base {row['base']} ({row['base_f32']} f32 noise) | f32 hint {row['f32_hint']} | "
              f"{row['queries']} q | {row['cpu']:.1f} s", flush=True)
    inside = [r["single"] for r in rows if r["where"] == "in" and r["single"] is not None]
    outside = [r["single"] for r in rows if r["where"] == "out" and r["single"] is not None]
    print(f"single-token misfit: in-class at most {max(inside, default=0):.1e} ({len(inside)} "
          f"runs), out-of-class at least {min(outside, default=0):.1e} ({len(outside)} runs)")
    for where in ("in", "out"):
        print(f"{where}: outcomes", {o: sum(r["outcome"] == o for r in rows if r["where"] == where)
                                    for o in sorted({r["outcome"] for r in rows})})


if __name__ == "__main__":
    raise SystemExit(main())
