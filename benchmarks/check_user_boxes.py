"""Boxes written as a new user writes them, run through the API and the command line.

Every box is built in ``tests/user_boxes.py`` (numpy written from the formula, PyTorch
``nn.MultiheadAttention`` called directly or wrapped as the docs say; nothing from
``attnextract.adapters.targets``). Each case runs in its own process with a time limit
(60 CPU s for d <= 16 with H told, else ``--slow-limit``; the machine may be shared, so
CPU seconds are judged, wall seconds stated) and reports its outcome: recovered
(with the canonical error against the truth from the box's own weights), refused (the
error type and message), crashed (a traceback or an untyped error) or timed out;
seconds and queries against paper 2's count 4Hd^2 - 2H + 1.

    python3 benchmarks/check_user_boxes.py            # writes benchmarks/results/check_user_boxes.md
    python3 benchmarks/check_user_boxes.py --only torch-d8 --out /tmp/x.md   # a subset
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402

import _results


def paper2(H, d):
    return 4 * H * d * d - 2 * H + 1


# -- the cases -------------------------------------------------------------------------

def cases():
    out = []
    # 1. torch nn.MultiheadAttention as users write them
    for d in (8, 16, 32):
        for H in (1, 2, 4, 8):
            if H > d or (d == 32 and H == 1):
                continue
            # the layouts (batch_first, a float64 module) at d = 8; d = 32 with H told,
            # its float32 and biased boxes at H = 4 (a shared 2-core machine's time)
            variants = {8: ("default", "float32 forward", "bias=False", "batch_first",
                            "float64 module", "trained biases", "own wrapper f32"),
                        16: ("default", "float32 forward", "bias=False", "trained biases",
                             "own wrapper f32"),
                        32: ("default",) + (("float32 forward", "trained biases")
                                            if H == 4 else ())}[d]
            for variant in variants:
                for heads in (None, H):
                    if d == 32 and heads is None:
                        continue
                    opts = [{}]
                    if variant in ("float32 forward", "own wrapper f32"):
                        opts = [{}, {"output_dtype": "float32"}]
                        if d == 32:
                            opts = [{"output_dtype": "float32"}]
                    if variant == "trained biases":
                        opts = [{}, {"biases": True}]
                    for o in opts:
                        out.append(dict(kind="torch", d=d, H=H, variant=variant, heads=heads,
                                        **o))
    # the same through the command line, a file as the docs give it
    for d, H in ((8, 2), (16, 4), (16, 1)):
        for variant in ("default", "float32 forward", "trained biases"):
            for heads in (None, H):
                opts = [{}]
                if variant == "float32 forward":
                    opts = [{}, {"output_dtype": "float32"}]
                if variant == "trained biases":
                    opts = [{}, {"biases": True}]
                for o in opts:
                    out.append(dict(kind="torch", d=d, H=H, variant=variant, heads=heads,
                                    cli=True, **o))
    # 2. numpy from the formula
    for style in ("batched", "float", "0d", "(1,)", "float32"):
        for heads in (None, 2):
            out.append(dict(kind="numpy", d=8, H=2, style=style, heads=heads))
            if style in ("float", "batched"):
                out.append(dict(kind="numpy", d=8, H=2, style=style, heads=heads, cli=True))
    for special in ("v_h = 0", "two equal heads", "tiny v 1e-6", "W N(0, 9/d)", "W N(0, 25/d)"):
        for d, H in ((8, 2), (16, 4)):
            for heads in (None, H):
                out.append(dict(kind="numpy", d=d, H=H, style="batched", special=special,
                                heads=heads))
    for heads in (None, 2):
        out.append(dict(kind="numpy", d=64, H=2, style="batched", heads=heads))
    # 3. outside the class
    from user_boxes import OUTSIDE
    for what in OUTSIDE:
        for heads in (None, 2):
            out.append(dict(kind="outside", d=8, H=2, what=what, heads=heads))
        out.append(dict(kind="outside", d=8, H=2, what=what, heads=2, cli=True))
    for c in out:
        c["id"] = case_id(c)
    return out


def case_id(c) -> str:
    bits = [c["kind"], f"d{c['d']}", f"H{c['H']}"]
    for key in ("variant", "style", "special", "what"):
        if key in c:
            bits.append(c[key])
    bits.append("heads given" if c.get("heads") else "no heads")
    if c.get("biases"):
        bits.append("biases")
    if c.get("output_dtype"):
        bits.append("output_dtype " + c["output_dtype"])
    bits.append("CLI" if c.get("cli") else "API")
    return " / ".join(bits)


# -- building a case's box and its truth --------------------------------------------------

TORCH_FILE = """\
import torch
from attnextract.adapters.torch_target import TorchAttentionBlackBox

