"""The full seed grids of the grid-like slow tests, which CI runs on a representative few.

CI (``python3 -m pytest -q -n auto``) runs a few seeds of each test below: every kind of
target and assertion, less repetition (tests/conftest.py: ``grid(full, ci)``). This script
runs the same tests, with the same assertions, over their full grids
(ATTNEXTRACT_FULL_GRIDS=1), and writes pass/fail and the time per test function.

Run (one BLAS thread, a shared machine):

    OPENBLAS_NUM_THREADS=1 nice -n 10 python benchmarks/test_grids.py \
        [--only NAME ...] [--out FILE.md] [-- extra pytest args]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import _results

ROOT = Path(__file__).resolve().parents[1]

# test function: (full grid, what CI runs)
GRIDS = {
    "tests/test_impostors.py::test_impostor_refused_on_more_seeds":
        ("every impostor x 3 learners x d = 8, 32, seeds 0-19", "seeds 3-6 (FAST: 0-2)"),
    "tests/test_transformer_layer.py::test_bias_free_single_head":
        ("widths 16, 32 x seeds 0-19", "seeds 0-3"),
    "tests/test_transformer_layer.py::test_biases_single_head":
        ("3 bias scales x seeds 0-5", "seeds 0-1"),
    "tests/test_transformer_layer.py::test_residual":
        ("2 bias scales x seeds 0-5", "seeds 0-2"),
    "tests/test_biases.py::test_biased_single_head_at_d_256":
        ("seeds 0-19 (bias 0, 5.1, 1.0 by seed mod 3)", "seeds 0-2 (each bias once)"),
    "tests/test_multi_head_biases.py::test_biased_heads_over_twenty_seeds":
        ("6 cells x 20 seeds", "20 seeds; 10 at H = 4, d = 16; 5 at H = 8, d = 16"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", help="test functions (substrings) to run")
    _results.add_out_option(parser, __file__)
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as results:
        returncode, text = measure(args)
        results.add(text)
    sys.exit(returncode)


def measure(args) -> tuple[int, str]:
    """pytest over the full grids; returns its exit code and the table."""
    tests = [t for t in GRIDS if not args.only or any(o in t for o in args.only)]
    env = {**os.environ, "ATTNEXTRACT_FULL_GRIDS": "1", "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
               "--durations=0", "--durations-min=0", *tests, *args.pytest_args]
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    elapsed = time.perf_counter() - start
    seconds, count = defaultdict(float), defaultdict(int)
    for line in proc.stdout.splitlines():
        match = re.match(r"\s*([\d.]+)s (call|setup|teardown)\s+(\S+?)(\[.*)?$", line)
        if match:
            seconds[match.group(3)] += float(match.group(1))
            count[match.group(3)] += match.group(2) == "call"
    outcome = {}
    for line in proc.stdout.splitlines():
        for word in ("PASSED", "FAILED", "ERROR"):
            if line.startswith(word + " "):
                node = line.split()[1].split("[")[0]
                outcome.setdefault(node, defaultdict(int))[word] += 1
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(summary)
    rows = [{"test": t, "full grid": GRIDS[t][0], "CI runs": GRIDS[t][1],
             "tests": count.get(t, 0), "passed": outcome.get(t, {}).get("PASSED", 0),
             "failed": outcome.get(t, {}).get("FAILED", 0) + outcome.get(t, {}).get("ERROR", 0),
             "seconds": round(seconds.get(t, 0.0), 1)} for t in tests]
    lines = ["Full seed grids of the grid-like slow tests (ATTNEXTRACT_FULL_GRIDS=1, "
             f"{elapsed:.0f} s of pytest). CI runs the subset in the third column with "
             "the same assertions.", "",
             f"pytest: {summary}", "",
             "| test | full grid | CI runs | tests | passed | failed | s |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['test']} | {r['full grid']} | {r['CI runs']} | {r['tests']} | "
              f"{r['passed']} | {r['failed']} | {r['seconds']} |" for r in rows]
    failures = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    if failures:
        lines += ["", "Failures:", ""] + [f"- `{f}`" for f in failures]
    return proc.returncode, "\n".join(lines)


if __name__ == "__main__":
    main()
