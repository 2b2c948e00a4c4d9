"""What a user sees around a run: the report's headline (at most 15 lines for every
learner, the rest under -v and in --json), progress that ends at what was sent, Ctrl-C
while the command starts, the package's exports, and a result's notebook view."""

from __future__ import annotations

import inspect
import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import attnextract
from attnextract import Oracle, errors, extract
from attnextract.adapters.journal import QueryJournal
from attnextract.adapters.targets import (
    random_low_rank_head,
    random_low_rank_multi_head,
    random_multi_head,
    random_pre_layer_norm,
    random_single_head,
    random_vector_attention,
)
from attnextract.cli import main
from attnextract.learners.one_layer import random_one_layer
from attnextract.learners.relu_network import random_relu_network
from attnextract.learners.residual import random_residual_one_layer
from attnextract.learners.transformer_layer import random_transformer_layer
from attnextract.models import MODEL_CLASSES, VectorAttention, layer_norm
from attnextract.progress import ProgressBar
from attnextract.registry import LEARNERS, learner_names
from attnextract.report import human_label, snake_case

SRC = Path(__file__).resolve().parents[1] / "src"
HEADLINE = 15


def vector_pre_ln_box(d: int, seed: int):
    """A pre-LN attention block answering vectors at the last position: LN, one head, the
    residual x_N added."""
    rng = np.random.default_rng(seed)
    attention = random_vector_attention(1, d, seed=seed)
    gamma, beta = 1 + 0.3 * rng.standard_normal(d), 0.2 * rng.standard_normal(d)

    def box(X):
        X = np.asarray(X, dtype=float)
        return attention(layer_norm(X, gamma, beta, 1e-5)) + X[:, -1]
    return box


def standard_layer(d: int, heads: int, seed: int) -> VectorAttention:
    """An attention layer as deployed: heads of rank d / H with biases."""
    rng = np.random.default_rng(seed)
    r = d // heads
    Wq, Wk, Wv, Wo = (rng.standard_normal((d, d)) / np.sqrt(d) for _ in range(4))
    bq, bv, bo = (0.5 * rng.standard_normal(d) for _ in range(3))
    rows = [slice(h * r, (h + 1) * r) for h in range(heads)]
    return VectorAttention(np.stack([Wk[s].T @ Wq[s] / np.sqrt(r) for s in rows]),
                           np.stack([Wo[:, s] @ Wv[s] for s in rows]),
                           np.stack([Wk[s].T @ bq[s] / np.sqrt(r) for s in rows]),
                           Wo @ bv + bo, positions="last")


# every registered learner on a small box of its class: (box, d, Oracle options, options)
CASES = {
    "single-head": (lambda s: random_single_head(4, seed=s), 4, {}, {}),
    "low-rank": (lambda s: random_low_rank_head(8, 2, seed=s), 8, {}, {}),
    "multi-head": (lambda s: random_multi_head(2, 6, seed=s), 6, {}, {"heads": 2}),
    "multi-head-low-rank": (lambda s: random_low_rank_multi_head(2, 8, 2, seed=s), 8, {},
                            {"heads": 2, "rank": 2}),
    "one-layer": (lambda s: random_one_layer(4, 4, seed=s), 4, {}, {}),
    "one-layer-residual": (lambda s: random_residual_one_layer(4, 4, seed=s), 4, {}, {}),
    "pre-ln": (lambda s: random_pre_layer_norm(1, 4, seed=s), 4, {}, {}),
    "relu-network": (lambda s: random_relu_network(4, 4, seed=s), 4, {}, {}),
    "transformer-layer": (lambda s: random_transformer_layer(4, 8, seed=s), 4, {}, {}),
    "vector-layer": (lambda s: standard_layer(8, 2, s), 8, {"outputs": "last"}, {}),
    "vector-multi-head": (lambda s: random_vector_attention(2, 6, seed=s), 6,
                          {"outputs": "last"}, {"heads": 2}),
    "vector-pre-ln": (lambda s: vector_pre_ln_box(5, s), 5, {"outputs": "last"}, {}),
    "vector-single-head": (lambda s: random_vector_attention(1, 5, seed=s), 5,
                           {"outputs": "last"}, {}),
}


def test_the_cases_cover_every_registered_learner():
    assert set(CASES) == set(learner_names())


# -- the report's headline ---------------------------------------------------------------

