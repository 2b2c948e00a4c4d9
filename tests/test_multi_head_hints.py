"""Multi-head messages that match what the run knows: told too few heads, the refusal
names a larger --heads first; a run told H does not say its count rests on one row."""

from __future__ import annotations

import pytest

from attnextract import ModelMismatchError, Oracle
from attnextract.adapters.targets import random_multi_head
from attnextract.registry import extract


def test_too_few_heads_told_suggests_more_heads_before_biases():
    with pytest.raises(ModelMismatchError) as refused:
        extract(Oracle(random_multi_head(4, 8, seed=0), 8), "multi-head", heads=2, seed=0)
    text = str(refused.value)
    assert "larger --heads" in text and text.index("larger --heads") < text.index("--biases")


def test_a_run_told_its_heads_does_not_claim_one_row_found_them():
    result = extract(Oracle(random_multi_head(2, 4, seed=1), 4), "multi-head", heads=2, seed=1)
    assert not any("rests on one base row" in note for note in result.report.notes)
