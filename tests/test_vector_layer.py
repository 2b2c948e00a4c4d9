"""The vector-layer learner: a standard attention layer (heads with independent output
ranges, biases) from vector answers, against canonical truths; impostors refused."""

import numpy as np
import pytest

from attnextract import extract
from attnextract.adapters.minilm import minilm_vector_layer
from attnextract.errors import InputError, ModelMismatchError, RecoveryFailedError
from attnextract.learners.vector_canonical import match_vector_heads, vector_canonical_errors
from attnextract.learners.vector_layer import (
    READ_NOISE_ROWS,
    ROUNDING_SEQUENCES,
    extract_vector_layer,
    ordered_payloads,
    payload_weights,
)
from attnextract.models import VectorAttention
from attnextract.oracle import Oracle
from attnextract.testing.impostors import VectorRotary, random_vector_layer


def standard_layer(seed, d, H, m=None, biases=True, positions="last", causal=False):
    """A random layer as deployed: W_h = K_h^T Q_h / sqrt(r), b_h = K_h^T b_q,h / sqrt(r),
    O_h = W_o,h V_h, c = W_o b_v + b_o, r = d / H."""
    rng = np.random.default_rng(seed)
    m, r = m or d, d // H
    Wq, Wk, Wv = (rng.standard_normal((d, d)) / np.sqrt(d) for _ in range(3))
    Wo = rng.standard_normal((m, d)) / np.sqrt(d)
    bq, bv, bo = (0.5 * rng.standard_normal(n) for n in (d, d, m))
    rows = [slice(h * r, (h + 1) * r) for h in range(H)]
    W = np.stack([Wk[s].T @ Wq[s] / np.sqrt(r) for s in rows])
    b = np.stack([Wk[s].T @ bq[s] / np.sqrt(r) for s in rows]) if biases else None
    O = np.stack([Wo[:, s] @ Wv[s] for s in rows])
    c = Wo @ bv + bo if biases else None
    return VectorAttention(W, O, b, c, positions=positions, causal=causal)


class OtherWeights:
    """A layer of the same shape whose attention weights are ``weights(scores)`` (B, N)
    instead of a softmax: an impostor answering at the last position."""

    output_kind = "last"

    def __init__(self, layer: VectorAttention, weights):
        self.layer, self.weights = layer, weights

    def __call__(self, X):
        out = np.broadcast_to(self.layer.c, (len(X), self.layer.out_dim)).copy()
        for W, O, b in zip(self.layer.W, self.layer.O, self.layer.b):
            scores = np.einsum("bnd,bd->bn", X, X[:, -1] @ W.T + b)
            out += np.einsum("bn,bnd->bd", self.weights(scores), X) @ O.T
        return out


def softmax(s):
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def assert_within(result, box, bound=1e-10):
    errors = vector_canonical_errors(result.model, box)
    assert errors["heads"][0] == errors["heads"][1], errors
    assert errors["max"] <= bound, errors
    assert result.report.verification.passed


