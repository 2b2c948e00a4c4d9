"""Verification over the deployment's domain (issue 23): lengths up to max_length, far
scores, the adversarial search, the learner's own error bar, scale-safe comparisons,
guarded targets, exact query counts and typed journal errors."""

from __future__ import annotations

import json
import math
import sqlite3
import sys
import textwrap

import numpy as np
import pytest

from attnextract import Oracle, extract
from attnextract.testing.impostors import (LEARNER_CASES, make_impostor, recovery_queries,
                                            run_impostor)
from attnextract.adapters.journal import QueryJournal
from attnextract.adapters.targets import random_multi_head, random_single_head
from attnextract.errors import (BlackBoxError, InputError, JournalError, MalformedOutputError,
                                ModelMismatchError, RecoveryFailedError)
from attnextract.models import MultiHeadAttention
from attnextract.oracle import validate_outputs
from attnextract.report import mismatch_reason, verification_count
from attnextract.verification import (DEFAULT_LONGEST, SEARCH_MIN, SEARCH_SHARE,
                                      answers_look_rounded, design, length_grid, safe_norm,
                                      safe_rms, scaled_relative_errors, verify_model)

# an overflow anywhere in a comparison is a bug here, not a warning to scroll past
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

D = 8


def test_length_grid_is_geometric_and_reaches_L():
    grid = length_grid(4096)
    assert grid[0] == 1 and grid[-1] == 4096
    ratios = grid[7:] / grid[6:-1]
    assert ratios.max() <= 1.5 and len(grid) < 40


