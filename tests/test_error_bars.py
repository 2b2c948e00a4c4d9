"""Errors per part, dynamic-range heads, and error bars that hold in low precision."""

import numpy as np
import pytest

from attnextract import ModelMismatchError, MultiHeadAttention, Oracle, SingleHeadAttention
from attnextract.learners.noisy import extract_low_precision
from attnextract import extract
from attnextract.learners.single_head import extract_single_head
from attnextract.oracle import RoundedOutputs
from attnextract.report import parameter_errors

from conftest import run_cli


def dynamic_range_head(d, seed, ratio, axis):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((d, d)) / np.sqrt(d)
    if axis == "column":
        W[:, seed % d] *= ratio
    else:
        W[seed % d, :] *= ratio
    return SingleHeadAttention(W, rng.standard_normal(d))


def test_parameter_errors_see_what_frobenius_hides():
    rng = np.random.default_rng(0)
    W = rng.standard_normal((6, 6))
    W[:, 0] *= 1e12
    truth = SingleHeadAttention(W, rng.standard_normal(6))
    off = W.copy()
    off[:, 3] *= 1 + 1e-3                       # a small column off by 1e-3
    v = truth.v.copy()
    v[2] *= 1 + 1e-5
    errs = parameter_errors(SingleHeadAttention(off, v), truth)
    assert errs["W_relative"] < 1e-14                        # Frobenius sees nothing
    assert errs["W_column_max"] == pytest.approx(1e-3, rel=1e-6)
    assert np.argmax(errs["W_columns"]) == 3
    assert errs["v_entry_max"] == pytest.approx(1e-5, rel=1e-6) and np.argmax(errs["v_entries"]) == 2


@pytest.mark.parametrize("axis", ["column", "row"])
@pytest.mark.parametrize("ratio", [1e6, 1e12, 1e14])
@pytest.mark.parametrize("d", [4, 16])
def test_dynamic_range_heads_recovered_in_every_column_and_row(d, ratio, axis):
    for seed in range(3):
        truth = dynamic_range_head(d, seed, ratio, axis)
        result = extract_single_head(Oracle(truth, d), seed=seed)
        errs = parameter_errors(result.model, truth)
        assert errs["W_column_max"] <= 1e-8 and errs["W_row_max"] <= 1e-8, (seed, errs)
        assert errs["v_entry_max"] <= 1e-12
        details = result.report.details
        # the learner's own per-column and per-row bars hold
        assert errs["W_column_max"] <= details["error_bar_W_columns"]
        assert errs["W_row_max"] <= details["error_bar_W_rows"]
        assert result.report.breakdown["rescaling"] > 0          # the small block re-probed


def test_generic_heads_need_no_reprobing():
    from attnextract.adapters.targets import random_single_head
    for seed in range(5):
        truth = random_single_head(12, seed)
        result = extract_single_head(Oracle(truth, 12), seed=seed)
        assert result.report.breakdown["rescaling"] == 0
        errs = parameter_errors(result.model, truth)
        assert errs["W_column_max"] <= result.report.details["error_bar_W_columns"]
        assert errs["W_row_max"] <= result.report.details["error_bar_W_rows"]


def test_rounded_to_decimals():
    box = RoundedOutputs(lambda X: X[:, -1, 0] * 1.0, decimals=3)
    out = box(np.array([[[0.12345, 0.0]], [[-2.00049, 0.0]]]))
    assert np.array_equal(out, [0.123, -2.0]) and box.tolerance == 0.0005


def torch_head(d, seed, dtype):
    import torch
    from attnextract.adapters.torch_target import TorchAttentionBlackBox
    torch.manual_seed(seed)
    module = torch.nn.MultiheadAttention(d, 1, bias=False, batch_first=True).double()
    box = TorchAttentionBlackBox(module, seed, head=0, dtype=dtype)
    return box, SingleHeadAttention(*box.merged_parameters())


@pytest.mark.parametrize("case", ["float32", "bfloat16", "decimals"])
@pytest.mark.slow
def test_measured_error_bars_hold(case):
    """The full 100-trial measurement is benchmarks/bench_error_bars.py; here 20 trials."""
    held, held_parts, verified = 0, 0, 0
    for seed in range(20):
        if case == "decimals":
            box, truth = torch_head(6, seed, "float64")
            box, options = RoundedOutputs(box, decimals=6), {"decimals": 6}
        else:
            (box, truth), options = torch_head(6, seed, case), {"output_dtype": case}
        result = extract_low_precision(Oracle(box, 6), seed=seed, **options)
        verified += result.report.verification.passed
        bar = result.report.details["error_bar_W"]
        error = np.linalg.norm(result.model.W - truth.W)
        held += error <= bar
        errs = parameter_errors(result.model, truth)        # per column and row too
        held_parts += (errs["W_column_max"] <= result.report.details["error_bar_W_columns"]
                       and errs["W_row_max"] <= result.report.details["error_bar_W_rows"])
        assert bar < 3.0 * np.linalg.norm(truth.W)          # a bar, not "anything goes"
    assert held >= 19 and held_parts >= 19 and verified == 20


