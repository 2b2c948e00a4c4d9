"""Command-line interface: ``attnextract extract | verify | demo | twins | checkpoint | minilm | serve | bench``.

One vocabulary across subcommands: every option shows its default in ``--help``;
``-v``/``--log-level``, ``--no-progress`` and ``--threads`` exist everywhere;
``--tolerance`` is always the black box's output noise, ``--verify-tolerance`` the
held-out error accepted; ``--out`` is a result file, ``--out-dir`` a directory;
``--journal`` exists on every subcommand that queries. ``--model`` names come from
:mod:`attnextract.registry`. Argument errors are one line plus a pointer to ``--help``.

Exit codes: 0 success; 1 the extraction or verification failed (mismatch, not
identifiable, budget); 2 bad usage (arguments, target or result files); 3 the black
box failed (raised, malformed or non-finite answers, unreachable); 4 the query journal
failed (cannot be written or read, fails its checks, or was recorded against another
black box); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from . import __version__
from ._startup import interrupts_as_usual
from .adapters.journal import QueryJournal
from .adapters.minilm import (
    extract_minilm_head,
    extract_minilm_layer,
    minilm_weights_path,
    save_layer_target,
    save_vector_layer_target,
)
from .adapters.remote import HttpBlackBox, read_token_file
from .adapters.replicas import RayReplicas, load_spec
from .adapters.server import make_server, read_tokens
from .adapters.targets import (
    FirstBatchHint,
    load_target,
    random_multi_head,
    random_single_head,
    random_vector_attention,
)
from .bench import SECTIONS, readme_summary, run_bench, update_readme
from .checkpoint import extract_checkpoint
from .errors import (
    AttnExtractError,
    BlackBoxError,
    BudgetExceededError,
    InputError,
    JournalError,
    NotIdentifiableError,
    RefusalWithResult,
    TargetLoadError,
)
from .learners.multi_head import (
    canonical_error,
    canonical_form,
    non_identifiable_twin,
    twin_difference,
)
from .learners.vector_canonical import vector_canonical_errors, vector_canonical_form
from .models import VectorAttention
from .oracle import OUTPUT_KINDS, Oracle
from .progress import ProgressBar, configure_logging, thread_limits
from .registry import LEARNERS, extract, get_learner, learner_names, resolve
from .report import (
    DEFAULT_VERIFY_TOLERANCE,
    human_number,
    load_model,
    load_result,
    mismatch_reason,
    verification_count,
    verify_model,
)

__all__ = ["main", "build_parser", "ProgressBar"]

# extract options that belong to some models only: CLI dest -> the learner's keyword.
# An option given for a model whose learner does not take it is an error.
MODEL_OPTIONS = {"rank": "rank", "method": "method", "oversampling": "oversampling",
                 "heads": "heads", "polish": "polish", "precision": "precision",
                 "relative_tolerance": "relative_tolerance", "noise": "noise",
                 "noise_method": "method", "repeats": "repeats", "norm_bound": "norm_bound",
                 "margin": "margin", "bits": "bits", "threshold": "threshold",
                 "biases": "biases", "radius": "radius", "max_error_bar": "max_error_bar"}
NOISE_OPTIONS = ("relative_tolerance", "noise", "noise_method", "repeats", "norm_bound", "margin")
LABEL_OPTIONS = ("bits", "threshold")
# their defaults on the command line (the learners' own): equal to it counts as not given
OPTION_DEFAULTS = {"polish": True, "relative_tolerance": 0.0, "noise": "bounded",
                   "noise_method": "robust", "repeats": 1, "threshold": 0.0, "bits": 40,
                   "biases": False}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help: flags say "off", unset options say what that
    means ("no limit", "random") or "none"; descriptions and epilogs keep their lines."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.help == argparse.SUPPRESS or not action.option_strings or action.required
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))
                or "default" in text or "%(default)" in text):
            return action.help
        if action.nargs == 0:                       # a flag: not given, it is off
            return text + " (default: off)"
        if action.default is None:
            return text + " (default: none)"
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """Argument errors as one line plus a pointer to --help (not the usage block)."""

    def error(self, message):
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            names = re.findall(r"'([^']*)'", choice.group(2)) or choice.group(2).split(", ")
            close = difflib.get_close_matches(choice.group(1), names, n=1, cutoff=0.5)
            message = (f"{message.split(':')[0]}: unknown {choice.group(1)!r}"
                       + (f"; did you mean {close[0]!r}?" if close else
                          f" (choose from {', '.join(names)})"))
        self.exit(2, f"{self.prog}: error: {message}\nsee {self.prog} --help\n")


class Renamed(argparse.Action):
    """An old option spelling, still accepted, with a note naming the new one."""

    def __init__(self, option_strings, dest, new: str = "", **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"attnextract: note: {option_string} is now {self.new} (the old spelling "
              f"still works, for now)", file=sys.stderr)
        setattr(namespace, self.dest, values)


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


def _common_options() -> argparse.ArgumentParser:
    """Options every subcommand takes: verbosity, progress, threads."""
    common = Parser(add_help=False, formatter_class=HelpFormatter)
    group = common.add_argument_group("output and resources (every subcommand)")
    group.add_argument("-v", "--verbose", action="count", default=0,
                       help="the whole report (every measurement, not the headline) and the "
                            "learner's stages logged on stderr (-v info, -vv debug)")
    group.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                       help="log level of the attnextract loggers, overriding -v (default: from -v)")
    group.add_argument("--no-progress", action="store_true",
                       help="no progress display (a bar on a terminal, else a line every "
                            "few seconds, on stderr)")
    group.add_argument("--threads", type=_positive_int, default=1, metavar="N",
                       help="BLAS/OpenMP threads of this process (threadpoolctl); 1 does not "
                            "oversubscribe a shared machine")
    return common


def _add_journal(parser, beside_out: bool = True) -> None:
    """--journal / --no-journal of a subcommand that queries a black box."""
    default = ("RESULT.journal.sqlite beside --out" if beside_out else
               "none, every run starts over")
    parser.add_argument("--journal", metavar="FILE.sqlite",
                        help="record every query and answer in FILE; a restarted run resumes "
                             f"from it (default: {default})")
    parser.add_argument("--no-journal", action="store_true",
                        help="keep no journal: an interrupted run starts over")


def _add_domain(parser) -> None:
    """--max-length and --target-timeout (every command that queries a target)."""
    parser.add_argument("--max-length", type=_positive_int, metavar="L",
                        help="the longest sequence the black box accepts: no query is longer "
                        "(a learner that needs longer probes refuses at its start), and "
                        "verification covers lengths up to L (default: the longest the "
                        "learner sent, at least 4096)")
    parser.add_argument("--target-timeout", type=float, metavar="SECONDS",
                        help="FILE.py targets: a call that has not answered after SECONDS is "
                        "a black-box error (exit 3)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="attnextract", formatter_class=HelpFormatter,
        description="Recover attention-model parameters from black-box query access. "
                    "Documentation: https://attnextract.github.io/attnextract/")
    parser.add_argument("--version", action="version", version=f"attnextract {__version__}")
    parser.epilog = "attnextract COMMAND --help lists a command's options and their defaults."
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _common_options()

    def command(name, help):
        return sub.add_parser(name, help=help, description=help, parents=[common],
                              formatter_class=HelpFormatter)

    for add in (_extract_parser, _serve_parser, _checkpoint_parser, _minilm_parser,
                _verify_parser, _demo_parser, _bench_parser, _twins_parser):
        add(command)
    return parser


def _extract_parser(command) -> None:
    """extract: the target, the learner and its options."""
    ex = command("extract", "extract a model from a black box")
    ex.epilog = model_table()
    ex.add_argument("--target", required=True,
                    help="FILE.py:NAME or MODULE:NAME (a callable (B, N, d) -> (B,), or (N, d) -> one number) or http://HOST:PORT")
    ex.add_argument("--dim", required=True, type=_positive_int, help="token width d")
    ex.add_argument("--model", default="single-head", choices=learner_names(), metavar="MODEL",
                    help="the model class the black box is assumed to be (the table below)")
    ex.add_argument("--out", required=True, metavar="RESULT.npz",
                    help="result file to write (.npz is appended if missing)")
    ex.add_argument("--budget", type=_nonnegative_int,
                    help="hard limit on queries (default: no limit)")
    ex.add_argument("--max-batch", type=_positive_int,
                    help="largest batch per black-box call (default: no limit)")
    _add_domain(ex)
    ex.add_argument("--seed", type=int, help="seed of the learner's random choices, kept in the "
                    "journal (default: random)")
    ex.add_argument("--verify-tolerance", type=float, dest="verify_tolerance", metavar="ERR",
                    help=f"held-out relative error accepted (default {DEFAULT_VERIFY_TOLERANCE:g}"
                         "; with --tolerance or --sign-only: extra slack beyond the noise, "
                         "default 0)")
    ex.add_argument("--tolerance-verify", type=float, dest="verify_tolerance",
                    action=Renamed, new="--verify-tolerance", help=argparse.SUPPRESS)
    ex.add_argument("--verify-sequences", type=_positive_int, dest="verify_sequences",
                    metavar="N", help="held-out sequences asked at least (default: the "
                    "learner's count); more buy a stronger coverage statement: n draws of "
                    "a family catch a deviation on a share 1 - 0.05^(1/n) of its inputs "
                    "with 95%% confidence")
    ex.add_argument("--json", action="store_true", help="print one JSON object")
    _add_journal(ex)
    ex.add_argument("--biases", action="store_true",
                    help="the attention has query, value and output biases, as deployed layers "
                         "do: f = sum_h softmax(X (W_h x_N + b_h))^T X v_h + c; recovers b_h "
                         "and c too (single-head, low-rank, multi-head, multi-head-low-rank; "
                         "see https://attnextract.github.io/attnextract/biases/)")
    _add_vector_options(ex)
    _add_learner_options(ex)
    _add_noise_options(ex)
    _add_http_client_options(ex)


def _add_vector_options(ex) -> None:
    """extract: what the black box answers (one number, or output vectors)."""
    vec = ex.add_argument_group(
        "vector answers (https://attnextract.github.io/attnextract/vector-outputs/)")
    vec.add_argument("--outputs", choices=OUTPUT_KINDS,
                     help="what the black box answers per sequence: one number (scalar), the "
                          "output vector (m,) at the last position (last), or the output "
                          "vectors (N, m) at every position (all) (default: found from its "
                          "first answer)")
    vec.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                     help="--outputs all: position j sees positions i <= j only (a decoder); "
                          "--no-causal: every position sees every other (an encoder) "
                          "(default: not stated; a learner that needs to know refuses)")
    vec.add_argument("--out-dim", type=_positive_int, metavar="M",
                     help="m, the width of a vector answer (default: found from the first "
                          "answer; a box answering another m is a black-box error, exit 3)")


def _add_learner_options(ex) -> None:
    """extract: the options of particular learners (rank, heads, polish)."""
    low = ex.add_argument_group("--model low-rank")
    low.add_argument("--rank", type=_positive_int,
                     help="rank r of W, needed by --method rop (default: found)")
    low.add_argument("--method", choices=["adaptive", "rop"],
                     help="adaptive cross approximation at the floor d + r(2d - r), or the "
                          "paper's Gaussian rank-one projections (default: adaptive)")
    low.add_argument("--oversampling", type=float, metavar="C",
                     help="rop: C in m = C r 2d measurements (default 2)")
    multi = ex.add_argument_group("--model multi-head, transformer-layer, pre-ln")
    multi.add_argument("--heads", type=_positive_int,
                       help="the model's number of heads, an upper bound on the canonical "
                            "heads (default: detected; pre-ln: 1, a block with more is "
                            "refused)")
    multi.add_argument("--precision", choices=["full", "fast"],
                       help="multi-head: full spends what the multi-head paper's count "
                            "(4Hd^2 - 2H + 1) leaves on a last "
                            "round (short probes for float64 answers, else wide columns) for "
                            "the smallest error; fast runs only wide columns, and only when "
                            "the error bar would exceed 1e-10 (default: full)")
    multi.add_argument("--max-error-bar", type=float, metavar="BAR",
                       help="multi-head: the largest error bar (relative parameter error) "
                            "accepted, in (0, 1); a larger one is refused and the refusal "
                            "states it (default 1e-6; 9.5e-3 for float32 answers)")
    pre = ex.add_argument_group("--model pre-ln")
    pre.add_argument("--radius", type=float, metavar="R",
                     help="norm of every probe token, all with zero mean: the sphere where "
                          "LayerNorm is affine and the model is defined (default sqrt(d))")
    ffn = ex.add_argument_group("--model relu-network, one-layer, one-layer-residual")
    ffn.add_argument("--no-polish", action="store_false", dest="polish",
                     help="skip measuring each hidden unit alone (m d fewer queries, fewer "
                          "bits of precision)")


def _add_noise_options(ex) -> None:
    """extract: noisy, rounded, low-precision and label-only outputs."""
    noisy = ex.add_argument_group("noisy or rounded outputs (--model single-head; --output-dtype "
                                  "and --decimals also multi-head, multi-head-low-rank, "
                                  "transformer-layer)")
    noisy.add_argument("--tolerance", type=float, metavar="TAU",
                       help="outputs are accurate to +-TAU (+ RHO |f|): noisy extraction with "
                            "error bars (with --noise random: the noise std; default: exact "
                            "outputs)")
    noisy.add_argument("--relative-tolerance", type=float, default=OPTION_DEFAULTS["relative_tolerance"], metavar="RHO",
                       help="relative part of the tolerance, for outputs computed in float64 and "
                            "rounded once at the end (a float32 cast: 5.96e-8); a forward pass "
                            "run in low precision errs far more: use --output-dtype")
    noisy.add_argument("--output-dtype", choices=["float32", "bfloat16", "float16"],
                       help="the black box runs its forward pass in this dtype (single-head: "
                            "probes repeated in --repeats dithered bases, default 4; every "
                            "learner: error bars from measured spread or residuals)")
    noisy.add_argument("--decimals", type=_nonnegative_int, metavar="K",
                       help="the outputs are rounded to K decimals (0..15): as --output-dtype "
                            "(default: not rounded)")
    noisy.add_argument("--noise", choices=["bounded", "random"], default=OPTION_DEFAULTS["noise"],
                       help="worst-case (adversarial) or independent random noise")
    noisy.add_argument("--noise-method", choices=["robust", "paper"],
                       default=OPTION_DEFAULTS["noise_method"],
                       help="robust, or the single-head paper's Theorem 6.1 (needs --norm-bound)")
    noisy.add_argument("--repeats", type=_positive_int, default=OPTION_DEFAULTS["repeats"],
                       help="measure every probe in this many dithered bases")
    noisy.add_argument("--norm-bound", type=float, metavar="B", help="B >= ||W||_F (paper)")
    noisy.add_argument("--margin", type=float, metavar="MU", help="mu <= min |v_i| (paper)")
    labels = ex.add_argument_group("label-only outputs (--model single-head)")
    labels.add_argument("--sign-only", action="store_true",
                        help="the target answers labels 1{f(X) > THRESHOLD}: extract by "
                             "bisection (threshold 0: v up to a positive scale)")
    labels.add_argument("--threshold", type=float, default=OPTION_DEFAULTS["threshold"],
                        help="the labels' known THRESHOLD; a nonzero one also fixes the scale of v")
    labels.add_argument("--bits", type=_positive_int, default=OPTION_DEFAULTS["bits"],
                        help="bisection steps per entry of W")


def _add_http_client_options(ex) -> None:
    """extract: the HTTP client of an http:// target."""
    http = ex.add_argument_group("http:// targets")
    client = _http_defaults()
    http.add_argument("--http-timeout", type=float, metavar="SECONDS",
                      help="seconds one attempt of an HTTP request may take in all: connect, "
                           f"send and the whole answer (default: {client['timeout']:g})")
    http.add_argument("--http-token-file", metavar="FILE",
                      help="send the bearer token in FILE (the server's --token-file) on "
                           "every request")
    http.add_argument("--http-retries", type=_nonnegative_int,
                      help=f"retries of timeouts and 5xx answers (default: {client['retries']})")
    http.add_argument("--http-concurrency", type=_positive_int,
                      help=f"HTTP requests in flight at once (default: {client['concurrency']})")
    http.add_argument("--http-transport", choices=["npy", "json"],
                      help="request/answer format (default npy, falling back to json for "
                           "servers without it)")


