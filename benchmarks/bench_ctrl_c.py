"""How long Ctrl-C takes to stop `attnextract extract` (issue 22: within 1 s).

Starts `attnextract extract --model multi-head` on a numpy multi-head box (d = 32, H = 8
by default) with a journal, sends SIGINT at a random time after the journal appears, and
measures the time from the signal to the "interrupted" line on stderr and to the exit.
With --diagnose, a run still alive 0.5 s after the signal dumps every thread's Python stack
(faulthandler on SIGUSR2), which names the call that holds the signal up.

Run (one BLAS thread, a shared machine):

    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_ctrl_c.py --tries 20 --longest 60 \
        (writes benchmarks/results/bench_ctrl_c.md)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _results

TARGET = """
from attnextract.adapters.targets import random_multi_head
box = random_multi_head({heads}, {dim}, seed={seed})
"""

HERE = str(Path(__file__).resolve().parents[1] / "src")

# the CLI behind a faulthandler that dumps all stacks on SIGUSR2, for --diagnose
LAUNCH = ("import faulthandler, signal, sys; "
          "faulthandler.register(signal.SIGUSR2, all_threads=True); "
          "from attnextract.cli import main; sys.exit(main())")


def one_try(folder: Path, args, delay: float, tag: int, src: str) -> dict:
    journal = folder / f"run{tag}-{abs(hash(src))}.journal.sqlite"
    command = [sys.executable, "-c", LAUNCH, "extract", "--target",
               f"{folder}/target.py:box", "--dim", str(args.dim), "--model", "multi-head",
               "--heads", str(args.heads), "--seed", str(tag), "--out",
               str(folder / f"run{tag}-{abs(hash(src))}.npz"), "--journal", str(journal), "--no-progress"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    started = time.monotonic()
    # a process started from a background script ignores SIGINT: give it the default, as
    # a terminal would
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                        signal.SIG_DFL))
    first_line = {}
    stderr_lines = []

    def read_stderr():
        for line in proc.stderr:
            if "interrupted" in line and "at" not in first_line:
                first_line["at"] = time.monotonic()
            stderr_lines.append(line)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    while not journal.exists() and proc.poll() is None:
        time.sleep(0.01)
    journal_at = time.monotonic()
    time.sleep(delay)
    if proc.poll() is not None:
        reader.join(5)
        return {"src": src, "try": tag, "delay": round(delay, 2), "finished_before_signal": True,
                "returncode": proc.returncode}
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    if args.diagnose:
        try:
            proc.wait(0.5)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR2)
    proc.wait(120)
    exited = time.monotonic()
    reader.join(5)
    return {"src": src, "try": tag, "delay": round(delay, 2),
            "seconds_after_journal": round(sent - journal_at, 2),
            "seconds_since_start": round(sent - started, 2), "returncode": proc.returncode,
            "to_message": round(first_line["at"] - sent, 3) if "at" in first_line else None,
            "to_exit": round(exited - sent, 3),
            "stderr_tail": "".join(stderr_lines[-40:]) if args.diagnose and
            exited - sent > 0.5 else "".join(stderr_lines[-1:]).strip()}


def summarize(rows: list[dict]) -> dict:
    timed = [r for r in rows if "to_exit" in r]
    return {"tries": len(rows), "signalled": len(timed),
            "exit 130": sum(r["returncode"] == 130 for r in timed),
            "max to_message": max((r["to_message"] or 99 for r in timed), default=None),
            "max to_exit": max((r["to_exit"] for r in timed), default=None),
            "median to_exit": sorted(r["to_exit"] for r in timed)[len(timed) // 2]
            if timed else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--longest", type=float, default=40.0,
                        help="signal at a uniform time in [0, LONGEST] s after the journal "
                        "appears")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--diagnose", action="store_true")
    parser.add_argument("--src", nargs="+", default=[HERE],
                        help="source trees to compare (PYTHONPATH of the runs): each try runs "
                        "each tree in turn with the same signal time (default: this checkout's)")
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as results:
        results.add(measure(args))


def measure(args) -> str:
    """The tries, printed as JSON lines; returns the summary and per-try tables."""
    chooser = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "target.py").write_text(TARGET.format(heads=args.heads, dim=args.dim,
                                                        seed=args.dim))
        for tag in range(args.tries):
            delay = chooser.uniform(0, args.longest)
            for src in args.src:
                row = one_try(folder, args, delay, tag, src)
                print(json.dumps(row), flush=True)
                rows.append(row)
    summaries = {src: summarize([r for r in rows if r["src"] == src]) for src in args.src}
    print(json.dumps(summaries))
    lines = ["Ctrl-C latency of `attnextract extract --model multi-head` with a journal: "
             f"d = {args.dim}, H = {args.heads}, {args.tries} tries, SIGINT at a "
             f"uniform time in [0, {args.longest}] s after the journal appears. "
             "Seconds are wall-clock.",
             "", "| source tree | " + " | ".join(next(iter(summaries.values()))) + " |",
             "|---" * (1 + len(next(iter(summaries.values())))) + "|"]
    lines += [f"| {src} | " + " | ".join(str(v) for v in summary.values()) + " |"
              for src, summary in summaries.items()]
    lines += ["", "| source tree | try | signal at (s after journal) | exit code | "
              "to message (s) | to exit (s) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['src']} | {r['try']} | "
              f"{r.get('seconds_after_journal', 'finished first')} | "
              f"{r['returncode']} | {r.get('to_message')} | {r.get('to_exit')} |"
              for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