@pytest.mark.parametrize("d, box_seed, seeds", [(6, 3, (56,)), (4, 0, (32,)), (8, 1, (1, 37))])
def test_held_out_allowance_covers_the_float32_sums_over_long_sequences(d, box_seed, seeds):
    """The true head itself (no model error, zero bars) against its float32 forward pass:
    the allowance is the box's own rounding alone. These held-out designs hold a sequence
    of 2048 to 4096 repeated tokens whose float32 answer is off by up to 1.0e-4 relative,
    the rounding of the sums over the tokens; the allowance without its length term was
    exceeded (1.04, 1.30, 1.47 and 1.03 x; with it 0.15, 0.18, 0.14 and 0.22), and extracting
    with these learner seeds was refused."""
    from attnextract.learners.noisy import (ACCUMULATION_UNIT, FORWARD_RHO, NoiseModel,
                                            verify_noisy)
    from attnextract.report import verification_count
    box, truth = torch_head(d, box_seed, "float32")
    noise = NoiseModel(0.0, FORWARD_RHO["float32"], "random", forward=True,
                       accumulation=ACCUMULATION_UNIT["float32"])
    count = verification_count(d * d + d, 4 * (d * d + d))
    for seed in seeds:
        check = verify_noisy(Oracle(box, d), truth, noise, 0.0, 0.0, count=count, seed=seed,
                             scale=1 / np.sqrt(d), nonlinear=True)
        assert check.worst_ratio < 0.5, (seed, check.worst_ratio, check.worst_family)


@pytest.mark.slow
def test_float32_single_head_is_not_refused_for_any_of_30_seeds():
    """The CLI's box (nn.MultiheadAttention(6, 1), torch seed 3) in float32, 30 learner
    seeds with 56 (refused before the allowance's length term: 1.02 x): none refused,
    the held-out error at most 0.5 of the allowance, the W bar holding."""
    box, truth = torch_head(6, 3, "float32")
    worst = []
    for seed in list(range(29)) + [56]:
        result = extract_low_precision(Oracle(box, 6), seed=seed, output_dtype="float32")
        worst.append(result.report.verification.worst_ratio)
        assert np.linalg.norm(result.model.W - truth.W) <= result.report.details["error_bar_W"]
    assert max(worst) < 0.5, worst


def test_float32_forward_pass_is_refused_with_a_hint():
    box, _ = torch_head(8, 0, "float32")
    with pytest.raises(ModelMismatchError) as info:
        extract_single_head(Oracle(box, 8), seed=0)
    assert "--output-dtype" in str(info.value) and "precision" in str(info.value)


@pytest.mark.slow
def test_cli_output_dtype_and_help(tmp_path):
    import torch  # noqa: F401  (a test-all package: see conftest.py)
    target = tmp_path / "target.py"
    target.write_text(
        "import torch\n"
        "from attnextract.adapters.torch_target import TorchAttentionBlackBox\n"
        "torch.manual_seed(3)\n"
        "m = torch.nn.MultiheadAttention(6, 1, bias=False, batch_first=True).double()\n"
        "box = TorchAttentionBlackBox(m, 3, head=0, dtype='float32')\n")
    out = tmp_path / "r.npz"
    # learner seed 56 was refused here (held-out 1.02 x the allowance: the float32 sums
    # over a 4096-token sequence; a one-off run, in the git history)
    proc = run_cli("extract", "--target", f"{target}:box", "--dim", 6, "--output-dtype", "float32",
                   "--seed", 56, "--out", out, "--json", check=0)
    assert '"error_bar_W"' in proc.stdout and out.exists()
    plain = run_cli("extract", "--target", f"{target}:box", "--dim", 6, "--out",
                    tmp_path / "p.npz", check=1)
    assert "--output-dtype" in plain.stderr
    helptext = run_cli("extract", "--help", check=0).stdout
    assert "--output-dtype" in helptext and "--decimals" in helptext
    assert "rounded once" in " ".join(helptext.split())


def test_float32_forward_pass_is_not_a_rounded_output():
    """Issue 13's case: --tolerance 0 --relative-tolerance 5.96e-8 on a float32 forward pass
    used to PASS with a bar 7-14x too small; now it is refused and the message names the fix."""
    for seed in range(3):
        box, _ = torch_head(16, seed, "float32")
        with pytest.raises(ModelMismatchError, match="--output-dtype"):
            extract(Oracle(box, 16), "single-head", seed=seed, tolerance=0.0,
                    relative_tolerance=5.96e-8)


def test_float32_answers_name_the_precision_option_whatever_the_error():
    """Float32 answers make a learner that assumed float64 err by any amount (on one
    machine a float32 head's check measured 4e-3, on another 3e-2): the hint to state the
    precision follows the answers being float32 numbers, not the error's size. Here a
    box of two heads answers in float32, with errors far above rounding's size."""
    rng = np.random.default_rng(7)
    for seed in range(3):
        d = 6
        W = rng.standard_normal((2, d, d))
        v = rng.standard_normal((2, d))
        box = RoundedOutputs(MultiHeadAttention(W, v), "float32")
        with pytest.raises(ModelMismatchError) as info:
            extract_single_head(Oracle(box, d), seed=seed)
        message = str(info.value)
        assert "held-out relative error" in message
        assert "--output-dtype" in message and "float32 numbers" in message, message
