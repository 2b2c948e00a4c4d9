"""Out-of-class boxes told float32: how many of 6 learner seeds refuse them, per size eps.

The base is the float32 torch head (d = 6, torch seed 3); "second head" adds eps times a
second float32 head (torch seed 11), "length drift" multiplies the answer by
1 + eps log(N) / log(4096) (eps at N = 4096).

    PYTHONPATH=src OPENBLAS_NUM_THREADS=1 python benchmarks/check_low_precision_impostors.py out.json
(benchmarks/results/single32_summary.md)
"""
import sys, json, numpy as np, torch
from attnextract import Oracle
from attnextract.errors import AttnExtractError
from attnextract.adapters.torch_target import TorchAttentionBlackBox
from attnextract.learners.noisy import extract_low_precision

def head(d, seed):
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(d, 1, bias=False, batch_first=True).double()
    return TorchAttentionBlackBox(m, seed, head=0, dtype="float32")

d = 6
base, other = head(d, 3), head(d, 11)
def second_head(eps):
    return lambda X: base(X) + eps * other(X)
def length_drift(eps):
    return lambda X: base(X) * (1 + eps * np.log(X.shape[1]) / np.log(4096))
out = {}
for name, make in (("second head", second_head), ("length drift", length_drift)):
    for eps in (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 1e-2):
        refused = 0
        for s in range(6):
            try:
                extract_low_precision(Oracle(make(eps), d), seed=s, output_dtype="float32")
            except AttnExtractError:
                refused += 1
        out[f"{name} {eps:g}"] = refused
        print(f"{name:>12} eps {eps:g}: refused {refused}/6", flush=True)
if len(sys.argv) > 1:
    json.dump(out, open(sys.argv[1], "w"))
