"""Multi-head attention with low-rank heads (W_h = A_h B_h^T, sum r_h <= d): the layer learner."""

import numpy as np
import pytest

from attnextract import InputError
from attnextract.adapters.targets import random_low_rank_multi_head, random_multi_head
from attnextract.errors import (BudgetExceededError, ModelMismatchError, NotIdentifiableError,
                                RecoveryFailedError)
from attnextract.learners.multi_head import canonical_error, canonical_form
from attnextract.learners.multi_head_low_rank import (extract_multi_head_low_rank,
                                                      low_rank_multi_head_floor, paper_two_count)
from attnextract.models import MultiHeadAttention, OneLayerTransformer
from attnextract.oracle import Oracle


def extract(target, heads, rank=None, seed=0, **options):
    oracle = Oracle(target, target.dim)
    result = extract_multi_head_low_rank(oracle, heads, rank, seed=seed, **options)
    return result, oracle


def check_counts(result, oracle, heads_found, d, rank):
    """Every query is accounted for; the deterministic stages cost exactly their design."""
    b = result.report.breakdown
    assert result.queries == oracle.queries == b["recovery"] + b["verification"]
    assert b["recovery"] == (b["values"] + b["query spaces"] + b["isolation"]
                             + b["heights"])
    assert b["heights"] == heads_found * d
    # rank + 1 rows against d columns, d rows against r columns, plus scouts and rescues
    design = heads_found * (rank + 1) * d + d * heads_found * rank
    assert b["query spaces"] + b["isolation"] == design + b["(rescaled)"]
    assert b["(rescaled)"] >= 2 * 8 * heads_found


@pytest.mark.parametrize("heads", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(5))
def test_small_layers_over_seeds(heads, seed):
    d, r = 16, 4
    target = random_low_rank_multi_head(heads, d, r, seed)
    result, oracle = extract(target, heads, r, seed=seed)
    assert canonical_error(result.model, target) < 1e-10
    assert result.report.verification.passed and result.model.heads == heads
    check_counts(result, oracle, heads, d, r)
    floor = low_rank_multi_head_floor(d, [r] * heads)
    assert result.report.floor == floor
    assert result.report.breakdown["recovery"] <= 2.5 * floor     # the values' overhead at d = 16
    assert result.report.breakdown["recovery"] < paper_two_count(d, heads)
    numbers = result.report.details["conditioning_numbers"]
    # a cosine: at most 1, up to its last bits (1 + 2e-16 under numpy's X86_V3 loops)
    assert 0 < numbers["query_space_separation"] <= 1 + 1e-12
    assert numbers["predicted_error"] < 1e-8


@pytest.mark.parametrize("seed", range(3))
def test_rank_found_when_not_given(seed):
    target = random_low_rank_multi_head(3, 24, 5, seed)
    result, _ = extract(target, 3, None, seed=seed)
    assert result.report.details["ranks"] == [5, 5, 5]
    assert canonical_error(result.model, target) < 1e-10


@pytest.mark.parametrize("d,heads,r,seeds", [(64, 8, 8, range(3)), (96, 12, 8, range(2))])
@pytest.mark.slow
def test_real_layer_shapes(d, heads, r, seeds):
    """Issue 12 item 2: H r = d at (64, 8, 8) and (96, 12, 8), canonical error <= 1e-8."""
    floor = heads * (d + r * (2 * d - r))
    for seed in seeds:
        target = random_low_rank_multi_head(heads, d, r, seed)
        result, oracle = extract(target, heads, r, seed=seed)
        assert canonical_error(result.model, target) < 1e-10
        check_counts(result, oracle, heads, d, r)
        assert result.report.breakdown["recovery"] <= 1.3 * floor
        assert result.report.breakdown["recovery"] < 0.1 * paper_two_count(d, heads)


def test_larger_scale_heads():
    """W entries 3x larger (logits of order 3): same recovery."""
    target = random_low_rank_multi_head(4, 32, 8, 7, scale=3.0)
    result, _ = extract(target, 4, 8, seed=1)
    assert canonical_error(result.model, target) < 1e-10


def test_dead_head_is_dropped():
    target = random_low_rank_multi_head(4, 16, 4, 3)
    v = target.v.copy()
    v[2] = 0.0
    dead = MultiHeadAttention(target.W, v)
    result, _ = extract(dead, 4, 4, seed=0)
    assert result.model.heads == 3
    assert canonical_error(result.model, dead) < 1e-10


def test_tied_heads_merge():
    """Two heads with the same W are one canonical head (their v add)."""
    target = random_low_rank_multi_head(4, 16, 4, 5)
    W = target.W.copy()
    W[3] = W[1]
    tied = MultiHeadAttention(W, target.v)
    result, _ = extract(tied, 4, 4, seed=0)
    assert result.model.heads == 3 == canonical_form(tied).heads
    assert canonical_error(result.model, tied) < 1e-10


def test_rank_deficient_heads():
    """Heads of ranks 1, 2 and 4 with rank not given: each rank found, sum below d."""
    rng = np.random.default_rng(11)
    d, ranks = 16, [1, 2, 4]
    W = np.array([rng.standard_normal((d, r)) @ rng.standard_normal((r, d)) / np.sqrt(d * r)
                  for r in ranks])
    target = MultiHeadAttention(W, rng.standard_normal((3, d)))
    result, oracle = extract(target, 3, None, seed=2)
    assert sorted(result.report.details["ranks"]) == ranks
    assert result.report.floor == low_rank_multi_head_floor(d, ranks)
    assert canonical_error(result.model, target) < 1e-10


