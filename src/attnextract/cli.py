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
from pathlib import Path

import numpy as np

from . import __version__
from .errors import (AttnExtractError, BlackBoxError, BudgetExceededError, InputError,
                     ModelMismatchError, NotIdentifiableError, TargetLoadError)
from .adapters.journal import QueryJournal
from .oracle import Oracle
from .report import DEFAULT_VERIFY_TOLERANCE, load_model, verification_count, verify_model
from .learners.one_layer import extract_one_layer
from .learners.relu_network import extract_relu_network
from .learners.residual import extract_one_layer_residual
from .learners.sign_only import extract_sign_only
from .learners.multi_head import extract_multi_head
from .learners.single_head import extract_single_head
from .learners.low_rank import extract_low_rank
from .adapters.targets import load_target, random_single_head

# model kind -> learner; every learner takes (oracle, seed=..., **options)
EXTRACTORS = {"single-head": extract_single_head}
EXTRACTORS["relu-network"] = extract_relu_network     # single-token queries
EXTRACTORS["one-layer"] = extract_one_layer
EXTRACTORS["one-layer-residual"] = extract_one_layer_residual
POLISHED = ("relu-network", "one-layer", "one-layer-residual")   # learners taking polish=
EXTRACTORS["low-rank"] = extract_low_rank
# extract options that only some --model kinds take: kind -> option names
EXTRACTORS["multi-head"] = extract_multi_head
MODEL_OPTIONS = {"low-rank": ("rank", "method", "oversampling"), "multi-head": ("heads",)}
# multi-head attention with low-rank heads (a real layer: H r <= d)
from .learners.multi_head_low_rank import extract_multi_head_low_rank  # noqa: E402
EXTRACTORS["multi-head-low-rank"] = extract_multi_head_low_rank
MODEL_OPTIONS["multi-head-low-rank"] = ("heads", "rank")


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

    def fitting(self, iteration: int, fit: float) -> None:
        """Solver progress (ROP fit): iteration and relative measurement residual."""
        now = time.perf_counter()
        if not self.enabled or now - self.last < 0.1:
            return
        self.last = now
        self.stream.write(f"\rfitting: iteration {iteration}, relative residual {fit:.1e}"
                          + " " * 20)
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
    ex.add_argument("--target", required=True,
                    help="FILE.py:NAME, a callable (B, N, d) -> (B,), or http://HOST:PORT")
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
    noisy = ex.add_argument_group("noisy, rounded or sign-only outputs")
    noisy.add_argument("--tolerance", type=float, metavar="TAU",
                       help="outputs are accurate to +-TAU (+ RHO |f|): noisy extraction with "
                            "error bars (with --noise random: the noise std)")
    noisy.add_argument("--relative-tolerance", type=float, default=0.0, metavar="RHO",
                       help="relative part of the tolerance (float32 5.96e-8, float16 4.88e-4)")
    noisy.add_argument("--noise", choices=["bounded", "random"], default="bounded",
                       help="worst-case (adversarial) or independent random noise")
    noisy.add_argument("--noise-method", choices=["robust", "paper"], default="robust",
                       help="robust default, or paper 1's Theorem 6.1 (needs --norm-bound)")
    noisy.add_argument("--repeats", type=_positive_int, default=1,
                       help="measure every probe in this many dithered bases")
    noisy.add_argument("--norm-bound", type=float, metavar="B", help="B >= ||W||_F")
    noisy.add_argument("--margin", type=float, metavar="MU", help="mu <= min |v_i| (paper)")
    noisy.add_argument("--sign-only", action="store_true",
                       help="the target answers labels 1{f(X) > THRESHOLD}: extract by bisection "
                            "(threshold 0: v up to a positive scale)")
    noisy.add_argument("--threshold", type=float, default=0.0,
                       help="with --sign-only: the labels are 1{f(X) > THRESHOLD} (known); a "
                            "nonzero threshold also fixes the scale of v")
    noisy.add_argument("--bits", type=_positive_int, default=40,
                       help="bisection steps per entry of W (--sign-only)")
    ex.add_argument("--out", required=True, help="RESULT.npz to write")
    ex.add_argument("--rank", type=_positive_int,
                    help="low-rank: rank r of W (needed by --method rop; found if not given)")
    ex.add_argument("--method", choices=["adaptive", "rop"],
                    help="low-rank: adaptive cross approximation at the floor d + r(2d - r) "
                         "(default) or the paper's Gaussian rank-one projections")
    ex.add_argument("--oversampling", type=float,
                    help="low-rank rop: C in m = C r 2d measurements (default 2)")
    ex.add_argument("--json", action="store_true", help="print one JSON object")
    ex.add_argument("--no-progress", action="store_true")
    ex.add_argument("--no-polish", action="store_true",
                    help="relu-network, one-layer(-residual): skip measuring each hidden unit alone "
                         "(m d fewer queries, fewer bits of precision)")
    ex.add_argument("--journal", metavar="FILE.sqlite",
                    help="record every query and answer; a restarted run resumes from it")
    ex.add_argument("--http-timeout", type=float, help="seconds per HTTP request (http:// targets)")
    ex.add_argument("--http-retries", type=_nonnegative_int,
                    help="retries of timeouts and 5xx answers (http:// targets)")
    ex.add_argument("--http-concurrency", type=_positive_int,
                    help="HTTP requests in flight at once (http:// targets)")

    se = sub.add_parser("serve", help="serve a model file as an HTTP black box")
    se.add_argument("--secret", required=True, help="FILE.npz with W and v (or a RESULT.npz)")
    se.add_argument("--port", required=True, type=_nonnegative_int, help="0 picks a free port")
    se.add_argument("--host", default="127.0.0.1")
    se.add_argument("--budget", type=_nonnegative_int, help="queries served in all (429 past it)")
    se.add_argument("--round", type=_nonnegative_int, dest="round_digits", metavar="DIGITS",
                    help="round every output to DIGITS decimals")
    se.add_argument("--verbose", action="store_true", help="log every request on stderr")

    mi = sub.add_parser("minilm", help="extract a real head of all-MiniLM-L6-v2 (offline weights)")
    mi.add_argument("--layer", required=True, type=_nonnegative_int, help="layer 0..5")
    mi.add_argument("--head", type=_nonnegative_int, help="head 0..11")
    mi.add_argument("--all-heads", action="store_true",
                    help="the layer's 12 heads as one multi-head target (multi-head learner)")
    mi.add_argument("--subspace", type=_positive_int, metavar="K",
                    help="--all-heads: tokens in a random K-dim subspace, full-rank multi-head "
                         "learner (default: the full width 384, low-rank multi-head learner)")
    mi.add_argument("--target", metavar="URL",
                    help="--all-heads: query this http:// endpoint serving the layer "
                         "(see --save-target) instead of the local weights")
    mi.set_defaults(http_binary=True)     # --target: float64 bodies (384-wide probes)
    mi.add_argument("--save-target", metavar="FILE.npz",
                    help="--all-heads: write the layer's 12 heads as a model file for "
                         "'attnextract serve --secret FILE.npz' and stop")
    mi.add_argument("--readout-seed", type=int, default=0, help="seed of the readout vector r")
    mi.add_argument("--seed", type=int, default=0, help="seed of the learner")
    mi.add_argument("--budget", type=_nonnegative_int)
    mi.add_argument("--journal", metavar="FILE.sqlite")
    mi.add_argument("--out", help="RESULT.npz to write")
    mi.add_argument("--json", action="store_true")
    mi.add_argument("--no-progress", action="store_true")

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

    be = sub.add_parser("bench", help="benchmark every learner against floors and a baseline")
    be.add_argument("--quick", action="store_true", help="small sizes, under two minutes")
    be.add_argument("--out", default="bench-out", help="directory for bench.json, bench.md, PNGs")
    be.add_argument("--sections", nargs="+", help="run only these sections")
    be.add_argument("--update-readme", metavar="README", help="put the table into README's "
                    "<!-- bench:begin --> ... <!-- bench:end --> block")

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
               "bench": cmd_bench, "twins": cmd_twins, "serve": cmd_serve,
               "minilm": cmd_minilm}[args.command]
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


