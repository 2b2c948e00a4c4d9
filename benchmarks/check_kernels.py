"""Run the numerical tests under every OpenBLAS kernel and every numpy SIMD level of this CPU.

Two things round differently from one x86-64 CPU to another:

- OpenBLAS (numpy's is built with DYNAMIC_ARCH): OPENBLAS_CORETYPE picks the kernels
  (Haswell, Zen, Sandybridge, and SkylakeX on AVX-512 CPUs);
- numpy's own loops (sums, exp, tanh, ...): each is compiled for several SIMD levels and
  the best one the CPU has is dispatched at import. NPY_DISABLE_CPU_FEATURES turns levels
  off, so a test run sees the results of an older CPU. Only dispatchable features can be
  turned off (turning off a baseline one is an error at import), and a level is only off
  with every level above it, so the levels are tried cumulatively from the top: with
  dispatchable features F_1 < ... < F_n, "up to F_k" disables F_{k+1} .. F_n and
  "baseline" disables them all. The features come from the numpy build in use
  (``numpy.show_runtime()`` lists them).

Each configuration runs pytest in its own subprocess with the variables set for that
process only; the subprocess also reports what took effect (OpenBLAS's core type, numpy's
enabled dispatch features). The report gives pass/fail per configuration.

Run:  python benchmarks/check_kernels.py [--tests tests/test_multi_head.py ... | --all] [--slow]
          [--no-openblas] [--no-simd] [--only NAME ...] [--out FILE.md]
          [--log-dir DIR]
          [-- extra pytest args]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))     # the tests load this file
import _results  # noqa: E402

# Every test file that runs a learner (its outcome can depend on rounding): the fast part of
# DEFAULT_TESTS takes about a minute per configuration at low load; --all adds the rest.
DEFAULT_TESTS = ["tests/test_multi_head.py", "tests/test_multi_head_polish.py",
                 "tests/test_multi_head_low_rank.py", "tests/test_multi_head_labels.py",
                 "tests/test_multi_head_count.py", "tests/test_multi_head_biases.py",
                 "tests/test_multi_head_short.py", "tests/test_multi_head_float32.py",
                 "tests/test_multi_head_crowded.py", "tests/test_multi_head_retry.py",
                 "tests/test_multi_head_f32_limits.py", "tests/test_multi_head_hints.py",
                 "tests/test_low_precision.py", "tests/test_biases.py",
                 "tests/test_transformer_layer.py", "tests/test_transformer_layer_low_precision.py",
                 "tests/test_pre_layer_norm.py", "tests/test_pre_layer_norm_heads.py",
                 "tests/test_low_rank.py",
                 "tests/test_single_head.py"]
MORE_TESTS = ["tests/test_noisy.py", "tests/test_one_layer.py", "tests/test_residual.py",
              "tests/test_vector_pre_layer_norm_heads.py",
              "tests/test_relu_network.py", "tests/test_error_bars.py", "tests/test_impostors.py",
              "tests/test_impostors_learners.py", "tests/test_verification_domain.py",
              "tests/test_minilm.py", "tests/test_models.py", "tests/test_torch_target.py",
              "tests/test_user_boxes.py", "tests/test_newuser3_ux.py", "tests/test_vector_oracle.py",
              "tests/test_vector_single_head.py", "tests/test_vector_layer.py",
              "tests/test_vector_layer_positions.py",
              "tests/test_vector_multi_head.py",
              "tests/test_stated_tolerance.py", "tests/test_verified_domain.py",
              "tests/test_batch_invariance.py", "tests/test_accounting.py",
              "tests/test_journal_transparency.py",
              "tests/test_vector_pre_layer_norm.py", "tests/test_checkpoint.py",
              "tests/test_impostors_vector.py"]
ALL_TESTS = DEFAULT_TESTS + MORE_TESTS
# Test files of plumbing (transport, journal, CLI, docs, packaging): they run learners only on
# easy single-head boxes that tests/test_single_head.py covers, or none at all.
NOT_NUMERICAL = ["tests/test_bench.py", "tests/test_check_kernels.py", "tests/test_cli.py",
                 "tests/test_cli_headline.py",
                 "tests/test_docs.py", "tests/test_examples.py", "tests/test_http.py",
                 "tests/test_import_graph.py",
                 "tests/test_journal.py", "tests/test_journal_binding.py",
                 "tests/test_lossy_network.py", "tests/test_oracle.py", "tests/test_packaging.py",
                 "tests/test_remote_adapters.py", "tests/test_server_hardening.py",
                 "tests/test_server_state.py", "tests/test_ux.py", "tests/test_vector_transport.py",
                 "tests/test_vector_bench.py", "tests/test_hostile_server.py",
                 "tests/test_ledger_faults.py", "tests/test_replicas_reaper.py",
                 "tests/test_server_access.py", "tests/test_benchmark_results.py"]

PROBE = """
import json, numpy, threadpoolctl
try:
    from numpy._core._multiarray_umath import (__cpu_baseline__, __cpu_dispatch__,
                                               __cpu_features__)