@pytest.mark.parametrize("max_length", [None, 300, 1000])
def test_design_covers_lengths_up_to_L_and_never_beyond(max_length):
    model = random_single_head(D, 0)
    held = design(D, 64, np.random.default_rng(0), 0.5, model=model, max_length=max_length,
                  probe_length=2)
    lengths = [len(x) for x in held.sequences]
    L = max_length or DEFAULT_LONGEST
    assert max(lengths) == L
    assert held.longest == L
    # several long sequences, not only the one at L
    assert sum(n > L // 4 for n in lengths) >= 3


def test_far_family_puts_every_score_far_from_zero():
    model = random_single_head(D, 3)
    held = design(D, 128, np.random.default_rng(1), 0.5, model=model)
    far = [x for x, f in zip(held.sequences, held.family) if f == "far"]
    assert len(far) >= 4
    below = above = 0
    for X in far:
        s = X @ (model.W @ X[-1])
        rest = s[:-1]                    # the query's own score may stay near 0 (definite W)
        assert np.all(np.abs(rest) >= 8.0)
        assert rest.max() - rest.min() <= 4.0 + 1e-6      # soft attention among them
        below += rest.max() < 0
        above += rest.min() > 0
    assert below and above


def test_oracle_refuses_queries_longer_than_max_length():
    calls = []
    oracle = Oracle(lambda X: calls.append(X.shape) or np.zeros(len(X)), D, max_length=64)
    oracle.query(np.zeros((2, 64, D)))
    with pytest.raises(InputError, match="max_length 64"):
        oracle.query(np.zeros((1, 65, D)))
    assert calls == [(2, 64, D)] and oracle.queries == 2
    with pytest.raises(InputError):
        Oracle(lambda X: X, D, max_length=0)


def test_verification_respects_max_length_and_reports_the_domain():
    model = random_single_head(D, 1)
    oracle = Oracle(model, D, max_length=500)
    result = extract(oracle, "single-head", seed=1)
    check = result.report.verification
    assert check.passed and check.max_length == 500 and check.lengths[1] == 500
    assert check.norms[0] > 0 and check.norms[1] > 100 * check.norms[0]
    count = verification_count(D * D + D, D * D + D)
    assert check.search_queries == max(SEARCH_MIN, int(SEARCH_SHARE * count))
    assert check.own_probes > 0
    assert result.queries == D * D + D + count         # the search is inside the count
    assert "domain" in result.report.render()


@pytest.mark.parametrize("max_length", [2, 3, 5])
def test_single_head_works_within_the_shortest_domains(max_length):
    model = random_single_head(D, 7)
    result = extract(Oracle(model, D, max_length=max_length), "single-head", seed=0)
    assert result.report.verification.lengths[1] == max_length


def test_multi_head_refuses_a_short_max_length_before_any_query():
    model = random_multi_head(2, D, 0)
    oracle = Oracle(model, D, max_length=512)
    with pytest.raises(InputError, match="2048 tokens"):
        extract(oracle, "multi-head", heads=2, seed=0)
    assert oracle.queries == 0


@pytest.mark.parametrize("keep", [257, 1000])
@pytest.mark.parametrize("seed", range(4))
def test_truncated_context_is_refused_and_honest_accepted(keep, seed):
    outcome, _, _ = run_impostor("single-head", f"truncation {keep}", D, seed, 72)
    assert outcome == "refused: ModelMismatchError"
    assert run_impostor("single-head", "honest", D, seed, 72)[0] == "accepted"


@pytest.mark.parametrize("name", ["log-length scaling", "offset above length", "sink far below",
                                  "small rotation", "cubic scores", "quadratic values",
                                  "two heads x1e200"])
@pytest.mark.parametrize("learner", ["single-head", "verify"])
def test_audit_classes_are_refused(name, learner):
    for seed in range(3):
        outcome, _, _ = run_impostor(learner, name, D, seed, 72)
        assert outcome.startswith("refused"), (seed, outcome)


def test_search_walks_towards_the_edge_of_the_domain():
    """An offset that appears only beyond 2000 tokens: the search's sequences reach there."""
    model = random_single_head(D, 2)
    box = make_impostor("offset above length", model, np.random.default_rng(5), 72)
    box.n0 = 2000
    check = verify_model(Oracle(box, D), model, count=64, seed=0)
    assert not check.passed
    assert check.lengths[1] == DEFAULT_LONGEST


@pytest.mark.parametrize("exponent", [-300, -150, 0, 150, 300])
def test_comparisons_are_scale_safe(exponent):
    rng = np.random.default_rng(0)
    observed = rng.standard_normal(50)
    predicted = observed * (1 + 1e-6 * rng.standard_normal(50))   # differences stay normal at 1e-300
    norms = rng.uniform(0.5, 2, 50)
    base = scaled_relative_errors(predicted, observed, norms)
    scaled = scaled_relative_errors(predicted * 10.0 ** exponent, observed * 10.0 ** exponent, norms)
    assert np.all(np.isfinite(scaled))
    np.testing.assert_allclose(scaled, base, rtol=1e-6)


@pytest.mark.parametrize("factor", [1e-300, 1e300])
def test_scaled_honest_head_passes_and_an_extra_head_fails(factor):
    model = random_single_head(D, 4)
    big = type(model)(model.W, model.v * factor)
    assert verify_model(Oracle(big, D), big, count=64, seed=0).passed
    extra = MultiHeadAttention(np.stack([model.W, model.W.T]), np.stack([model.v, 0.3 * model.v[::-1]]) * factor)
    assert not verify_model(Oracle(extra, D), big, count=64, seed=0).passed


@pytest.mark.parametrize("exponent", [-300, -200, 0, 200, 300])
def test_safe_norm_and_rms_match_numpy_at_every_scale(exponent):
    rng = np.random.default_rng(exponent + 1000)
    x = rng.standard_normal((5, 7, 3))
    scaled = x * 10.0 ** exponent
    for axis in (None, 0, 1, 2, (1, 2)):
        want = np.linalg.norm(x.reshape(5, -1), axis=1) if axis == (1, 2) else \
            np.linalg.norm(x, axis=axis) if axis is not None else np.linalg.norm(x.ravel())
        np.testing.assert_allclose(np.asarray(safe_norm(scaled, axis=axis)) / 10.0 ** exponent,
                                   want, rtol=1e-12)
    assert safe_rms(scaled) / 10.0 ** exponent == pytest.approx(
        math.sqrt(float(np.mean(x ** 2))), rel=1e-12)


def test_safe_norm_keeps_zero_and_infinite_vectors():
    x = np.array([[0.0, 0.0], [np.inf, 1.0], [1e308, 1e308]])
    assert list(safe_norm(x, axis=1)[:2]) == [0.0, np.inf]
    assert safe_norm(x, axis=1)[2] == pytest.approx(math.sqrt(2) * 1e308)
    assert safe_norm(np.zeros((0, 3)), axis=1).shape == (0,)


@pytest.mark.parametrize("learner", [name for name, case in LEARNER_CASES.items()])
def test_outputs_of_1e200_are_refused_without_an_overflow(learner):
    """Two heads x 1e200: squared, these outputs overflow float64. Every learner (and
    verify) refuses the box, and no RuntimeWarning (an error in this module) is raised
    on the way: norms and sizes of outputs are computed scaled."""
    outcome, _, box = run_impostor(learner, "two heads x1e200", D, 0, recovery_queries(learner, D))
    assert outcome.startswith("refused"), (learner, outcome)


class _Scaled:
    """An honest model whose every answer is multiplied by ``factor`` (in every class)."""

    def __init__(self, model, factor):
        self.model, self.factor = model, factor

    def __call__(self, X):
        return self.factor * self.model(X)


@pytest.mark.parametrize("factor", [1e-300, 1e300])
@pytest.mark.parametrize("learner", ["single-head", "low-rank", "sign-only", "one-layer",
                                     "single-head --biases"])
def test_learners_accept_honest_models_at_output_scales_1e_minus_300_to_1e300(learner, factor):
    from attnextract.oracle import SignOnly
    honest, run, labels = LEARNER_CASES[learner]
    box = _Scaled(honest(D, 2), factor)
    result = run(Oracle(SignOnly(box) if labels else box, D), 0)
    check = result.report.verification
    assert check is not None and check.passed and check.max_relative_error <= check.tolerance


# outputs of 1e300 x the two-head boxes overflow the box's own answers at the large
# tokens these learners probe with (1e298 does not): that is the top scale for them
SCALED_LEARNERS = ["noisy", "transformer-layer", "multi-head H<=1", "multi-head H<=2",
                   "multi-head H<=2 --biases", "multi-head-low-rank",
                   "multi-head-low-rank --biases"]


@pytest.mark.parametrize("factor", [1e-300, 1e-150, 1e150, 1e298])
@pytest.mark.parametrize("learner", SCALED_LEARNERS)
def test_every_learner_accepts_honest_models_at_extreme_output_scales(learner, factor):
    """The learners that work in absolute numbers (thresholds, squared sums, LAPACK)
    run on answers rescaled exactly by a power of two (oracle.ScaledOutputs): before,
    the Transformer layer refused outputs x 1e-6 or x 1e50, multi-head x 1e-150 (NaN in
    the fits) and x 1e300, the noisy learner x 1e-300. The noisy learner is told its
    noise in the box's units (tolerance x factor)."""
    from attnextract.testing.impostors import NOISY_TOLERANCE
    honest, run, _ = LEARNER_CASES[learner]
    model = honest(D, 2)
    box = _Scaled(model, factor)
    if learner == "noisy":
        result = extract(Oracle(box, D), "single-head", tolerance=NOISY_TOLERANCE * factor, seed=0)
        bar = result.report.details["error_bar_v"]          # in the box's units
        assert safe_norm(result.model.v - factor * model.v) <= bar <= 1e-6 * factor
    else:
        result = run(Oracle(box, D), 0)
    check = result.report.verification
    assert check.passed and check.max_relative_error <= check.tolerance
    # the model is in the box's units: its outputs are the box's, not the rescaled ones
    X = np.random.default_rng(0).standard_normal((16, 5, D)) * 0.5
    assert np.max(np.abs(result.model(X) - box(X))) <= 1e-6 * np.max(np.abs(box(X)))


def test_scaled_outputs_view_is_exact_and_the_identity_at_ordinary_scales():
    from attnextract.models import scale_outputs
    from attnextract.oracle import ScaledOutputs
    model = random_multi_head(2, D, 0)
    X = np.random.default_rng(1).standard_normal((6, 4, D))
    ordinary = ScaledOutputs(Oracle(model, D))
    assert np.array_equal(ordinary.query(X), model(X)) and ordinary.exponent == 0
    tiny = ScaledOutputs(Oracle(_Scaled(model, 1e-200), D))
    assert tiny.query(np.zeros((2, 3, D))).tolist() == [0.0, 0.0]   # zeros fix nothing
    assert tiny.exponent is None
    y = tiny.query(X)
    assert tiny.exponent < -600 and 2.0 ** -10 <= np.abs(y).max() <= 2.0 ** 10
    assert np.array_equal(y * tiny.factor, 1e-200 * model(X))        # every bit kept
    assert tiny.queries == 8 and tiny.longest_probes[0][1] * tiny.factor == \
        tiny.base.longest_probes[0][1]
    back = scale_outputs(model, 1e-200)
    assert np.allclose(back(X), 1e-200 * model(X), rtol=1e-14, atol=0)


def test_a_small_check_keeps_every_family_and_the_search():
    """verification_count with the recovery: within 5% of it, never below 34 (a check
    of 24 and the batch check's 10); a check of 24 still has every family (the hull 4,
    norms and far one at each end) and the adversarial search (6 queries), and still
    refuses what the zoo's 64 did; one of 34 adds the batch check."""
    from attnextract.report import MIN_VERIFY_COUNT
    assert verification_count(32 * 32 + 32, 32 * 32 + 32) == 52       # 4.9% of 1,056
    assert verification_count(480, 480) == 34 == MIN_VERIFY_COUNT    # rank 8 at d = 32
    assert verification_count(72, 72) == 34                            # d = 8: the least
    assert verification_count(64 * 64 + 64) == verification_count(64 * 64 + 64, 10 ** 6) == 64
    for d in (32, 64, 128):
        assert verification_count(d * d + d, d * d + d) <= 0.05 * (d * d + d)
    model = random_single_head(D, 4)
    check = verify_model(Oracle(model, D), model, count=24, seed=0)
    assert check.passed and check.sequences == 24 and check.search_queries == SEARCH_MIN
    assert {"ordinary", "long", "repeated", "norms", "sparse", "peaked", "far", "hull",
            "steps", "search"} <= set(check.family_errors)
    assert check.lengths[1] == DEFAULT_LONGEST
    assert not check.batch_sizes                # no batch check below 34 ...
    check = verify_model(Oracle(model, D), model, count=34, seed=0)
    assert check.passed and check.sequences == 34 and check.batch_sizes == (1, 9)
    assert {"ordinary", "long", "repeated", "norms", "sparse", "peaked", "far", "hull",
            "steps", "search", "batch"} <= set(check.family_errors)       # ... and at 34
    for seed in range(5):                   # the top end, every token there (none mixed in)
        held = design(D, 15, np.random.default_rng(seed), 0.5, model=model)
        ends = [safe_norm(x, axis=1) for x, f in zip(held.sequences, held.family) if f == "norms"]
        assert len(ends) == 2
        low, high = sorted(ends, key=np.max)
        assert high.min() > 30 * low.max() and high.min() > 50.0
    for seed in range(3):
        for name in ("truncation 257", "norm trigger", "sink far below", "cubic scores"):
            box = make_impostor(name, model, np.random.default_rng([seed, 7]), 72)
            assert not verify_model(Oracle(box, D), model, count=24, seed=seed).passed, name


def test_single_head_is_held_to_its_own_error_bar():
    model = random_single_head(D, 6)
    result = extract(Oracle(model, D), "single-head", seed=0)
    check = result.report.verification
    assert check.tolerance < 1e-7 and check.requested_tolerance == 1e-7


@pytest.mark.parametrize("bar", [0.5, 744.0, float("inf")])
def test_a_huge_error_bar_does_not_widen_the_check(bar):
    """A model whose own bar says it is unknown is held to the flat tolerance: a head
    with a wrong W must fail however large the bar it claims."""
    from attnextract.verification import verify_model
    truth = random_single_head(D, 3)
    wrong = type(truth)(truth.W + 0.5 * np.linalg.norm(truth.W) / D, truth.v)
    check = verify_model(Oracle(truth, D), wrong, count=64, seed=0, expected_error=bar)
    assert not check.passed and check.error_bar == 0.0 and check.tolerance == 1e-7


LOW_RANK_TARGET = """
    import numpy as np
    from attnextract import SingleHeadAttention
    rng = np.random.default_rng(0)
    head = SingleHeadAttention(rng.standard_normal((10, 2)) @ rng.standard_normal((2, 10)),
                               rng.standard_normal(10))
    """


def test_verify_holds_a_saved_result_to_its_own_error_bar(tmp_path, capsys):
    """``attnextract verify`` judges a saved model as its learner did: the search's
    large scores show a parameter error of 1e-12 as up to 1e-6 in the output, which
    a flat 1e-7 refuses on some seeds (1 of 40 for this low-rank head)."""
    from attnextract.cli import main
    from attnextract.report import load_result
    spec = _write_target(tmp_path, LOW_RANK_TARGET)
    out = tmp_path / "r.npz"
    assert main(["extract", "--target", spec.replace(":box", ":head"), "--dim", "10", "--model",
                 "low-rank", "--method", "rop", "--rank", "2", "--seed", "1", "--out", str(out),
                 "--no-progress", "--json"]) == 0
    saved = load_result(out).report.verification
    assert 0 < saved.error_bar < 1e-11 and saved.tolerance < saved.requested_tolerance
    capsys.readouterr()
    for seed in range(40):
        code = main(["verify", "--target", spec.replace(":box", ":head"), "--result", str(out),
                     "--seed", str(seed), "--json", "--no-progress"])
        payload = json.loads(capsys.readouterr().out)
        assert code == 0 and payload["ok"], (seed, payload)
        assert payload["error_bar"] == saved.error_bar
        # judged by the saved check's tolerance; the one printed is what every error met
        assert payload["judged_tolerance"] == saved.judged_tolerance
        assert payload["max_relative_error"] <= payload["tolerance"]


@pytest.mark.parametrize("answer, match", [
    (lambda X: np.ones(len(X)) * (1 + 1j), "complex"),
    (lambda X: ["1.5"] * len(X), "strings"),
    (lambda X: [10 ** 400] * len(X), "float64 range"),
    (lambda X: [None] * len(X), "NoneType"),
])
def test_answers_that_are_not_real_numbers_are_typed_errors(answer, match):
    with pytest.raises(MalformedOutputError, match=match):
        Oracle(answer, D).query(np.zeros((2, 3, D)))


def test_validate_outputs_keeps_real_answers():
    np.testing.assert_array_equal(validate_outputs([1, 2.5, np.float32(3)], 3), [1.0, 2.5, 3.0])


def test_sys_exit_in_a_target_is_a_black_box_error():
    def box(X):
        sys.exit(0)
    with pytest.raises(BlackBoxError, match="sys.exit"):
        Oracle(box, D).query(np.zeros((1, 2, D)))


def test_journal_fingerprint_queries_are_counted_and_budgeted(tmp_path):
    model = random_single_head(D, 0)
    need = None
    with QueryJournal(tmp_path / "a.sqlite") as journal:
        oracle = Oracle(model, D, journal=journal)
        result = extract(oracle, "single-head", seed=0)
        need = oracle.queries + oracle.check_queries
        assert oracle.check_queries > 0
        assert result.queries == D * D + D + verification_count(D * D + D, D * D + D) + oracle.check_queries
    served = []

    def box(X):
        served.append(len(X))
        return model(X)
    with QueryJournal(tmp_path / "b.sqlite") as journal:
        oracle = Oracle(box, D, journal=journal, budget=need)
        extract(oracle, "single-head", seed=0)
        assert sum(served) == oracle.queries + oracle.check_queries == need
    with QueryJournal(tmp_path / "c.sqlite") as journal:
        from attnextract.errors import BudgetExceededError
        with pytest.raises(BudgetExceededError):
            extract(Oracle(model, D, journal=journal, budget=need - 1), "single-head", seed=0)


def test_journal_fingerprint_respects_max_length(tmp_path):
    model = random_single_head(D, 0)
    longest = []

    def box(X):
        longest.append(X.shape[1])
        return model(X)
    with QueryJournal(tmp_path / "a.sqlite") as journal:
        oracle = Oracle(box, D, journal=journal, max_length=40)
        result = extract(oracle, "single-head", seed=0)
        assert oracle.check_queries > 0 and result.report.verification.passed
    assert max(longest) == 40


def test_damaged_journal_pages_are_journal_errors(tmp_path):
    model = random_single_head(D, 0)
    path = tmp_path / "j.sqlite"
    with QueryJournal(path) as journal:
        extract(Oracle(model, D, journal=journal), "single-head", seed=0)
    data = path.read_bytes()
    page = 4096
    outcomes = set()
    for k in range(1, len(data) // page):
        damaged = tmp_path / f"d{k}.sqlite"
        body = bytearray(data)
        body[k * page + 8:(k + 1) * page] = bytes([0xA5]) * (page - 8)
        damaged.write_bytes(bytes(body))
        try:
            with QueryJournal(damaged) as journal:
                extract(Oracle(model, D, journal=journal), "single-head", seed=0)
            outcomes.add("ok")
        except JournalError:
            outcomes.add("JournalError")
        except sqlite3.Error as exc:                     # must never escape untyped
            pytest.fail(f"page {k}: raw {type(exc).__name__}: {exc}")
    assert "JournalError" in outcomes


def test_precision_hint_only_where_answers_show_rounding():
    rng = np.random.default_rng(0)
    assert not answers_look_rounded(rng.standard_normal(64))
    assert answers_look_rounded(rng.standard_normal(64).astype(np.float32))
    assert answers_look_rounded(np.round(rng.standard_normal(64), 4))
    assert not answers_look_rounded(1e-150 * rng.standard_normal(64))     # tiny, not 0
    model = random_single_head(D, 2)
    tiny = make_impostor("second head 1e-6", model, np.random.default_rng(0), 72)
    with pytest.raises(ModelMismatchError) as refused:
        extract(Oracle(tiny, D), "single-head", seed=0)
    assert "--output-dtype" not in mismatch_reason(refused.value.result.report.verification)


@pytest.mark.parametrize("learner", ["multi-head-low-rank", "transformer-layer"])
def test_learners_that_take_output_dtype_do_not_suggest_it_for_float64_impostors(learner):
    """The registry names --output-dtype on a refusal only when the kept answers show
    rounding (or too few were asked to tell): a float64 impostor is a mismatch."""
    honest, run, _ = LEARNER_CASES[learner]
    model = honest(D, 1)
    # (default_rng(1) would draw the second head's W equal to the honest W: in the class)
    tiny = make_impostor("second head 1e-6", model, np.random.default_rng([1, D, 23]), 100)
    with pytest.raises((ModelMismatchError, RecoveryFailedError)) as refused:
        run(Oracle(tiny, D), 1)
    assert "output-dtype" not in str(refused.value) and "output_dtype" not in str(refused.value)
    # answers rounded to float32: a refusal may be a precision problem, the hint is given
    window = make_impostor("sliding window 8", model, np.random.default_rng([1, D, 5]), 100)
    box = lambda X: np.asarray(window(X), dtype=np.float32).astype(np.float64)  # noqa: E731
    with pytest.raises((ModelMismatchError, RecoveryFailedError)) as refused:
        run(Oracle(box, D), 1)
    assert "output-dtype" in str(refused.value) or "output_dtype" in str(refused.value)


def _write_target(tmp_path, body):
    path = tmp_path / "target.py"
    path.write_text(textwrap.dedent(body))
    return f"{path}:box"


CLI_TARGETS = {
    "exit": """
        import sys
        def box(X):
            sys.exit(0)
        """,
    "complex": """
        import numpy as np
        def box(X):
            return np.ones(len(X)) * 1j
        """,
    "strings": """
        def box(X):
            return ["1.0"] * len(X)
        """,
    "huge": """
        def box(X):
            return [10 ** 400] * len(X)
        """,
    "hang": """
        import time
        def box(X):
            time.sleep(30)
        """,
}


@pytest.mark.parametrize("kind", sorted(CLI_TARGETS))
def test_cli_bad_targets_get_one_typed_line_and_exit_3(kind, tmp_path, capsys):
    from attnextract.cli import main
    spec = _write_target(tmp_path, CLI_TARGETS[kind])
    code = main(["extract", "--target", spec, "--dim", "4", "--out", str(tmp_path / "r.npz"),
                 "--json", "--no-progress", "--target-timeout", "1"])
    out, err = capsys.readouterr()
    assert code == 3
    payload = json.loads(out)                       # exactly one JSON object
    assert payload["ok"] is False and payload["error"] in ("BlackBoxError", "MalformedOutputError")
    assert len([line for line in err.splitlines() if line.startswith("attnextract:")]) == 1


def test_cli_printing_target_keeps_json_one_object(tmp_path, capsys):
    from attnextract.cli import main
    spec = _write_target(tmp_path, """
        import numpy as np
        print("hello at import")
        rng = np.random.default_rng(0)
        W = rng.standard_normal((4, 4)) / 2
        v = rng.standard_normal(4)
        def box(X):
            print("hello from the target")
            s = np.einsum("bnd,bd->bn", X, X[:, -1] @ W.T)
            a = np.exp(s - s.max(axis=1, keepdims=True))
            a /= a.sum(axis=1, keepdims=True)
            return np.einsum("bn,bnd,d->b", a, X, v)
        """)
    code = main(["extract", "--target", spec, "--dim", "4", "--out", str(tmp_path / "r.npz"),
                 "--json", "--no-progress", "--max-length", "600"])
    out, err = capsys.readouterr()
    assert code == 0
    payload = json.loads(out)
    assert payload["ok"] and payload["verification"]["max_length"] == 600
    assert "hello from the target" in err and "hello at import" in err