def _open_target(spec: str, dim: int | None = None, args=None):
    """A black box from FILE.py:NAME, or from an HTTP endpoint http://HOST:PORT."""
    if spec.startswith(("http://", "https://")):
        from .adapters.remote import HttpBlackBox
        options = {k: getattr(args, f"http_{k}") for k in ("timeout", "retries", "concurrency",
                                                           "binary")
                   if getattr(args, f"http_{k}", None) is not None}
        black_box = HttpBlackBox(spec, **options)
        if dim is not None:
            black_box.check_dim(dim)       # also fails early, typed, when unreachable
        return black_box
    return load_target(spec)


def _model_options(args) -> dict:
    """The extract options given for --model's learner; an option of another kind is an error."""
    allowed = MODEL_OPTIONS.get(args.model, ())
    given = {name: getattr(args, name) for names in MODEL_OPTIONS.values() for name in names
             if getattr(args, name, None) is not None}
    stray = sorted(set(given) - set(allowed))
    if stray:
        raise InputError(f"--{stray[0]} does not apply to --model {args.model}")
    return given


def _learner_and_options(args):
    """The learner for ``--model`` (or ``--sign-only``) and its keyword options."""
    noisy_flags = (args.noise_method != "robust" or args.noise != "bounded" or args.repeats != 1
                   or args.norm_bound is not None or args.margin is not None)
    if args.sign_only:
        if args.tolerance is not None:
            raise InputError("--sign-only answers are labels: --tolerance does not apply")
        return extract_sign_only, {"bits": args.bits, "threshold": args.threshold}
    options = _model_options(args)
    if args.model in POLISHED:
        options["polish"] = not args.no_polish
    if args.tolerance is not None:
        if args.model != "single-head":
            raise InputError("--tolerance applies to --model single-head")
        options.update(tolerance=args.tolerance, relative_tolerance=args.relative_tolerance,
                       noise=args.noise, method=args.noise_method, repeats=args.repeats,
                       norm_bound=args.norm_bound, margin=args.margin)
    elif noisy_flags:
        raise InputError("--noise-method, --noise, --repeats, --norm-bound and --margin "
                         "need --tolerance")
    return EXTRACTORS[args.model], options


