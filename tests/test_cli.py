"""The command line, run as a user runs it: in a subprocess, on target files."""

import json
import subprocess
import textwrap

import numpy as np
import pytest

from attnextract.adapters.journal import CHALLENGES
from attnextract.adapters.targets import random_single_head
from attnextract.report import verification_count

from conftest import rel_err, run_cli

TARGETS = textwrap.dedent("""
    import numpy as np
    from attnextract.adapters.targets import random_single_head

    head = random_single_head({d}, seed=11)          # an object with __call__

    def as_function(X):                              # a plain function
        return head(X)

    def two_heads(X):
        return head(X) + random_single_head({d}, seed=12)(X)

    def nan_box(X):
        out = head(X)
        out[0] = np.nan
        return out

    def wrong_shape(X):
        return np.zeros((len(X), 2, 3, 4))     # no kind of answer has four axes

    def crashes(X):
        raise RuntimeError("backend down")

    class NotAnInstance:
        pass

    zero_v = random_single_head({d}, seed=1)
    zero_v.v[:] = 0.0
""")


def run(*args, check=None):
    return run_cli(*args, check=check)


@pytest.fixture
def target_file(tmp_path):
    path = tmp_path / "targets.py"
    path.write_text(TARGETS.format(d=6))
    return path


@pytest.mark.parametrize("name", ["head", "as_function"])
@pytest.mark.slow
def test_extract_writes_result_and_json(tmp_path, target_file, name):
    out = tmp_path / "result.npz"
    proc = run("extract", "--target", f"{target_file}:{name}", "--dim", "6", "--seed", "3",
               "--out", str(out), "--json", check=0)
    report = json.loads(proc.stdout)
    assert report["ok"] and report["kind"] == "single-head"
    # every query the box answered: the learner's and the journal's challenges (asked of
    # the box, so counted and within --budget)
    assert report["breakdown"]["journal_fingerprint"] == report["details"]["check_queries"]
    assert report["details"]["check_queries"] == CHALLENGES
    assert report["queries"] == 6 * 6 + 6 + verification_count(42, 42) + CHALLENGES
    assert report["verification_error"] < 1e-9
    assert report["seconds"] >= report["black_box_seconds"] >= 0
    truth = random_single_head(6, seed=11)
    with np.load(out) as data:
        assert data["W"].shape == (6, 6) and data["v"].shape == (6,)
        assert int(data["queries"]) == report["queries"]
        assert rel_err(data["W"], truth.W) < 1e-9


@pytest.mark.slow
def test_extract_readable_report_then_verify(tmp_path, target_file):
    out = tmp_path / "r.npz"
    proc = run("extract", "--target", f"{target_file}:head", "--dim", "6", "--out", str(out),
               check=0)
    assert "queries" in proc.stdout and "PASSED" in proc.stdout
    proc = run("verify", "--target", f"{target_file}:head", "--result", str(out), check=0)
    assert "MATCH" in proc.stdout
    proc = run("verify", "--target", f"{target_file}:two_heads", "--result", str(out), check=1)
    assert "MISMATCH" in proc.stderr


@pytest.mark.parametrize("name, code, reason", [
    ("two_heads", 1, "ModelMismatchError"),
    ("zero_v", 1, "NotIdentifiableError"),
    ("nan_box", 3, "NonFiniteOutputError"),
    ("wrong_shape", 3, "MalformedOutputError"),
    ("crashes", 3, "RuntimeError: backend down"),
    ("NotAnInstance", 2, "is a class"),
    ("missing", 2, "defines no 'missing'"),
])
@pytest.mark.slow
def test_extract_failures_exit_nonzero_with_one_line(tmp_path, target_file, name, code, reason):
    out = tmp_path / "r.npz"
    proc = run("extract", "--target", f"{target_file}:{name}", "--dim", "6", "--out", str(out),
               check=code)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("attnextract:") and reason in last
    assert not out.exists()                  # no result file for a failure


@pytest.mark.slow
def test_extract_json_failure_is_one_object(tmp_path, target_file):
    proc = run("extract", "--target", f"{target_file}:two_heads", "--dim", "6", "--json",
               "--out", str(tmp_path / "r.npz"), check=1)
    report = json.loads(proc.stdout)
    assert report["ok"] is False and report["error"] == "ModelMismatchError"
    assert report["report"]["verification"]["passed"] is False


@pytest.mark.slow
def test_budget_flag(tmp_path, target_file):
    proc = run("extract", "--target", f"{target_file}:head", "--dim", "6", "--budget", "50",
               "--out", str(tmp_path / "r.npz"), check=1)
    assert "BudgetExceededError" in proc.stderr and "budget of 50" in proc.stderr


@pytest.mark.slow
def test_bad_target_spec_and_file(tmp_path):
    run("extract", "--target", "nocolon", "--dim", "3", "--out", str(tmp_path / "r.npz"), check=2)
    run("extract", "--target", f"{tmp_path}/nope.py:f", "--dim", "3",
        "--out", str(tmp_path / "r.npz"), check=2)
    run("extract", "--target", "x.py:f", "--dim", "0", "--out", "r.npz", check=2)


@pytest.mark.slow
def test_verify_rejects_bad_result_file(tmp_path, target_file):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    proc = run("verify", "--target", f"{target_file}:head", "--result", str(bad), check=2)
    assert "TargetLoadError" in proc.stderr


@pytest.mark.slow
def test_demo_runs_and_reports_error_against_secret():
    proc = run("demo", "--dim", "16", "--seed", "4", "--json", check=0)
    report = json.loads(proc.stdout)
    assert report["relative_error_W"] < 1e-9 and report["relative_error_v"] < 1e-12
    assert report["breakdown"]["recovery"] == 16 * 16 + 16
    proc = run("demo", "--dim", "8", check=0)
    assert "relative error W" in proc.stdout


@pytest.mark.slow
def test_console_script_matches_module(tmp_path):
    import shutil
    exe = shutil.which("attnextract")
    assert exe is not None, "the console script is not installed"
    proc = subprocess.run([exe, "demo", "--dim", "4", "--seed", "1", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert json.loads(proc.stdout)["queries"] == json.loads(
        run("demo", "--dim", "4", "--seed", "1", "--json", check=0).stdout)["queries"]