def _serve_parser(command) -> None:
    """serve: a model file as an HTTP black box, its limits and its ledger."""
    se = command("serve", "serve a model file as an HTTP black box")
    se.add_argument("--secret", required=True,
                    help="FILE.npz with W and v (or a RESULT.npz), or FILE.py:NAME")
    se.add_argument("--port", required=True, type=_nonnegative_int, help="0 picks a free port")
    se.add_argument("--host", default="127.0.0.1", help="address to listen on")
    se.add_argument("--budget", type=_nonnegative_int,
                    help="queries served in all, 429 past it (default: no limit)")
    se.add_argument("--round", type=_nonnegative_int, dest="round_digits", metavar="DIGITS",
                    help="round every output to DIGITS decimals (default: exact float64)")
    se.add_argument("--max-connections", type=_positive_int, default=2048,
                    help="connections open at once (one more gets 503)")
    se.add_argument("--idle-timeout", type=float, default=2.0,
                    help="seconds a request body may pause before it is refused (400)")
    se.add_argument("--workers", type=_positive_int, default=4,
                    help="threads evaluating the model")
    se.add_argument("--replicas", type=_positive_int, metavar="N",
                    help="evaluate the model on N Ray actors, pip install 'attnextract[ray]' "
                         "(default: in this process)")
    se.add_argument("--ray-address", help="an existing Ray cluster (default: start a local one)")
    se.add_argument("--state", metavar="FILE.sqlite",
                    help="keep the budget, charges and recent answers in this SQLite ledger: "
                         "a restart, a crash or kill -9 loses nothing (default: in memory); "
                         "a damaged, empty or foreign file is refused, never reset")
    se.add_argument("--state-new", action="store_true",
                    help="--state names a new ledger: create it (a missing or empty file; "
                         "a file with bytes is never overwritten)")
    se.add_argument("--body-memory", type=_positive_int, default=96, metavar="MIB",
                    help="MiB all request bodies being answered may hold (others wait)")
    se.add_argument("--cache-memory", type=_nonnegative_int, default=32, metavar="MIB",
                    help="MiB of answers kept for their Idempotency-Keys (replays are free)")
    se.add_argument("--slot-timeout", type=float, default=10.0, metavar="SECONDS",
                    help="seconds a body may wait for memory before a 503")
    se.add_argument("--outputs", choices=["last", "all"],
                    help="serve a saved vector model (VectorAttention) at the last position "
                         "or at every position (default: as saved)")
    se.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                    help="with --outputs all: a causal mask (default: as saved)")
    se.add_argument("--min-body-rate", type=float, default=256.0, metavar="KIB_PER_S",
                    help="KiB/s a body must average after its idle-timeout grace (else 408)")
    se.add_argument("--token-file", metavar="FILE",
                    help="bearer tokens, one a line: a query without one gets 401 and "
                         "/health says only that it is alive (default: no tokens)")
    se.add_argument("--max-client-connections", type=_positive_int, metavar="N",
                    help="connections one address may hold at once, more get 503 "
                         "(default: --max-connections / 8)")
    se.add_argument("--max-client-rate", type=float, metavar="PER_S",
                    help="requests a second one address may send (bursts of twice that), "
                         "more get 503 (default: no limit)")