def cmd_extract(args) -> int:
    learner, options = _learner_and_options(args)     # option errors before any work
    black_box = _open_target(args.target, args.dim, args)
    journal = _open_journal(args)
    bar = ProgressBar("extracting", enabled=False if args.no_progress or args.json else None)
    oracle = Oracle(black_box, args.dim, budget=args.budget, max_batch=args.max_batch,
                    progress=bar, journal=journal)
    if learner is extract_low_rank:
        options["fit_progress"] = bar.fitting
    try:
        result = learner(oracle, seed=args.seed, verify_tolerance=args.verify_tolerance,
                         **options)
    finally:
        bar.close()
        _close_journal(oracle)
    _note_sources(result.report, oracle)
    result.save(args.out)
    if args.json:
        print(json.dumps({"ok": True, "out": args.out, **result.report.to_dict()}))
    else:
        print(result.report.render())
        print(f"wrote        {args.out}")
    return 0


def _open_journal(args):
    """The --journal of an extraction (None without one); fixes the learner's seed in it."""
    if not getattr(args, "journal", None):
        return None
    journal = QueryJournal(args.journal, context={"target": args.target, "dim": args.dim})
    # a resumed run must ask the same sequences: the learner's seed is part of the journal
    if args.seed is None:
        args.seed = journal.context.get("seed", int.from_bytes(os.urandom(4), "little"))
    journal.remember(seed=args.seed)
    if journal.context.get("seed") != args.seed:
        journal.close()
        raise InputError(f"journal {args.journal} was recorded with --seed "
                         f"{journal.context['seed']}, not {args.seed}")
    return journal


def _close_journal(oracle: Oracle) -> None:
    """Close the oracle's journal; a failed extraction's report still says who answered."""
    if oracle.journal is None:
        return
    failure = sys.exc_info()[1]
    if getattr(failure, "result", None) is not None:
        _note_sources(failure.result.report, oracle)
    oracle.journal.close()


def _note_sources(report, oracle: Oracle) -> None:
    """Say in the report how many queries the black box and the journal answered."""
    if oracle.journal is not None:
        report.details["black_box_queries"] = oracle.black_box_queries
        report.details["journal_queries"] = oracle.journal_queries
        report.details["journal"] = oracle.journal.path


def cmd_verify(args) -> int:
    model = load_model(args.result)
    oracle = Oracle(_open_target(args.target, model.dim), model.dim, budget=args.budget)
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