torch.manual_seed(0)
layer = torch.nn.MultiheadAttention({d}, {H}{kw})
{extra}box = TorchAttentionBlackBox(layer, readout=0{dtype})
"""


def build(c):
    """(box, (W, v, b, c0), file text or None) for case c."""
    import user_boxes as ub
    d, H = c["d"], c["H"]
    if c["kind"] == "torch":
        variant = c["variant"]
        kw = {}
        if variant == "bias=False":
            kw["bias"] = False
        if variant == "batch_first":
            kw["batch_first"] = True
        layer = ub.torch_layer(d, H, trained_biases=variant == "trained biases",
                               float64=variant == "float64 module", **kw)
        r = ub.unit_readout(d, 0)
        from attnextract.adapters.torch_target import TorchAttentionBlackBox
        if variant == "own wrapper f32":
            box = ub.torch_user_box(layer, r)
        else:
            dtype = None if variant in ("float32 forward", "float64 module") else "float64"
            box = TorchAttentionBlackBox(layer, readout=0, dtype=dtype)
        if variant in ("float32 forward", "own wrapper f32"):
            r = r.astype(np.float32).astype(np.float64)
        truth = ub.torch_truth(layer, r)
        text = None
        if c.get("cli"):
            kws = "".join(f", {k}={v}" for k, v in kw.items())
            extra = ("with torch.no_grad():\n    layer.in_proj_bias.normal_()\n"
                     "    layer.out_proj.bias.normal_()\n" if variant == "trained biases" else "")
            text = TORCH_FILE.format(d=d, H=H, kw=kws, extra=extra,
                                     dtype=", dtype=None" if variant == "float32 forward" else "")
        return box, truth, text
    W, v = ub.draw_heads(d, H, seed=c.get("seed", 0),
                         w_scale={"W N(0, 9/d)": 3.0, "W N(0, 25/d)": 5.0}.get(c.get("special"), 1.0),
                         v_scale=1e-6 if c.get("special") == "tiny v 1e-6" else 1.0)
    if c.get("special") == "v_h = 0":
        v[-1] = 0.0
    if c.get("special") == "two equal heads":
        W[1] = W[0]
    if c["kind"] == "outside":
        box = ub.outside_box(c["what"], W, v)
        what = c["what"]
        text = NUMPY_FILE.format(seed=c.get("seed", 0), d=d, H=H, ws=1.0, vs=1.0, edit="",
                                 box=f"box = user_boxes.outside_box({what!r}, W, v)")
    else:
        box = ub.numpy_box(W, v, c["style"])
        text = NUMPY_FILE.format(seed=c.get("seed", 0), d=d, H=H, ws=1.0, vs=1.0, edit="",
                                 box=f"box = user_boxes.numpy_box(W, v, {c['style']!r})")
    return box, (W, v, np.zeros((H, d)), 0.0), text


NUMPY_FILE = """\
import sys
sys.path.insert(0, {tests!r})
import user_boxes

