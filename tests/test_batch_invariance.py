"""Batch invariance: held-out sequences are asked again alone and at the end of a batch as
large as the learner's largest; a box whose answers (or whose precision) depend on the
batch is refused with that reason, and a box's precision is never taken from one batch
shape for another."""

from __future__ import annotations

import numpy as np
import pytest

from attnextract import ModelMismatchError, Oracle
from attnextract.testing.impostors import BatchDependent, Float32AboveBatch
from attnextract.adapters.targets import random_single_head
from attnextract.errors import AttnExtractError
from attnextract.oracle import RoundedOutputs
from attnextract.registry import extract
from attnextract.report import mismatch_reason, verify_model
from attnextract.verification import BATCH_CAP


@pytest.mark.parametrize("d", [8, 16])
@pytest.mark.parametrize("kind", ["float32 above 8", "batch mean"])
def test_a_batch_dependent_box_is_refused_with_that_reason(d, kind):
    for seed in range(2):
        model = random_single_head(d, seed)
        rng = np.random.default_rng(seed)
        box = (Float32AboveBatch(model, rng, 8) if kind == "float32 above 8"
               else BatchDependent(model, rng))
        check = verify_model(Oracle(box, d), model, count=64, seed=seed)
        assert not check.passed and check.batch_dependence
        assert "batch" in mismatch_reason(check)
        oracle = Oracle(box, d)
        oracle.verify_sequences = 64       # a check large enough for the batch stage
        with pytest.raises(ModelMismatchError, match="batch"):
            extract(oracle, "single-head", seed=seed)


def test_a_float32_box_is_not_widened_by_batches_that_differ():
    """The learner told float32 (or finding it) widens its tolerance; a box that is float32
    only in large batches is refused, not accepted at the float32 tolerance."""
    model = random_single_head(8, 3)
    box = Float32AboveBatch(model, np.random.default_rng(3), 8)
    oracle = Oracle(box, 8)
    oracle.verify_sequences = 64           # a check large enough for the batch stage
    with pytest.raises(AttnExtractError):
        extract(oracle, "low-precision", output_dtype="float32", seed=3)


@pytest.mark.parametrize("d", [8, 16])
def test_honest_boxes_answer_the_same_in_every_batch(d):
    for seed in range(2):
        model = random_single_head(d, seed)
        oracle = Oracle(model, d)
        oracle.verify_sequences = 4 * BATCH_CAP     # a share that reaches the largest batch
        result = extract(oracle, "single-head", seed=seed)
        check = result.report.verification
        assert check.passed and not check.batch_dependence
        assert check.batch_sizes[0] == 1
        assert check.batch_sizes[-1] >= min(oracle.largest_batch, BATCH_CAP)
        assert result.report.breakdown["verification"] == check.sequences == 4 * BATCH_CAP
        rounded = RoundedOutputs(model, "float32")       # rounded the same in every batch
        stated = extract(Oracle(rounded, d), "low-precision", output_dtype="float32",
                         seed=seed)
        assert stated.report.verification.passed
