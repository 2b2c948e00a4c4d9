"""The surface around the learners: one entry point, result files, reprs, progress,
logging, threads, and one command-line vocabulary (issue 15)."""

import argparse
import ast
import io
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from attnextract import InputError, Oracle, extract
from attnextract.adapters.targets import random_single_head
from attnextract.cli import build_parser, main
from attnextract.progress import ProgressBar
from attnextract.registry import LEARNERS, learner_names, register
from attnextract.report import ExtractionResult, load_model

from conftest import rel_err

SRC = Path(__file__).resolve().parents[1] / "src" / "attnextract"


# -- the registry ----------------------------------------------------------------------

def test_extract_runs_every_registered_model_name_and_records_its_options():
    assert {"single-head", "low-rank", "multi-head", "one-layer", "one-layer-residual",
            "relu-network"} <= set(learner_names())
    secret = random_single_head(6, seed=3)
    result = extract(Oracle(secret, 6), "low-rank", seed=2, method="adaptive")
    assert rel_err(result.model.W, secret.W) < 1e-9
    assert result.options == {"model": "low-rank", "seed": 2, "method": "adaptive"}


@pytest.mark.parametrize("call, message", [
    (dict(model="low-rnak"), "did you mean 'low-rank'"),
    (dict(model="single-head", rank=3), "'rank' does not apply to model 'single-head'"),
    (dict(model="multi-head", tolerance=1e-6), "tolerance applies to 'single-head'"),
    (dict(model="low-rank", sign_only=True), "sign-only outputs are supported for"),
    (dict(sign_only=True, tolerance=1e-3), "labels: tolerance does not apply"),
])
def test_extract_rejects_bad_names_and_options_before_any_query(call, message):
    oracle = Oracle(random_single_head(4, seed=0), 4)
    with pytest.raises(InputError, match=re.escape(message)):
        extract(oracle, **call)
    assert oracle.queries == 0


def test_registering_a_learner_is_one_line_and_its_options_come_from_its_signature():
    def toy(oracle, *, seed=None, verify_tolerance=1e-7, scale=1.0):
        result = extract(oracle, "single-head", seed=seed)
        result.model.v *= scale
        return result
    register("toy", toy, "a single head, v scaled")
    try:
        assert LEARNERS["toy"].options == {"scale": 1.0} and "toy" in learner_names()
        result = extract(Oracle(random_single_head(4, seed=1), 4), "toy", scale=2.0, seed=0)
        assert result.options["model"] == "toy" and result.options["scale"] == 2.0
        with pytest.raises(InputError, match="'rank' does not apply"):
            extract(Oracle(random_single_head(4, seed=1), 4), "toy", rank=1)
    finally:
        del LEARNERS["toy"]


def test_no_learner_imports_another_to_dispatch_on_tolerance():
    tree = ast.parse((SRC / "learners" / "single_head.py").read_text())
    imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not any("noisy" in name or "sign_only" in name for name in imported), imported


# -- results, reports, reprs -----------------------------------------------------------

def test_result_save_load_round_trips_model_report_queries_and_options(tmp_path):
    secret = random_single_head(5, seed=4)
    result = extract(Oracle(secret, 5), "single-head", seed=1)
    written = result.save(tmp_path / "r.txt")
    assert written == tmp_path / "r.txt.npz" and written.exists()
    back = ExtractionResult.load(written)
    assert np.array_equal(back.model.W, result.model.W) and np.array_equal(back.model.v, result.model.v)
    assert back.queries == result.queries and back.options == {"model": "single-head", "seed": 1}
    assert str(back.report) == str(result.report) == result.report.render()
    assert back.report.verification.passed and back.report.to_dict() == result.report.to_dict()
    assert np.array_equal(load_model(written).W, result.model.W)


def test_result_files_without_a_stored_report_state_still_load(tmp_path):
    result = extract(Oracle(random_single_head(4, seed=2), 4), seed=0)
    old = tmp_path / "old.npz"          # the layout written before schema 2
    np.savez(old, W=result.model.W, v=result.model.v, queries=np.int64(result.queries),
             kind=np.str_("single-head"), report=np.str_(json.dumps(result.report.to_dict())))
    back = ExtractionResult.load(old)
    assert back.queries == result.queries and back.report.kind == "single-head"
    assert back.report.verification.max_relative_error == result.report.verification.max_relative_error
    assert back.options == {}


