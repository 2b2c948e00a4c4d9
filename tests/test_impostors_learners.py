"""Every learner against the impostor zoo (attnextract.testing.impostors).

Each impostor changes one thing of an honest model of the learner's class and carries
the reason it is outside the class. A learner must refuse it (a typed error), never
return it, and must accept the honest model. The fast set runs a few impostors per
learner (rotating through the zoo); the slow set the whole zoo at d = 8 on one seed.
The 20-seed sweeps at d in {8, 32} are benchmarks/bench_impostors.py
(benchmarks/results/bench_impostors.md).
"""

import math

import numpy as np
import pytest

from attnextract import ModelMismatchError, MultiHeadAttention, Oracle
from attnextract.testing import impostors
from attnextract.testing.impostors import (LEARNER_CASES, SAME_LABELS, impostor_names,
                                            make_impostor, recovery_queries, run_impostor, zoo)
from attnextract.adapters.targets import random_single_head
from attnextract.learners.one_layer import random_one_layer
from attnextract.learners.transformer_layer import random_transformer_layer
from attnextract.report import verify_model

D = 8
_RECOVERY = {}

# an overflow anywhere (outputs of 1e200 squared) is a bug here, not a warning
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def recovery(learner, d=D):
    if (learner, d) not in _RECOVERY:
        _RECOVERY[learner, d] = recovery_queries(learner, d)
    return _RECOVERY[learner, d]


def assert_refused(learner, name, d, seed):
    outcome, _, box = run_impostor(learner, name, d, seed, recovery(learner, d))
    assert outcome.startswith("refused"), (learner, name, seed, outcome, box.reason)


# the fast set: one impostor per learner, rotating through the zoo, plus the second
# head at 1e-8 (the hardest) where the second layer is new
FAST_LEARNERS = [n for n in LEARNER_CASES if n != "multi-head H<=2"]
FAST = [(learner, impostor_names(learner)[(5 * i) % len(impostor_names(learner))])
        for i, learner in enumerate(FAST_LEARNERS)]
FAST += [(learner, "second head 1e-8") for learner in ("multi-head H<=1", "one-layer")]


@pytest.mark.parametrize("learner, name", FAST)
def test_impostor_refused_by_learner(learner, name):
    assert_refused(learner, name, D, seed=0)


@pytest.mark.parametrize("learner", ["sign-only", "multi-head H<=1", "one-layer",
                                     "transformer-layer"])
def test_honest_model_accepted(learner):
    outcome, _, _ = run_impostor(learner, "honest", D, 3, recovery(learner))
    assert outcome == "accepted", (learner, outcome)


# the slowest learners take every k-th impostor (offset by the seed) to keep this short
STRIDE = {"multi-head H<=2": 3, "sign-only": 2}


@pytest.mark.slow
@pytest.mark.parametrize("learner", list(LEARNER_CASES))
def test_whole_zoo_refused_by_learner(learner):
    outcome, _, _ = run_impostor(learner, "honest", D, 1, recovery(learner))
    assert outcome == "accepted", (learner, outcome)
    names = impostor_names(learner)[1 % STRIDE.get(learner, 1)::STRIDE.get(learner, 1)]
    missed = [name for name in names
              if not run_impostor(learner, name, D, 1, recovery(learner))[0].startswith("refused")]
    known = KNOWN_MISSES.get(learner, set())
    assert not set(missed) - known, f"{learner} did not refuse {missed} at d = {D}"


# measured limits, kept visible (none now: sign-only's label check hinges labels on
# large and tiny tokens with attention weight, so a clip of large tokens' values and
# tiny tokens taken for padding flip them)
KNOWN_MISSES: dict = {}


# the zoo's norm classes at other sizes (SIZED): refused, or acting only outside the
# token norms the report states as verified (a clip above its largest, padding below
# its smallest); honest controls at the same seeds accepted
SIGN_ONLY_SIZED = [n for n in impostors.SIZED if "float32" not in n]     # labels keep float32's sign


def _limit_outside_verified(box, result) -> bool:
    """The box acts only where the report does not claim to have seen it: padding below
    the smallest verified norm; a clip that changes no verified token by more than the
    10% a hinge label resolves (a clip above 0.9 x the largest verified norm)."""
    low, high = result.report.verification.norms
    return (box.limit > 0.9 * high if isinstance(box, impostors.LargeTokenClip)
            else box.limit < low)


