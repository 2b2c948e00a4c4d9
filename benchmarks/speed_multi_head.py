"""CPU time of the multi-head learner on fixed (target, learner seed) cases.

Usage: speed_multi_head.py --dim 32 --heads 8 --targets 0 1 2 [--learner-seeds S ...]
       [--json OUT]

Targets as in benchmarks/multi_head_grid.py (numpy boxes, W_h entries N(0, 1 / d), v_h
N(0, 1), target seed 10000 H + 100 d + index); the learner seed is fixed per case (by
default 1000 + index) so that two versions of the learner can be compared run by run:
queries, canonical error and CPU seconds (``time.process_time()``, 1 BLAS thread), with
the 1-minute load average at the end of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from threadpoolctl import threadpool_limits

from attnextract import Oracle
from attnextract.adapters.targets import random_multi_head
from attnextract.learners.multi_head import canonical_error, extract_multi_head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, required=True)
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--targets", type=int, nargs="+", required=True)
    parser.add_argument("--learner-seeds", type=int, nargs="*", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    d, H = args.dim, args.heads
    seeds = args.learner_seeds or [1000 + i for i in args.targets]
    rows = []
    for index, learner_seed in zip(args.targets, seeds):
        target = random_multi_head(H, d, seed=10_000 * H + 100 * d + index,
                                   w_scale=1.0 / np.sqrt(d))
        oracle = Oracle(target, d)
        with threadpool_limits(1):
            start = time.process_time()
            result = extract_multi_head(oracle, heads=H, seed=learner_seed)
            cpu = time.process_time() - start
        row = dict(dim=d, heads=H, target=index, learner_seed=learner_seed,
                   queries=int(result.queries), error=float(canonical_error(result.model, target)),
                   cpu=round(cpu, 1), load=round(os.getloadavg()[0], 1))
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
