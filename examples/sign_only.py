"""Label-only outputs: the black box answers 1{f(X) > threshold}, nothing more.

``sign_only=True`` makes ``attnextract.extract`` recover the head by bisection.
Notebook-style (``# %%`` cells). The mathematics: docs/algorithms.md, "Sign-only outputs".
"""

# %% A head that answers only whether its output exceeds 0.25.
import numpy as np

import attnextract
from attnextract import Oracle
from attnextract.adapters.targets import random_single_head
from attnextract.oracle import SignOnly

d = 4
secret = random_single_head(d, seed=0)
labels = SignOnly(secret, threshold=0.25)
print("answers to three random sequences:", labels(np.random.default_rng(0).standard_normal((3, 2, d))))

# %% Bisection: --bits steps per entry of W. A nonzero threshold also fixes the scale of v.
result = attnextract.extract(Oracle(labels, d), model="single-head", sign_only=True,
                             threshold=0.25, bits=30, seed=1)
print(result.report)
error_v = np.linalg.norm(result.model.v - secret.v) / np.linalg.norm(secret.v)
error_W = np.linalg.norm(result.model.W - secret.W) / np.linalg.norm(secret.W)
print(f"relative error v {error_v:.1e}, W {error_W:.1e} from {result.queries} labels")
assert error_v < 1e-8 and error_W < 1e-4