W, v = user_boxes.draw_heads({d}, {H}, seed={seed}, w_scale={ws}, v_scale={vs})
{edit}{box}
""".replace("{tests!r}", repr(str(ROOT / "tests")))


# -- running one case -----------------------------------------------------------------------

def run_one(c) -> dict:
    box, (W, v, b, c0), text = build(c)
    d, H = c["d"], c["H"]
    import resource
    res = {"id": c["id"], "paper2": paper2(H, d)}
    start, cpu = time.perf_counter(), time.process_time()
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    if c.get("cli"):
        res.update(_run_cli(c, text))
    else:
        import attnextract
        from attnextract import Oracle
        opts = {k: c[k] for k in ("biases", "output_dtype") if c.get(k)}
        if c.get("heads"):
            opts["heads"] = c["heads"]
        try:
            result = attnextract.extract(Oracle(box, dim=d), model="multi-head", seed=0, **opts)
        except attnextract.errors.AttnExtractError as exc:
            res.update(outcome="refused", error_type=type(exc).__name__, message=str(exc))
        except Exception as exc:        # untyped: a crash
            import traceback
            res.update(outcome="crash", error_type=type(exc).__name__, message=str(exc),
                       traceback=traceback.format_exc()[-1500:])
        else:
            res.update(outcome="recovered", queries=int(result.queries),
                       recovery=int(result.report.details.get("recovery queries", 0) or 0),
                       model=result.model)
    res["seconds"] = round(time.perf_counter() - start, 2)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)     # the CLI's process
    res["cpu"] = round(time.process_time() - cpu + after.ru_utime - kids.ru_utime
                       + after.ru_stime - kids.ru_stime, 2)
    model = res.pop("model", None)
    if model is not None:
        import user_boxes as ub
        err = ub.canonical_errors(model, W, v, b, c0)
        res["error"] = float(max(err["W"], err["v"], err["c"]))
        res["heads found"] = list(err["heads"])
        bar = getattr(model, "error_bar", None)
        res["outside class"] = c["kind"] == "outside"
    return res


def _run_cli(c, text) -> dict:
    d = c["d"]
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "mybox.py"
        target.write_text(text)
        cmd = [sys.executable, "-m", "attnextract", "extract", "--target", f"{target}:box",
               "--dim", str(d), "--model", "multi-head", "--out", str(Path(tmp) / "r.npz"),
               "--no-progress", "--no-journal", "--seed", "0"]
        if c.get("heads"):
            cmd += ["--heads", str(c["heads"])]
        if c.get("biases"):
            cmd += ["--biases"]
        if c.get("output_dtype"):
            cmd += ["--output-dtype", c["output_dtype"]]
        p = subprocess.run(cmd, capture_output=True, text=True)
        res = {"exit": p.returncode, "command": " ".join(["attnextract"] + cmd[3:])}
        last = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
        if p.returncode == 0:
            import attnextract
            result = attnextract.ExtractionResult.load(str(Path(tmp) / "r.npz"))
            res.update(outcome="recovered", queries=int(result.queries), model=result.model)
        elif "Traceback" in p.stderr or p.returncode not in (1, 2, 3):
            res.update(outcome="crash", message=p.stderr[-1500:])
        else:
            res.update(outcome="refused", message=last)
            if last.startswith("attnextract: "):
                res["error_type"] = last.split(":")[1].strip()
        return res


def limit_for(c, slow_limit):
    """CPU seconds a box may take (issue 22: 60 s for d <= 16 with H told)."""
    return 60 if c["d"] <= 16 and c.get("heads") else slow_limit


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run the cases whose id contains this")
    _results.add_out_option(ap, __file__)
    ap.add_argument("--slow-limit", type=float, default=300.0,
                    help="CPU seconds allowed where the 60 s of issue 22 do not apply")
    ap.add_argument("--wall-limit", type=float, default=900.0,
                    help="wall seconds before a box's process is stopped (the machine is "
                         "shared: its CPU seconds are what is judged)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        c = json.loads(args.one)
        print("RESULT " + json.dumps(run_one(c), default=str))
        return 0
    with _results.Run(__file__, args.out, argv=argv) as run:
        every_box(args, run)
    return 0


def every_box(args, run) -> None:
    """Each case in its own process; the results file is saved after every box."""
    results = []
    todo = [c for c in cases() if args.only in c["id"]]
    for i, c in enumerate(todo):
        limit = args.wall_limit
        start = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, __file__, "--one", json.dumps(c)],
                               capture_output=True, text=True, timeout=limit,
                               env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if line:
                r = json.loads(line[-1][7:])
            else:
                r = {"id": c["id"], "outcome": "crash", "message": p.stderr[-1500:],
                     "paper2": paper2(c["H"], c["d"])}
        except subprocess.TimeoutExpired:
            r = {"id": c["id"], "outcome": f"timeout (> {limit:.0f} s wall)",
                 "paper2": paper2(c["H"], c["d"])}
        r["wall"] = round(time.perf_counter() - start, 1)
        r["case"] = c
        results.append(r)
        print(f"[{i + 1}/{len(todo)}] {r['id']}: {r['outcome']} "
              f"{r.get('error', '')} {r.get('queries', '')} {r.get('seconds', r['wall'])}s "
              f"cpu {r.get('cpu', '')} "
              f"{(r.get('message') or '')[:200]}", flush=True)
        run.parts = [markdown(results)]             # a stopped run keeps its boxes
        run.save()


def verdict(r) -> str:
    """ok or BUG, by the rules of issue 22."""
    c = r["case"]
    if r.get("cpu", 0) > limit_for(c, 300.0):
        return f"BUG: {r['cpu']:.0f} CPU s"
    inside = c["kind"] != "outside"
    if r["outcome"] == "recovered":
        if not inside:
            return "BUG: accepted outside the class"
        f32 = c.get("variant") in ("float32 forward", "own wrapper f32") or c.get("style") == "float32"
        limit = 1e-2 if f32 else 1e-6
        return "ok" if r.get("error", np.inf) <= limit else "BUG: wrong parameters"
    if r["outcome"] == "refused":
        if inside and not (c.get("variant") == "trained biases" and not c.get("biases")):
            return "BUG: in-class box refused"
        if c.get("variant") == "trained biases" and "biases" not in (r.get("message") or ""):
            return "BUG: refusal does not name --biases"
        return "ok"
    return "BUG"


def markdown(results) -> str:
    """The boxes' table and the count of those not ok."""
    for r in results:
        r["verdict"] = verdict(r)
    lines = ["User-written boxes. Errors are canonical (heads merged and matched), relative, against the truth "
             "from the box's own weights; queries include verification; paper 2 = 4Hd^2 - 2H + 1.",
             "", "| box | outcome | verdict | error | queries | paper 2 | wall s | CPU s | message |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        err = f"{r['error']:.1e}" if isinstance(r.get("error"), float) else r.get("error", "")
        msg = (r.get("message") or "").replace("|", "/").replace("\n", " ")[:160]
        lines.append(f"| {r['id']} | {r['outcome']} | {r['verdict']} | {err} | "
                     f"{r.get('queries', '')} | {r['paper2']} | {r.get('seconds', r['wall'])} | "
                     f"{r.get('cpu', '')} | "
                     f"{msg} |")
    bugs = sum(r["verdict"] != "ok" for r in results)
    lines += ["", f"{len(results)} boxes, {bugs} not ok."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