@pytest.mark.slow
@pytest.mark.parametrize("d", [4, 8, 16])
def test_sign_only_refuses_norm_classes_at_several_sizes(d):
    rec = recovery("sign-only", d)
    for seed in range(2):
        outcome, _, _ = run_impostor("sign-only", "honest", d, seed, rec)
        assert outcome == "accepted", (d, seed, outcome)
        for name in SIGN_ONLY_SIZED:
            outcome, result, box = run_impostor("sign-only", name, d, seed, rec)
            assert outcome.startswith("refused") or (
                outcome == "accepted" and _limit_outside_verified(box, result)), (name, d, seed)


def test_sign_only_states_the_norms_its_labels_hinged_on():
    """A clip of large tokens far beyond every token sent is in the class where checked:
    accepted, with a verified range that stops below it; the range spans tiny to large."""
    outcome, result, box = run_impostor("sign-only", "honest", D, 0, recovery("sign-only"))
    v = result.report.verification
    ordinary = 1.0                          # the label check's ordinary token norm
    assert v.norms[0] <= 1e-5 * ordinary and v.norms[1] >= 1e3 * ordinary
    assert v.family_sequences["hinge"] >= 16 and 0 < v.coverage["hinge"] < 0.2
    assert "verified token norms" in result.report.details
    far = impostors.LargeTokenClip(random_single_head(D, 0), np.random.default_rng(0), 1e4)
    from attnextract.learners.sign_only import extract_sign_only
    from attnextract.oracle import SignOnly
    kept = extract_sign_only(Oracle(SignOnly(far), D), seed=0)
    assert kept.report.verification.norms[1] < far.limit


def test_every_impostor_has_a_reason_and_differs_from_its_model():
    """Each impostor states why it is outside the class, and answers differently from
    the honest model somewhere in the verification design (or after its switch)."""
    from attnextract.oracle import evaluate_ragged
    from attnextract.verification import design
    rng = np.random.default_rng(0)
    for model in (random_single_head(D, 0), random_one_layer(D, D, 0),
                  random_transformer_layer(D, 2 * D, 0, bias_scale=0.5, c0=0.2)):
        held = design(D, 128, rng, 0.5, probe_length=2).sequences
        honest = evaluate_ragged(model, held)
        for name in zoo(model):
            box = make_impostor(name, model, np.random.default_rng(1), 10)
            assert len(box.reason) > 20, name
            if "switch" in name:
                continue
            gap = np.abs(evaluate_ragged(box, held) - honest).max()
            assert gap > 1e-12, (name, type(model).__name__)


def test_label_only_boxes_skip_sign_preserving_impostors():
    assert not SAME_LABELS & set(impostor_names("sign-only"))
    assert SAME_LABELS <= set(impostor_names("single-head"))
    # value bias is in the class of a Transformer layer with biases (b absorbs it)
    assert "value bias" not in impostor_names("transformer-layer")


# -- the second layer: model-free hull checks ------------------------------------------

def test_hull_of_a_one_head_multi_head_model_catches_a_second_head_at_1e_8():
    """A one-head model stored as MultiHeadAttention gets the single-head hull: a second
    head at 1e-8 (absorbed into v by length-1 answers, as a learner's v would be) errs by
    ~1e-8 < the 1e-7 tolerance on every plain family, and is caught by the hull alone."""
    caught = 0
    for seed in range(4):
        head = random_single_head(D, seed)
        box = impostors.SecondHead(head, np.random.default_rng(100 + seed), 1e-8)
        v_seen = head.v + box.v2                # what f([x]) = (v + v2)^T x shows
        model = MultiHeadAttention(head.W[None], v_seen[None])
        check = verify_model(Oracle(box, D), model, count=64, seed=seed)
        assert check.max_relative_error <= check.tolerance    # the plain families miss it
        caught += check.hull_violation > check.hull_tolerance
        honest = verify_model(Oracle(head, D), MultiHeadAttention(head.W[None], head.v[None]),
                              count=64, seed=seed)
        assert honest.passed and honest.hull_violation <= honest.hull_tolerance
    assert caught == 4