@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_report_headline_is_at_most_15_lines_for_every_learner(name, seed):
    make, d, oracle_options, options = CASES[name]
    result = extract(Oracle(make(seed), d, **oracle_options), name, seed=seed, **options)
    report = result.report
    brief = report.render(extra=[("wrote", "result.npz")]).splitlines()
    full = report.render(verbose=True).splitlines()
    assert len(brief) <= HEADLINE, "\n".join(brief)
    labels = [line.split("  ")[0] for line in brief]
    assert labels[:3] == ["model", "queries", "floor"] and "verification" in labels
    assert labels[-1] == "wrote" and brief[1].split()[1] == str(report.queries)
    assert str(report.recovery_queries) in brief[1]
    # the rest is one flag away: every detail the learner kept, under -v and in to_dict()
    assert len(full) > len(brief) - 1
    hidden = re.search(r"^more +(\d+) more rows", "\n".join(brief), re.MULTILINE)
    assert hidden is not None and int(hidden.group(1)) > 0
    assert set(report.to_dict()["details"]) == {snake_case(k) for k in report.details}
    for key in report.details:
        assert any(line.startswith(human_label(key)) for line in full), key


def test_the_headline_holds_many_notes_and_details_to_15_lines():
    """A report carrying every kind of row (notes, many details, a journal, a breakdown)
    still prints at most 15 lines; the first notes and the model's error bar stay."""
    result = extract(Oracle(random_single_head(4, seed=3), 4), seed=0)
    report = result.report
    report.notes += [f"note number {i}" for i in range(6)]
    report.details.update({f"measurement {i}": i / 7 for i in range(30)})
    report.details.update({"heads": 1, "rank": 4, "hidden units": 0, "error bar": 1e-12,
                           "output precision": "float64", "journal": "r.journal.sqlite",
                           "black_box_queries": 40, "journal_queries": 4})
    report.breakdown.update({f"part {i}": i for i in range(10)})
    brief = report.render(extra=[("wrote", "r.npz")]).splitlines()
    assert len(brief) <= HEADLINE, "\n".join(brief)
    text = "\n".join(brief)
    assert "note number 0" in text and "note number 5" not in text
    assert "measurement 3" not in text
    assert re.search(r"^journal +r\.journal\.sqlite \(40 answered by the black box, 4 by the "
                     r"journal\)$", text, re.MULTILINE)
    full = report.render(verbose=True)
    assert "note number 5" in full and "measurement 29" in full and "part 9" in full


@pytest.fixture
def two_heads(tmp_path):
    path = tmp_path / "box.py"
    path.write_text(textwrap.dedent("""
        from attnextract.adapters.targets import random_multi_head
        two = random_multi_head(2, 6, seed=1)
    """))
    return f"{path}:two"


def test_the_cli_prints_the_headline_and_the_internals_under_v_and_in_json(tmp_path,
                                                                           two_heads, capsys):
    base = ["extract", "--target", two_heads, "--dim", "6", "--model", "multi-head",
            "--heads", "2", "--seed", "4", "--no-progress"]
    assert main(base + ["--out", str(tmp_path / "a")]) == 0
    brief = capsys.readouterr().out.splitlines()
    assert len(brief) <= HEADLINE and brief[-1].startswith("wrote")
    assert not any("label misfit" in line or "weighted residual" in line for line in brief)
    assert main(base + ["--out", str(tmp_path / "b"), "-v"]) == 0
    full = capsys.readouterr().out
    assert "label misfit (before, after)" in full and "weighted residual" in full
    assert len(full.splitlines()) > 30
    assert main(base + ["--out", str(tmp_path / "c"), "--json"]) == 0
    details = json.loads(capsys.readouterr().out)["details"]
    assert "label_misfit_before_after" in details and "weighted_residual_row_fits_polished" \
        in details


# -- progress ------------------------------------------------------------------------------

