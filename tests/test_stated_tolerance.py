"""A tolerance that was seen: no check passes with an error above the tolerance it
prints. A model's error bar widens each sequence's allowance by its score reach; where
that accepts a larger error, the check prints the larger tolerance it achieved."""

from __future__ import annotations

import numpy as np
import pytest

from attnextract import Oracle
from attnextract.testing.impostors import MeanPoolHead, make_impostor
from attnextract.adapters.targets import random_single_head
from attnextract.report import Report, Verification, verify_model
from attnextract.verification import CONSISTENCY_FACTOR, merge_verifications


@pytest.mark.parametrize("d", [8, 16])
def test_a_hidden_mean_pooling_head_is_refused_or_within_the_printed_tolerance(d):
    widened = []
    for size in (1e-8, 1e-7, 1e-6):
        for bar in (1e-10, 1e-9):
            model = random_single_head(d, 0)
            box = MeanPoolHead(model, np.random.default_rng(0), size)
            v = verify_model(Oracle(box, d), model, count=64, seed=0, expected_error=bar)
            assert v.judged_tolerance <= v.tolerance
            if v.passed:
                assert v.max_relative_error <= v.tolerance
                if v.tolerance > v.judged_tolerance:
                    widened.append((size, bar, v))
            else:
                assert v.max_relative_error > v.tolerance == v.judged_tolerance
    for size, bar, v in widened:        # the error bar accepted more: printed, and said
        assert v.max_relative_error > v.judged_tolerance
        report = Report(kind="single-head", dim=d, queries=64, floor=272, breakdown={},
                        seconds=0.0, black_box_seconds=0.0, verification=v)
        assert "widened from" in report.render()


def test_merged_checks_print_a_tolerance_every_error_met():
    def check(error, tolerance):
        return Verification(sequences=10, max_relative_error=error, median_relative_error=error,
                            tolerance=tolerance, judged_tolerance=1e-9)
    both = merge_verifications(check(3e-9, 4e-9), check(1e-9, 1e-9))
    assert both.passed and both.tolerance == 4e-9 and both.max_relative_error == 3e-9
    one = merge_verifications(check(3e-9, 4e-9), check(2e-9, 1e-9))
    assert not one.passed and one.tolerance == 1e-9
    assert both.family_sequences == {"all": 20} and both.sequences == 20


@pytest.mark.parametrize("d", [8, 16])
def test_a_loose_bar_widens_an_exact_check_no_further_than_its_tolerance_assumes(d):
    """A bar far above the model's real error (a design bound; here 3e-8 and 1e-6 for a
    model exact to rounding) widens an exact check by at most tolerance / 1e3: a box off
    by 1e-3 (or clipped) only on large tokens is refused, where the whole bar passed it
    (8 of 8 and 7 of 8 seeds); the honest box is accepted. Rounded answers keep the bar."""
    for bar in (3e-8, 1e-6):
        for seed in range(4):
            model = random_single_head(d, seed)
            honest = verify_model(Oracle(model, d), model, count=64, seed=seed,
                                  expected_error=bar)
            assert honest.passed and honest.error_bar == honest.tolerance / CONSISTENCY_FACTOR
            kept = verify_model(Oracle(model, d), model, count=64, seed=seed,
                                expected_error=bar, rounded_answers=True)
            assert kept.passed and kept.error_bar == bar
            for name in ("large-token drift 0.001", "large-token clip x300"):
                box = make_impostor(name, model, np.random.default_rng(seed), 100)
                v = verify_model(Oracle(box, d), model, count=64, seed=seed, expected_error=bar)
                assert not v.passed and v.max_relative_error > 1e-4, (bar, seed, name)
