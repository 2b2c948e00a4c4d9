"""Multi-head attention: only the canonical form is identifiable, and it is recovered.

Notebook-style (``# %%`` cells). The mathematics: docs/algorithms.md, "Multi-head".
"""

# %% Two heads of width 4.
import numpy as np

import attnextract
from attnextract import Oracle
from attnextract.adapters.targets import random_multi_head

secret = random_multi_head(2, 4, seed=0)

# %% Copy-count probes: the output is a rational function of the copy ratio,
# one pole per head.
result = attnextract.extract(Oracle(secret, 4), model="multi-head", seed=1)
print(result.report)

# %% The recovered heads, in some order: compare each with its closest secret head.
recovered = attnextract.canonical_form(result.model)
print(f"{recovered.heads} canonical heads recovered with {result.queries} queries")
worst = max(min(np.linalg.norm(W - Wt) / np.linalg.norm(Wt) for Wt in secret.W)
            for W in recovered.W)
print(f"worst relative error of a head's W: {worst:.1e}")
assert recovered.heads == 2 and worst < 1e-8
