"""all-MiniLM-L6-v2 with every bias: `attnextract minilm --all-heads`, locally and through `serve`.

For each layer asked: the CLI run (learner seed 0, readout seed 0, 1 BLAS thread, no
journal) in a subprocess under /usr/bin/time -v; recorded per layer: recovery queries
against the low-rank floor sum_h (d + r(2d - r) + r) + 1 = 287,617 (d = 384, r = 32,
H = 12), each head's error (W_h, v_h, b_h, relative, against the layer's own weights,
which the learner never sees), c's error, the held-out check, CPU seconds (user +
system of the process) and wall time, and the load average before and after (the
machine is shared: wall times are upper bounds).

``--serve L``: the same layer saved with ``--save-target``, served by
``attnextract serve --secret ... --workers 2 --threads 1`` and extracted with
``--target http://127.0.0.1:PORT``; the server's CPU seconds too.

Run:  nice -n 10 python benchmarks/bench_minilm_biases.py --layers 0 5 [--serve 5] [--out FILE.md]
(with OPENBLAS_NUM_THREADS=1 and PYTHONPATH=src). Each layer (and path) is one section of
benchmarks/results/bench_minilm_biases.md, so layers may be run one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _results

FLOOR = 287_617
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1"}
CLI = [sys.executable, "-m", "attnextract"]


def _timed(command: list[str]) -> tuple[dict, float, str]:
    """Run ``command`` under /usr/bin/time -v; returns (its JSON, CPU s, wall)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as timing:
        done = subprocess.run(["/usr/bin/time", "-v", "-o", timing.name, *command],
                              capture_output=True, text=True, env=ENV)
        text = timing.read()
    if done.returncode not in (0,):
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    user = float(re.search(r"User time \(seconds\): ([\d.]+)", text).group(1))
    system = float(re.search(r"System time \(seconds\): ([\d.]+)", text).group(1))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text).group(1)
    return json.loads(done.stdout), user + system, wall


def _row(layer: int, out: dict, cpu: float, wall: str, load: tuple) -> dict:
    details = out["details"]
    return {"layer": layer, "breakdown": out["breakdown"], "floor": out["floor"],
            "recovery": out["breakdown"]["recovery"],
            "per_head_error": details["per_head_error"],
            "per_head_bias_error": details["per_head_bias_error"],
            "c_error": details["c_error"], "outcome": details["outcome"],
            "verified": out["verification"]["passed"],
            "held_out_error": out["verification"]["max_relative_error"],
            "predicted_error": details["predicted_error"], "cpu_s": round(cpu, 2),
            "wall": wall, "load_before_after": load}


def local(layer: int) -> dict:
    load = os.getloadavg()[0]
    out, cpu, wall = _timed(CLI + ["minilm", "--layer", str(layer), "--all-heads", "--json",
                                   "--no-progress", "--no-journal", "--threads", "1"])
    return _row(layer, out, cpu, wall, (round(load, 1), round(os.getloadavg()[0], 1)))


def served(layer: int) -> dict:
    """The layer through `serve` and `--target http://`."""
    with tempfile.TemporaryDirectory() as tmp:
        secret = Path(tmp) / f"layer{layer}-secret.npz"
        subprocess.run(CLI + ["minilm", "--layer", str(layer), "--all-heads", "--save-target",
                              str(secret)], check=True, env=ENV, capture_output=True)
        server = subprocess.Popen(CLI + ["serve", "--secret", str(secret), "--port", "0",
                                         "--workers", "2", "--threads", "1"],
                                  stdout=subprocess.PIPE, text=True, env=ENV)
        try:
            line = server.stdout.readline()
            url = re.search(r"http://\S+", line).group(0).rstrip(").,")
            load = os.getloadavg()[0]
            start = time.perf_counter()
            out, cpu, wall = _timed(CLI + ["minilm", "--layer", str(layer), "--all-heads",
                                           "--json", "--no-progress", "--no-journal",
                                           "--threads", "1", "--target", url,
                                           "--http-timeout", "600"])
            seconds = time.perf_counter() - start
            # the server's own CPU time (user + system, clock ticks) before it is stopped
            fields = Path(f"/proc/{server.pid}/stat").read_text().rsplit(")", 1)[1].split()
            server_cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        finally:
            server.terminate()          # the server this script started, by its handle
            server.wait(timeout=60)
    row = _row(layer, out, cpu, wall, (round(load, 1), round(os.getloadavg()[0], 1)))
    row.update({"served": True, "server_cpu_s": round(server_cpu, 2),
                "client_waited_s": round(out.get("black_box_seconds", float("nan")), 1),
                "wall_s": round(seconds, 1), "target": out["details"]["target"]})
    return row


def table(rows: list[dict]) -> str:
    lines = ["| layer | path | recovery queries | / floor 287,617 | worst head (W_h, v_h, b_h) "
             "| worst b_h | c | held-out check | CPU s | wall | load (before, after) |",
             "|" + "---|" * 11]
    for r in sorted(rows, key=lambda r: (r.get("served", False), r["layer"])):
        c = "exact" if r["c_error"] == 0 else f"{r['c_error']:.1e}"
        cpu = (f"{r['cpu_s']:.0f} + server {r['server_cpu_s']:.0f}" if r.get("served")
               else f"{r['cpu_s']:.0f}")
        lines.append(f"| {r['layer']} | {'serve + http' if r.get('served') else 'local'} "
                     f"| {r['recovery']:,} | {r['recovery'] / FLOOR:.3f} "
                     f"| {max(r['per_head_error']):.1e} | {max(r['per_head_bias_error']):.1e} "
                     f"| {c} | {r['outcome']} | {cpu} | {r['wall']} "
                     f"| {r['load_before_after'][0]}, {r['load_before_after'][1]} |")
    return "\n".join(lines)


NOTE = ("Each layer: `attnextract minilm --layer L --all-heads --json --no-progress "
        "--no-journal --threads 1` (learner seed 0, readout seed 0); served: the layer saved "
        "with `--save-target`, `attnextract serve --secret FILE --port 0 --workers 2 "
        "--threads 1`, and `--target http://127.0.0.1:PORT --http-timeout 600`. CPU s = user "
        "+ system of the process under /usr/bin/time -v (the server's from /proc); wall "
        "times depend on the machine's load (1-minute load average before and after each "
        "run in the last column). Errors are relative, per head, against the layer's own "
        "weights; \"exact\" means c equals the float64 truth.")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="*", default=[0, 5])
    parser.add_argument("--serve", type=int, nargs="*", default=[])
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    for layer, serve in [(layer, False) for layer in args.layers] + [(l, True) for l in args.serve]:
        # one section per layer and path: layers may be run one at a time
        name = f"layer {layer}, {'served' if serve else 'local'}"
        with _results.Run(__file__, args.out, section=name) as results:
            row = served(layer) if serve else local(layer)
            print(table([row]), flush=True)
            results.add(NOTE + "\n\n" + table([row]))


if __name__ == "__main__":
    main()