def _checkpoint_parser(command) -> None:
    """checkpoint: every attention layer of a local model folder."""
    ck = command("checkpoint", "extract every attention layer of a local model folder "
                               "(config.json + model.safetensors), run by its own code")
    ck.add_argument("path", metavar="PATH", help="the model folder (nothing is downloaded)")
    ck.add_argument("--layers", default="all", metavar="all|0,3,5",
                    help="which layers (default: all)")
    ck.add_argument("--outputs", choices=["scalar", "last", "all"], default="last",
                    help="what the layer's black box answers: the whole vector F at the "
                         "last position (default), r^T F at the last position (seeded "
                         "readout r: one direction of the output, far more queries), or "
                         "at every position (BERT-style layers: fewer queries; GPT-2 "
                         "layers of several heads: read at the last position)")
    ck.add_argument("--model", dest="learner", metavar="LEARNER",
                    help="a registered learner instead of the family's own (BERT-style: "
                         "multi-head-low-rank with biases; GPT-2: pre-ln)")
    ck.add_argument("--seed", type=int, default=0, help="seed of the learners")
    ck.add_argument("--readout-seed", type=int, default=0, help="seed of the readout vector r")
    ck.add_argument("--budget", type=_nonnegative_int, help="query budget of each layer")
    ck.add_argument("--run-dir", metavar="DIR",
                    help="journals, progress and finished layers; a rerun resumes it "
                         "(default: <folder name>.attnextract-run)")
    ck.add_argument("--ray", nargs="?", const=True, default=None, metavar="ADDRESS",
                    help="every layer a Ray task: on a local cluster started for the run "
                         "(as many CPUs as cores), or on the cluster at ADDRESS")
    ck.add_argument("--out", metavar="RESULT.json",
                    help="the bundle: per layer the canonical heads, queries, floor, error "
                         "bar, verification, CPU and wall time (default: in the run folder)")
    ck.add_argument("--check-against", metavar="PATH",
                    help="a model folder with the true weights (usually PATH): canonical "
                         "error per layer")
    ck.add_argument("--export", metavar="FILE.safetensors",
                    help="write the model back: the original state dict with the recovered "
                         "attention re-factored in (needs --outputs last)")
    ck.add_argument("--compare", metavar="EXPORTED",
                    help="load PATH, swap in EXPORTED's tensors, report the largest "
                         "difference of the outputs on real inputs, and stop")
    ck.add_argument("--save-target", metavar="FILE.npz",
                    help="write one layer (--layers L) read out by r as a model file for "
                         "'attnextract serve --secret FILE.npz', and stop")
    ck.add_argument("--json", action="store_true", help="print one JSON object (no heads)")


def _minilm_parser(command) -> None:
    """minilm: a real all-MiniLM-L6-v2 head or layer."""
    mi = command("minilm", "extract a real head of all-MiniLM-L6-v2 (offline weights)")
    mi.add_argument("--layer", required=True, type=_nonnegative_int, help="layer 0..5")
    mi.add_argument("--head", type=_nonnegative_int,
                    help="head 0..11 (or --all-heads; neither: the layer through 'checkpoint' "
                         "on the MiniLM folder, run by the model's own code)")
    mi.add_argument("--all-heads", action="store_true",
                    help="the layer's 12 heads as one multi-head target (multi-head learner)")
    mi.add_argument("--subspace", type=_positive_int, metavar="K",
                    help="--all-heads: tokens in a random K-dim subspace, full-rank multi-head "
                         "learner (default: the full width 384, low-rank multi-head learner)")
    mi.add_argument("--target", metavar="URL",
                    help="--all-heads: query this http:// endpoint serving the layer "
                         "(see --save-target) instead of the local weights")
    mi.add_argument("--http-timeout", type=float, metavar="SECONDS",
                    help="--target: seconds one attempt of an HTTP request may take in all "
                         "(a loaded server answering batches of 12 heads at d = 384 may "
                         "need more than the default)")
    mi.add_argument("--http-token-file", metavar="FILE",
                    help="--target: send the bearer token in FILE (the server's "
                         "--token-file) on every request")
    mi.add_argument("--save-target", metavar="FILE.npz",
                    help="--all-heads: write the layer's 12 heads as a model file for "
                         "'attnextract serve --secret FILE.npz' and stop")
    mi.add_argument("--outputs", choices=["last", "all"],
                    help="with --save-target: save the whole layer (all 12 heads, biases, "
                         "the full OV circuit) as a vector model answering its output at "
                         "the last position or at every position")
    mi.add_argument("--no-biases", action="store_false", dest="biases",
                    help="--all-heads: leave the layer's query, key, value and output biases "
                         "out (the bias-free layer of earlier versions); the biases are kept "
                         "by default at the full width, and left out with --head or --subspace")
    mi.add_argument("--readout-seed", type=int, default=0, help="seed of the readout vector r")
    mi.add_argument("--seed", type=int, default=0, help="seed of the learner")
    mi.add_argument("--budget", type=_nonnegative_int,
                    help="hard limit on queries (default: no limit)")
    mi.add_argument("--out", metavar="RESULT.npz", help="result file to write (default: none)")
    mi.add_argument("--json", action="store_true", help="print one JSON object")
    _add_journal(mi)


