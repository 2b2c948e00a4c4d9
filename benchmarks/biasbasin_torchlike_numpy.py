"""Heads drawn as PyTorch initialises nn.MultiheadAttention(d, H) (in-projection uniform
+-sqrt(6 / 4d), out-projection +-1/sqrt(d)) with trained biases N(0, BQ^2) for b_q and
N(0, 1) for b_v, b_o, read out by a random unit vector, in numpy (no torch):
W_h = K_h^T Q_h / sqrt(hd), b_h = K_h^T b_q,h / sqrt(hd), v_h = V_h^T O_h^T r.
Learner told H, seed = box seed.

Run:  python benchmarks/biasbasin_torchlike_numpy.py D H SEEDS [BQ]
"""
import sys, time
import numpy as np
from attnextract.models import BiasedMultiHeadAttention
from attnextract.oracle import Oracle
from attnextract.learners.multi_head import extract_multi_head
from attnextract.learners.multi_head.canonical import biased_canonical_errors

def trained_bias_heads(d, H, seed):
    rng = np.random.default_rng(seed)
    hd = d // H
    bound = np.sqrt(6.0 / (4 * d))
    P = rng.uniform(-bound, bound, (3 * d, d))
    O = rng.uniform(-1 / np.sqrt(d), 1 / np.sqrt(d), (d, d))
    bq, bv, bo = BQ * rng.standard_normal(d), rng.standard_normal(d), rng.standard_normal(d)
    r = rng.standard_normal(d); r /= np.linalg.norm(r)
    Q, K, V = P[:d], P[d:2 * d], P[2 * d:]
    W, v, b = [], [], []
    for h in range(H):
        s = slice(h * hd, (h + 1) * hd)
        W.append(K[s].T @ Q[s] / np.sqrt(hd)); b.append(K[s].T @ bq[s] / np.sqrt(hd))
        v.append(V[s].T @ (O[:, s].T @ r))
    return BiasedMultiHeadAttention(np.array(W), np.array(v), np.array(b), float((O @ bv + bo) @ r))

d, H = int(sys.argv[1]), int(sys.argv[2]); BQ = float(sys.argv[4]) if len(sys.argv) > 4 else 1.0
for seed in [int(s) for s in sys.argv[3].split(",")]:
    truth = trained_bias_heads(d, H, seed)
    t = time.time()
    try:
        res = extract_multi_head(Oracle(truth, d), H, seed=seed, biases=True)
        e = biased_canonical_errors(res.model, truth)
        dt = res.report.details
        print(seed, "ok %.1e" % max(e["W"], e["b"], e["v"], e["c"]), "bar %.1e" % dt["error bar"], "mv", dt.get("column moves / gap (median, max)"), "gain", dt.get("column gain measured / assumed"), dt.get("designs tried", 1), "%.1fs" % (time.time() - t), flush=True)
    except Exception as ex:
        print(seed, type(ex).__name__, str(ex)[:120], "%.1fs" % (time.time() - t), flush=True)