def test_ffn_hull_catches_a_second_head_the_plain_families_miss():
    """One-layer models: inside one linear region of the FFN the layer is a single head;
    the hull pairs there see a second head at 1e-8 with its own value map that the
    relative-error families (tolerance 1e-7) cannot."""
    caught = 0
    for seed in range(4):
        model = random_one_layer(D, D, seed)
        box = impostors.SecondHead(model, np.random.default_rng(100 + seed), 1e-8)
        # what single tokens show: A (I + eps R), as a learner recovers it
        seen = type(model)(model.W, model.A @ (np.eye(D) + box.R), model.w)
        check = verify_model(Oracle(box, D), seen, count=64, seed=seed)
        assert check.max_relative_error <= check.tolerance
        caught += check.hull_violation > check.hull_tolerance
        honest = verify_model(Oracle(model, D), model, count=64, seed=seed)
        assert honest.passed and honest.hull_violation <= honest.hull_tolerance
    assert caught == 4


def test_sign_only_boundary_sequences_sit_next_to_the_boundary():
    from attnextract.verification import near_boundary
    head = random_single_head(D, 0)
    allowance = lambda X: np.full(len(X), 1e-9)            # noqa: E731
    seqs = near_boundary(head, 16, np.random.default_rng(0), 1 / math.sqrt(D), 0.0, allowance)
    f = np.array([head(x[None])[0] for x in seqs])
    assert len(seqs) == 16
    assert np.all(np.abs(f) >= 1.9e-9) and np.all(np.abs(f) <= 30.1e-9)
    assert (f > 0).any() and (f < 0).any()


def test_replay_refuses_a_box_that_switched_to_another_member_of_the_class():
    """The box answers as head A for the learner's first queries, then as head B: the
    final model can match B on every fresh sequence; the re-asked learner queries show
    the switch."""
    a, b = random_single_head(D, 0), random_single_head(D, 1)
    state = {"n": 0}

    def box(X):
        out = a(X) if state["n"] < 20 else b(X)
        state["n"] += len(X)
        return out

    oracle = Oracle(box, D)
    oracle.query(np.random.default_rng(0).standard_normal((20, 3, D)))     # A's answers, kept
    check = verify_model(oracle, b, count=64, seed=0)
    # the re-asked queries show the switch (and the kept longest probes, answered by A,
    # disagree with the model of B too)
    assert not check.passed and check.worst_family in ("replay", "own")
    assert check.family_errors["replay"] > check.tolerance
    assert len(oracle.replay) == 16
    fresh = Oracle(b, D)
    fresh.query(np.random.default_rng(0).standard_normal((20, 3, D)))
    assert verify_model(fresh, b, count=64, seed=0).passed


def test_noisy_learner_refuses_infinite_error_bars():
    from attnextract.learners.noisy import extract_noisy
    head = random_single_head(D, 0)
    box = impostors.AttentionSink(head, np.random.default_rng(0))
    with pytest.raises(ModelMismatchError):
        extract_noisy(Oracle(box, D), tolerance=1e-10, seed=0)


def test_label_hull_sequences_take_their_tokens_label():
    """The label hull: pool tokens sit just off the threshold, alone; a sequence of one
    side's tokens takes that side's label for an honest head whatever W is (a convex
    combination), and a second head at 1e-8 flips some of them."""
    from attnextract.learners.sign_only import label_hull
    flipped = 0
    for seed in range(4):
        head = random_single_head(D, seed)
        unit = type(head)(head.W, head.v / np.linalg.norm(head.v))   # t = 0: v's direction
        for threshold, model in ((0.0, unit), (0.3, head)):
            hull = label_hull(model, 48, np.random.default_rng(seed), 1 / math.sqrt(D),
                              threshold, 1e-14)
            pool = [X for X, singles in hull if singles is None]
            assert len(pool) == 16
            side = np.array([head(X[None])[0] > threshold for X in pool])
            assert side.any() and not side.all()
            box = impostors.SecondHead(head, np.random.default_rng(seed), 1e-8)
            for X, singles in hull:
                if singles is not None:
                    assert (head(X[None])[0] > threshold) == side[singles[0]]
                    assert side[singles].all() == side[singles].any()
                    flipped += (box(X[None])[0] > threshold) != side[singles[0]]
    assert flipped > 0