def _verify_parser(command) -> None:
    """verify: a saved result against a black box."""
    ve = command("verify", "compare a saved result with a black box")
    ve.add_argument("--target", required=True,
                    help="FILE.py:NAME or MODULE:NAME (a callable (B, N, d) -> (B,), or (N, d) -> one number) or http://HOST:PORT")
    ve.add_argument("--http-token-file", metavar="FILE",
                    help="http:// targets: send the bearer token in FILE (the server's "
                         "--token-file) on every request")
    ve.add_argument("--result", required=True, metavar="RESULT.npz",
                    help="result file written by extract")
    ve.add_argument("--count", type=_positive_int,
                    help="held-out sequences (default max(64, 1%% of parameters))")
    ve.add_argument("--seed", type=int, help="seed of the held-out sequences (default: random)")
    ve.add_argument("--verify-tolerance", type=float, dest="verify_tolerance", metavar="ERR",
                    help="largest held-out relative output error accepted as a match (default: "
                         "the tolerance and error bar the result's own verification used, else "
                         f"{DEFAULT_VERIFY_TOLERANCE:g})")
    ve.add_argument("--tolerance", type=float, dest="verify_tolerance", action=Renamed,
                    new="--verify-tolerance", help=argparse.SUPPRESS)
    ve.add_argument("--budget", type=_nonnegative_int,
                    help="hard limit on queries (default: no limit)")
    _add_domain(ve)
    ve.add_argument("--json", action="store_true", help="print one JSON object")
    _add_journal(ve, beside_out=False)


def _demo_parser(command) -> None:
    """demo: a secret random head, extracted and checked."""
    de = command("demo", "extract a secret random single head and check it")
    de.add_argument("--dim", type=_positive_int, default=64, help="token width d")
    de.add_argument("--seed", type=int, help="seed of the secret target (default: random)")
    de.add_argument("--max-length", type=_positive_int, metavar="L",
                    help="longest sequence sent (verification covers lengths up to L)")
    de.add_argument("--json", action="store_true", help="print one JSON object")
    _add_journal(de, beside_out=False)


def _bench_parser(command) -> None:
    """bench: every learner against floors and a baseline."""
    be = command("bench", "benchmark every learner against floors and a baseline")
    be.add_argument("--quick", action="store_true", help="small sizes, under two minutes")
    be.add_argument("--out-dir", default="bench-out", metavar="DIR",
                    help="directory for bench.json, bench.md and the plots (PNG and SVG)")
    be.add_argument("--out", dest="out_dir", action=Renamed, new="--out-dir",
                    help=argparse.SUPPRESS)
    be.add_argument("--sections", nargs="+", metavar="SECTION",
                    help="run only these sections (default: all)")
    be.add_argument("--update-readme", metavar="README", help="put the table into README's "
                    "<!-- bench:begin --> ... <!-- bench:end --> block")


def _twins_parser(command) -> None:
    """twins: two parameter sets with one input-output map."""
    tw = command("twins", "show that multi-head attention is not identifiable: "
                          "two different parameter sets, one input-output map")
    tw.add_argument("--heads", type=_positive_int, default=3, help="heads of the random model")
    tw.add_argument("--dim", type=_positive_int, default=8, help="token width d")
    tw.add_argument("--seed", type=int, help="seed of the random model (default: random)")
    tw.add_argument("--count", type=_positive_int, default=1000,
                    help="random sequences compared")
    tw.add_argument("--outputs", choices=OUTPUT_KINDS, default="scalar",
                    help="the models answer one number per sequence (scalar), or the output "
                         "vector at the last position (last) or at every position (all): "
                         "a vector model's twin splits a head's O between two heads")
    tw.add_argument("--out-dim", type=_positive_int, metavar="M",
                    help="m, the width of vector answers (default: d)")
    tw.add_argument("--json", action="store_true", help="print one JSON object")


def model_table() -> str:
    """The --model choices as a short table: name, then what the black box is."""
    import textwrap
    names = learner_names()
    width = max(map(len, names)) + 2
    lines = ["models (--model):"]
    for name in names:
        text = textwrap.wrap(get_learner(name).description, 78 - width - 2)
        lines.append(f"  {name:<{width}}{text[0] if text else ''}")
        lines += [" " * (width + 2) + more for more in text[1:]]
    return "\n".join(lines)


def _http_defaults() -> dict:
    """The HTTP client's own defaults, shown in --help (the options pass None to keep them)."""
    import inspect
    parameters = inspect.signature(HttpBlackBox).parameters
    return {k: parameters[k].default for k in ("timeout", "retries", "concurrency")}


# subcommands that run a target (Python code, a C extension, a model library) in-process
TARGET_COMMANDS = ("extract", "verify", "demo", "minilm")


@contextlib.contextmanager
def _descriptor_1_to_stderr(enabled: bool = True):
    """While the block runs, file descriptor 1 writes to stderr and ``sys.stdout`` to the
    real standard output (a duplicate of the old descriptor 1).

    A target's Python prints are sent to stderr by its guard, but a C extension, a
    subprocess or ``os.write(1, ...)`` writes to descriptor 1 itself: with ``--json``
    that would break the one JSON object on stdout. The command's own output (the
    report, the JSON) goes through ``sys.stdout`` and reaches the real stdout; descriptor
    1 is restored on leaving. Without real descriptors (a captured test run) nothing is
    changed."""
    try:
        out_fd, err_fd = sys.stdout.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        out_fd = err_fd = None
    if not enabled or out_fd is None or err_fd is None or out_fd == err_fd:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(out_fd)
    previous = sys.stdout
    os.dup2(err_fd, out_fd)
    sys.stdout = os.fdopen(saved, "w", encoding=getattr(previous, "encoding", None) or "utf-8",
                           closefd=False)
    try:
        yield
    finally:
        try:
            sys.stdout.flush()
        finally:
            sys.stdout = previous
            os.dup2(saved, out_fd)
            os.close(saved)


def main(argv=None) -> int:
    """The ``attnextract`` program: run ``argv`` (default ``sys.argv[1:]``), return the exit code.

    Called without ``argv`` (the installed ``attnextract`` command, ``python -m attnextract``),
    Ctrl-C ends the process right after its one-line message (:func:`_exit_now`)."""
    as_program = argv is None
    interrupts_as_usual()           # from here on, Ctrl-C is this function's to report
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:                    # bare `attnextract`: the help, not an error
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    configure_logging(args.verbose, args.log_level)
    handler = {"extract": cmd_extract, "verify": cmd_verify, "demo": cmd_demo,
               "bench": cmd_bench, "twins": cmd_twins, "serve": cmd_serve,
               "minilm": cmd_minilm, "checkpoint": cmd_checkpoint}[args.command]
    _RUN.clear()
    try:
        with thread_limits(args.threads), _descriptor_1_to_stderr(args.command in TARGET_COMMANDS):
            code = handler(args) or 0
        sys.stdout.flush()          # a closed pipe shows here, inside the handler below
        return code
    except KeyboardInterrupt:
        print(_interrupted_line(), file=sys.stderr)
        if as_program:
            _exit_now(130)
        return 130
    except JournalError as exc:
        return _fail(args, exc, 4)
    except RefusalWithResult as exc:
        if exc.result is not None and not getattr(args, "json", False):
            print(exc.result.report.render(verbose=_verbose(args)), file=sys.stderr)
            hint = (_rounding_hint(exc.result.report, args)
                    if getattr(args, "model", None) == "single-head" else None)
            if hint:
                print(hint, file=sys.stderr)
        return _fail(args, exc, 1)
    except (NotIdentifiableError, BudgetExceededError) as exc:
        return _fail(args, exc, 1)
    except (TargetLoadError, InputError) as exc:
        return _fail(args, exc, 2)
    except BlackBoxError as exc:
        return _fail(args, exc, 3)
    except AttnExtractError as exc:
        return _fail(args, exc, 1)
    except BrokenPipeError:
        # the reader went away (``| head``): stop quietly, without a traceback at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _verbose(args) -> bool:
    """-v: the whole report (every measurement), not its headline."""
    return bool(getattr(args, "verbose", 0))


