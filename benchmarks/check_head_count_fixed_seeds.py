"""bench_head_count's boxes (d = 8, H 2 4 6 8, scales 1 3, seeds 0-2) with a fixed learner
seed (the box seed; bench_head_count draws it unseeded), told and not told; plus the
out-of-class box of test_count_not_found_is_refused_quickly_with_a_hint (tanh + sine of
a 2-head box, d = 6) not told, learner seeds 0-11. One JSON line per run."""
import json, sys
import numpy as np
from threadpoolctl import threadpool_limits
from attnextract import Oracle
from attnextract.adapters.targets import random_multi_head
from attnextract.errors import AttnExtractError
from attnextract.learners.multi_head import canonical_error, extract_multi_head
out = open(sys.argv[1], "w")
def run(box, d, heads, seed, truth, tag):
    o = Oracle(box, d)
    row = {"tag": tag, "heads": heads, "seed": seed}
    try:
        r = extract_multi_head(o, heads, seed=seed)
        row.update(found=r.model.heads, error=float(canonical_error(r.model, truth)) if truth is not None and r.model.heads == truth.heads else None,
                   bar=r.report.details.get("error bar"), reopened=r.report.details.get("head count reopened"))
    except AttnExtractError as e:
        row.update(refused=type(e).__name__, message=str(e)[:300])
    row["queries"] = o.queries
    out.write(json.dumps(row) + "\n"); out.flush()
with threadpool_limits(1):
    for H in (2, 4, 6, 8):
        for scale in (1, 3):
            for seed in range(3):
                M = random_multi_head(H, 8, seed=10_000 * H + 800 + seed, w_scale=scale / np.sqrt(8))
                for heads in (H, None):
                    run(M, 8, heads, seed, M, f"H{H}s{scale}b{seed}")
    for seed in range(12):
        M = random_multi_head(2, 6, seed=5)
        run(lambda X: np.tanh(3 * M(X)) + 0.5 * np.sin(4 * M(X)), 6, None, seed, None, "tanh")
