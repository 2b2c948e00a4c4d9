"""A float32 / bfloat16 torch head's own error on the held-out sequences, by length.

No extraction: the held-out designs of verify_noisy (seeds 0..--seeds-1) built on the
true head, answered by the box in --dtype and by the float64 head. Per length band:
the error over the allowance without the length term (``current``: 5 (rho s K + rho
(|grad_W| |W| + |grad_v| |v|)), rho = FORWARD_RHO), with it (``new``: + (N - 1) 2^-24
(sum_i alpha_i |v^T x_i| + s K), --variant 2; --variant 1 uses |f| for s K), and the
error over the length term alone (``acc``).

    PYTHONPATH=src OPENBLAS_NUM_THREADS=1 python benchmarks/check_low_precision_box_error.py --seeds 10 \
        --boxes 0 1 2 3 4 5
(benchmarks/results/single32_summary.md)
"""
import numpy as np, torch, math, argparse
from attnextract import Oracle, SingleHeadAttention
from attnextract.adapters.torch_target import TorchAttentionBlackBox
from attnextract.learners import noisy
from attnextract.models import softmax
from attnextract.oracle import by_length, evaluate_ragged
from attnextract.report import verification_count
from attnextract.verification import design, token_norms, output_scale, safe_norm
p = argparse.ArgumentParser()
p.add_argument("--dims", type=int, nargs="+", default=[4, 6, 8, 16])
p.add_argument("--boxes", type=int, nargs="+", default=[0, 1, 2, 3])
p.add_argument("--seeds", type=int, default=10)
p.add_argument("--dtype", default="float32")
p.add_argument("--variant", type=int, default=2)
a = p.parse_args()
u = {"float32": 2.0**-24, "bfloat16": 2.0**-8}[a.dtype]
rows = []
for d in a.dims:
    for b in a.boxes:
        torch.manual_seed(b)
        m = torch.nn.MultiheadAttention(d, 1, bias=False, batch_first=True).double()
        box = TorchAttentionBlackBox(m, b, head=0, dtype=a.dtype)
        truth = SingleHeadAttention(*box.merged_parameters())
        rho = noisy.FORWARD_RHO[a.dtype]
        noise = noisy.NoiseModel(0.0, rho, "random", forward=True)
        for s in range(a.seeds):
            rng = np.random.default_rng(s)
            count = verification_count(d * d + d, 4 * (d * d + d))
            held = design(d, count, rng, 1 / math.sqrt(d), model=truth, max_length=None, exclude=("far",))
            seqs = held.sequences
            obs = Oracle(box, d).query_ragged(seqs)
            f64 = evaluate_ragged(truth, seqs)
            n = len(seqs)
            gW, gv, S, L = np.empty(n), np.empty(n), np.empty(n), np.empty(n)
            for idx, X in by_length(seqs):
                _, gW[idx], gv[idx] = noisy.output_gradient_norms(truth, X)
                sc = np.einsum("bnd,bd->bn", X, X[:, -1, :] @ truth.W.T)
                al = softmax(sc)
                S[idx] = np.einsum("bn,bn->b", al, np.abs(X @ truth.v))
                L[idx] = X.shape[1]
            norms = token_norms(seqs)
            ref = np.array([f != "hull" for f in held.family])
            denom = np.maximum(np.abs(obs), norms * output_scale(obs[ref], norms[ref]))
            nb = 5 * (noise.bound(denom) + rho * (gW * safe_norm(truth.W) + gv * safe_norm(truth.v)))
            err = np.abs(obs - f64)
            for i in range(n):
                rows.append((d, b, s, held.family[i], L[i], err[i], nb[i], S[i], denom[i], abs(f64[i])))

fams = np.array([r[3] for r in rows])
R = np.array([(r[0], r[4], r[5], r[6], r[7], r[8], r[9]) for r in rows])
d_, L_, e_, nb_, S_, den_, f_ = R.T
u32 = 2.0 ** -24
acc = u32 * (L_ - 1) * (S_ + (den_ if a.variant == 2 else f_))
new = nb_ + acc
print(f"{a.dtype}: {len(R)} answers; max err/current {np.max(e_/nb_):.3f}; max err/new {np.max(e_/new):.3f}; median new/current {np.median(new/nb_):.4f}")
bins = [1, 2, 8, 32, 128, 512, 1024, 2048, 4097]
for lo, hi in zip(bins[:-1], bins[1:]):
    k = (L_ >= lo) & (L_ < hi)
    if not k.any(): continue
    with np.errstate(all="ignore"):
        print(f"  N {lo:>4}-{hi-1:<4} n {k.sum():>5}: err/current max {np.max(e_[k]/nb_[k]):.3f}; err/new max {np.max(e_[k]/new[k]):.3f} p99 {np.quantile(e_[k]/new[k], .99):.3f}; "
              f"err/acc max {np.nanmax(e_[k]/acc[k]):.3f}; new/current median {np.median(new[k]/nb_[k]):.2f} max {np.max(new[k]/nb_[k]):.2f}")
for f in sorted(set(fams)):
    k = fams == f
    with np.errstate(all="ignore"):
        print(f"  {f:>9} n {k.sum():>5} Lmax {L_[k].max():.0f}: err/current max {np.max(e_[k]/nb_[k]):.3f}; err/new max {np.max(e_[k]/new[k]):.3f}; err/acc max (N>64) {np.nanmax(np.where(L_[k]>64, e_[k]/acc[k], 0)):.3f}")