except ImportError:                                   # numpy 1.x
    from numpy.core._multiarray_umath import (__cpu_baseline__, __cpu_dispatch__,
                                              __cpu_features__)
blas = next((i.get("architecture") for i in threadpoolctl.threadpool_info()
             if i.get("internal_api") == "openblas"), "unknown")
print(json.dumps({"baseline": list(__cpu_baseline__), "dispatch": list(__cpu_dispatch__),
                  "enabled": [f for f in __cpu_dispatch__ if __cpu_features__.get(f)],
                  "openblas": blas, "numpy": numpy.__version__}))
"""


def cpu_has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as fh:
            return "avx512f" in fh.read()
    except OSError:
        return False


def kernels() -> list[str]:
    out = ["Haswell", "Zen", "Sandybridge"]
    return out + ["SkylakeX"] if cpu_has_avx512() else out


def probe(env: dict) -> dict:
    """What numpy and OpenBLAS use in a subprocess with ``env`` (or {"error": ...})."""
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": (proc.stderr.strip() or "no output")[-300:]}


def simd_levels(base_env: dict) -> list[tuple[str, str]]:
    """(name, NPY_DISABLE_CPU_FEATURES) for every SIMD level below the CPU's best:
    cumulative from the top, as described in the module docstring."""
    found = probe(base_env)
    if "error" in found:
        return []
    enabled = found["enabled"]           # dispatchable features this CPU has, ascending
    levels = []
    for k in range(len(enabled) - 1, -1, -1):
        name = f"up to {enabled[k - 1]}" if k else f"baseline {'+'.join(found['baseline'])}"
        levels.append((name, " ".join(enabled[k:])))
    return levels


def run(name: str, env: dict, command: list[str], log_dir: str | None = None) -> dict:
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if log_dir:                       # the whole pytest output: failure messages, --durations
        os.makedirs(log_dir, exist_ok=True)
        with open(os.path.join(log_dir, name.replace(" ", "_") + ".log"), "w") as fh:
            fh.write(proc.stdout + proc.stderr)
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    seen = probe(env)
    row = {"configuration": name, "OPENBLAS_CORETYPE": env.get("OPENBLAS_CORETYPE", "(preset)"),
           "NPY_DISABLE_CPU_FEATURES": env.get("NPY_DISABLE_CPU_FEATURES", ""),
           "openblas reports": seen.get("openblas", seen.get("error")),
           "numpy SIMD enabled": " ".join(seen.get("enabled", [])) or "(baseline only)",
           "passed": proc.returncode == 0, "summary": summary,
           "failures": [line for line in proc.stdout.splitlines()
                        if line.startswith(("FAILED", "ERROR"))],
           "seconds": round(time.perf_counter() - start, 1)}
    print(f"{name:<28} blas {row['openblas reports']:<12} simd [{row['numpy SIMD enabled']}]: "
          f"{'PASS' if row['passed'] else 'FAIL'}  {summary}", flush=True)
    for line in row["failures"]:
        print("    " + line, flush=True)
    return row


def markdown(rows: list[dict], tests: list[str], numpy_version: str,
             pytest_args: tuple = (), slow: bool = False, only=None) -> str:
    lines = ["Numerical tests under every OpenBLAS kernel and numpy SIMD level.", "",
             f"Tests: {', '.join(tests)} (numpy {numpy_version}); command: "
             f"`python benchmarks/check_kernels.py{' --slow' if slow else ''} --tests "
             f"{' '.join(tests)}" + (f" --only {' '.join(only)}" if only else "")
             + "".join(f" {a!r}" if " " in a else f" {a}" for a in
                       (("--", *pytest_args) if pytest_args else ()))
             + "` (each configuration in its own subprocess, tests marked slow left out "
             "unless --slow). Seconds are wall-clock on a shared machine.", "",
             "| configuration | OPENBLAS_CORETYPE | NPY_DISABLE_CPU_FEATURES | OpenBLAS reports "
             "| numpy SIMD enabled | result | summary | s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['configuration']} | {r['OPENBLAS_CORETYPE']} | "
                     f"{r['NPY_DISABLE_CPU_FEATURES'] or '-'} | {r['openblas reports']} | "
                     f"{r['numpy SIMD enabled']} | {'PASS' if r['passed'] else 'FAIL'} | "
                     f"{r['summary']} | {r['seconds']} |")
    failures = [(r["configuration"], f) for r in rows for f in r["failures"]]
    if failures:
        lines += ["", "Failures:", ""] + [f"- {c}: `{f}`" for c, f in failures]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", nargs="+",
                        help="test files (default: DEFAULT_TESTS, the learners' main tests)")
    parser.add_argument("--all", action="store_true",
                        help="every test file that runs a learner (ALL_TESTS) instead of "
                        "DEFAULT_TESTS")
    parser.add_argument("--slow", action="store_true", help="include tests marked slow")
    parser.add_argument("--no-openblas", action="store_true", help="skip the OpenBLAS kernels")
    parser.add_argument("--no-simd", action="store_true", help="skip the numpy SIMD levels")
    parser.add_argument("--only", nargs="+", metavar="TEXT",
                        help="only the configurations whose name contains one of these "
                        "(e.g. Haswell Zen X86_V3)")
    _results.add_out_option(parser, __file__)
    parser.add_argument("--log-dir", help="write each configuration's pytest output to "
                        "DIR/<configuration>.log")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    if args.tests and args.all:
        parser.error("--tests and --all exclude each other")
    args.tests = args.tests or (ALL_TESTS if args.all else DEFAULT_TESTS)
    base = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    base.pop("NPY_DISABLE_CPU_FEATURES", None)
    base.pop("OPENBLAS_CORETYPE", None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.tests,
               *([] if args.slow else ["-m", "not slow"]), *args.pytest_args]
    numpy_version = probe(base).get("numpy", "?")
    configurations = []
    if not args.no_openblas:
        configurations += [(f"OpenBLAS {kernel}", {**base, "OPENBLAS_CORETYPE": kernel})
                           for kernel in kernels()]
    if not args.no_simd:
        configurations += [(f"numpy SIMD {name}", {**base, "NPY_DISABLE_CPU_FEATURES": disabled})
                           for name, disabled in simd_levels(base)]
    if args.only:
        configurations = [(name, env) for name, env in configurations
                          if any(text in name for text in args.only)]
    rows = []
    with _results.Run(__file__, args.out) as results:
        for name, env in configurations:
            rows.append(run(name, env, command, args.log_dir))
            # saved after every configuration: a long --slow run that is stopped keeps its rows
            results.parts = [markdown(rows, args.tests, numpy_version, tuple(args.pytest_args),
                                      slow=args.slow, only=args.only)]
            results.save()
    sys.exit(0 if rows and all(r["passed"] for r in rows) else 1)


if __name__ == "__main__":
    main()
