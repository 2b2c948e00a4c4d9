"""The impostor zoo with vector answers (attnextract.testing.impostors, vector section)
against the vector learners.

Each vector impostor is a VectorAttention (the learner's honest model) that changes one
thing: soft-capped or QK-normed scores, ALiBi, top-k, sliding windows, log-length scaling,
a hidden extra head, a norm clip, float32 in large batches only, tiny tokens taken for
padding, triggers, an int8 cache, a switch of model, the other causal mask than the one
stated, and the rest of the scalar zoo. vector-single-head, vector-multi-head (told two
heads), vector-layer and vector-pre-ln (the impostor behind a LayerNorm) must refuse each
(a typed error), at the last position and (where the learner reads them) at every
position, causal or not; the honest controls (the model itself, the model through the
impostors' own code, a float32 forward pass where the learner is told float32, answers
of 1e200) must be accepted. The fast set rotates through the zoo; the slow sets take the
whole zoo over several seeds and sizes.
"""

import pytest

from attnextract.testing.impostors import (
    IN_PRE_LN_CLASS,
    VECTOR_CASES,
    VECTOR_REACH,
    VECTOR_SIZED,
    VectorCone,
    VectorFloat32AboveBatch,
    VectorLargeTokenClip,
    VectorTinyPadding,
    run_vector_impostor,
    vector_impostor_names,
)
from conftest import grid

LEARNERS = list(VECTOR_CASES)
EVERY_POSITION = [n for n in LEARNERS if VECTOR_CASES[n][2]]
# the learner calibrated for float32 forward passes (vector-multi-head's float32 limit
# is documented: its 1,024-token scans are refused at the first one; the others take
# float64 answers only)
FLOAT32 = ("vector-single-head",)

# an overflow anywhere (answers of 1e200 squared) is a bug here, not a warning
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def outcome(learner, name, d, seed, where="last"):
    positions = "last" if where == "last" else "all"
    result = run_vector_impostor(learner, name, d, seed, positions=positions,
                                 causal=where == "causal")
    assert not result[0].startswith("crash"), result[0]
    return result


def refused(learner, name, d, seed, where="last") -> bool:
    return outcome(learner, name, d, seed, where)[0].startswith("refused")


def controls(learner) -> list:
    return (["honest", "honest through the impostor code", "honest x1e200"]
            + (["honest float32"] if learner in FLOAT32 else []))


# the fast set: every learner at the last position takes a rotating share of the zoo,
# the every-position learners a few more causal and bidirectional
FAST = [(learner, name, "last") for i, learner in enumerate(LEARNERS)
        for name in vector_impostor_names(learner)[i::6]]
FAST += [(learner, name, where) for i, learner in enumerate(EVERY_POSITION)
         for where in ("causal", "all")
         for name in vector_impostor_names(learner, "all")[i + (where == "all")::11]]


@pytest.mark.parametrize("learner, name, where", FAST)
def test_vector_impostor_refused(learner, name, where):
    assert refused(learner, name, 8, 0, where), (learner, name, where)


@pytest.mark.parametrize("learner", LEARNERS)
def test_honest_vector_controls_accepted(learner):
    for name in controls(learner):
        result = outcome(learner, name, 8, 1)
        assert result[0] == "accepted", (learner, name, result[0])
        assert result[1].report.verification.passed


@pytest.mark.parametrize("learner", EVERY_POSITION)
@pytest.mark.parametrize("where", ["causal", "all"])
def test_causal_mask_flipped_refused(learner, where):
    """A box answering every position under the other mask than the one stated."""
    assert refused(learner, "causal mask flipped", 8, 2, where)
    assert outcome(learner, "honest", 8, 2, where)[0] == "accepted"


def test_a_region_of_query_tokens_is_refused_or_stated():
    """A deviation on 5% of the query tokens (a cone) is caught, or the check states a
    coverage that does not claim a region that small."""
    for learner in LEARNERS:
        for seed in range(3):
            state, result, _ = outcome(learner, "cone of query tokens", 8, seed)
            if state == "accepted":
                assert result.report.verification.coverage["all"] > 0.05, (learner, seed)


@pytest.mark.slow
@pytest.mark.parametrize("d", [8, 16])
@pytest.mark.parametrize("learner", LEARNERS)
def test_whole_vector_zoo_refused(learner, d):
    """Seeds 0-2 in CI at d in {8, 16}; ATTNEXTRACT_FULL_GRIDS=1 takes 0-9."""
    accepted = [(name, seed) for name in vector_impostor_names(learner)
                for seed in grid(range(10), range(3)) if not refused(learner, name, d, seed)]
    assert not accepted, f"{learner} accepted at d = {d}: {accepted}"


# measured limits, kept visible: (learner, where, impostor, seed) accepted (none now: a
# causal box with an attention sink at -18.7 passed vector-single-head while its float64
# error bar, a design bound 700x its real error, widened the check without limit)
KNOWN_VECTOR_MISSES: set = set()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["causal", "all"])
@pytest.mark.parametrize("learner", EVERY_POSITION)
def test_whole_vector_zoo_refused_at_every_position(learner, where):
    """KNOWN_VECTOR_MISSES must still be accepted (else they leave the list); nothing else."""
    accepted = {(learner, where, name, seed) for name in vector_impostor_names(learner, "all")
                for seed in grid(range(6), range(2)) if not refused(learner, name, 8, seed, where)}
    known = {k for k in KNOWN_VECTOR_MISSES if k[:2] == (learner, where)
             and k[3] in grid(range(6), range(2))}
    assert accepted == known, f"{learner} ({where}): accepted {accepted}, known {known}"


