"""Batch invariance: held-out sequences are asked again alone and at the end of a batch as
large as the learner's largest; a box whose answers (or whose precision) depend on the
batch is refused with that reason, and a box's precision is never taken from one batch
shape for another."""

from __future__ import annotations

import numpy as np
import pytest

from attnextract import ModelMismatchError, Oracle
from attnextract.adapters.targets import random_single_head
from attnextract.errors import AttnExtractError
from attnextract.oracle import RoundedOutputs
from attnextract.registry import extract
from attnextract.report import mismatch_reason, verify_model
from attnextract.testing.impostors import BatchDependent, Float32AboveBatch
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


class Float32KernelPerBatch:
    """A float32 forward pass whose kernel for one sequence alone sums in another order than
    its batched kernel (as torch's do): an answer alone moves by tens of float32 ulps."""

    def __init__(self, model):
        self.model = model

    def __call__(self, X):
        out = np.asarray(self.model(np.asarray(X, dtype=np.float64)), dtype=np.float64)
        if len(X) == 1:
            out = out * (1.0 + 64 * 2.0 ** -24)
        return out.astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("seed", range(3))
def test_a_float32_box_that_moves_with_the_batch_is_told_its_precision_option(seed):
    """A float32 box refused for answers that move with the batch is named as float32, with
    the option that describes it (a user's torch module in float32, asked alone and batched)."""
    model = random_single_head(8, seed)
    check = verify_model(Oracle(Float32KernelPerBatch(model), 8), model, count=64, seed=seed)
    assert not check.passed and check.batch_dependence and check.float32_answers
    reason = mismatch_reason(check)
    assert "batch" in reason and "--output-dtype" in reason


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
