"""Multi-head messages that match what the run knows: told too few heads, the refusal
names a larger --heads first; a run told H does not say its count rests on one row."""

from __future__ import annotations

import pytest

from attnextract import ModelMismatchError, Oracle
from attnextract.adapters.targets import random_multi_head
from attnextract.registry import extract


@pytest.mark.parametrize("heads, told, d, seed", [
    (4, 2, 8, 0), (3, 1, 8, 1), (4, 3, 8, 2), (6, 4, 8, 3), (2, 1, 6, 4), (5, 2, 8, 5),
    (3, 2, 12, 6)])
def test_too_few_heads_told_suggests_more_heads_before_biases(heads, told, d, seed):
    with pytest.raises(ModelMismatchError) as refused:
        extract(Oracle(random_multi_head(heads, d, seed=seed), d), "multi-head", heads=told,
                seed=seed)
    text = str(refused.value)
    assert "larger --heads" in text and text.index("larger --heads") < text.index("--biases")


def test_a_run_told_its_heads_does_not_claim_one_row_found_them():
    result = extract(Oracle(random_multi_head(2, 4, seed=1), 4), "multi-head", heads=2, seed=1)
    assert not any("rests on one base row" in note for note in result.report.notes)


def test_the_max_error_bar_docstring_states_the_codes_default():
    """The float32 default of max_error_bar in the docstring is the code's: ROUNDED_TOLERANCE
    units of float32 rounding."""
    from attnextract.learners.multi_head import extract_multi_head
    from attnextract.learners.multi_head.constants import ROUNDED_TOLERANCE
    text = " ".join(extract_multi_head.__doc__.split())
    assert f"ROUNDED_TOLERANCE = {ROUNDED_TOLERANCE:.1e}".replace("e+0", "e") in text
    assert f"{ROUNDED_TOLERANCE * 2.0 ** -24:.1e} for float32".replace("e-0", "e-") in text