def _exit_now(code: int) -> None:
    """End the process with ``code`` at once, skipping the interpreter's shutdown.

    Ctrl-C must take effect within a second. By the time the interrupted line is
    printed the journal is closed and no result is half-written (both are closed or removed
    while the interrupt unwinds), but the interpreter's shutdown (garbage collection and
    teardown of numpy's and scipy's modules) still takes 0.2-0.5 s of CPU, over a second on
    a loaded machine, and would wait for any non-daemon thread (an HTTP request in flight)
    until its timeout. Standard streams and log handlers are flushed first."""
    import logging
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):       # a closed pipe or stream: nothing left to say
            pass
    logging.shutdown()
    os._exit(code)


def _rounding_hint(report, args) -> str | None:
    """A mismatch whose error is small enough to be rounding names the tolerance options."""
    check = report.verification
    if check is None or getattr(args, "tolerance", None) is not None:
        return None
    if not getattr(check, "rounded_answers", False):
        return None                 # the answers show no rounding: no hint to loosen the check
    if check.max_relative_error <= 1e-2:
        return (f"attnextract: hint: a held-out error of {check.max_relative_error:.1e} is small: "
                "if the black box rounds its outputs (float32, a few digits), extract with "
                "--tolerance 0 --relative-tolerance 6e-8 (float32; float16 4.9e-4) or accept "
                "more error with --verify-tolerance")
    return None


def _fail(args, exc: Exception, code: int) -> int:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if getattr(args, "json", False):
        out: dict[str, Any] = {"ok": False, "error": type(exc).__name__, "reason": reason}
        oracle = _RUN.get("oracle")
        if oracle is not None:
            # every sequence the black box answered, whether a result exists or not
            out["queries"] = oracle.queries + oracle.check_queries
        result = getattr(exc, "result", None)
        if result is not None:
            out["report"] = result.report.to_dict()
            if oracle is not None:
                out["report"]["queries"] = out["queries"]
        print(json.dumps(out))
    print(f"attnextract: {type(exc).__name__}: {reason}", file=sys.stderr)
    return code


def _open_target(spec: str, dim: int | None = None, args=None):
    """A black box from FILE.py:NAME, or from an HTTP endpoint http://HOST:PORT."""
    if spec.startswith(("http://", "https://")):
        options = {k: getattr(args, f"http_{k}")
                   for k in ("timeout", "retries", "concurrency", "transport")
                   if getattr(args, f"http_{k}", None) is not None}
        if getattr(args, "http_token_file", None) is not None:
            options["token"] = read_token_file(args.http_token_file)
        black_box = HttpBlackBox(spec, **options)
        if dim is not None:
            black_box.check_dim(dim)       # also fails early, typed, when unreachable
        return black_box
    return FirstBatchHint(load_target(spec), spec, getattr(args, "target_timeout", None))


def _progress(args, label: str = "extracting") -> ProgressBar:
    """The progress display of a subcommand (off with --no-progress)."""
    return ProgressBar(label, enabled=False if args.no_progress else None)


def _learner_and_options(args):
    """The learner for ``--model`` (or ``--sign-only`` / ``--tolerance``) and its options.

    Options are those of the registry's learner (see :mod:`attnextract.registry`); a
    per-model option given on the command line for a learner that does not take it is
    an :class:`InputError`, raised before any query.
    """
    precision = {"output_dtype": args.output_dtype, "decimals": args.decimals}
    if args.output_dtype is not None or args.decimals is not None:
        if args.tolerance is not None or args.sign_only:
            raise InputError("--output-dtype and --decimals state the precision instead of "
                             "--tolerance; they do not go with --tolerance or --sign-only")
        if args.model == "single-head":
            learner = get_learner("low-precision")
            options = dict(precision)
            if args.repeats != OPTION_DEFAULTS["repeats"]:
                options["repeats"] = args.repeats
            return learner, options
        takes = [n for n in learner_names() if "output_dtype" in get_learner(n).options]
        if "output_dtype" not in get_learner(args.model).options:
            raise InputError(f"--output-dtype and --decimals apply to --model "
                             f"{', '.join(['single-head'] + takes)}, not {args.model}")
    learner = resolve(args.model, tolerance=args.tolerance, sign_only=args.sign_only)
    accepted = learner.options
    options = {}
    for dest, keyword in MODEL_OPTIONS.items():
        value = getattr(args, dest, None)
        if value is None or value == OPTION_DEFAULTS.get(dest):
            continue                           # not given: the learner's own default
        flag = "--no-polish" if dest == "polish" else "--" + dest.replace("_", "-")
        if dest in NOISE_OPTIONS and args.tolerance is None:
            raise InputError(f"{flag} needs --tolerance (noisy outputs)")
        if dest in LABEL_OPTIONS and not args.sign_only:
            raise InputError(f"{flag} needs --sign-only (label outputs)")
        if dest == "method" and args.tolerance is not None:
            raise InputError("--method is --model low-rank's; with --tolerance, use --noise-method")
        if keyword not in accepted:
            raise InputError(f"{flag} does not apply to --model {learner.name}")
        options[keyword] = value
    options.update({k: v for k, v in precision.items() if v is not None})
    return learner, options


def _check_vector_options(args) -> None:
    """--outputs, --out-dim and --causal that contradict one another: InputError (exit 2)."""
    if args.outputs == "scalar" and args.out_dim not in (None, 1):
        raise InputError(f"--out-dim {args.out_dim} contradicts --outputs scalar (one number "
                         f"per sequence)")
    if args.causal is not None and args.outputs in ("scalar", "last"):
        raise InputError(f"--causal / --no-causal apply to --outputs all, not --outputs "
                         f"{args.outputs}")
    twin = get_learner(args.model).with_vectors
    if args.outputs in ("last", "all") and twin is not None and twin not in LEARNERS:
        raise InputError(f"--outputs {args.outputs}: the learner for vector answers of --model "
                         f"{args.model} ({twin}) is not installed in this version")


def cmd_extract(args) -> int:
    _check_vector_options(args)
    learner, options = _learner_and_options(args)     # option errors before any work
    args.out = _prepare_out(args.out)                 # an unwritable --out before any query
    black_box = _open_target(args.target, args.dim, args)
    journal_path = _journal_path(args)
    created = journal_path is not None and not os.path.exists(journal_path)
    journal = _open_journal(args)
    bar = _progress(args)
    oracle = Oracle(black_box, args.dim, budget=args.budget, max_batch=args.max_batch,
                    progress=bar, journal=journal, max_length=args.max_length,
                    outputs=args.outputs, out_dim=args.out_dim, causal=args.causal)
    oracle.verify_sequences = args.verify_sequences
    _RUN.update(oracle=oracle, journal=journal)
    try:
        result = extract(oracle, learner.name, seed=args.seed, tolerance=args.tolerance,
                         sign_only=args.sign_only, verify_tolerance=args.verify_tolerance,
                         **options)
    except InputError:
        # a usage error (a wrong --dim, found at the first batch): a journal this run
        # created holds nothing a rerun could use, and is not left behind
        if created and journal is not None and not len(journal):
            journal.close()
            _remove_journal(journal.path)
            _RUN["journal"] = None
        raise
    finally:
        bar.close()
        _close_journal(oracle)
    _note_sources(result.report, oracle)
    _note_cost(result.report, oracle)
    written = _save_atomically(result, args.out)
    if args.json:
        print(json.dumps({"ok": True, "out": str(written), **result.report.to_dict()}))
    else:
        print(result.report.render(extra=[("wrote", str(written))], verbose=_verbose(args)))
    return 0


# What the running command has spent, for the one line printed on Ctrl-C.
_RUN: dict = {}


def _interrupted_line() -> str:
    """One line: the queries so far and how to resume."""
    oracle, journal = _RUN.get("oracle"), _RUN.get("journal")
    if oracle is not None:
        spent = (f"{oracle.queries} queries ({oracle.black_box_queries} answered by the "
                 f"black box)")
    elif journal is not None:
        spent = f"{journal.hits + journal.recorded} queries"
    else:
        spent = "no queries"
    if journal is None:
        how = "no journal was kept: a rerun starts over"
    else:
        how = (f"rerun the same command to resume: journal {journal.path} keeps "
               f"{len(journal)} answers")
    return f"attnextract: interrupted after {spent}; {how}"