def test_reprs_are_short_and_say_what_matters():
    oracle = Oracle(random_single_head(4, seed=5), 4, budget=500)
    result = extract(oracle, seed=0)
    for text in (repr(result), repr(result.report), repr(oracle), repr(result.report.verification)):
        assert "\n" not in text and len(text) < 160, text
    assert re.fullmatch(r"<ExtractionResult single-head d=4: 54 queries, held-out error \S+ PASSED>",
                        repr(result))
    assert "54 queries of budget 500" in repr(oracle)
    assert repr(result.report.verification).startswith("<Verification PASSED: 34 held-out")
    assert str(result.report) == result.report.render()


def test_report_json_has_snake_case_keys_numbers_and_a_schema_version():
    result = extract(Oracle(random_single_head(6, seed=6), 6), seed=0)
    out = result.report.to_dict()
    assert out["schema_version"] == 2 and out["recovery_queries"] == 42
    for key in out["details"]:
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), key
    lo, hi = out["details"]["logit_scale"]
    assert 0 < lo <= hi and isinstance(out["details"]["probe_readout"], float)
    assert "logit scale" in result.report.render(verbose=True)   # the human rendering keeps it
    json.dumps(out)


def test_multi_head_count_is_paper_count_in_json_also_from_results_saved_before(tmp_path):
    """The multi-head paper's count 4Hd^2 - 2H + 1 is `paper_count` for programs; results
    saved when the detail was called "paper-2 count" load and give the same key."""
    from attnextract.adapters.targets import random_multi_head
    result = extract(Oracle(random_multi_head(2, 4, seed=21), 4), "multi-head", heads=2, seed=0)
    details = result.report.details
    assert details["multi-head paper's count"] == 4 * 2 * 4 ** 2 - 2 * 2 + 1
    assert result.report.to_dict()["details"]["paper_count"] == 125
    assert "multi-head paper's count" in result.report.render(verbose=True)
    details["paper-2 count"] = details.pop("multi-head paper's count")     # the earlier name
    back = ExtractionResult.load(result.save(tmp_path / "saved-before"))
    out = back.report.to_dict()["details"]
    assert out["paper_count"] == 125 and not any("paper_2" in key for key in out)


def test_one_layer_breakdown_parts_add_up_without_a_recovery_line(tmp_path):
    from attnextract.learners.one_layer import random_one_layer
    result = extract(Oracle(random_one_layer(4, 4, seed=1), 4), "one-layer", seed=0)
    report = result.report
    assert "recovery" not in report.breakdown
    assert sum(report.breakdown.values()) == report.queries
    lines = report.render().splitlines()
    assert not any(line.startswith("  recovery") for line in lines)
    assert any(line.startswith("floor") and f"recovery ({report.recovery} queries" in line
               for line in lines)
    back = ExtractionResult.load(result.save(tmp_path / "one-layer"))
    assert str(back.report) == str(report) and back.report.recovery == report.recovery
    assert np.array_equal(back.model.A, result.model.A)


# -- progress and logging --------------------------------------------------------------

