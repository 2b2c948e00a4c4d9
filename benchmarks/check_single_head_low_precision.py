"""Single-head low-precision learner on torch heads: held-out error / allowance per run.

For each box (torch nn.MultiheadAttention(d, 1, bias=False), torch seed B, readout seed B,
in --case float32 | bfloat16 | float16, or float64 rounded to --decimals K) and learner
seed s: extract_low_precision(Oracle(box, d), seed=s, ...); records whether it was
refused, the held-out check's worst |f_hat - y| / allowed (``ratio``) and its family,
the W error against the head's float64 weights and the bar ``error_bar_W``.

    PYTHONPATH=src OPENBLAS_NUM_THREADS=1 python benchmarks/check_single_head_low_precision.py --dim 6 \
        --box 3 --seeds 0-199 --out runs.json
(benchmarks/results/single32_summary.md)
"""
import json, time, argparse
import numpy as np
import torch
from attnextract import Oracle, SingleHeadAttention, ModelMismatchError
from attnextract.adapters.torch_target import TorchAttentionBlackBox
from attnextract.learners import noisy
from attnextract.oracle import RoundedOutputs

p = argparse.ArgumentParser()
p.add_argument("--dim", type=int, default=6)
p.add_argument("--box", type=int, nargs="+", default=[3])
p.add_argument("--seeds", default="0-199")
p.add_argument("--case", default="float32")
p.add_argument("--decimals", type=int, default=6)
p.add_argument("--out")
a = p.parse_args()
lo, hi = map(int, a.seeds.split("-"))

# record the verification ratio
captured = {}
orig = noisy.verify_noisy
def wrap(*args, **kw):
    ver = orig(*args, **kw)
    captured["ver"] = ver
    return ver
noisy.verify_noisy = wrap

rows = []
for b in a.box:
    torch.manual_seed(b)
    m = torch.nn.MultiheadAttention(a.dim, 1, bias=False, batch_first=True).double()
    dtype = "float64" if a.case == "decimals" else a.case
    box = TorchAttentionBlackBox(m, b, head=0, dtype=dtype)
    truth = SingleHeadAttention(*box.merged_parameters())
    opts = {"decimals": a.decimals} if a.case == "decimals" else {"output_dtype": a.case}
    if a.case == "decimals":
        box = RoundedOutputs(box, decimals=a.decimals)
    t0 = time.time()
    for s in range(lo, hi + 1):
        try:
            res = noisy.extract_low_precision(Oracle(box, a.dim), seed=s, **opts)
            ok = True
        except ModelMismatchError as e:
            res, ok = e.result, False
        det = res.report.details
        eW = float(np.linalg.norm(res.model.W - truth.W))
        ev = float(np.linalg.norm(res.model.v - truth.v))
        rows.append(dict(box=b, seed=s, ok=ok, ratio=captured["ver"].worst_ratio,
                         fam=captured["ver"].worst_family, eW=eW, barW=det["error_bar_W"],
                         ev=ev, barv=det["error_bar_v"], q=res.queries,
                         normW=float(np.linalg.norm(truth.W))))
    r = [x for x in rows if x["box"] == b]
    rat = np.array([x["ratio"] for x in r]); eb = np.array([x["eW"] / x["barW"] for x in r])
    print(f"box {b} d {a.dim} {a.case}: refused {sum(not x['ok'] for x in r)}/{len(r)}, "
          f"ratio max {rat.max():.3f} (seed {r[int(rat.argmax())]['seed']}) p50 {np.median(rat):.3f}, "
          f"eW/bar max {eb.max():.3f} p50 {np.median(eb):.3f}, bar p50 {np.median([x['barW'] for x in r]):.3g}, "
          f"rel bar p50 {np.median([x['barW']/x['normW'] for x in r]):.3g}, q {r[0]['q']}, {time.time()-t0:.0f}s",
          flush=True)
if a.out:
    json.dump(rows, open(a.out, "w"))
