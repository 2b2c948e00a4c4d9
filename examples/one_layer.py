"""A one-layer Transformer f(X) = w^T ReLU(A h(X)) with attention h, end to end.

Single tokens give the ReLU feed-forward part; the odd part f(X) - f(-X) is a single
head. Notebook-style (``# %%`` cells). The mathematics: docs/algorithms.md,
"One-layer Transformer".
"""

# %% A random layer, width 6, 6 hidden units.
import attnextract
from attnextract import Oracle
from attnextract.learners.one_layer import compare_one_layer, random_one_layer

secret = random_one_layer(6, 6, seed=0)

# %% Extract both parts; the report splits the queries between them.
result = attnextract.extract(Oracle(secret, 6), model="one-layer", seed=1)
print(result.report)

# %% Compare with the secret, up to the feed-forward units' permutation and scale.
check = compare_one_layer(result.model, secret, seed=2)
print(f"relative error of W {check['relative_error_W']:.1e}, {check['bits']:.1f} bits")
assert check["relative_error_W"] < 1e-9
