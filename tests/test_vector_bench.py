"""The bench's scalar-vs-vector rows: skipped with a message while the vector learners are
not registered, and wired (same boxes, three units of cost) when they are."""

from types import SimpleNamespace

import numpy as np

from attnextract import bench
from attnextract.registry import LEARNERS


def test_vector_rows_are_skipped_without_the_vector_learners(monkeypatch):
    for name in ("vector-single-head", "vector-multi-head"):
        monkeypatch.delitem(LEARNERS, name, raising=False)
    lines = []
    rows = bench.section_vector(True, lines.append)
    assert rows[0]["vector_skipped"].startswith("skipped: the vector learners")
    assert "skipped" in lines[0] and "skipped" in bench.markdown(rows)


def test_vector_rows_compare_the_same_boxes(monkeypatch):
    """Stand-in vector learners (they answer the truth after one query) show the wiring:
    the scalar learner runs on the readout of the very box the vector one asks."""
    real = bench.extract

    def fake(oracle, learner, seed=None, **options):
        if not learner.startswith("vector-"):
            return real(oracle, learner, seed=seed, **options)
        oracle.query(np.ones((2, 3, oracle.dim)))
        return SimpleNamespace(model=oracle.black_box, queries=oracle.queries,
                               report=SimpleNamespace(verification=SimpleNamespace(
                                   max_relative_error=0.0)))
    for name in ("vector-single-head", "vector-multi-head"):
        monkeypatch.setitem(LEARNERS, name, LEARNERS["single-head"])
    monkeypatch.setattr(bench, "extract", fake)
    monkeypatch.setattr(bench, "VECTOR_CASES", bench.VECTOR_CASES[:1])
    rows = bench.section_vector(True, lambda line: None)
    scalar, vector = rows[0], rows[1]
    assert scalar["learner"] == "single-head" and vector["learner"] == "vector-single-head"
    assert scalar["canonical_error"] < 1e-9 and vector["canonical_error"] == 0.0
    assert vector["numbers"] == 2 * 8 and scalar["numbers"] == scalar["queries"]
    assert vector["floor_queries"] == 2 * 8 + 2                  # 2d + 2 at m = d
    assert "| single head, biases | vector-single-head | 8 |" in bench.markdown(rows)
