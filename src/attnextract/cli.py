"""Command-line interface: ``attnextract extract | verify | demo | twins``.

Exit codes: 0 success; 1 the extraction or verification failed (mismatch, not
identifiable, budget); 2 bad usage (arguments, target or result files); 3 the black
box failed (raised, malformed or non-finite answers, unreachable).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from . import __version__
from .errors import (AttnExtractError, BlackBoxError, BudgetExceededError, InputError,
                     ModelMismatchError, NotIdentifiableError, TargetLoadError)
from .oracle import Oracle
from .report import DEFAULT_VERIFY_TOLERANCE, load_model, verification_count, verify_model
from .multi_head import extract_multi_head
from .single_head import extract_single_head
from .targets import load_target, random_single_head

# model kind -> learner; every learner takes (oracle, seed=..., **options)
EXTRACTORS = {"single-head": extract_single_head, "multi-head": extract_multi_head}
# options a --model kind takes from the command line: option name -> args attribute
EXTRACTOR_OPTIONS = {"multi-head": {"heads": "heads"}}


class ProgressBar:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, label: str, enabled: bool | None = None, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.label, self.last = label, 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if not self.enabled or (now - self.last < 0.1 and done < total):
            return
        self.last = now
        frac = min(done / total, 1.0) if total else 1.0
        bar = "#" * int(30 * frac)
        self.stream.write(f"\r{self.label} [{bar:<30}] {done}/{total} queries")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value
    return parse


_positive_int, _nonnegative_int = _int_at_least(1), _int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnextract",
        description="Recover attention-model parameters from black-box query access.")
    parser.add_argument("--version", action="version", version=f"attnextract {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    ex = sub.add_parser("extract", help="extract a model from a black box")
    ex.add_argument("--target", required=True, help="FILE.py:NAME, a callable (B, N, d) -> (B,)")
    ex.add_argument("--dim", required=True, type=_positive_int, help="token width d")
    ex.add_argument("--model", default="single-head", choices=sorted(EXTRACTORS))
    ex.add_argument("--budget", type=_nonnegative_int, help="hard limit on queries")
    ex.add_argument("--max-batch", type=_positive_int, help="largest batch per black-box call")
    ex.add_argument("--seed", type=int, help="seed of the learner's random choices")
    ex.add_argument("--tolerance-verify", type=float, default=DEFAULT_VERIFY_TOLERANCE,
                    dest="verify_tolerance", help="held-out relative error accepted")
    ex.add_argument("--heads", type=_positive_int,
                    help="multi-head: the model's number of heads (an upper bound on the "
                         "canonical heads); default: detected")
    ex.add_argument("--out", required=True, help="RESULT.npz to write")
    ex.add_argument("--json", action="store_true", help="print one JSON object")
    ex.add_argument("--no-progress", action="store_true")

    ve = sub.add_parser("verify", help="compare a saved result with a black box")
    ve.add_argument("--target", required=True, help="FILE.py:NAME")
    ve.add_argument("--result", required=True, help="RESULT.npz written by extract")
    ve.add_argument("--count", type=_positive_int, help="held-out sequences (default max(64, 1%% of parameters))")
    ve.add_argument("--seed", type=int)
    ve.add_argument("--tolerance", type=float, default=DEFAULT_VERIFY_TOLERANCE)
    ve.add_argument("--budget", type=_nonnegative_int)
    ve.add_argument("--json", action="store_true")

    de = sub.add_parser("demo", help="extract a secret random single head and check it")
    de.add_argument("--dim", type=_positive_int, default=64)
    de.add_argument("--seed", type=int, help="seed of the secret target (default: random)")
    de.add_argument("--json", action="store_true")
    de.add_argument("--no-progress", action="store_true")

    tw = sub.add_parser("twins", help="show that multi-head attention is not identifiable: "
                                      "two different parameter sets, one input-output map")
    tw.add_argument("--heads", type=_positive_int, default=3)
    tw.add_argument("--dim", type=_positive_int, default=8)
    tw.add_argument("--seed", type=int, help="seed of the random model (default: random)")
    tw.add_argument("--count", type=_positive_int, default=1000,
                    help="random sequences compared")
    tw.add_argument("--json", action="store_true")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = {"extract": cmd_extract, "verify": cmd_verify, "demo": cmd_demo,
               "twins": cmd_twins}[args.command]
    try:
        return handler(args)
    except ModelMismatchError as exc:
        if exc.result is not None and not getattr(args, "json", False):
            print(exc.result.report.render(), file=sys.stderr)
        return _fail(args, exc, 1)
    except (NotIdentifiableError, BudgetExceededError) as exc:
        return _fail(args, exc, 1)
    except (TargetLoadError, InputError) as exc:
        return _fail(args, exc, 2)
    except BlackBoxError as exc:
        return _fail(args, exc, 3)
    except AttnExtractError as exc:
        return _fail(args, exc, 1)


def _fail(args, exc: Exception, code: int) -> int:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if getattr(args, "json", False):
        out = {"ok": False, "error": type(exc).__name__, "reason": reason}
        result = getattr(exc, "result", None)
        if result is not None:
            out["report"] = result.report.to_dict()
        print(json.dumps(out))
    print(f"attnextract: {type(exc).__name__}: {reason}", file=sys.stderr)
    return code


def _open_target(spec: str):
    return load_target(spec)


def cmd_extract(args) -> int:
    black_box = _open_target(args.target)
    bar = ProgressBar("extracting", enabled=False if args.no_progress or args.json else None)
    oracle = Oracle(black_box, args.dim, budget=args.budget, max_batch=args.max_batch,
                    progress=bar)
    try:
        options = {name: getattr(args, attr)
                   for name, attr in EXTRACTOR_OPTIONS.get(args.model, {}).items()}
        if args.heads is not None and args.model not in EXTRACTOR_OPTIONS:
            raise InputError(f"--heads applies to --model multi-head, not {args.model}")
        result = EXTRACTORS[args.model](oracle, seed=args.seed,
                                        verify_tolerance=args.verify_tolerance, **options)
    finally:
        bar.close()
    result.save(args.out)
    if args.json:
        print(json.dumps({"ok": True, "out": args.out, **result.report.to_dict()}))
    else:
        print(result.report.render())
        print(f"wrote        {args.out}")
    return 0


def cmd_verify(args) -> int:
    model = load_model(args.result)
    oracle = Oracle(_open_target(args.target), model.dim, budget=args.budget)
    count = args.count or verification_count(sum(np.size(p) for p in model.parameters().values()))
    verification = verify_model(oracle, model, count=count, seed=args.seed,
                                tolerance=args.tolerance)
    if args.json:
        print(json.dumps({"ok": verification.passed, "queries": oracle.queries,
                          "sequences": verification.sequences,
                          "max_relative_error": verification.max_relative_error,
                          "median_relative_error": verification.median_relative_error,
                          "tolerance": verification.tolerance}))
    else:
        print(f"{model.kind} model, d = {model.dim}, {verification.sequences} held-out sequences:"
              f" max relative error {verification.max_relative_error:.2e}, median "
              f"{verification.median_relative_error:.2e} (tolerance {verification.tolerance:.0e})")
    if not verification.passed:
        print(f"attnextract: MISMATCH: max relative error {verification.max_relative_error:.2e}"
              f" > tolerance {verification.tolerance:.0e}", file=sys.stderr)
        return 1
    if not args.json:
        print("MATCH")
    return 0


def cmd_demo(args) -> int:
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    secret = random_single_head(args.dim, seed)
    bar = ProgressBar("extracting", enabled=False if args.no_progress or args.json else None)
    oracle = Oracle(secret, args.dim, progress=bar)
    try:
        result = extract_single_head(oracle, seed=seed + 1)
    finally:
        bar.close()
    model = result.model
    w_err = float(np.linalg.norm(model.W - secret.W) / np.linalg.norm(secret.W))
    v_err = float(np.linalg.norm(model.v - secret.v) / np.linalg.norm(secret.v))
    if args.json:
        print(json.dumps({"ok": True, "secret_seed": seed, "relative_error_W": w_err,
                          "relative_error_v": v_err, **result.report.to_dict()}))
        return 0
    print(f"attnextract demo: a secret random single-head attention model (d = {args.dim}, "
          f"seed {seed}) behind a black box that answers one number per sequence.\n")
    print(result.report.render())
    print(f"\nchecked against the secret (the learner never saw it): relative error "
          f"W {w_err:.2e}, v {v_err:.2e}")
    return 0


def cmd_twins(args) -> int:
    from .multi_head import canonical_error, canonical_form, non_identifiable_twin, twin_difference
    from .targets import random_multi_head
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    model = random_multi_head(args.heads, args.dim, seed)
    twin = non_identifiable_twin(model, seed + 1)
    diff = twin_difference(model, twin, count=args.count, seed=seed + 2)
    canon_err = canonical_error(twin, model)
    # the twin's parameters, laid side by side with the original's, differ a lot
    v_gap = float(min(np.linalg.norm(twin.v[:, None] - model.v[None], axis=2).min(axis=1).max(),
                      np.inf))
    out = {"ok": True, "seed": seed, "heads": model.heads, "twin_heads": twin.heads,
           "dim": args.dim, "twin_canonical_heads": canonical_form(twin).heads,
           "canonical_error": canon_err, "largest_v_mismatch": v_gap,
           "max_output_difference": diff["max_abs"],
           "max_relative_output_difference": diff["max_relative"],
           "sequences": diff["sequences"]}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"attnextract twins: a random multi-head attention model (H = {model.heads}, "
          f"d = {args.dim}, seed {seed}) and a twin built from it.\n")
    print("  original  head norms |W_h|, |v_h|: " + ", ".join(
        f"({np.linalg.norm(W):.2f}, {np.linalg.norm(v):.2f})" for W, v in zip(model.W, model.v)))
    print("  twin      head norms |W_h|, |v_h|: " + ", ".join(
        f"({np.linalg.norm(W):.2f}, {np.linalg.norm(v):.2f})" for W, v in zip(twin.W, twin.v)))
    print(f"\n  the twin has {twin.heads} heads: one head's v split over two heads with the same W,"
          f"\n  a dead head (random W, v = 0), all permuted. Some twin head's v is "
          f"{v_gap:.2f} away from every original v.")
    print(f"  canonical forms (merge equal W, drop v = 0): {canonical_form(model).heads} and "
          f"{out['twin_canonical_heads']} heads, agreeing to {canon_err:.1e} after matching.")
    print(f"\n  largest output difference over {diff['sequences']} random sequences (lengths "
          f"1-16): {diff['max_abs']:.2e} (relative {diff['max_relative']:.2e})")
    print("  -> no black-box query can tell them apart: only the canonical form is identifiable.")
    return 0
