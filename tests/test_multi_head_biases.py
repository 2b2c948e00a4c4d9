"""Full-rank multi-head attention with query, value and output biases (issue 26).

f(X) = sum_h softmax(X (W_h x_N + b_h))^T X v_h + c, learned by `multi-head --biases`
(``extract_multi_head(..., biases=True)``): c = f([0]) and the row fits affine in the
column, t_h = u^T (W_h q + b_h). Every head's W_h, b_h, v_h (canonical form) and c
within 1e-10 relative; queries within the biased count, paper 2's count plus c and
H + 1 more samples per short-probe row (4Hd^2 - 2H + 1 + (H + 1) d + 1), and within 1.1x
the bias-free run's on the same heads plus H d. The
20-seed grid over H in {2, 4, 8}, d in {8, 16} is slow
(benchmarks/bench_multi_head_biases.py runs it; its latest run is in
benchmarks/results/bench_multi_head_biases.md).
"""

import numpy as np
import pytest

from attnextract import extract
from attnextract.adapters.targets import random_multi_head, with_biases
from attnextract.errors import InputError, ModelMismatchError, RecoveryFailedError
from attnextract.learners.multi_head import biased_count, extract_multi_head, paper2_count
from attnextract.learners.multi_head.canonical import biased_canonical_errors
from attnextract.models import BiasedMultiHeadAttention, MultiHeadAttention
from attnextract.oracle import Oracle, RoundedOutputs
from attnextract.report import load_model, save_result, verification_count
from conftest import grid

BIAS_SCALES = (1.0, 5.1, 0.0, 0.3)      # 5.1: MiniLM layer 2's |b_q|; 0: exactly bias-free


def biased_heads(H, d, seed):
    """The benchmark grid's box: generic heads, |b_h| cycling through BIAS_SCALES,
    c = 0 on every fifth seed."""
    heads = random_multi_head(H, d, seed=10_000 * H + 100 * d + seed)
    return with_biases(heads, seed, bias_scale=BIAS_SCALES[seed % 4],
                       c=0.0 if seed % 5 == 0 else None)


def check(H, d, seed, goal=1e-10):
    """Run the biased learner; assert its accuracy and its count."""
    truth = biased_heads(H, d, seed)
    oracle = Oracle(truth, d)
    result = extract_multi_head(oracle, H, seed=seed, biases=True)
    errors = biased_canonical_errors(result.model, truth)
    assert isinstance(result.model, BiasedMultiHeadAttention)
    assert errors["heads"] == (H, H)
    assert max(errors["W"], errors["b"], errors["v"], errors["c"]) <= goal, errors
    # verification included; the count is within 1.1x paper 2's + H d from d = 8 on
    cap = biased_count(H, d)
    assert oracle.queries <= cap <= 1.1 * (paper2_count(H, d) + H * d)
    report = result.report
    assert report.details["count with biases"] == cap
    if report.details["short probes"].endswith(", kept"):
        # the short probes spend what the count leaves (verification included) to
        # within d - 1 queries, d rows of equal length
        assert cap - d < oracle.queries
        assert report.breakdown["short probes"] % d == 0
    assert report.floor == H * (d * d + 2 * d) + 1
    assert report.kind == "biased-multi-head"
    assert report.breakdown["v tokens and c = f([0])"] == d + 1
    assert report.verification.passed
    return result, errors


@pytest.mark.parametrize("H, d, seed, short", [(2, 8, 0, False), (2, 8, 1, False),
                                               (4, 8, 2, False), (3, 8, 5, False),
                                               (2, 16, 6, True)])
def test_biased_heads_recovered(H, d, seed, short):
    """``short``: whether the short probes run (they need the bias-free run's
    1.25 H (d + 1) plus H + 1 queries per row left in the count: at H = 2, d = 8 16 per
    row of 25.5 are left, at H = 3, d = 8 36 of 37.75, at H = 4, d = 8 45 of 50, as the
    bias-free runs on these heads have 10, 25 and 40 of their 22.5, 33.75 and 45; at
    H = 2, d = 16 58 of 45.5, the bias-free run 55 of 42.5)."""
    result, _ = check(H, d, seed)
    if short is not None:
        assert result.report.details["short probes"].endswith(", kept") == short


