"""Multi-head refusals on float32 answers that the rounding explains (issue 22, item 4):
the message states the limit the run measured and what lets a box through, never blames
the box (measured with benchmarks/check_f32_heads.py, the run in the git history: float32
``nn.MultiheadAttention`` with head dimension 1 or 2)."""

from __future__ import annotations

import re

import pytest

from attnextract import InputError, Oracle, extract
from attnextract.adapters.targets import Float32MultiHeadBlackBox
from attnextract.cli import _learner_and_options, build_parser
from attnextract.errors import RecoveryFailedError
from attnextract.learners.multi_head import canonical_error


def test_error_bar_refusal_names_the_bar_that_returns_the_model():
    """An error bar above the one accepted is what the count's samples give at this
    rounding (float32 nn.MultiheadAttention, d = 8, H = 4: bars 1.5e-2 and 2.6e-2 against
    the default 9.5e-3): the refusal states the bar and names max_error_bar, and that
    option returns a model within its bar."""
    box = Float32MultiHeadBlackBox(2, 8, seed=0)
    with pytest.raises(RecoveryFailedError) as refused:
        extract(Oracle(box, 8), "multi-head", heads=2, seed=0, max_error_bar=1e-6)
    message = str(refused.value)
    bar = float(re.search(r"pin these heads to an error bar of ([0-9.e+-]+)", message).group(1))
    suggested = float(re.search(r"max_error_bar=([0-9.e+-]+) \(--max-error-bar", message).group(1))
    assert 1e-6 < bar < suggested < 1
    assert "float32, detected" in message and "not multi-head attention" not in message
    # the learner already allows for a float32 pass: no hint to state the dtype
    assert "say so with --output-dtype" not in message
    result = extract(Oracle(box, 8), "multi-head", heads=2, seed=0, max_error_bar=suggested)
    error, stated = canonical_error(result.model, box.truth), result.report.details["error bar"]
    assert error <= stated <= suggested


def test_heads_hidden_by_the_rounding_are_the_learners_limit():
    """8 heads of dimension 1 at d = 8 in float32: base rows show 3 to 6 of the 8 steps
    (close steps merge, small ones sink below the rounding) and every design fails. The
    refusal says so, as the learner's limit (not the box's), and names what helps."""
    box = Float32MultiHeadBlackBox(8, 8, seed=2)
    with pytest.raises(RecoveryFailedError) as refused:
        extract(Oracle(box, 8), "multi-head", heads=8, seed=2)
    message = str(refused.value)
    shown = re.search(r"(\d+) of (\d+) base rows showed fewer steps than the 8 heads asked",
                      message)
    assert shown and 2 * int(shown.group(1)) > int(shown.group(2))
    assert "the black box is not judged" in message and "float64 forward pass" in message
    assert "say so with --output-dtype" not in message
    assert "not multi-head attention" not in message


@pytest.mark.slow        # 2.5 s: the fast multi-head tests stay within 50 s
def test_count_not_told_on_coarse_answers_may_be_low():
    """Not told H, the rows of the same box agree on fewer heads than it has (5 or 6 of
    8) and their counts differ: the refusal says the count may be low, for the same
    reason (RecoveryFailedError, the learner's limit)."""
    box = Float32MultiHeadBlackBox(8, 8, seed=2)
    with pytest.raises(RecoveryFailedError) as refused:
        extract(Oracle(box, 8), "multi-head", seed=2)
    message = str(refused.value)
    assert re.search(r"the rows showed \[[0-9, ]+\] steps\), so the count \d may be low",
                     message), message
    # (a design's own failure may add "or the black box is not multi-head attention with
    # 5 canonical heads", true of this box; the refusal's type and last word are the
    # learner's)
    assert "the black box is not judged" in message and "float64 forward pass" in message


def _parsed(*argv):
    return build_parser().parse_args(["extract", "--target", "x.py:f", "--dim", "8",
                                      "--out", "r.npz", *argv])


def test_cli_max_error_bar_reaches_multi_head_only():
    learner, options = _learner_and_options(_parsed("--model", "multi-head", "--heads", "4",
                                                    "--max-error-bar", "0.03"))
    assert learner.name == "multi-head" and options == {"heads": 4, "max_error_bar": 0.03}
    with pytest.raises(InputError, match="--max-error-bar does not apply"):
        _learner_and_options(_parsed("--model", "single-head", "--max-error-bar", "0.03"))
