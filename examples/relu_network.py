"""A bias-free ReLU network F(x) = w^T ReLU(A x), from single-token queries.

Only the function is identifiable: hidden units can be permuted and rescaled.
Notebook-style (``# %%`` cells). The mathematics: docs/algorithms.md, "ReLU network".
"""

# %% A network with 6 hidden units on width 5.
import attnextract
from attnextract import Oracle
from attnextract.learners.relu_network import align_relu_networks, random_relu_network

secret = random_relu_network(5, 6, seed=0)

# %% Kinks, cone gradients, signs, then the polish (on by default).
result = attnextract.extract(Oracle(secret, 5), model="relu-network", seed=1)
print(result.report)

# %% Up to permutation and positive rescaling, the units match the secret's.
match = align_relu_networks(result.model, secret)
print({k: v for k, v in match.items() if isinstance(v, (int, float))})
assert result.model.width == 6 and result.report.verification.passed
