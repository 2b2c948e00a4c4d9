"""Run the multi-head tests under every OpenBLAS kernel this CPU supports.

numpy's OpenBLAS is built with DYNAMIC_ARCH: OPENBLAS_CORETYPE picks the kernels
(Haswell, Zen, Sandybridge, and SkylakeX on AVX-512 CPUs), which round differently.
Each kernel runs pytest in its own subprocess with the variable set for that process
only (never for the tests or .ci/run); the report gives pass/fail per kernel.

Run:  python benchmarks/check_kernels.py [--tests tests/test_multi_head.py] [--slow]
                                         [--json FILE] [-- extra pytest args]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def cpu_has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as fh:
            return "avx512f" in fh.read()
    except OSError:
        return False


def kernels() -> list[str]:
    out = ["Haswell", "Zen", "Sandybridge"]
    return out + ["SkylakeX"] if cpu_has_avx512() else out


def active_kernel(env: dict) -> str:
    """The core type OpenBLAS reports in a subprocess with ``env``."""
    code = ("import numpy, threadpoolctl; info = threadpoolctl.threadpool_info(); "
            "print(next((i.get('architecture') for i in info if i.get('internal_api') == "
            "'openblas'), 'unknown'))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return proc.stdout.strip() or proc.stderr.strip()[-200:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", default="tests/test_multi_head.py")
    parser.add_argument("--slow", action="store_true", help="include tests marked slow")
    parser.add_argument("--json")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    results = []
    for kernel in kernels():
        env = {**os.environ, "OPENBLAS_CORETYPE": kernel, "OPENBLAS_NUM_THREADS": "1",
               "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", args.tests,
                   *([] if args.slow else ["-m", "not slow"]), *args.pytest_args]
        start = time.perf_counter()
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
        results.append({"kernel": kernel, "openblas reports": active_kernel(env),
                        "passed": proc.returncode == 0, "summary": summary,
                        "seconds": round(time.perf_counter() - start, 1)})
        print(f"{kernel:<12} ({results[-1]['openblas reports']}): "
              f"{'PASS' if proc.returncode == 0 else 'FAIL'}  {summary}", flush=True)
        if proc.returncode != 0:
            print("\n".join(line for line in proc.stdout.splitlines()
                            if line.startswith(("FAILED", "ERROR"))))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    sys.exit(0 if all(r["passed"] for r in results) else 1)


if __name__ == "__main__":
    main()
