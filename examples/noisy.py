"""Noisy outputs: an estimate with an error bar that covers the truth.

The black box adds noise |eta| <= tau to every answer. ``tolerance=tau`` makes
``attnextract.extract`` run the noisy learner. Notebook-style (``# %%`` cells). The
mathematics: docs/algorithms.md, "Noisy outputs".
"""

# %% A head behind bounded noise of size 1e-6 (random signs).
import numpy as np

import attnextract
from attnextract import Oracle
from attnextract.adapters.targets import random_single_head
from attnextract.oracle import BoundedNoise

d, tau = 8, 1e-6
secret = random_single_head(d, seed=0)
noisy_box = BoundedNoise(secret, tau, "sign", seed=1)

# %% Without the tolerance the exact learner's check rejects the noisy answers.
try:
    attnextract.extract(Oracle(noisy_box, d), model="single-head", seed=2)
except attnextract.ModelMismatchError as exc:
    print("exact learner:", str(exc).splitlines()[0])

# %% With it: the error bar covers the true error.
result = attnextract.extract(Oracle(noisy_box, d), model="single-head", tolerance=tau, seed=2)
error = float(np.linalg.norm(result.model.W - secret.W))
bar = float(result.report.details["error_bar_W"])
print(result.report)
print(f"|W_hat - W|_F = {error:.1e} <= error bar {bar:.1e}")
assert error <= bar and result.options["model"] == "noisy"
