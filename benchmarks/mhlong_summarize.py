"""Tables of benchmarks/mhlong_box_error.py's JSON: per length band (and family), the true
model's error against its low-precision box relative to the held-out allowance.

    python benchmarks/mhlong_summarize.py /tmp/mh.json [--by-family]
"""
from __future__ import annotations

import json
import sys

import numpy as np

BANDS = [(1, 1), (2, 7), (8, 31), (32, 127), (128, 511), (512, 1023), (1024, 2047), (2048, 8192)]


def main():
    rows = []
    for path in [a for a in sys.argv[1:] if not a.startswith("--")]:
        rows += json.load(open(path))
    N = np.concatenate([r["N"] for r in rows])
    rel = np.concatenate([r["rel"] for r in rows])
    allow = np.concatenate([r["allowance"] for r in rows])
    fam = sum((r["family"] for r in rows), [])
    cells = sorted({(r["learner"], r["d"], r["H"], r["mode"]) for r in rows})
    print(f"runs (verify calls): {len(rows)}; cells {cells}; answers {len(N)}")
    tol_each = np.concatenate([[r["tolerance"]] * len(r["N"]) for r in rows])
    print("| N | answers | box error (relative), max | box error / allowance, max | "
          "box error / tolerance alone (no bar x reach term), max | allowance, median (min) |")
    print("|---|---|---|---|---|---|")
    for lo, hi in BANDS:
        m = (N >= lo) & (N <= hi)
        if not m.any():
            continue
        print(f"| {lo}-{hi} | {m.sum()} | {rel[m].max():.2e} | {(rel[m] / allow[m]).max():.3f} | "
              f"{(rel[m] / tol_each[m]).max():.3f} | {np.median(allow[m]):.2e} "
              f"({allow[m].min():.2e}) |")
    if "--by-family" in sys.argv:
        print("\n| family | answers | box error / allowance, max | at N |")
        print("|---|---|---|---|")
        for f in sorted(set(fam)):
            m = np.array([x == f for x in fam])
            r = rel[m] / allow[m]
            print(f"| {f} | {m.sum()} | {r.max():.3f} | {int(N[m][r.argmax()])} |")
    print("\n| cell | checks | whole check of the true model (search included): max error / "
          "tolerance | worst family there |")
    print("|---|---|---|---|")
    for cell in cells:
        sel = [r for r in rows if (r["learner"], r["d"], r["H"], r["mode"]) == cell]
        top = max(sel, key=lambda r: r.get("full", 0.0))
        print(f"| {cell[0]} {cell[1]}x{cell[2]} {cell[3]} | {len(sel)} | "
              f"{top.get('full', float('nan')):.3f} | {top.get('full_family', '')} |")
    tol = np.array([r["tolerance"] for r in rows])
    bar = np.array([r["bar"] for r in rows])
    print(f"\ntolerance median {np.median(tol):.2e} (min {tol.min():.2e}); bar median "
          f"{np.median(bar):.2e} (min {bar.min():.2e}); outcomes "
          f"{ {o: sum(r['outcome'] == o for r in rows) for o in {r['outcome'] for r in rows}} }")


if __name__ == "__main__":
    main()
