"""Exact accounting: the count a run reports is the count the black box answered, on
successes, refusals and budget failures; a budget equal to a run's reported total lets
that run through."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from conftest import run_cli

from attnextract import Oracle
from attnextract.adapters.journal import QueryJournal
from attnextract.adapters.targets import random_multi_head
from attnextract.errors import ModelMismatchError
from attnextract.registry import extract

TARGET = textwrap.dedent("""
    import os
    import numpy as np
    from attnextract.adapters.targets import random_multi_head, random_single_head

    LOG = os.environ["ANSWERED_LOG"]
    {box}

    def box(X):
        out = BOX(X)
        with open(LOG, "a") as f:       # after answering: what the box answered
            f.write(f"{{len(X)}}\\n")
        return out
""")


def _answered(log) -> int:
    return sum(int(n) for n in open(log).read().split()) if os.path.exists(log) else 0


@pytest.mark.parametrize("journal", [False, True])
@pytest.mark.parametrize("case, box, options", [
    ("refusal", "BOX = random_multi_head(2, 4, seed=0)", ["--model", "single-head"]),
    ("budget", "BOX = random_multi_head(2, 4, seed=0)",
     ["--model", "multi-head", "--budget", "150"]),
    ("success", "BOX = random_single_head(4, seed=0)", ["--model", "single-head"]),
])
def test_json_queries_are_what_the_box_answered(tmp_path, case, box, options, journal):
    target, log = tmp_path / "target.py", tmp_path / "answered.log"
    target.write_text(TARGET.format(box=box))
    env = {**os.environ, "ANSWERED_LOG": str(log)}
    proc = run_cli("extract", "--target", f"{target}:box", "--dim", 4, "--seed", 1,
                   "--out", tmp_path / "r.npz", "--json", "--no-progress", *options,
                   *([] if journal else ["--no-journal"]), env=env, timeout=120)
    out = json.loads(proc.stdout)
    assert out["ok"] == (case == "success"), proc.stderr
    queries = out["queries"] if "queries" in out else out["report"]["queries"]
    assert queries == _answered(log)
    if "report" in out:
        assert out["report"]["queries"] == queries
    if case == "budget":
        assert 0 < queries <= 150


def test_a_refusal_counts_the_queries_asked_after_the_learner_stopped():
    """The zero token asked after a refusal (to tell a constant) is in the count."""
    answered = []
    box = random_multi_head(2, 4, seed=0)

    def counting(X):
        answered.append(len(X))
        return box(X)

    with pytest.raises(ModelMismatchError) as caught:
        extract(Oracle(counting, 4), "single-head", seed=1)
    assert caught.value.result.queries == caught.value.result.report.queries == sum(answered)


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("journal", [False, True])
def test_a_budget_equal_to_the_reported_total_succeeds(tmp_path, heads, journal):
    """Multi-head not told H plans for the most heads it may count; the budget need only
    hold the least run, and every later stage checks it."""
    box = random_multi_head(heads, 8, seed=2)
    first = extract(Oracle(box, 8), "multi-head", seed=2)
    with QueryJournal(tmp_path / "a.sqlite") if journal else _nothing() as kept:
        oracle = Oracle(box, 8, journal=kept)
        total = extract(oracle, "multi-head", seed=2).queries
    assert total == first.queries + oracle.check_queries
    with QueryJournal(tmp_path / "b.sqlite") if journal else _nothing() as kept:
        again = extract(Oracle(box, 8, budget=total, journal=kept), "multi-head", seed=2)
    assert again.queries == total
    assert again.model.parameters().keys() == first.model.parameters().keys()
    for key, value in first.model.parameters().items():
        assert (again.model.parameters()[key] == value).all()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_target_output_at_descriptor_1_never_reaches_json_stdout(tmp_path):
    """A target writing to file descriptor 1 itself (a C extension, os.write) while it
    answers: with --json, stdout is one JSON object and the noise goes to stderr."""
    target = tmp_path / "noisy_target.py"
    target.write_text(textwrap.dedent("""
        import os
        from attnextract.adapters.targets import random_single_head
        os.write(1, b"noise at import\\n")
        BOX = random_single_head(4, 0)

        def box(X):
            os.write(1, b"noise\\n")
            return BOX(X)
    """))
    for command in (["extract", "--out", tmp_path / "r.npz", "--no-journal"],):
        proc = run_cli(*command[:1], "--target", f"{target}:box", "--dim", 4, "--seed", 1,
                       *command[1:], "--json", "--no-progress", check=0, timeout=120)
        assert json.loads(proc.stdout)["ok"] is True
        assert "noise" not in proc.stdout and "noise" in proc.stderr
    proc = run_cli("verify", "--target", f"{target}:box", "--result", tmp_path / "r.npz",
                   "--json", "--no-progress", check=0, timeout=120)
    assert json.loads(proc.stdout)["ok"] is True and "noise" in proc.stderr
