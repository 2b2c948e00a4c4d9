"""Every example under examples/ runs to the end (each asserts what it shows)."""

import runpy
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))
LEARNERS = {"single_head", "low_rank", "noisy", "sign_only", "relu_network", "one_layer",
            "multi_head"}


def test_one_example_per_learner():
    assert LEARNERS <= {p.stem for p in EXAMPLES}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
@pytest.mark.slow
def test_example_runs(path, capsys):
    runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    assert "queries" in out           # each prints its report
