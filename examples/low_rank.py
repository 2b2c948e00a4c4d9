"""Low-rank head: rank(W) = r << d costs d + r(2d - r) queries, not d^2 + d.

Notebook-style (``# %%`` cells). The mathematics: docs/algorithms.md, "Low-rank head".
"""

# %% A rank-3 head of width 32, like a real head (W = Q K^T, head dimension r).
import numpy as np

import attnextract
from attnextract import Oracle
from attnextract.adapters.targets import random_low_rank_head
from attnextract.learners.low_rank import low_rank_floor

d, r = 32, 3
secret = random_low_rank_head(d, r, seed=0)

# %% Adaptive cross approximation: the rank is found, the count sits at the floor.
result = attnextract.extract(Oracle(secret, d), model="low-rank", seed=1)
print(result.report)
found = result.report.details["rank"]
floor = low_rank_floor(d, found)
print(f"rank {found}: {result.report.recovery_queries} recovery queries, floor {floor}, "
      f"full head {d * d + d}")
assert found == r and result.report.recovery_queries <= floor + 32

# %% Paper 1's rank-one projections: the rank must be given, m = C r 2d measurements.
rop = attnextract.extract(Oracle(secret, d), model="low-rank", rank=r, method="rop", seed=1)
error = np.linalg.norm(rop.model.W - secret.W) / np.linalg.norm(secret.W)
print(f"rop: {rop.report.recovery_queries} recovery queries, relative error of W {error:.1e}")
assert error < 1e-8