@pytest.mark.parametrize("journal", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_progress_total_ends_at_the_queries_sent(tmp_path, seed, journal):
    """The multi-head learner plans for its count search's worst case; the bar ends at
    what was sent (the journal's fingerprint queries counted, as the result counts them)."""
    stream = io.StringIO()
    bar = ProgressBar("extracting", enabled=True, stream=stream)
    seen = []

    def progress(done, total):
        seen.append((done, total))
        bar(done, total)
    progress.finish = bar.finish
    kept = QueryJournal(str(tmp_path / "j.sqlite")) if journal else None
    oracle = Oracle(random_multi_head(2, 6, seed=seed), 6, progress=progress, journal=kept)
    result = extract(oracle, "multi-head", heads=2, seed=seed)
    bar.close()
    if kept is not None:
        kept.close()
        assert result.report.breakdown["journal fingerprint"] == 8
    assert max(total for _, total in seen) > result.queries   # the plan was an upper bound
    assert bar.done == bar.total == result.queries
    drawn = stream.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert f" {result.queries}/{result.queries} " in drawn, drawn


def test_a_callback_without_finish_hears_the_end_as_no_forecast_left():
    seen = []
    oracle = Oracle(random_multi_head(2, 6, seed=1), 6,
                    progress=lambda done, total: seen.append((done, total)))
    result = extract(oracle, "multi-head", heads=2, seed=1)
    assert seen[-1] == (result.queries, result.queries)


# -- Ctrl-C while the command starts -------------------------------------------------------

SITECUSTOMIZE = '''
import os, signal, sys

# a terminal's Ctrl-C: a runner started in the background (`cmd &`) ignores SIGINT, and
# its children inherit that
signal.signal(signal.SIGINT, signal.default_int_handler)

class _InterruptAt:
    """Sends this process SIGINT when the module named by INTERRUPT_AT is first imported."""
    def find_spec(self, name, path=None, target=None):
        if name == os.environ.get("INTERRUPT_AT"):
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, _InterruptAt())
'''


def _interrupted(tmp_path, command: list[str], at: str):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**os.environ, "INTERRUPT_AT": at,
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(SRC)])}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120,
                          cwd=tmp_path)


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or os.name != "posix", reason="POSIX signals")
@pytest.mark.parametrize("at", ["numpy", "scipy.optimize", "attnextract.learners.multi_head",
                                "attnextract.cli"])
@pytest.mark.parametrize("how", ["module", "script"])
def test_ctrl_c_while_the_command_starts_is_one_line(tmp_path, at, how):
    if how == "module":
        command = [sys.executable, "-m", "attnextract", "demo", "--dim", "4"]
    else:                           # what the installed `attnextract` script runs
        script = tmp_path / "attnextract"
        script.write_text("import sys\nfrom attnextract.cli import main\nsys.exit(main())\n")
        command = [sys.executable, str(script), "demo", "--dim", "4"]
    done = _interrupted(tmp_path, command, at)
    assert done.returncode == 130, done.stderr
    assert done.stderr == "attnextract: interrupted while starting; nothing was sent\n"
    assert done.stdout == ""


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_ctrl_c_while_a_program_imports_the_library_stays_its_keyboard_interrupt(tmp_path):
    done = _interrupted(tmp_path, [sys.executable, "-c", "import attnextract"], "scipy.optimize")
    assert done.returncode != 130 and "KeyboardInterrupt" in done.stderr


# -- exports and the notebook view -------------------------------------------------------------

def test_all_exports_every_registered_learner_model_class_and_error():
    exported = set(attnextract.__all__)
    assert len(exported) == len(attnextract.__all__)              # no name twice
    for entry in LEARNERS.values():
        name = entry.function.__name__
        assert name in exported and getattr(attnextract, name) is entry.function, entry.name
    for cls in set(MODEL_CLASSES.values()):
        assert cls.__name__ in exported and getattr(attnextract, cls.__name__) is cls
    internal = {errors.VectorAnswersFound}     # extract()'s own signal: never reaches a caller
    for name, cls in vars(errors).items():
        if inspect.isclass(cls) and issubclass(cls, Exception) and cls not in internal:
            assert name in exported and getattr(attnextract, name) is cls, name
    namespace: dict = {}
    exec("from attnextract import *", namespace)
    assert exported <= set(namespace)


@pytest.mark.parametrize("passed", [True, False])
def test_a_result_shows_as_a_table_in_a_notebook(passed):
    result = extract(Oracle(random_single_head(4, seed=2), 4), seed=0)
    if not passed:
        result.report.verification.max_relative_error = 1.0
    result.report.notes.append("a <b>note</b> & more")
    html = result._repr_html_()
    assert html.startswith("<p><b>ExtractionResult</b>: single-head, d = 4, "
                           f"{result.queries} queries")
    assert ("PASSED" in html) == passed and ("FAILED" in html) == (not passed)
    assert "a &lt;b&gt;note&lt;/b&gt; &amp; more" in html and "<b>note</b>" not in html
    headline, folded = html.split("<details>")
    assert headline.count("<tr>") == len(result.report.rows())
    assert folded.count("<tr>") == len(result.report.rows(verbose=True))
    assert result.report._repr_html_() in html