def _prepare_out(out) -> str | None:
    """--out with its .npz suffix, checked writable (before any query); None stays None."""
    if out is None:
        return None
    path = Path(out)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")        # what numpy would write
    folder = path.parent
    if path.is_dir():
        raise InputError(f"--out {path} is a directory")
    if not folder.is_dir():
        raise InputError(f"--out {path}: folder {folder} does not exist")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".probe")
        os.close(fd)
        os.remove(probe)
        if path.exists():
            with open(path, "ab"):
                pass
    except OSError as exc:
        raise InputError(f"--out {path} is not writable: {exc.strerror or exc}") from None
    return str(path)


def _save_atomically(result, out: str) -> Path:
    """Write the result to a temporary file beside ``out``, then rename it (atomic);
    returns the path written."""
    folder = os.path.dirname(os.path.abspath(out))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(out)}.", suffix=".npz")
    os.close(fd)
    try:
        result.save(tmp)
        with open(tmp, "rb+") as f:           # on disk before it takes the name
            os.fsync(f.fileno())
        os.replace(tmp, out)
        return Path(out)
    except BaseException as exc:
        try:
            os.remove(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise InputError(f"cannot write {out} (a rerun of the same command is answered "
                             f"by its journal): {exc}") from exc
        raise


def _journal_path(args) -> str | None:
    """--journal, else RESULT.journal.sqlite beside --out, None with --no-journal."""
    if getattr(args, "no_journal", False):
        if getattr(args, "journal", None):
            raise InputError("give either --journal FILE or --no-journal")
        return None
    if getattr(args, "journal", None):
        return args.journal
    out = getattr(args, "out", None)
    return None if out is None else str(Path(out).with_suffix("")) + ".journal.sqlite"


def _remove_journal(path) -> None:
    """Delete a journal this run created and nothing rests on (and SQLite's side files)."""
    for name in (str(path), f"{path}-journal", f"{path}-wal", f"{path}-shm"):
        try:
            os.remove(name)
        except FileNotFoundError:
            pass


def _open_journal(args):
    """The journal of an extraction (None without one); fixes the learner's seed in it."""
    path = _journal_path(args)
    if path is None:
        return None
    args.journal = path
    # the noise the black box is allowed: its fingerprint is compared within it
    tau = getattr(args, "tolerance", None)
    if tau is not None and getattr(args, "noise", "bounded") == "random":
        tau = 6.0 * tau                          # --tolerance is the noise's std
    rho = getattr(args, "relative_tolerance", None) if tau is not None else None
    journal = QueryJournal(path, context={"dim": args.dim}, tolerance=tau,
                           relative_tolerance=rho)
    # the target's name is kept for the reader only: the fingerprint decides (a server
    # moved to another port is the same black box, another box at the same URL is not)
    journal.remember(target=args.target)
    # a resumed run must ask the same sequences: the learner's seed is part of the journal
    if args.seed is None:
        args.seed = journal.context.get("seed", int.from_bytes(os.urandom(4), "little"))
    journal.remember(seed=args.seed)
    if journal.context.get("seed") != args.seed and journal.restart():
        journal.remember(dim=args.dim, target=args.target, seed=args.seed)   # nothing to resume
    if journal.context.get("seed") != args.seed:
        journal.close()
        raise InputError(f"journal {args.journal} was recorded with --seed "
                         f"{journal.context['seed']}, not {args.seed} (give another --journal "
                         f"or --out, or --no-journal)")
    return journal


def _close_journal(oracle: Oracle) -> None:
    """Close the oracle's journal; a failed extraction's report still says who answered."""
    if oracle.journal is None:
        return
    result = getattr(sys.exc_info()[1], "result", None)
    if result is not None:
        _note_sources(result.report, oracle)
    oracle.journal.close()


def _note_sources(report, oracle: Oracle) -> None:
    """Say in the report how many queries the black box and the journal answered."""
    accounting = getattr(oracle.black_box, "accounting", None)
    if callable(accounting):               # a remote black box: what the server charged
        report.details["http"] = accounting()
    if oracle.journal is not None:
        report.details["black_box_queries"] = oracle.black_box_queries
        report.details["journal_queries"] = oracle.journal_queries
        report.details["check_queries"] = oracle.check_queries
        report.details["journal"] = oracle.journal.path


def _note_cost(report, oracle: Oracle) -> None:
    """Vector answers: the cost in three units (queries, numbers received, tokens sent)
    and the floor in queries, the free parameters over the numbers one query brings
    (m at the last position; m per token at every position, at the longest probe)."""
    if oracle.outputs not in ("last", "all"):
        return
    m = oracle.out_dim
    assert m is not None                        # fixed with the outputs
    per = m if oracle.outputs == "last" else m * max(1, oracle.longest)
    report.details.setdefault("cost", f"{report.queries} queries, {oracle.numbers} numbers "
                                      f"received, {oracle.tokens} tokens sent")
    where = (f"m = {m} numbers per query" if oracle.outputs == "last" else
             f"m N = {m} x {max(1, oracle.longest)} numbers per query of the longest probes")
    # a vector learner states its parameter count (its Report.floor is already in queries)
    parameters = report.details.get("parameters", report.floor)
    report.details.setdefault("floor in queries",
                              f"{math.ceil(parameters / per)} ({parameters} free "
                              f"parameters / {where})")


def _vector_oracle_options(model) -> dict:
    """What a saved vector model (a VectorAttention, a VectorSphereAttention) says its
    black box answers (the Oracle holds the box to it: a box answering the other kind, or
    causal when told bidirectional, fails)."""
    kind = getattr(model, "output_kind", None)
    if kind not in ("last", "all"):
        return {}
    return {"outputs": kind, "out_dim": model.out_dim,
            "causal": bool(model.causal) if kind == "all" else None}


def _open_query_journal(args, target: str, dim: int):
    """--journal of verify or demo: the journal keeps this subcommand's seed
    (``verify_seed``, ``demo_seed``) beside an extraction's, so one file serves both."""
    if not args.journal:
        return None
    journal = QueryJournal(args.journal, context={"target": target, "dim": dim})
    key = f"{args.command}_seed"
    if args.seed is None:
        args.seed = journal.context.get(key, int.from_bytes(os.urandom(4), "little"))
    journal.remember(**{key: args.seed})
    if journal.context[key] != args.seed and journal.restart():
        journal.remember(target=target, dim=dim, **{key: args.seed})      # nothing to resume
    if journal.context[key] != args.seed:
        journal.close()
        raise InputError(f"journal {args.journal} was recorded with --seed "
                         f"{journal.context[key]}, not {args.seed}")
    return journal


def cmd_verify(args) -> int:
    model = load_model(args.result)
    journal = _open_query_journal(args, args.target, model.dim)
    bar = _progress(args, "verifying")
    oracle = Oracle(_open_target(args.target, model.dim, args), model.dim, budget=args.budget,
                    journal=journal, progress=bar,
                    max_length=args.max_length, **_vector_oracle_options(model))
    _RUN.update(oracle=oracle)
    count = args.count or verification_count(sum(np.size(p) for p in model.parameters().values()))
    error_bar, tolerance, floor, rounded = _saved_error_bar(args.result, args.verify_tolerance)
    try:
        verification = verify_model(oracle, model, count=count, seed=args.seed,
                                    tolerance=tolerance, measure_v=True,
                                    expected_error=error_bar,
                                    tolerance_floor=floor, rounded_answers=rounded)
    finally:
        bar.close()
        _close_journal(oracle)
    if args.json:
        print(json.dumps({"ok": verification.passed,
                          "queries": oracle.queries + oracle.check_queries,
                          "sequences": verification.sequences,
                          "max_relative_error": verification.max_relative_error,
                          "median_relative_error": verification.median_relative_error,
                          "tolerance": verification.tolerance,
                          "judged_tolerance": verification.judged_tolerance,
                          "batch_sizes": list(verification.batch_sizes),
                          "batch_dependence": verification.batch_dependence,
                          "hull_violation": verification.hull_violation,
                          "worst_family": verification.worst_family,
                          "lengths": list(verification.lengths),
                          "norms": list(verification.norms),
                          "norms_sent": list(verification.norms_sent),
                          "family_sequences": verification.family_sequences,
                          "coverage": verification.coverage,
                          "max_length": verification.max_length,
                          "search_queries": verification.search_queries,
                          "error_bar": verification.error_bar}))
    else:
        print(f"{model.kind} model, d = {model.dim}, {verification.sequences} held-out sequences:"
              f" largest relative error {human_number(verification.max_relative_error)}, median "
              f"{human_number(verification.median_relative_error)} (tolerance "
              f"{human_number(verification.tolerance)}); lengths {verification.lengths[0]} to "
              f"{verification.lengths[1]} of up to {verification.max_length}, token norms "
              f"{human_number(verification.norms[0])} to {human_number(verification.norms[1])}, "
              f"{verification.search_queries} from the adversarial search"
              + (f"; the model's own error bar {human_number(verification.error_bar)} allowed for"
                 if verification.error_bar else ""))
    if not verification.passed:
        print(f"attnextract: MISMATCH: {mismatch_reason(verification)}", file=sys.stderr)
        return 1
    if not args.json:
        print("MATCH")
    return 0


def _saved_error_bar(path, tolerance):
    """(bar, tolerance, floor, rounded) for re-verifying a saved result: the relative
    parameter error bar its learner's verification allowed for, the tolerance it was held
    to, and whether its answers were rounded (an exact box's bar widens the check by at
    most tolerance / 1e3, a rounded one's whole), so that a search reaching large scores
    (where a model's error of 1e-12 shows as 1e-7) judges the model as its learner did.
    A tolerance the user gives is kept; results saved without a bar get the flat
    tolerance."""
    try:
        saved = load_result(path).report.verification
    except TargetLoadError:
        saved = None
    bar = getattr(saved, "error_bar", 0.0)
    rounded = bool(getattr(saved, "rounded_answers", False))
    if not bar:
        return None, DEFAULT_VERIFY_TOLERANCE if tolerance is None else tolerance, None, rounded
    if tolerance is not None:
        return bar, tolerance, None, rounded
    # the tolerance the saved check judged by (its printed one may be the larger error it
    # achieved, where the bar widened an allowance)
    judged = getattr(saved, "judged_tolerance", 0.0) or saved.tolerance
    return bar, saved.requested_tolerance or judged, judged, rounded


def cmd_demo(args) -> int:
    journal = None
    if args.journal:       # the secret's seed is the journal's: a resumed demo asks the same
        journal = _open_query_journal(args, f"demo d = {args.dim}", args.dim)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    secret = random_single_head(args.dim, seed)
    bar = _progress(args)
    oracle = Oracle(secret, args.dim, progress=bar, journal=journal, max_length=args.max_length)
    _RUN.update(oracle=oracle)
    try:
        result = extract(oracle, "single-head", seed=seed + 1)
    finally:
        bar.close()
        _close_journal(oracle)
    model = result.model
    w_err = float(np.linalg.norm(model.W - secret.W) / np.linalg.norm(secret.W))
    v_err = float(np.linalg.norm(model.v - secret.v) / np.linalg.norm(secret.v))
    if args.json:
        print(json.dumps({"ok": True, "secret_seed": seed, "relative_error_W": w_err,
                          "relative_error_v": v_err, **result.report.to_dict()}))
        return 0
    print(f"attnextract demo: a secret random single-head attention model (d = {args.dim}, "
          f"seed {seed}) behind a black box that answers one number per sequence.\n")
    print(result.report.render(verbose=_verbose(args)))
    print(f"\nchecked against the secret (the learner never saw it): relative error "
          f"W {human_number(w_err)}, v {human_number(v_err)}")
    return 0


def cmd_bench(args) -> int:
    unknown = set(args.sections or ()) - set(SECTIONS)
    if unknown:
        raise InputError(f"unknown bench section(s) {sorted(unknown)}; known: {sorted(SECTIONS)}")
    command = " ".join(["attnextract bench"] + (["--quick"] if args.quick else [])
                       + (["--sections", *args.sections] if args.sections else [])
                       + ["--out-dir", str(args.out_dir)]
                       + (["--update-readme", args.update_readme] if args.update_readme else []))
    summary = run_bench(args.out_dir, quick=args.quick, sections=args.sections,
                        log=lambda line: print(line, file=sys.stderr), command=command)
    table = (Path(args.out_dir) / "bench.md").read_text()
    print(table)
    if not summary["plots"]:
        print("(matplotlib is not installed: no plots; pip install 'attnextract[plot]')",
              file=sys.stderr)
    print(f"wrote {args.out_dir}/bench.json, bench.md" +
          "".join(f", {p}" for p in summary["plots"]) + f" in {summary['seconds']:.1f} s")
    if args.update_readme:       # the README shows the first table; the docs show them all
        update_readme(args.update_readme, readme_summary(table), None)
    return 0


def cmd_twins(args) -> int:
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    if args.outputs != "scalar":
        return _vector_twins(args, seed)
    if args.out_dim is not None:
        raise InputError("--out-dim goes with --outputs last or all")
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


def _vector_twins(args, seed: int) -> int:
    """twins --outputs last|all: a random VectorAttention and its twin (a head's O split
    between two heads with the same W and b, a dead head, permuted)."""

    model = random_vector_attention(args.heads, args.dim, args.out_dim, seed,
                                    positions=args.outputs)
    twin = non_identifiable_twin(model, seed + 1)
    diff = twin_difference(model, twin, count=args.count, seed=seed + 2)
    errors = vector_canonical_errors(twin, model)
    # some twin head's O is far from every original O: the parameters differ
    O_gap = float(np.linalg.norm(twin.O[:, None] - model.O[None], axis=(2, 3)).min(axis=1).max())
    out = {"ok": True, "seed": seed, "outputs": args.outputs, "heads": model.heads,
           "twin_heads": twin.heads, "dim": args.dim, "out_dim": model.out_dim,
           "twin_canonical_heads": vector_canonical_form(twin).heads,
           "canonical_error": errors["max"], "largest_O_mismatch": O_gap,
           "max_output_difference": diff["max_abs"],
           "max_relative_output_difference": diff["max_relative"],
           "sequences": diff["sequences"]}
    if args.json:
        print(json.dumps(out))
        return 0
    where = "the last position" if args.outputs == "last" else "every position"
    print(f"attnextract twins: a random attention layer answering its output vector at {where} "
          f"(H = {model.heads}, d = {args.dim}, m = {model.out_dim}, seed {seed}) and a twin "
          f"built from it.\n")
    print(f"  the twin has {twin.heads} heads: one head's O split over two heads with the same "
          f"W and b,\n  a dead head (random W and b, O = 0), all permuted. Some twin head's O "
          f"is {O_gap:.2f} away from every original O.")
    print(f"  canonical forms (merge equal W and b, drop O = 0): {model.heads} and "
          f"{out['twin_canonical_heads']} heads, agreeing to {errors['max']:.1e} after "
          f"matching.")
    print(f"\n  largest output difference over {diff['sequences']} random sequences (lengths "
          f"1-16), every channel{' and position' if args.outputs == 'all' else ''}: "
          f"{diff['max_abs']:.2e} (relative {diff['max_relative']:.2e})")
    print("  -> no black-box query can tell them apart: only the canonical form is identifiable.")
    return 0


def cmd_serve(args) -> int:
    model = load_spec(args.secret)         # FILE.npz, or FILE.py:NAME (a black box with dim)
    model = _served_positions(model, args)
    if args.replicas is not None:
        if args.outputs is not None or args.causal is not None:
            raise InputError("--outputs and --causal do not go with --replicas (each replica "
                             "loads the model as saved): save it with its positions")
        model = RayReplicas(args.secret, args.replicas, address=args.ray_address)
    elif args.ray_address is not None:
        raise InputError("--ray-address needs --replicas N")
    if min(args.slot_timeout, args.min_body_rate, args.idle_timeout) <= 0:
        raise InputError("--slot-timeout, --min-body-rate and --idle-timeout must be > 0")
    if args.max_client_rate is not None and args.max_client_rate <= 0:
        raise InputError("--max-client-rate must be > 0")
    # a server bound beyond loopback without tokens logs a warning (make_server)
    tokens = None if args.token_file is None else read_tokens(args.token_file)
    if args.state_new and args.state is None:
        raise InputError("--state-new needs --state FILE.sqlite")
    try:
        server = make_server(model, args.host, args.port, budget=args.budget,
                             round_digits=args.round_digits, verbose=args.verbose > 0,
                             max_connections=args.max_connections,
                             idle_timeout=args.idle_timeout, workers=args.workers,
                             state=args.state, state_new=args.state_new,
                             body_memory=args.body_memory << 20,
                             cache_bytes=args.cache_memory << 20,
                             slot_timeout=args.slot_timeout,
                             min_body_rate=args.min_body_rate * 1024, tokens=tokens,
                             max_client_connections=args.max_client_connections,
                             max_client_rate=args.max_client_rate)
    except BaseException as exc:
        if args.replicas is not None:
            model.close()
        if isinstance(exc, OSError):
            raise InputError(f"cannot listen on {args.host}:{args.port}: {exc}") from exc
        raise
    health = server.state.health()
    budget = ("no budget" if health["budget"] is None
              else f"budget {health['budget']} queries, {health['remaining']} remaining")
    kept = "" if args.state is None else f", ledger {args.state}: {health['served']} served"
    replicas = "" if args.replicas is None else f", {args.replicas} Ray replicas"
    print(f"serving {health['kind']} d = {model.dim} on {server.url} ({budget}{kept}"
          f"{replicas}); POST /query, GET /health; Ctrl-C stops", flush=True)
    try:
        server.serve_forever(handle_signals=True)    # SIGINT/SIGTERM: finish, then stop
    finally:
        server.server_close()
        if args.replicas is not None:
            model.close()
    return 0


def cmd_checkpoint(args) -> int:

    if args.compare:
        from .adapters.checkpoint_export import compare
        report = compare(args.path, args.compare)
        if args.json:
            print(json.dumps({"ok": True, **report}))
        else:
            print(f"{args.path} with {args.compare}'s attention (layers "
                  f"{report['recovered_layers']}): largest difference "
                  f"{report['max_abs_difference']:.3e} (relative "
                  f"{report['max_relative_difference']:.3e}) on {report['inputs']}")
        return 0
    if args.save_target:
        from .adapters.checkpoint import save_layer_target as save_checkpoint_target
        written = save_checkpoint_target(args.path, args.layers, args.save_target,
                                         readout_seed=args.readout_seed)
        print(f"wrote {written} (serve it with attnextract serve --secret {written})")
        return 0
    result = extract_checkpoint(
        args.path, layers=args.layers, outputs=args.outputs, seed=args.seed,
        readout_seed=args.readout_seed, learner=args.learner, run_dir=args.run_dir,
        ray=args.ray, check_against=args.check_against, budget=args.budget,
        progress=False if args.no_progress else None)
    out = Path(args.out) if args.out else Path(result.data["run_dir"]) / "result.json"
    result.save(out)
    exported = None
    if args.export and not result.failed:
        from .adapters.checkpoint_export import export_state_dict
        exported = export_state_dict(result, args.export)
    if args.json:
        layers = [{k: v for k, v in e.items() if k != "heads"} for e in result.layers]
        print(json.dumps({"ok": not result.failed, "out": str(out),
                          "export": exported and str(exported),
                          **{k: v for k, v in result.data.items() if k != "layers"},
                          "layers": layers}))
    else:
        print(result.summary())
        print(f"wrote {out}" + (f" and {exported}" if exported else ""))
    if result.failed:
        print(f"attnextract: layer(s) {', '.join(str(e['layer']) for e in result.failed)} "
              f"failed twice (see {out})", file=sys.stderr)
        return 1
    return 0


def _served_positions(model, args):
    """The secret served at the positions --outputs / --causal ask (a VectorAttention)."""
    if args.outputs is None and args.causal is None:
        return model
    if not isinstance(model, VectorAttention):
        raise InputError(f"--outputs and --causal serve a saved vector model "
                         f"(vector-attention); {args.secret} holds a "
                         f"{getattr(model, 'kind', type(model).__name__)} model")
    positions = args.outputs or model.positions
    if args.causal is not None and positions != "all":
        raise InputError("--causal / --no-causal apply to every-position answers "
                         "(--outputs all)")
    causal = model.causal if args.causal is None else args.causal
    return VectorAttention(model.W, model.O, model.b, model.c, positions,
                           causal and positions == "all")


def _minilm_as_checkpoint(args) -> int:
    """``minilm --layer L`` alone: ``checkpoint`` on the MiniLM folder, that layer, checked
    against its own weights (the layer's box is the model's own code, vectors with
    ``--outputs last``)."""
    if args.target or args.subspace or args.save_target:
        raise InputError("--subspace, --target and --save-target go with --all-heads")
    if args.outputs == "all":
        raise InputError("minilm --layer L runs checkpoint: --outputs scalar or last")
    folder = str(minilm_weights_path().parent)
    forwarded = argparse.Namespace(
        path=folder, layers=str(args.layer), outputs=args.outputs or "last",
        learner=None, seed=args.seed, readout_seed=args.readout_seed, budget=args.budget,
        run_dir=None, ray=None, out=args.out, check_against=folder, export=None,
        compare=None, save_target=None, json=args.json, no_progress=args.no_progress)
    return cmd_checkpoint(forwarded)


def cmd_minilm(args) -> int:
    if args.all_heads and args.head is not None:
        raise InputError("give either --head H or --all-heads")
    if not args.all_heads and args.head is None:
        return _minilm_as_checkpoint(args)
    if not args.all_heads and (args.target or args.save_target or args.subspace):
        raise InputError("--subspace, --target and --save-target go with --all-heads")
    if args.outputs is not None and not args.save_target:
        raise InputError("--outputs goes with --save-target (a vector model of the layer)")
    if args.save_target and args.outputs is not None:
        save_vector_layer_target(args.save_target, args.layer, args.outputs,
                                 biases=args.biases)
        print(f"wrote {args.save_target}: layer {args.layer}, 12 heads"
              f"{' with their biases' if args.biases else ''} as a vector model answering "
              f"{'the last position' if args.outputs == 'last' else 'every position'} (serve "
              f"it with attnextract serve --secret {args.save_target})")
        return 0
    if args.save_target:
        save_layer_target(args.save_target, args.layer, args.readout_seed, biases=args.biases)
        print(f"wrote {args.save_target}: layer {args.layer}, 12 heads"
              f"{' with their biases' if args.biases else ''}, readout seed "
              f"{args.readout_seed} (serve it with attnextract serve --secret "
              f"{args.save_target})")
        return 0
    if args.target and args.subspace is not None:
        raise InputError("--target serves the full-width layer: drop --subspace")
    args.out = _prepare_out(args.out)                 # an unwritable --out before any query
    journal, path = None, _journal_path(args)
    if path is not None:
        which = "all heads" if args.all_heads else f"head {args.head}"
        journal = QueryJournal(path, context={
            "target": f"minilm layer {args.layer} {which} readout {args.readout_seed}"
                      + (" with biases" if args.all_heads and args.biases and not args.subspace
                         else ""),
            "dim": (args.subspace or 384) if args.all_heads else 384, "seed": args.seed})
    _RUN.update(journal=journal)
    bar = _progress(args)
    try:
        if args.all_heads:
            black_box = _open_target(args.target, 384, args) if args.target else None
            result, _, error = extract_minilm_layer(
                args.layer, readout_seed=args.readout_seed, subspace=args.subspace,
                seed=args.seed, budget=args.budget, journal=journal, black_box=black_box,
                progress=bar, biases=args.biases and args.subspace is None)
            if error is not None:
                raise error      # exit 1, with the report of what the learner achieved
        else:
            result, _ = extract_minilm_head(args.layer, args.head,
                                            readout_seed=args.readout_seed, seed=args.seed,
                                            budget=args.budget, progress=bar, journal=journal)
    finally:
        bar.close()
        if journal is not None:
            journal.close()
    written = _save_atomically(result, args.out) if args.out else None
    if args.json:
        print(json.dumps({"ok": True, "out": written and str(written),
                          **result.report.to_dict()}))
    else:
        print(result.report.render(extra=[("wrote", str(written))] if written else [],
                                   verbose=_verbose(args)))
    return 0