def test_heads_sharing_v_are_refused_not_wrong():
    """Equal v_h leave no row that sees one of them alone: refused with the reason."""
    target = random_low_rank_multi_head(3, 16, 4, 2)
    v = target.v.copy()
    v[2] = v[0]
    with pytest.raises(RecoveryFailedError):
        extract(MultiHeadAttention(target.W, v), 3, 4)


@pytest.mark.parametrize("seed", range(3))
def test_full_rank_heads_are_refused(seed):
    """Full-rank heads (sum of ranks > d) are outside the class: refused, with or without r."""
    target = random_multi_head(3, 12, seed)
    with pytest.raises(ModelMismatchError, match="rank above the given"):
        extract(target, 3, 4, seed=seed)
    with pytest.raises((RecoveryFailedError, ModelMismatchError)):
        extract(target, 3, None, seed=seed)


def test_impostor_is_refused():
    """A one-layer Transformer (attention + ReLU) is no multi-head attention: never a model."""
    rng = np.random.default_rng(4)
    d = 12
    impostor = OneLayerTransformer(rng.standard_normal((d, d)) / np.sqrt(d),
                                   rng.standard_normal((20, d)), rng.standard_normal(20))
    with pytest.raises((ModelMismatchError, RecoveryFailedError)):
        extract(impostor, 3, 4)


def test_too_many_heads_for_the_bound_is_refused():
    target = random_low_rank_multi_head(4, 16, 4, 9)
    with pytest.raises(ModelMismatchError, match="at most 2 heads"):
        extract(target, 2, 4)


def test_bad_input_and_budget():
    target = random_low_rank_multi_head(2, 8, 2, 0)
    with pytest.raises(InputError, match="heads"):
        extract(target, 0)
    with pytest.raises(InputError, match="rank"):
        extract(target, 2, 9)
    oracle = Oracle(target, 8, budget=50)
    with pytest.raises(BudgetExceededError):
        extract_multi_head_low_rank(oracle, 2, 2, seed=0)
    assert oracle.queries == 0                     # refused before anything was sent
    zero = MultiHeadAttention(target.W, np.zeros((2, 8)))
    with pytest.raises(NotIdentifiableError):
        extract(zero, 2, 2)


def test_seeded_runs_repeat():
    target = random_low_rank_multi_head(3, 16, 4, 1)
    a, _ = extract(target, 3, 4, seed=5)
    b, _ = extract(target, 3, 4, seed=5)
    assert a.queries == b.queries
    np.testing.assert_array_equal(a.model.W, b.model.W)


@pytest.mark.slow
def test_command_line(tmp_path):
    from conftest import run_cli
    target = tmp_path / "layer.py"
    target.write_text("from attnextract.adapters.targets import random_low_rank_multi_head\n"
                      "box = random_low_rank_multi_head(3, 16, 4, 21)\n")
    out = tmp_path / "r.npz"
    proc = run_cli("extract", "--target", f"{target}:box", "--dim", "16", "--model",
                   "multi-head-low-rank", "--heads", "3", "--rank", "4", "--seed", "1",
                   "--out", out, "--json", check=0)
    import json
    report = json.loads(proc.stdout)
    assert report["ok"] and report["details"]["ranks"] == [4, 4, 4]
    with np.load(out) as saved:
        model = MultiHeadAttention(saved["W"], saved["v"])
    assert canonical_error(model, random_low_rank_multi_head(3, 16, 4, 21)) < 1e-10
    missing = run_cli("extract", "--target", f"{target}:box", "--dim", "16", "--model",
                      "multi-head-low-rank", "--out", out)
    assert missing.returncode == 2 and "number of heads" in missing.stderr


def close_query_spaces(eps, seed=0, d=32, heads=4, r=8):
    """Heads 0 and 1 with query spaces eps apart (B_1 = B_0 + eps G)."""
    rng = np.random.default_rng(seed)
    A, B = rng.standard_normal((heads, d, r)), rng.standard_normal((heads, d, r))
    B[1] = B[0] + eps * rng.standard_normal((d, r))
    W = np.einsum("hdr,her->hde", A, B) / np.sqrt(d * r)
    return MultiHeadAttention(W, rng.standard_normal((heads, d)))


def test_conditioning_predicts_the_error_and_the_breaking_point():
    """The predicted error follows the query-space separation; past 1e-7 it is refused."""
    predicted, measured = [], []
    for eps in (1e-1, 1e-2):
        target = close_query_spaces(eps)
        result, _ = extract(target, 4, 8)
        predicted.append(result.report.details["conditioning_numbers"]["predicted_error"])
        measured.append(canonical_error(result.model, target))
    assert predicted[1] > 5 * predicted[0]                  # closer heads, larger bar
    for p, m in zip(predicted, measured):
        assert m / 10 < p < 10 * m
    with pytest.raises(RecoveryFailedError, match="too close to pin down"):
        extract(close_query_spaces(1e-6), 4, 8)


@pytest.mark.parametrize("seed", range(6))
def test_kept_logits_stay_precise(seed):
    """Entries are measured again until |G t| <= PRECISE_LOGIT (a logit of 11.9 once cost a
    MiniLM head 1.6e-8, 44x its error bar); the bar then covers the measured error."""
    from attnextract.learners.multi_head_low_rank import PRECISE_LOGIT
    target = random_low_rank_multi_head(3, 16, 4, seed)
    result, _ = extract(target, 3, 4, seed=seed)
    numbers = result.report.details["conditioning_numbers"]
    assert numbers["steepest_logit"] <= PRECISE_LOGIT
    assert canonical_error(result.model, target) < 10 * numbers["predicted_error"]