@pytest.mark.parametrize("seed, heads", [(0, None), (14, 8)])
def test_trained_bias_heads_of_head_dim_one(seed, heads):
    """nn.MultiheadAttention(8, 8) (head_dim 1) with trained N(0, 1) biases, as float64
    heads (issue 22), both refused before. Seed 0 (not told): on the base row's designed
    column W_h q_0 + b_h nearly cancel, so |W_h q_0 + b_h| / |q_0| understates how far a
    column move moves the steps (17x on the torch box of seed 0); round 2's moves
    crossed steps, and a row fit stopped in a wrong basin (residual 1.4e4 x the output
    precision, moves 0.98 of the gap); the base columns' measured |W_h^T u_0| / |u_0|
    bounds the moves. Seed 14 (told): the base row's nudged columns were orthogonal to
    q_0, which with biases left their moves of rank d - 1 < H (the designed column
    missed, base estimate error 1.9, two designs refused); they span q_0 too now."""
    import torch  # noqa: F401  (a test-all package: see conftest.py)
    import user_boxes as ub
    layer = ub.torch_layer(8, 8, seed=seed, float64=True, trained_biases=True)
    truth = BiasedMultiHeadAttention(*ub.torch_truth(layer, ub.unit_readout(8, 0)))
    oracle = Oracle(truth, 8)
    result = extract_multi_head(oracle, heads, seed=0, biases=True)
    errors = biased_canonical_errors(result.model, truth)
    assert errors["heads"] == (8, 8)
    assert max(errors["W"], errors["b"], errors["v"], errors["c"]) <= 1e-10, errors
    assert result.report.details["column moves / gap (median, max)"][1] <= 0.5
    assert result.report.details["base estimate relative error"] <= 1e-4
    assert oracle.queries <= biased_count(8, 8)


def test_biased_count_is_paper2_plus_what_the_biases_add():
    """The biased learner's count: paper 2's 4Hd^2 - 2H + 1 plus c and H + 1 more samples
    in each of the d short-probe rows, (H + 1) d + 1, at most 1.1x paper 2's count + H d
    (binding only at d <= 3, one head) and at least the floor H(d^2 + 2d) + 1 plus the
    verification from d = 5 (d = 4 with two heads or more)."""
    assert [biased_count(H, d) for H, d in [(1, 8), (2, 8), (8, 8), (4, 16), (12, 32)]] == [
        272, 534, 2106, 4170, 49546]
    assert biased_count(1, 3) == 41 < 35 + 2 * 3 + 1                # capped: 1.1 x 38
    for d in range(2, 65):
        for H in range(1, min(d, 12) + 1):
            derived = paper2_count(H, d) + (H + 1) * d + 1
            bound = 1.1 * (paper2_count(H, d) + H * d)
            assert biased_count(H, d) == min(derived, int(bound))
            assert biased_count(H, d) == derived or (d <= 3 and H == 1)
            floor = H * (d * d + 2 * d) + 1
            if d >= 5 or (d == 4 and H >= 2):
                assert biased_count(H, d) >= floor + verification_count(floor), (H, d)


@pytest.mark.parametrize("H, d, seed", [(2, 8, 0), (2, 8, 1), (4, 8, 0), (8, 8, 3), (8, 8, 18)])
def test_biased_run_within_1_1x_the_bias_free_run_plus_hd(H, d, seed):
    """Issue 26: the same heads with and without biases, the same learner seed: the
    biased run spends at most 1.1x the bias-free run's queries + H d (verification
    included in both). H = d = 8, seed 3: the bias-free run skips its short probes (87
    per row left of 90) and ends 120 queries below its count; with the count at paper 2's
    + 4Hd + 1 the biased run spent it all (1.158x); at paper 2's + (H + 1) d + 1 it is
    1.065x. H = 2, d = 8: 1.111x and 1.119x before, 1.010x and 1.018x now. H = d = 8,
    seed 18 (b_h = 0): both runs skip the short probes and take the wide columns; one
    biased row's columns reach |q| = 2334, whose answers round hundreds of times more:
    unweighted, its residual was 24x the floor and the run was refused; weighted by their
    rounding (:meth:`wide_weights`) 2.9e-12, 0.968x."""
    truth = biased_heads(H, d, seed)
    plain = Oracle(MultiHeadAttention(truth.W, truth.v), d)
    plain_result = extract_multi_head(plain, H, seed=seed)
    assert plain_result.report.verification.passed
    oracle = Oracle(truth, d)
    result = extract_multi_head(oracle, H, seed=seed, biases=True)
    errors = biased_canonical_errors(result.model, truth)
    assert max(errors["W"], errors["b"], errors["v"], errors["c"]) <= 1e-10, errors
    assert oracle.queries <= 1.1 * (plain.queries + H * d), (oracle.queries, plain.queries)
    assert oracle.queries <= biased_count(H, d) <= paper2_count(H, d) + (H + 1) * d + 1


