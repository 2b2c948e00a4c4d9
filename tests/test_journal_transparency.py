"""A journal changes nothing: the same queries, in the same order, and the same bits.

For every registered learner (small d, fast options; vector learners at the last
position, vector-single-head at every position too): a run without a journal, one
with a journal, runs interrupted after k answers (several k) and resumed, and a rerun of
a finished run send the learner's plan the same sequences in the same order and return
the same model bit for bit; the journal's binding checks are counted in the total but
never taken from the plan, and a rerun of a finished run asks the black box only them.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnextract import Oracle
from attnextract.adapters.journal import QueryJournal
from attnextract.adapters.targets import (
    random_low_rank_head,
    random_low_rank_multi_head,
    random_multi_head,
    random_pre_layer_norm,
    random_single_head,
    random_vector_attention,
)
from attnextract.errors import AttnExtractError
from attnextract.learners.one_layer import random_one_layer
from attnextract.learners.relu_network import random_relu_network
from attnextract.learners.residual import random_residual_one_layer
from attnextract.learners.transformer_layer import random_transformer_layer
from attnextract.oracle import BoundedNoise, RoundedOutputs, SignOnly
from attnextract.registry import extract
from attnextract.testing.impostors import VectorBehindLayerNorm, random_vector_layer

# learner -> (black box factory, d, model name, options); deterministic boxes only (a
# seeded noise stream would differ with the number of calls, journal or not)
CASES = {
    "single-head": (lambda: random_single_head(4, seed=1), 4, "single-head", {}),
    "low-rank": (lambda: random_low_rank_head(6, 2, seed=1), 6, "low-rank", {}),
    "multi-head": (lambda: random_multi_head(2, 4, seed=1), 4, "multi-head", {"heads": 2}),
    "relu-network": (lambda: random_relu_network(4, 4, seed=1), 4, "relu-network", {}),
    "one-layer": (lambda: random_one_layer(4, 4, seed=1), 4, "one-layer", {}),
    "one-layer-residual": (lambda: random_residual_one_layer(4, 4, seed=1), 4,
                           "one-layer-residual", {}),
    "multi-head-low-rank": (lambda: random_low_rank_multi_head(2, 6, 1, seed=1), 6,
                            "multi-head-low-rank", {"heads": 2, "rank": 1}),
    "transformer-layer": (lambda: random_transformer_layer(4, 6, seed=1), 4,
                          "transformer-layer", {}),
    "pre-ln": (lambda: random_pre_layer_norm(1, 4, seed=1), 4, "pre-ln", {}),
    "noisy": (lambda: BoundedNoise(random_single_head(4, seed=1), 1e-9, "outward"), 4,
              "single-head", {"tolerance": 1e-9}),
    "sign-only": (lambda: SignOnly(random_single_head(3, seed=1)), 3, "single-head",
                  {"sign_only": True}),
    "low-precision": (lambda: RoundedOutputs(random_single_head(4, seed=1), "float32"), 4,
                      "low-precision", {"output_dtype": "float32"}),
    # vector answers: at the last position and at every position (causal)
    "vector-single-head": (lambda: random_vector_attention(1, 4, seed=1), 4,
                           "vector-single-head", {}),
    "vector-single-head every position": (
        lambda: random_vector_attention(1, 4, seed=1, positions="all", causal=True), 4,
        "vector-single-head", {}),
    "vector-layer": (lambda: random_vector_layer(2, 4, seed=1), 4, "vector-layer", {}),
    "vector-multi-head": (lambda: random_vector_attention(2, 4, seed=1), 4,
                          "vector-multi-head", {"heads": 2}),
    "vector-pre-ln": (lambda: VectorBehindLayerNorm(random_vector_attention(1, 4, seed=1),
                                                    np.random.default_rng(1)), 4,
                      "vector-pre-ln", {}),
}
SEED = 3


class Stop(RuntimeError):
    """The black box stops answering (a run killed after k answers)."""


class Recorder:
    """A black box that logs, in order, every sequence it answered (as bytes), the
    journal's binding checks apart, and stops after ``stop_after`` plan answers."""

    def __init__(self, box, stop_after: int | None = None):
        self.box, self.stop_after = box, stop_after
        self.plan: list[bytes] = []
        self.checks: list[bytes] = []
        self.checking = False

    def __call__(self, X):
        if (not self.checking and self.stop_after is not None
                and len(self.plan) + len(X) > self.stop_after):
            raise Stop(f"stopped after {len(self.plan)} answers")
        out = self.box(X)
        (self.checks if self.checking else self.plan).extend(row.tobytes() for row in X)
        return out

    # what wrappers declare about their noise (the journal reads it)
    def __getattr__(self, name):
        if name in ("tolerance", "relative_tolerance", "std", "output_kind"):
            return getattr(self.box, name)
        raise AttributeError(name)


def _run(case, box: Recorder, journal=None):
    _, d, model, options = CASES[case]
    oracle = Oracle(box, d, journal=journal)
    ask_to_check = oracle._ask_to_check

    def checking(X):                  # the journal's checks, logged apart by the box
        box.checking = True
        try:
            return ask_to_check(X)
        finally:
            box.checking = False

    oracle._ask_to_check = checking
    return extract(oracle, model, seed=SEED, **dict(options)), oracle


def _bits(result) -> dict[str, bytes]:
    return {k: np.asarray(v).tobytes() for k, v in result.model.parameters().items()}


def _transparent(case: str, tmp_path, stops: tuple[int, ...]) -> None:
    make = CASES[case][0]
    plain_box = Recorder(make())
    plain, _ = _run(case, plain_box)
    assert plain.report.verification is None or plain.report.verification.passed
    sent = plain_box.plan
    assert len(sent) == plain.queries

    # with a journal: the same sequences in the same order, the same bits; the checks
    # are counted in the total, apart from the plan
    path = tmp_path / f"{case}.sqlite"
    box = Recorder(make())
    with QueryJournal(path) as journal:
        kept, oracle = _run(case, box, journal)
    assert box.plan == sent
    assert _bits(kept) == _bits(plain)
    assert kept.queries == plain.queries + oracle.check_queries == plain.queries + len(box.checks)

    # a rerun of the finished run asks the black box nothing but the journal's checks
    box = Recorder(make())
    with QueryJournal(path) as journal:
        again, oracle = _run(case, box, journal)
    assert box.plan == [] and len(box.checks) == oracle.check_queries > 0
    assert _bits(again) == _bits(plain)
    assert again.queries == plain.queries + oracle.check_queries

    # interrupted after k answers and resumed: the two runs' plan answers are the
    # uninterrupted run's, in order, and the result is the same bits
    for k in stops:
        path = tmp_path / f"{case}-{k}.sqlite"
        first = Recorder(make(), stop_after=k)
        with QueryJournal(path) as journal, pytest.raises(AttnExtractError):
            _run(case, first, journal)
        assert len(first.plan) <= k
        second = Recorder(make())
        with QueryJournal(path) as journal:
            resumed, oracle = _run(case, second, journal)
        assert first.plan + second.plan == sent, f"resumed after {k}"
        assert _bits(resumed) == _bits(plain), f"resumed after {k}"
        assert resumed.queries == plain.queries + oracle.check_queries


@pytest.mark.parametrize("case", sorted(CASES))
def test_journal_is_transparent(case, tmp_path):
    probe = Recorder(CASES[case][0]())
    result, _ = _run(case, probe)
    n = result.queries
    # early (inside the first stage), middle, and inside the held-out verification
    stops = tuple(sorted({max(2, n // 7), n // 2, n - 3}))
    _transparent(case, tmp_path, stops)