@pytest.mark.slow
@pytest.mark.parametrize("where", ["causal", "all"])
def test_multi_head_at_every_position(where):
    """vector-multi-head reads the last position; a box answering every position is
    verified at every one (a few of the zoo: each run sends 1,024-token scans)."""
    assert outcome("vector-multi-head", "honest", 8, 0, where)[0] == "accepted"
    for name in ("causal mask flipped", "sliding window 24", "second head 1e-8",
                 "float32 above batch 8"):
        assert refused("vector-multi-head", name, 8, 0, where), name


@pytest.mark.slow
@pytest.mark.parametrize("d", [8, 16])
@pytest.mark.parametrize("learner", LEARNERS)
def test_honest_vector_controls_accepted_on_more_seeds(learner, d):
    refusals = [(name, seed, state) for name in controls(learner)
                for seed in grid(range(10), range(4))
                for state in [outcome(learner, name, d, seed)[0]] if state != "accepted"]
    assert not refusals, f"{learner} refused honest boxes at d = {d}: {refusals}"


@pytest.mark.slow
@pytest.mark.parametrize("where", ["causal", "all"])
@pytest.mark.parametrize("learner", EVERY_POSITION)
def test_honest_vector_controls_accepted_at_every_position(learner, where):
    refusals = [(name, seed, state) for name in controls(learner) for seed in range(3)
                for state in [outcome(learner, name, 8, seed, where)[0]] if state != "accepted"]
    assert not refusals, f"{learner} ({where}) refused honest boxes: {refusals}"


def refused_or_honestly_reported(state, result, box) -> bool:
    """Refused; or accepted where the deviation lies outside what the report states it
    verified: a clip above the largest verified token norm, padding below the smallest,
    float32 above a batch size never asked, a region smaller than the stated coverage."""
    if state.startswith("refused"):
        return True
    if state != "accepted":
        return False
    v = result.report.verification
    box = getattr(box, "inner", box)    # the impostor behind a LayerNorm (vector-pre-ln)
    if isinstance(box, VectorLargeTokenClip):
        return box.limit > v.norms[1]
    if isinstance(box, VectorTinyPadding):
        return box.limit < v.norms[0]
    if isinstance(box, VectorFloat32AboveBatch):
        return box.seen <= box.largest
    if isinstance(box, VectorCone):
        return v.coverage["all"] > box.share
    return False


def sized_names(learner) -> list:
    names = list(VECTOR_SIZED)
    if learner == "vector-pre-ln":      # behind LayerNorm, token norms are the block's own
        names = [n for n in names if not any(n.startswith(k) for k in IN_PRE_LN_CLASS)]
    return names


@pytest.mark.slow
@pytest.mark.parametrize("learner", [n for n in LEARNERS if n != "vector-multi-head"])
def test_vector_classes_at_several_sizes(learner):
    """The zoo's classes at other sizes (VECTOR_SIZED: norm limits, a hidden head at 3 and
    10 times the tolerance, float32 above other batch sizes, regions of 2% and 25%) at
    the last position and, for the every-position learners, causal: refused or honestly
    reported; the honest model at the same seeds accepted."""
    wheres = ["last"] + (["causal"] if learner in EVERY_POSITION else [])
    missed = []
    for where in wheres:
        for seed in range(2):
            assert outcome(learner, "honest", 8, seed, where)[0] == "accepted"
            missed += [(name, where, seed) for name in sized_names(learner)
                       if not refused_or_honestly_reported(*outcome(learner, name, 8, seed,
                                                                    where))]
    assert not missed, f"{learner} accepted: {missed}"


@pytest.mark.slow
def test_vector_multi_head_classes_at_several_sizes():
    for name in ("large-token clip x10", "tiny tokens as padding x0.0001",
                 "mean-pool head 3e-07", "float32 above batch 2", "cone of query tokens 0.25"):
        assert refused_or_honestly_reported(*outcome("vector-multi-head", name, 8, 0)), name


@pytest.mark.parametrize("learner, where", [("vector-single-head", "last"),
                                            ("vector-single-head", "causal"),
                                            ("vector-multi-head", "last"),
                                            ("vector-layer", "last")])
def test_deviations_at_large_reach_are_refused_or_stated(learner, where):
    """Values of large tokens off by 1e-3 are refused; off by 1e-5 they may pass only with
    a printed tolerance at that size (vector-single-head: 5 of 9 runs at d = 8)."""
    for seed in range(2):
        for name in VECTOR_REACH:
            state, result, box = outcome(learner, name, 8, seed, where)
            if name == "large-token drift 1e-05" and state == "accepted":
                v = result.report.verification
                assert box.limit > v.norms[1] or v.tolerance >= 0.1 * box.drift, (learner, seed)
            else:
                assert state.startswith("refused"), (learner, name, where, seed, state)