def test_biased_short_probes_at_eight_heads_with_a_crowded_base_row():
    """H = d = 8, a box whose base rows crowd (the designed column rescans them): with
    the cap at paper 2's count + H d + 1 and the base search spending the biases' share,
    its short probes were skipped (58 per row left, 100 needed) and it ended at 1.4e-10.
    With the base stage at paper 2's share they run and are kept (2.3e-14 by default),
    the count spent to within d - 1 (verification included). Whether they fit depends on
    the designed column's scans: under OpenBLAS Haswell one more batch of its columns
    (300 queries, not 250) leaves 96 per row where 99 are needed, the short probes are
    skipped and the run ends at 2.3e-12 within its bar; the promise is the run's bar
    and count, and the short probes' 1e-11 where they are kept."""
    H, d, seed = 8, 8, 16
    truth = biased_heads(H, d, seed)
    oracle = Oracle(truth, d)
    result = extract_multi_head(oracle, H, seed=seed, biases=True)
    assert result.report.breakdown["base columns"] > 0       # the designed column ran
    assert oracle.queries <= biased_count(H, d)
    errors = biased_canonical_errors(result.model, truth)
    worst = max(errors["W"], errors["b"], errors["v"], errors["c"])
    assert worst <= min(1e-10, result.report.details["error bar"]), errors
    short = result.report.details["short probes"]
    if short.endswith(", kept"):
        assert biased_count(H, d) - d < oracle.queries
        assert worst <= 1e-11, errors
    else:
        assert short.startswith("skipped ("), short


def test_biased_short_probes_with_large_intercepts():
    """H = d = 8, |b_h| = 5.1 (MiniLM's |b_q|): the short probes' intercepts a u^T b_h
    make the box's scores hundreds, whose rounding the expected rounding includes
    (without that term this run's row residual measured 18.7x the expected rounding and
    seed 11's 33x, above the misfit allowed; with it 1.6x and 2.1x). Kept, the count
    spent to within d - 1, within its error bar and 1e-11 (1.1e-12 with numpy's SIMD at
    X86_V3 or below, 7e-13 above; with the short probes skipped 1e-10)."""
    import re
    H, d, seed = 8, 8, 9
    assert BIAS_SCALES[seed % 4] == 5.1
    truth = biased_heads(H, d, seed)
    result = extract_multi_head(Oracle(truth, d), H, seed=seed, biases=True)
    short = result.report.details["short probes"]
    assert short.endswith(", kept"), short
    assert float(re.search(r"residual ([0-9.]+) x", short).group(1)) <= 4.0
    errors = biased_canonical_errors(result.model, truth)
    worst = max(errors["W"], errors["b"], errors["v"], errors["c"])
    assert worst <= min(1e-11, result.report.details["error bar"]), errors


@pytest.mark.slow
@pytest.mark.parametrize("H, d, seeds", [(2, 8, 20), (4, 8, 20), (8, 8, 20), (2, 16, 20),
                                        (4, 16, grid(20, 10)), (8, 16, grid(20, 5))])
def test_biased_heads_over_twenty_seeds(H, d, seeds):
    """20 seeds (in CI 10 and 5 at d = 16 with 4 and 8 heads, all 20 in
    benchmarks/test_grids.py and bench_multi_head_biases.py): every run within 1e-10 and
    its own error bar, within the biased count (verification included), and with the
    short probes sent at d = 16 in every run of one design. At d = 8 they run where the
    bias-free run's would (1.25 H (d + 1) + H + 1 per row left): in 0, 3 and 12 of 20
    runs at H = 2, 4 and 8 (the bias-free runs keep them in 0, 6 and 9;
    benchmarks/bench_multi_head_biases.py, the run is in the git history); elsewhere the wide columns (weighted by their
    answers' rounding with biases) take the boxes to 2e-14 to 4e-11."""
    for seed in range(seeds):
        truth = biased_heads(H, d, seed)
        oracle = Oracle(truth, d)
        result = extract_multi_head(oracle, H, seed=seed, biases=True)
        errors = biased_canonical_errors(result.model, truth)
        worst = max(errors["W"], errors["b"], errors["v"], errors["c"])
        assert errors["heads"] == (H, H), seed
        assert worst <= min(1e-10, result.report.details["error bar"]), (seed, errors)
        assert oracle.queries <= biased_count(H, d), seed
        if d >= 16 and result.report.details.get("designs tried", 1) == 1:
            assert not result.report.details["short probes"].startswith("skipped"), seed


