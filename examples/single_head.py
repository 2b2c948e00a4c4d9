"""Single head: recover (W, v) exactly with d^2 + d queries.

Notebook-style: run it whole (``python examples/single_head.py``) or cell by cell
(``# %%`` cells in VS Code, Jupyter, Spyder). The mathematics: docs/algorithms.md,
"Single head".
"""

# %% A secret head behind a black box: any callable (B, N, d) -> (B,) will do.
import numpy as np

import attnextract
from attnextract import Oracle
from attnextract.adapters.targets import random_single_head

d = 16
secret = random_single_head(d, seed=0)

# %% Extract: the oracle counts queries and enforces the budget before sending.
oracle = Oracle(secret, dim=d, budget=10_000)
result = attnextract.extract(oracle, model="single-head", seed=1)
print(result)                  # <ExtractionResult single-head d=16: ... PASSED>
print(result.report)           # the readable report

# %% Compare with the secret (which the learner never saw).
error = np.linalg.norm(result.model.W - secret.W) / np.linalg.norm(secret.W)
print(f"relative error of W: {error:.1e}; recovery queries {result.report.recovery_queries} "
      f"= d^2 + d = {d * d + d}")
assert error < 1e-10 and result.report.recovery_queries == d * d + d

# %% Save and load back: model, report, query count and options.
import tempfile
from pathlib import Path

path = result.save(Path(tempfile.mkdtemp()) / "single_head")     # writes single_head.npz
again = attnextract.ExtractionResult.load(path)
assert str(again.report) == str(result.report) and again.options == result.options
print(f"saved to {path.name} and loaded back: {again}")