def test_progress_total_never_moves_backwards_and_unknown_totals_show_phases(monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")     # a narrower terminal cuts the phase text short
    stream = io.StringIO()
    bar = ProgressBar("extracting", enabled=True, stream=stream)
    totals = []
    for done, total in [(10, 100), (50, 80), (100, 100), (120, 120), (130, 130), (140, 400)]:
        bar(done, total)
        totals.append(bar.total)
    assert totals == [100, 100, 100, None, None, 400]
    bar.phase("columns 37/384, rank so far 12")
    bar.close()
    text = stream.getvalue()
    assert "columns 37/384, rank so far 12" in text and "q/s" in text


def test_progress_without_a_terminal_writes_plain_lines_at_an_interval():
    stream = io.StringIO()                      # not a terminal
    bar = ProgressBar("extracting", stream=stream, interval=0.0)
    bar(40, 100)
    bar.phase("fitting")
    bar(100, 100)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and len(lines) >= 3
    assert lines[0].startswith("extracting: 40/100 queries [")
    quiet = io.StringIO()
    slow = ProgressBar("extracting", stream=quiet, interval=3600)
    slow(40, 100), slow.close()
    assert quiet.getvalue() == ""               # a short run prints nothing


def test_adaptive_low_rank_reports_its_phases_through_the_oracle():
    from attnextract.adapters.targets import random_low_rank_head
    phases = []

    class Recorder:
        def __call__(self, done, total):
            pass

        def phase(self, text):
            phases.append(text)
    extract(Oracle(random_low_rank_head(12, 2, seed=0), 12, progress=Recorder()), "low-rank",
            seed=0)
    assert phases[0] == "columns 0/12, rank so far 0"
    assert "columns 2/12, rank so far 2" in phases and phases[-1] == "held-out verification"


# -- the command line ------------------------------------------------------------------

def _subparsers(parser):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


QUERYING = {"extract", "verify", "demo", "minilm"}


def test_every_option_has_help_and_the_shared_options_exist_everywhere():
    for name, sub in _subparsers(build_parser()).items():
        flags = {s for a in sub._actions for s in a.option_strings}
        for action in sub._actions:
            if action.option_strings and action.help is not argparse.SUPPRESS:
                assert action.help, (name, action.option_strings)
        assert {"-v", "--log-level", "--no-progress", "--threads"} <= flags, name
        assert ("--journal" in flags) == (name in QUERYING), name
    help_text = " ".join(_subparsers(build_parser())["extract"].format_help().split())
    assert "(default: 1)" in help_text and "(default: single-head)" in help_text
    assert "--model low-rank:" in help_text           # per-model options in their own group
    assert "http://" in _subparsers(build_parser())["verify"].format_help()


def test_argument_errors_are_one_line_and_a_pointer_to_help(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["extract", "--target", "x.py:f", "--dim", "3", "--out", "r", "--model", "low-rnak"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(err) == 2
    assert "did you mean 'low-rank'?" in err[0] and err[1] == "see attnextract extract --help"


def test_old_spellings_still_work_with_a_note(capsys):
    args = build_parser().parse_args(["verify", "--target", "t.py:f", "--result", "r.npz",
                                      "--tolerance", "1e-3"])
    assert args.verify_tolerance == 1e-3
    args = build_parser().parse_args(["bench", "--out", "somewhere"])
    assert args.out_dir == "somewhere"
    err = capsys.readouterr().err
    assert "--tolerance is now --verify-tolerance" in err and "--out is now --out-dir" in err


@pytest.fixture
def target_file(tmp_path):
    path = tmp_path / "target.py"
    path.write_text(textwrap.dedent("""
        import numpy as np
        from threadpoolctl import threadpool_info
        from attnextract.adapters.targets import random_single_head
        from attnextract.oracle import RoundedOutputs

        head = random_single_head(4, seed=11)
        W, v = head.W, head.v
        rounded = RoundedOutputs(head, "float32")
        threads = []

        def by_hand(X):                         # a target written with d = 4 baked in
            s = np.einsum("bnd,de,be->bn", X, W, X[:, -1])
            a = np.exp(s - s.max(1, keepdims=True)); a /= a.sum(1, keepdims=True)
            return np.einsum("bn,bn->b", a, X @ v)

        def counting_threads(X):
            threads.append(max(i["num_threads"] for i in threadpool_info()))
            return head(X)
    """))
    return path


@pytest.mark.parametrize("extra, reason", [
    (["--noise-method", "paper"], "--noise-method needs --tolerance"),
    (["--bits", "20"], "--bits needs --sign-only"),
    (["--tolerance", "1e-6", "--method", "rop"], "with --tolerance, use --noise-method"),
    (["--heads", "2"], "--heads does not apply to --model single-head"),
    (["--model", "low-rank", "--no-polish"], "--no-polish does not apply to --model low-rank"),
])
def test_options_of_another_model_are_one_line_errors_before_any_query(tmp_path, target_file,
                                                                       capsys, extra, reason):
    assert main(["extract", "--target", f"{target_file}:counting_threads", "--dim", "4",
                 "--out", str(tmp_path / "r"), *extra]) == 2
    assert reason in capsys.readouterr().err.strip().splitlines()[-1]
    module = next((m for m in list(sys.modules.values())
                   if getattr(m, "__file__", None) == str(target_file)), None)
    assert module is None or module.threads == []      # the black box was never asked


def test_out_names_the_file_actually_written(tmp_path, target_file, capsys):
    assert main(["extract", "--target", f"{target_file}:head", "--dim", "4",
                 "--out", str(tmp_path / "r.txt")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "r.txt.npz").exists() and not (tmp_path / "r.txt").exists()
    assert re.search(rf"^wrote +{re.escape(str(tmp_path / 'r.txt.npz'))}$", out, re.M)
    # in the report's columns: its value starts where the model's does
    model_line = next(line for line in out.splitlines() if line.startswith("model "))
    wrote_line = next(line for line in out.splitlines() if line.startswith("wrote "))
    assert len(model_line) - len(model_line[5:].lstrip()) == wrote_line.index(str(tmp_path))


@pytest.mark.parametrize("name", ["by_hand", "head"])
@pytest.mark.parametrize("journal", [[], ["--no-journal"]])
def test_a_wrong_dim_on_a_python_target_is_a_usage_error_naming_its_width(tmp_path, target_file,
                                                                          capsys, name, journal):
    """A numpy function with d = 4 baked in (its broadcast error) and a model object (its own
    shape check): exit 2, one short line naming the width the box answers for, and no
    journal left behind."""
    assert main(["extract", "--target", f"{target_file}:{name}", "--dim", "5",
                 "--out", str(tmp_path / "r.npz"), *journal]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0] == ("attnextract: DimensionError: --dim 5 does not match the target, which "
                      "answers for d = 4: give --dim 4")
    assert "broadcast" not in err[0] and "challenge" not in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target.py"]


def test_a_wrong_dim_keeps_a_journal_that_was_there(tmp_path, target_file, capsys):
    """Only a journal the failed run created goes: one an earlier run wrote stays, and
    still resumes that run."""
    out = str(tmp_path / "r.npz")
    assert main(["extract", "--target", f"{target_file}:head", "--dim", "4", "--out", out,
                 "--seed", "3"]) == 0
    journal = tmp_path / "r.journal.sqlite"
    kept = journal.read_bytes()
    assert main(["extract", "--target", f"{target_file}:head", "--dim", "5", "--out", out,
                 "--seed", "3"]) == 2
    assert journal.read_bytes() == kept
    capsys.readouterr()
    assert main(["extract", "--target", f"{target_file}:head", "--dim", "4", "--out", out,
                 "--seed", "3", "--json"]) == 0
    details = json.loads(capsys.readouterr().out)["details"]
    assert details["black_box_queries"] == 0 and details["journal_queries"] > 0   # resumed


def test_a_rounding_mismatch_names_the_tolerance_options_and_they_work(tmp_path, target_file,
                                                                       capsys):
    """A float32 box refused by the exact learner is told how to extract it, whatever the
    learner's seed: the refusal names a precision option (the error's --output-dtype, and
    the hint's --relative-tolerance when the held-out error is at most 1e-2: on some seeds
    the adversarial search finds a 1.3e-2 error and only the refusal's own text names
    one), and both options then return the model."""
    spec = f"{target_file}:rounded"
    for seed in map(str, range(6)):
        out = ["--dim", "4", "--out", str(tmp_path / "r"), "--seed", seed, "--no-journal"]
        assert main(["extract", "--target", spec, *out]) == 1
        err = capsys.readouterr().err
        assert "--output-dtype float32" in err
        assert "hint:" not in err or "--relative-tolerance 6e-8" in err
        assert main(["extract", "--target", spec, *out,
                     "--tolerance", "0", "--relative-tolerance", "6e-8"]) == 0
        assert main(["extract", "--target", spec, *out, "--output-dtype", "float32"]) == 0


def test_threads_option_limits_blas_threads_while_the_black_box_runs(tmp_path, target_file):
    for n in (2, 1):
        assert main(["extract", "--target", f"{target_file}:counting_threads", "--dim", "4",
                     "--out", str(tmp_path / "r"), "--threads", str(n), "--no-progress"]) == 0
        module = next(m for m in list(sys.modules.values())
                      if getattr(m, "__file__", None) == str(target_file))
        assert set(module.threads) == {n}


def test_verbose_logs_the_learners_stages(tmp_path, target_file, capsys):
    assert main(["extract", "--target", f"{target_file}:head", "--dim", "4", "-v",
                 "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert "attnextract.learners.single_head INFO: single head at d = 4" in err
    assert "attnextract.registry INFO: extracting single-head" in err
    main(["demo", "--dim", "4", "--seed", "1"])           # without -v: no log lines
    assert "INFO" not in capsys.readouterr().err


def test_verify_and_demo_take_a_journal(tmp_path, target_file, capsys):
    assert main(["extract", "--target", f"{target_file}:head", "--dim", "4",
                 "--out", str(tmp_path / "r")]) == 0
    journal = str(tmp_path / "j.sqlite")
    for _ in range(2):
        assert main(["verify", "--target", f"{target_file}:head", "--result",
                     str(tmp_path / "r.npz"), "--journal", journal, "--json"]) == 0
    first, second = [json.loads(line) for line in capsys.readouterr().out.splitlines()[-2:]]
    assert first["max_relative_error"] == second["max_relative_error"]   # same seed, resumed
    assert main(["demo", "--dim", "4", "--journal", str(tmp_path / "d.sqlite")]) == 0


@pytest.mark.slow
def test_a_closed_pipe_ends_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "attnextract", "demo", "--dim", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                   # like `| head` that has read enough
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipe" not in err


# -- the newcomer's CLI (issue: help, defaults, model table) ---------------------------

def test_bare_attnextract_prints_the_help(capsys):
    from attnextract.cli import main as cli_main
    assert cli_main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: attnextract") and "extract" in out and "demo" in out


def test_every_option_of_every_subcommand_shows_a_default():
    import argparse
    from attnextract.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if (not action.option_strings or action.required or action.help == argparse.SUPPRESS
                    or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
                continue
            text = formatter._get_help_string(action) or ""
            assert "default" in text, (name, action.option_strings, text)


def test_model_choices_are_a_short_table_not_a_paragraph(capsys):
    from attnextract.cli import main as cli_main
    from attnextract.registry import learner_names
    with pytest.raises(SystemExit):
        cli_main(["extract", "--help"])
    out = capsys.readouterr().out
    table = out.split("models (--model):\n", 1)[1].splitlines()
    for name in learner_names():
        assert any(line.startswith(f"  {name} ") for line in table), name
    assert all(len(line) <= 80 for line in table)
    model_help = out.split("\n  --model MODEL", 1)[1].split("\n  --", 1)[0]
    assert len(model_help.splitlines()) <= 3          # was one 20-line paragraph


@pytest.mark.parametrize("command", ["demo", "verify"])
def test_demo_and_verify_help_do_not_mention_an_out_they_lack(command, capsys):
    from attnextract.cli import main as cli_main
    with pytest.raises(SystemExit):
        cli_main([command, "--help"])
    assert "--out" not in capsys.readouterr().out


def test_a_wrong_dim_then_the_right_dim_succeeds_with_the_default_journal(tmp_path,
                                                                         target_file, capsys):
    """The failed first run leaves no journal: nothing blocks the rerun."""
    out = str(tmp_path / "r.npz")
    assert main(["extract", "--target", f"{target_file}:by_hand", "--dim", "5",
                 "--out", out, "--no-progress"]) == 2
    assert not (tmp_path / "r.journal.sqlite").exists()
    assert main(["extract", "--target", f"{target_file}:by_hand", "--dim", "4",
                 "--out", out, "--no-progress"]) == 0
    assert rel_err(load_model(out).W, np.load(out)["W"]) == 0
    capsys.readouterr()
    # and the same with an explicit --seed that differs from the failed run's
    out2 = str(tmp_path / "s.npz")
    assert main(["extract", "--target", f"{target_file}:by_hand", "--dim", "5", "--seed", "1",
                 "--out", out2, "--no-progress"]) == 2
    assert main(["extract", "--target", f"{target_file}:by_hand", "--dim", "4", "--seed", "2",
                 "--out", out2, "--no-progress"]) == 0


def test_a_box_whose_first_batch_failed_is_fingerprinted_afresh_when_corrected(tmp_path, capsys):
    """The challenges were answered (a fingerprint stored), then the learner's first batch
    failed: no answer rests on that fingerprint, so a corrected box is not refused."""
    path = tmp_path / "boxes.py"
    path.write_text(textwrap.dedent("""
        from attnextract.adapters.targets import random_single_head
        old, new = random_single_head(4, seed=1), random_single_head(4, seed=2)

        def buggy(X):                 # answers small batches (the challenges), fails on more
            if len(X) > 2:
                raise RuntimeError("batches are not supported")
            return old(X)

        fixed = new
    """))
    out = str(tmp_path / "r.npz")
    assert main(["extract", "--target", f"{path}:buggy", "--dim", "4", "--out", out,
                 "--no-progress"]) == 3
    err = capsys.readouterr().err
    assert "--no-journal" not in err
    assert main(["extract", "--target", f"{path}:fixed", "--dim", "4", "--out", out,
                 "--no-progress"]) == 0
    # with answers in it, the journal of the fixed box refuses the old one as before
    assert main(["extract", "--target", f"{path}:buggy", "--dim", "4", "--out", out,
                 "--no-progress"]) == 4


@pytest.mark.parametrize("content", ["python", "pickle", "object npz", "foreign npz"])
def test_a_file_that_is_not_a_result_gets_a_one_line_error_and_is_never_unpickled(
        tmp_path, target_file, capsys, content):
    bad = tmp_path / "bad.npz"
    if content == "python":
        bad = target_file
    elif content == "pickle":
        import pickle
        bad.write_bytes(pickle.dumps({"W": np.eye(4), "v": np.ones(4)}))
    elif content == "object npz":
        np.savez(bad, W=np.array([{"a": 1}], dtype=object), v=np.ones(4))
    else:
        np.savez(bad, weights=np.ones(3))
    assert main(["verify", "--target", f"{target_file}:head", "--result", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnextract: TargetLoadError: ")
    assert "pickle" not in err[0].replace("Python objects", "") and "allow_pickle" not in err[0]
    assert "not a result file" in err[0] or "never does" in err[0]


def test_the_human_report_has_no_raw_floats_keys_or_reprs():
    from attnextract.adapters.targets import random_multi_head
    from attnextract.report import human_label, human_value
    results = [extract(Oracle(random_single_head(6, seed=6), 6), seed=0),
               extract(Oracle(random_multi_head(2, 4, seed=3), 4), "multi-head", seed=0)]
    for result in results:
        report = result.report
        report.details["http"] = {"transport": "npy", "requests": 3,
                                  "queries_charged_by_server": 94}
        report.details["recovery / floor"] = 1.9540441176470589
        report.details["error_bar_W_columns"] = np.linspace(1e-12, 5.577069353069752e-10, 9)
        text = report.render(verbose=True)
        labels = [line[:line.index("  ")] if "  " in line else line
                  for line in text.splitlines() if not line.startswith(" ")]
        assert len(labels) == len(set(labels)), labels               # one label, one meaning
        for label in labels:
            assert "|" in label or not re.search(r"[a-z]_[a-zA-Z]", label), label  # no keys
        for number in re.findall(r"\d+\.\d+", text):                   # no raw floats
            assert len(number.replace(".", "").lstrip("0")) <= 3, (number, text)
        assert "{" not in text and "}" not in text and "[" not in text.replace("[o", "")
        assert "1.95" in text and "queries charged by server 94" in text
        assert "largest 5.58e-10" in text
        # every count stays an exact integer
        assert f"{report.queries} in all" in text
        # --json keeps full precision
        assert report.to_dict()["details"]["recovery_floor"] == 1.9540441176470589
    assert human_label("error_bar_W") == "error bar of W" and human_value(3) == "3"
    assert human_value(0.1 + 0.2) == "0.3" and human_value(True) == "yes"