def test_a_bias_free_box_is_learned_with_biases_too():
    H, d = 2, 8
    truth = random_multi_head(H, d, seed=3)
    result = extract_multi_head(Oracle(truth, d), H, seed=3, biases=True)
    m = result.model
    assert isinstance(m, BiasedMultiHeadAttention)
    errors = biased_canonical_errors(m, truth)
    assert max(errors["W"], errors["b"], errors["v"]) <= 1e-10
    assert abs(m.c) <= 1e-13 * np.max(np.abs(truth.v))


def test_equal_W_with_different_biases_are_two_heads_and_equal_both_merge():
    """Canonical form with biases: heads merge only when W_h and b_h both agree."""
    d = 8
    base = random_multi_head(3, d, seed=11)
    rng = np.random.default_rng(11)
    W = base.W.copy()
    W[1] = W[0]                                           # same W, different b
    b = np.einsum("hij,hj->hi", W, rng.standard_normal((3, d)))
    truth = BiasedMultiHeadAttention(W, base.v, b, 0.4)
    result = extract_multi_head(Oracle(truth, d), 3, seed=11, biases=True)
    errors = biased_canonical_errors(result.model, truth)
    assert errors["heads"] == (3, 3)
    assert max(errors["W"], errors["b"], errors["v"], errors["c"]) <= 1e-10
    # b_1 = b_0 too: one canonical head with v_0 + v_1
    b[1] = b[0]
    merged = BiasedMultiHeadAttention(W, base.v, b, 0.4)
    assert biased_canonical_errors(merged, merged)["heads"] == (2, 2)
    result = extract_multi_head(Oracle(merged, d), 3, seed=11, biases=True)
    errors = biased_canonical_errors(result.model, merged)
    assert errors["heads"] == (2, 2)
    assert max(errors["W"], errors["b"], errors["v"], errors["c"]) <= 1e-10


def test_biased_canonical_errors_see_each_part():
    truth = with_biases(random_multi_head(2, 6, seed=1), 1)
    same = biased_canonical_errors(truth, truth)
    assert same["heads"] == (2, 2) and max(same["W"], same["b"], same["v"], same["c"]) == 0
    swapped = BiasedMultiHeadAttention(truth.W[::-1], truth.v[::-1], truth.b[::-1], truth.c)
    assert max(biased_canonical_errors(swapped, truth)[k] for k in "Wbvc") == 0
    for part, nudged in [("b", BiasedMultiHeadAttention(truth.W, truth.v, truth.b * 1.001, truth.c)),
                         ("c", BiasedMultiHeadAttention(truth.W, truth.v, truth.b, truth.c + 1e-3))]:
        errors = biased_canonical_errors(nudged, truth)
        assert errors[part] > 1e-5 and errors["W"] == 0 and errors["v"] == 0


@pytest.mark.parametrize("seed, part", [(0, "query bias"), (1, "output constant"),
                                        (2, "both")])
def test_a_biased_box_is_refused_without_biases_with_a_hint(seed, part):
    H, d = 2, 8
    heads = random_multi_head(H, d, seed=seed)
    box = with_biases(heads, seed, bias_scale=0.0 if part == "output constant" else 1.0,
                      c=0.0 if part == "query bias" else 0.7)
    with pytest.raises((ModelMismatchError, RecoveryFailedError), match="--biases"):
        extract(Oracle(box, d), model="multi-head", heads=H, seed=seed)


def test_bad_bias_options():
    box = with_biases(random_multi_head(2, 8, seed=0), 0)
    with pytest.raises(InputError, match="biases"):
        extract_multi_head(Oracle(box, 8), 2, biases="yes")
    with pytest.raises(InputError, match="subspaces"):
        extract_multi_head(Oracle(box, 8), subspaces=[[0, 1], [2, 3]], biases=True)


def test_result_file_keeps_b_and_c(tmp_path):
    H, d = 2, 8
    truth = biased_heads(H, d, 1)
    result = extract(Oracle(truth, d), model="multi-head", heads=H, biases=True, seed=1)
    path = tmp_path / "heads.npz"
    save_result(path, result)
    model = load_model(path)
    assert isinstance(model, BiasedMultiHeadAttention)
    np.testing.assert_array_equal(model.b, result.model.b)
    assert model.c == result.model.c
    assert result.options["biases"] is True