def test_a_model_far_outside_its_own_error_bar_is_refused():
    """A third head at 1e-8 behind two low-rank heads: held-out errors ~1e-8, under the
    1e-7 tolerance, but 1e4 x what the model's own error bar allows (this seed was
    accepted before verification held models to their bar)."""
    assert_refused("multi-head-low-rank", "second head 1e-8", D, seed=2)
    outcome, result, _ = run_impostor("multi-head-low-rank", "honest", D, 2,
                                      recovery("multi-head-low-rank"))
    assert outcome == "accepted"
    v = result.report.verification
    # the honest model sits well inside the tightened bar (the impostor's 1e-8 is 10x above it)
    assert v.tolerance <= 1e-9 and v.max_relative_error <= 0.1 * v.tolerance


@pytest.mark.slow
@pytest.mark.parametrize("d, seed", [(8, 6), (32, 2), (32, 8), (32, 12)])
def test_ffn_hull_at_its_regions_slope_catches_a_second_head(d, seed):
    """Seeds a Transformer layer once accepted with a second head at 1e-8: the FFN hull,
    judged at its region's own slope, refuses them."""
    assert_refused("transformer-layer", "second head 1e-8", d, seed)


def test_separating_sequences_survive_a_model_with_an_enormous_W():
    """A best-effort model from a failed fit can have W so large that its token scale
    underflows to 0 (a 1-in-20 crash of the multi-head learner against sigmoid
    attention at d = 32): the head-separating family then keeps zero tokens, no crash."""
    from attnextract.verification import _separating_sequences, length_grid
    rng = np.random.default_rng(0)
    W, v = rng.standard_normal((2, D, D)), rng.standard_normal((2, D))
    seqs = _separating_sequences(W, v, 4, rng, 0.0, length_grid(256))
    assert len(seqs) == 4 and all(np.all(s == 0) for s in seqs)


def test_hinge_labels_turn_on_their_token():
    """Hinge sequences: the model's f sits a share rho of the hinge token's term beyond
    the threshold, so a box that clips that token's value or drops it as padding flips
    the label wherever the change exceeds rho; an honest box (the model) flips none."""
    from attnextract.learners.sign_only import HINGE_SHARE, hinge_sequences
    for seed in range(3):
        head = random_single_head(D, seed)
        allowance = lambda X: np.full(len(X), 1e-12)        # noqa: E731
        hinges = hinge_sequences(head, 32, np.random.default_rng(seed), 1 / math.sqrt(D), 0.0,
                                 allowance)
        assert len(hinges) == 32
        rs = np.array([R for _, R, _ in hinges])
        assert (rs <= 0.1).sum() == 16 and (rs >= 10).sum() == 16     # ordinary tokens: norm 1
        assert all(rho <= HINGE_SHARE[1] for *_, rho in hinges)
        X = [x for x, _, _ in hinges]
        label = np.array([head(x[None])[0] > 0 for x in X])
        for box in (impostors.LargeTokenClip(head, np.random.default_rng(0), 30.0),
                    impostors.TinyPadding(head, np.random.default_rng(0), 1e-4)):
            acted = np.array([np.any(np.linalg.norm(x, axis=1) > box.limit)
                              if isinstance(box, impostors.LargeTokenClip)
                              else np.any(np.linalg.norm(x, axis=1) < box.limit) for x in X])
            flipped = np.array([box(x[None])[0] > 0 for x in X]) != label
            assert not flipped[~acted].any()
            assert flipped[acted].sum() >= 0.5 * acted.sum() > 0, (seed, type(box).__name__)


# deviations only where the scores' reach is large (REACH): a learner's error bar widens
# its check most there. Refused; a drift of 1e-5 may pass only with a printed tolerance
# at its size (the bar's widening accepted it: single-head 4 of 6 runs at d = 8, 16)
REACH_LEARNERS = ["single-head", "multi-head H<=2", "multi-head-low-rank", "transformer-layer",
                  "low-rank", "one-layer"]


@pytest.mark.parametrize("learner", REACH_LEARNERS)
def test_deviations_at_large_reach_are_refused_or_stated(learner):
    for seed in range(2):
        for name in impostors.REACH:
            outcome, result, box = run_impostor(learner, name, D, seed, recovery(learner))
            if name == "large-token drift 1e-05" and outcome == "accepted":
                v = result.report.verification
                assert box.limit > v.norms[1] or v.tolerance >= 0.1 * box.drift, (learner, seed)
            else:
                assert outcome.startswith("refused"), (learner, name, seed, outcome)