SEEDS = range(12)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_layers_within_1e10(seed):
    d, H = [(16, 2), (16, 4), (32, 4), (32, 8), (24, 3), (48, 6)][seed % 6]
    box = standard_layer(seed, d, H, biases=seed % 2 == 0)
    result = extract_vector_layer(Oracle(box, d), seed=seed)
    assert_within(result, box)
    report = result.report
    assert report.details["heads found"] == H
    assert report.details["output ranks r_h"] == [d // H] * H
    assert report.floor == -(-report.details["parameters"] // d)


def test_query_count_is_deterministic_and_reported():
    box = standard_layer(3, 16, 4)
    runs = [extract_vector_layer(Oracle(box, 16), seed=3) for _ in range(2)]
    assert runs[0].queries == runs[1].queries
    report = runs[0].report
    assert report.queries == sum(v for k, v in report.breakdown.items()
                                 if k not in ("recovery",))
    assert report.breakdown["c and O (single tokens)"] == 17
    assert report.breakdown["ranges (designed selectors)"] == 16 + 2


def test_wider_outputs_and_extract_picks_it_for_vectors():
    box = standard_layer(5, 16, 4, m=24)
    result = extract(Oracle(box, 16), model="multi-head-low-rank", seed=5)
    assert result.options["model"] == "vector-layer"
    assert_within(result, box)
    assert result.report.details["numbers received"] > 24 * result.queries * 0.9


def test_every_position_and_causal_boxes():
    for causal in (False, True):
        box = standard_layer(7, 16, 4, positions="all", causal=causal)
        result = extract_vector_layer(Oracle(box, 16, causal=causal, max_length=48), seed=7)
        assert result.model.positions == "all" and result.model.causal == causal
        assert_within(result, box)


def test_every_position_needs_causal_stated():
    box = standard_layer(7, 16, 4, positions="all")
    with pytest.raises(InputError, match="causal"):
        extract_vector_layer(Oracle(box, 16, outputs="all"), seed=7)


def test_stated_heads_and_ranks_are_checked():
    box = standard_layer(2, 16, 4)
    assert_within(extract_vector_layer(Oracle(box, 16), seed=2, heads=4, ranks=4), box)
    with pytest.raises(ModelMismatchError, match="heads"):
        extract_vector_layer(Oracle(box, 16), seed=2, heads=3)
    with pytest.raises(ModelMismatchError, match="biases"):
        extract_vector_layer(Oracle(box, 16), seed=2, biases=False)


def test_heads_with_equal_attention_merge():
    box = standard_layer(4, 16, 4)
    W, O, b = box.W.copy(), box.O.copy(), box.b.copy()
    W[1], b[1] = W[0], b[0]                   # heads 0 and 1 attend alike: one canonical head
    twin = VectorAttention(W, O, b, box.c)
    result = extract_vector_layer(Oracle(twin, 16), seed=4)
    assert result.model.heads == 3
    assert_within(result, twin)


IMPOSTORS = {
    "relu attention": lambda box: OtherWeights(box, lambda s: np.maximum(s, 0) / s.shape[1]),
    "sigmoid attention": lambda box: OtherWeights(box, lambda s: 0.5 + 0.5 * np.tanh(s / 2)),
    "soft-capped logits": lambda box: OtherWeights(box, lambda s: softmax(30 * np.tanh(s / 30))),
}


@pytest.mark.parametrize("name", sorted(IMPOSTORS))
@pytest.mark.parametrize("seed", range(2))
def test_impostors_refused(name, seed):
    box = IMPOSTORS[name](standard_layer(seed, 16, 4))
    with pytest.raises((ModelMismatchError, RecoveryFailedError)):
        extract_vector_layer(Oracle(box, 16, outputs="last"), seed=seed)


@pytest.mark.parametrize("seed", range(3))
def test_hidden_head_overlapping_a_range_refused(seed):
    box = standard_layer(seed, 16, 4)
    rng = np.random.default_rng(100 + seed)
    R0 = np.linalg.svd(box.O[0])[0][:, :4]           # head 0's range
    extra_O = R0 @ rng.standard_normal((4, 16)) / 4  # a fifth head writing into it
    extra_W = rng.standard_normal((16, 16)) / 4
    hidden = VectorAttention(np.concatenate([box.W, extra_W[None]]),
                             np.concatenate([box.O, extra_O[None]]),
                             np.concatenate([box.b, np.zeros((1, 16))]), box.c)
    with pytest.raises((ModelMismatchError, RecoveryFailedError)):
        extract_vector_layer(Oracle(hidden, 16), seed=seed)


def test_causal_box_told_bidirectional_refused():
    box = standard_layer(1, 16, 4, positions="all", causal=True)
    with pytest.raises(ModelMismatchError):
        extract_vector_layer(Oracle(box, 16, causal=False, max_length=48), seed=1)


@pytest.mark.slow
def test_minilm_layer_through_a_numpy_box():
    """A real layer (all-MiniLM-L6-v2 layer 2, biases kept) from last-position vectors:
    12 heads of rank 32 found, within 2x the floor, every part within issue 38's 1e-10 of
    the real weights. (Measured, seed 0: W 1.0e-11, b 1.7e-12, O 3.5e-13; every layer in
    benchmarks/results/bench_vector_layer.md.)"""
    import safetensors  # noqa: F401  (a test-all package: see conftest.py)
    box = minilm_vector_layer(2)
    result = extract_vector_layer(Oracle(box, 384), seed=0)
    errors = vector_canonical_errors(result.model, box)
    assert errors["heads"] == (12, 12)
    assert result.report.details["output ranks r_h"] == [32] * 12
    assert result.queries <= 2 * result.report.floor
    assert errors["O"] <= 1e-10 and errors["c"] <= 1e-10 and errors["b"] <= 1e-10
    assert errors["W"] <= 1e-10
    assert result.report.verification.passed


@pytest.mark.slow
@pytest.mark.parametrize("layer, seed", [(5, 0), (0, 0), (0, 7), (1, 1), (2, 5)])
def test_minilm_layer_every_head_within_1e10(layer, seed):
    """all-MiniLM-L6-v2 layers 5 (head output ranges the most oblique of the six,
    cond(R) 7e4) and 0 (a head with the largest W_h and the weakest O_h): every head's
    W_h, b_h and O_h within 1e-10 of the real weights, each relative to its own norm (the
    measure of ``checkpoint --check-against``), within 2x the floor. Layer 0 read with
    payload weights in block order and K_h from max r_h + 3 directions: 8.0e-11 (seed 0),
    1.1e-10 (seed 7). Layers 1 (seed 1) and 2 (seed 5) were refused: random selector sets
    at |q| = 1, where the biases dominate the heads' scores, left two heads in one block."""
    import safetensors  # noqa: F401  (a test-all package: see conftest.py)
    box = minilm_vector_layer(layer)
    result = extract_vector_layer(Oracle(box, 384), seed=seed)
    model = result.model
    assert model.heads == 12
    assert result.queries <= 2 * result.report.floor
    order = match_vector_heads(model, box)
    for h in range(12):
        for part in ("W", "b", "O"):
            true = getattr(box, part)[h]
            error = np.linalg.norm(getattr(model, part)[order[h]] - true) / np.linalg.norm(true)
            assert error <= 1e-10, (h, part, error)
    assert result.report.verification.passed


def test_payload_weights_follow_the_heads_exposure():
    """The most exposed head (large W_h, small O_h) gets the largest weight, at the end of
    the scale; the weights are the same set, one per head."""
    rng = np.random.default_rng(0)
    for H in (2, 5, 12):
        exposure = rng.lognormal(size=H)
        mu = ordered_payloads(payload_weights(H), exposure)
        assert sorted(mu) == sorted(payload_weights(H))
        assert mu[np.argmax(exposure)] == max(mu) and mu[np.argmin(exposure)] == min(mu)
        assert np.all(np.diff(mu[np.argsort(exposure)]) > 0)


# -- low precision: a PyTorch layer run in float32 -----------------------------------------

def torch_layer(seed, d, H):
    """``torch.nn.MultiheadAttention(d, H, batch_first=True)`` with its default
    initialisation (biases 0) asked through its own float32 forward pass at the last
    position, and its canonical truth in float64."""
    import torch  # a test-all package: see conftest.py
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(d, H, batch_first=True).eval()

    def box(X):
        x = torch.as_tensor(np.asarray(X), dtype=torch.float32)
        with torch.no_grad():
            return mha(x[:, -1:], x, x, need_weights=False)[0][:, 0].double().numpy()

    Wi, bi = (t.detach().double().numpy() for t in (mha.in_proj_weight, mha.in_proj_bias))
    Wo, bo = (t.detach().double().numpy() for t in (mha.out_proj.weight, mha.out_proj.bias))
    r = d // H
    rows = [slice(h * r, (h + 1) * r) for h in range(H)]
    Wq, Wk, Wv = Wi[:d], Wi[d:2 * d], Wi[2 * d:]
    truth = VectorAttention(np.stack([Wk[s].T @ Wq[s] / np.sqrt(r) for s in rows]),
                            np.stack([Wo[:, s] @ Wv[s] for s in rows]),
                            np.stack([Wk[s].T @ bi[:d][s] / np.sqrt(r) for s in rows]),
                            Wo @ bi[2 * d:] + bo)
    return box, truth


def assert_within_bar(result, truth, heads):
    errors = vector_canonical_errors(result.model, truth)
    assert errors["heads"] == (heads, heads), errors
    assert errors["max"] <= result.report.details["error bar"], errors
    assert result.report.verification.passed


@pytest.mark.parametrize("seed", range(3))
def test_float32_torch_layer_within_its_bar(seed):
    box, truth = torch_layer(seed, 32, 4)
    result = extract_vector_layer(Oracle(box, 32, outputs="last"), seed=seed,
                                  output_dtype="float32")
    assert_within_bar(result, truth, 4)
    details = result.report.details
    # the rounding is measured (float32 sums in another order), not assumed
    assert 1e-9 < details["measured rounding"] < 1e-5
    # 4 pairs of reordered sequences, and the first W-stage rows asked again reordered
    assert result.report.breakdown["rounding (reordered tokens)"] >= (
        2 * ROUNDING_SEQUENCES + READ_NOISE_ROWS)
    assert details["error bar"] >= 10 * details["measured rounding"]
    # the bar is honest and not wider than float32 reading through these O explains
    assert details["error bar"] < 1e-2


@pytest.mark.slow
def test_float32_mha_64_8_twenty_seeds():
    """nn.MultiheadAttention(64, 8) in float32 with its default biases, through its own
    forward pass: every seed within its stated bar, none refused (cond(O) of these layers
    runs from 7e2 to 5e5)."""
    for seed in range(20):
        box, truth = torch_layer(seed, 64, 8)
        result = extract_vector_layer(Oracle(box, 64, outputs="last"), seed=seed,
                                      output_dtype="float32")
        assert_within_bar(result, truth, 8)
        assert result.report.details["precision"] == "float32"


@pytest.mark.parametrize("seed", [13, 24, 162])
def test_float32_mha_64_8_ill_conditioned_outputs(seed):
    """Layers whose O = sum_h O_h is ill-conditioned (cond 5.3e5, 2.1e5, 9.7e4): the
    random selectors' projectors leak, the first W is off by up to 0.9 per head, and
    designed selectors with a full payload then moved scores by up to 660 against margins
    of 200 (seed 24 was refused on every restart, seed 13 needed one). A first designed
    pass with a small payload, W read again, then the full one. Seed 162: the random sets
    split a head's range 1 + 7 on every restart; the first designed pass merges it."""
    box, truth = torch_layer(seed, 64, 8)
    result = extract_vector_layer(Oracle(box, 64, outputs="last"), seed=seed,
                                  output_dtype="float32")
    assert_within_bar(result, truth, 8)
    # two designed passes of d + 2 queries each (at least: a restart asks them again)
    assert result.report.breakdown["ranges (designed selectors)"] >= 2 * (64 + 2)


@pytest.mark.parametrize(("seed", "learner_seed"), [(81, 81), (160, 160), (198, 198),
                                                  (81, 1011)])
def test_float32_mha_64_8_weakly_read_directions(seed, learner_seed):
    """Layers (cond(O) 7.8e4, 5.9e4, 4.2e5) whose first random selector set reads a few
    directions of range(O) through the rounding times cond(O): their eigenvalues carry
    0.2 to 30 spacings of noise where the others carry below 1e-2. Grouped with the
    rest, one bridged two heads' groups (a part of two heads, split at a weight between
    theirs) or made a part of one direction; every later set (seeds 81, 198) or the score
    reads (seed 160) were then refused, on every restart (layer 81 with learner seed
    1011 too: it depends on the random sets, not only on the layer). Such eigenvalues now
    join the nearest group (the designed selectors read the ranges again), and the first
    set's payload is larger."""
    box, truth = torch_layer(seed, 64, 8)
    result = extract_vector_layer(Oracle(box, 64, outputs="last"), seed=learner_seed,
                                  output_dtype="float32")
    assert_within_bar(result, truth, 8)
    assert result.report.details["output ranks r_h"] == [8] * 8


def test_float64_box_told_float32_keeps_float64_checks():
    """Stating float32 for a float64 box does not widen anything: the rounding measured
    is float64's, so the bar and the held-out tolerance are float64's; the same box with
    a 1e-4 deviation is refused."""
    box = standard_layer(0, 16, 4)
    result = extract_vector_layer(Oracle(box, 16), seed=0, output_dtype="float32")
    assert result.report.details["measured rounding"] < 1e-14
    assert result.report.details["error bar"] < 1e-9
    assert_within(result, box)

    def deviating(X):
        X = np.asarray(X)
        return box(X) + 1e-4 * np.abs(box.c).max() * np.tanh(X.sum(axis=(1, 2)))[:, None]
    with pytest.raises(ModelMismatchError):
        extract_vector_layer(Oracle(deviating, 16, outputs="last"), seed=0,
                             output_dtype="float32")


@pytest.mark.parametrize("kind", ["deviation 1e-3", "order-dependent"])
def test_float32_impostors_refused(kind):
    box, _ = torch_layer(0, 32, 4)

    def impostor(X):
        X = np.asarray(X)
        if kind == "order-dependent":      # the first token counts apart from the rest
            return box(X) + 0.1 * X[:, 0, :1]
        return box(X) * (1 + 1e-3 * np.tanh(X.sum(axis=(1, 2))))[:, None]
    with pytest.raises((ModelMismatchError, RecoveryFailedError)):
        extract_vector_layer(Oracle(impostor, 32, outputs="last"), seed=0,
                             output_dtype="float32")


@pytest.mark.parametrize("seed", range(2))
def test_rotary_positions_told_float32_refused(seed):
    """Rotary positions at d = 32 move the answers by ~5e-3 when the tokens before the
    query token are reordered. Taken as float32 rounding (below 1e-2), that layer was
    accepted with an error bar of 1.6 (held-out error 1.5); reordering moves a float32
    forward pass by about 0.05 of float32's level, so 10x that level is the limit."""
    box = VectorRotary(random_vector_layer(2, 32, seed), np.random.default_rng(seed))
    with pytest.raises(ModelMismatchError):
        extract_vector_layer(Oracle(box, 32, outputs="last"), seed=seed,
                             output_dtype="float32")


def test_output_dtype_checked():
    box = standard_layer(0, 16, 4)
    with pytest.raises(InputError):
        extract_vector_layer(Oracle(box, 16), seed=0, output_dtype="float8")


def test_float32_through_extract():
    """The option reaches the learner through extract (and through the scalar learner's
    switch to vector answers)."""
    box, truth = torch_layer(0, 16, 2)
    for model in ("vector-layer", "multi-head-low-rank"):
        result = extract(Oracle(box, 16, outputs="last"), model=model, output_dtype="float32",
                         seed=0)
        assert result.report.details["precision"] == "float32"
        assert_within_bar(result, truth, 2)


@pytest.mark.parametrize("seed", [5, 10, 42])
def test_layers_once_refused_as_not_softmax_are_recovered(seed):
    """Random layers d = 64, H = 8 without biases that were called not softmax: a near-tie
    in an accepted selector set (seeds 5, 10) and a bias-free row q = 0 read as noise at
    every scale (seed 42)."""
    box = standard_layer(seed, 64, 8, biases=False)
    result = extract_vector_layer(Oracle(box, 64), seed=seed)
    assert vector_canonical_errors(result.model, box)["max"] < 1e-10
    assert result.report.recovery_queries <= 3 * result.report.floor


def test_heads_whose_scores_point_alike_are_split():
    """Two pairs of heads with W_h and b_h 55% shared (scores at cosine ~0.8, as the most
    alike heads of a MiniLM layer): such a pair takes the same random selector often, and
    a set that split nothing by chance ended the stage with the pair in one block (6 of
    40 seeds refused). Agreement tests at new query tokens ask for another set until
    three in a row find every block's heads agreeing."""
    for seed in range(16):
        box = standard_layer(seed, 32, 4)
        W, b = box.W.copy(), box.b.copy()
        for h in (1, 3):
            W[h] = 0.55 * W[h - 1] + 0.45 * W[h]
            b[h] = 0.55 * b[h - 1] + 0.45 * b[h]
        box = VectorAttention(W, box.O, b, box.c)
        result = extract_vector_layer(Oracle(box, 32, outputs="last"), seed=seed)
        errors = vector_canonical_errors(result.model, box)
        assert errors["heads"] == (4, 4) and errors["max"] <= 1e-10, (seed, errors)