def test_float32_box_within_its_error_bar_or_refused():
    """A biased box rounding its outputs to float32: the error bar covers the error, or
    the learner refuses naming the precision (never a silently wrong model)."""
    H, d = 2, 8
    for seed in range(3):
        truth = biased_heads(H, d, seed)
        try:
            result = extract_multi_head(Oracle(RoundedOutputs(truth), d), H, seed=seed,
                                        biases=True)
        except RecoveryFailedError:
            continue
        errors = biased_canonical_errors(result.model, truth)
        assert max(errors["W"], errors["b"], errors["v"]) <= result.report.details["error bar"]
        assert result.report.details["output precision"] == "float32"


@pytest.mark.slow               # a CLI subprocess
def test_cli_multi_head_with_biases(tmp_path):
    import json
    from conftest import run_cli
    target = tmp_path / "box.py"
    target.write_text(
        "from attnextract.adapters.targets import random_multi_head, with_biases\n"
        "box = with_biases(random_multi_head(2, 8, seed=4), 4, bias_scale=2.0)\n")
    out = tmp_path / "heads.npz"
    proc = run_cli("extract", "--target", f"{target}:box", "--dim", "8", "--model",
                   "multi-head", "--heads", "2", "--biases", "--out", out, "--json",
                   "--no-progress", "--seed", "1", check=0)
    report = json.loads(proc.stdout)
    assert report["kind"] == "biased-multi-head"
    truth = with_biases(random_multi_head(2, 8, seed=4), 4, bias_scale=2.0)
    errors = biased_canonical_errors(load_model(out), truth)
    assert max(errors["W"], errors["b"], errors["v"], errors["c"]) <= 1e-10
    refused = run_cli("extract", "--target", f"{target}:box", "--dim", "8", "--model",
                      "multi-head", "--heads", "2", "--no-progress",
                      "--out", tmp_path / "plain.npz", "--seed", "1")
    assert refused.returncode != 0 and "--biases" in refused.stderr


def test_head_count_found_with_biases():
    """heads=None: the count is found from the base rows, as without biases."""
    truth = with_biases(random_multi_head(3, 8, seed=2), 2)
    result = extract_multi_head(Oracle(truth, 8), None, seed=2, biases=True)
    errors = biased_canonical_errors(result.model, truth)
    assert errors["heads"] == (3, 3)
    assert max(errors["W"], errors["b"], errors["v"], errors["c"]) <= 1e-10


@pytest.mark.parametrize("case", ["output constant 1e3", "query biases 20x", "one biased head",
                                  "tiny v_0"])
def test_adversarial_biased_boxes(case):
    """A constant far above the heads, biases 20x W's scale (|u^T b_h| far beyond the
    window unless the rows shrink), a bias in one head only, a head 1000x weaker: learned
    within 1e-10 (the weak head: within its error bar) or, for the weak head, refused;
    never a model outside its own error bar."""
    t = with_biases(random_multi_head(3, 8, seed=1), 1)
    W, v, b, c = t.W, t.v.copy(), t.b.copy(), t.c
    if case == "output constant 1e3":
        c = 1e3
    elif case == "query biases 20x":
        b = 20 * b
    elif case == "one biased head":
        b[1:], c = 0.0, 0.0
    else:
        v[0] *= 1e-3
    box = BiasedMultiHeadAttention(W, v, b, c)
    try:
        result = extract_multi_head(Oracle(box, 8), 3, seed=1, biases=True)
    except RecoveryFailedError:
        assert case == "tiny v_0"
        return
    errors = biased_canonical_errors(result.model, box)
    worst = max(errors["W"], errors["b"], errors["v"], errors["c"])
    assert worst <= result.report.details["error bar"]
    assert worst <= 1e-10 or case == "tiny v_0"


def test_a_constant_box_has_no_heads_and_its_c():
    d = 8
    box = BiasedMultiHeadAttention(np.zeros((1, d, d)), np.zeros((1, d)), np.zeros((1, d)), 0.5)
    result = extract_multi_head(Oracle(box, d), 2, seed=0, biases=True)
    assert isinstance(result.model, BiasedMultiHeadAttention)
    assert result.model.heads == 0 and result.model.c == 0.5
    assert result.report.verification.passed
