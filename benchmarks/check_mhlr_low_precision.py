"""multi-head-low-rank on bfloat16 and K-decimal answers: within the bar, or refused typed.

Run:  python benchmarks/check_mhlr_low_precision.py   (H = 2, d = 12, r = 3, seeds 0-2;
prints one line per run: bfloat16 stated (float32 answers truncated to bfloat16), and
answers rounded to 4, 6 and 8 decimals, stated)
"""
import numpy as np, collections
from attnextract.adapters.targets import random_low_rank_multi_head
from attnextract.oracle import Oracle
from attnextract.registry import extract
from attnextract.errors import AttnExtractError
from attnextract.learners.multi_head import canonical_error
res = collections.defaultdict(list)
for how in ["bf16-stated", 4, 6, 8]:
    for seed in range(3):
        M = random_low_rank_multi_head(2, 12, 3, seed=seed)
        if how == "bf16-stated":
            def box(X, M=M):
                y = M(X).astype(np.float32)
                return (y.view(np.uint32) & 0xFFFF0000).view(np.float32).astype(np.float64)
            opts = {"output_dtype": "bfloat16"}
        else:
            box = (lambda X, M=M, K=how: np.round(M(X), K)); opts = {"decimals": how}
        o = Oracle(box, 12)
        try:
            r = extract(o, "multi-head-low-rank", heads=2, seed=seed, **opts)
            e, bar = canonical_error(r.model, M), r.report.details.get("error bar")
            res[how].append(("within" if e <= bar else "OUTSIDE", f"{e:.1e}", f"{bar:.1e}", o.queries))
        except AttnExtractError as exc:
            res[how].append(("refused", type(exc).__name__, str(exc)[:160]))
        except Exception as exc:
            res[how].append(("CRASH", repr(exc)[:200]))
        print(how, seed, res[how][-1], flush=True)