def cmd_bench(args) -> int:
    from .bench import SECTIONS, run_bench, update_readme
    unknown = set(args.sections or ()) - set(SECTIONS)
    if unknown:
        raise InputError(f"unknown bench section(s) {sorted(unknown)}; known: {sorted(SECTIONS)}")
    summary = run_bench(args.out, quick=args.quick, sections=args.sections,
                        log=lambda line: print(line, file=sys.stderr))
    table = (Path(args.out) / "bench.md").read_text()
    print(table)
    if not summary["plots"]:
        print("(matplotlib is not installed: no plots; pip install 'attnextract[plot]')",
              file=sys.stderr)
    print(f"wrote {args.out}/bench.json, bench.md" +
          "".join(f", {p}" for p in summary["plots"]) + f" in {summary['seconds']:.1f} s")
    if args.update_readme:
        image = None
        if "queries_vs_d.png" in summary["plots"]:
            image = os.path.relpath(Path(args.out) / "queries_vs_d.png",
                                    Path(args.update_readme).resolve().parent)
        update_readme(args.update_readme, table, image)


def cmd_twins(args) -> int:
    from .learners.multi_head import canonical_error, canonical_form, non_identifiable_twin, twin_difference
    from .adapters.targets import random_multi_head
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


def cmd_serve(args) -> int:
    from .adapters.server import make_server
    model = load_model(args.secret)
    try:
        server = make_server(model, args.host, args.port, budget=args.budget,
                             round_digits=args.round_digits, verbose=args.verbose)
    except OSError as exc:
        raise InputError(f"cannot listen on {args.host}:{args.port}: {exc}") from exc
    budget = "no budget" if args.budget is None else f"budget {args.budget} queries"
    print(f"serving {model.kind} d = {model.dim} on {server.url} ({budget}); "
          f"POST /query, GET /health; Ctrl-C stops", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def cmd_minilm(args) -> int:
    from .adapters.minilm import extract_minilm_head, extract_minilm_layer
    if args.all_heads == (args.head is not None):
        raise InputError("give either --head H or --all-heads")
    if not args.all_heads and (args.target or args.save_target or args.subspace):
        raise InputError("--subspace, --target and --save-target go with --all-heads")
    journal = None
    if args.journal:
        which = "all heads" if args.all_heads else f"head {args.head}"
        journal = QueryJournal(args.journal, context={
            "target": f"minilm layer {args.layer} {which} readout {args.readout_seed}",
            "dim": (args.subspace or 384) if args.all_heads else 384, "seed": args.seed})
    if args.all_heads:
        if args.save_target:
            from .adapters.minilm import save_layer_target
            save_layer_target(args.save_target, args.layer, args.readout_seed)
            print(f"wrote {args.save_target}: layer {args.layer}, 12 heads, readout seed "
                  f"{args.readout_seed} (serve it with attnextract serve --secret "
                  f"{args.save_target})")
            return 0
        black_box = None
        if args.target:
            if args.subspace is not None:
                raise InputError("--target serves the full-width layer: drop --subspace")
            black_box = _open_target(args.target, 384, args)
        bar = ProgressBar("extracting", enabled=False if args.no_progress or args.json else None)
        try:
            result, _, error = extract_minilm_layer(
                args.layer, readout_seed=args.readout_seed, subspace=args.subspace,
                seed=args.seed, budget=args.budget, journal=journal, black_box=black_box,
                progress=bar)
        finally:
            bar.close()
            if journal is not None:
                journal.close()
        if error is not None:
            raise error          # exit 1, with the report of what the learner achieved
        if args.out:
            result.save(args.out)
        print(json.dumps({"ok": True, "out": args.out, **result.report.to_dict()})
              if args.json else result.report.render())
        return 0
    bar = ProgressBar("extracting", enabled=False if args.no_progress or args.json else None)
    try:
        result, _ = extract_minilm_head(args.layer, args.head, readout_seed=args.readout_seed,
                                        seed=args.seed, budget=args.budget, progress=bar,
                                        journal=journal)
    finally:
        bar.close()
        if journal is not None:
            journal.close()
    if args.out:
        result.save(args.out)
    if args.json:
        print(json.dumps({"ok": True, "out": args.out, **result.report.to_dict()}))
    else:
        print(result.report.render())
        if args.out:
            print(f"wrote        {args.out}")
    return 0
