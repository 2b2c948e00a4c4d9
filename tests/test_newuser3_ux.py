"""Issue 22, a new user's audit (a one-off report, in the git history): defects met by
boxes written from the docs alone, each checked here on a cheap box."""

import numpy as np
import pytest

import attnextract
from attnextract import Oracle
from attnextract.adapters.replicas import load_spec
from attnextract.errors import InputError, ModelMismatchError, RecoveryFailedError
from attnextract.learners.multi_head import canonical_error


def _heads(H, d, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((H, d, d)) / np.sqrt(d), rng.standard_normal((H, d))


def _batched(W, v, decimals=None, noise=0.0):
    rng = np.random.default_rng(99)

    def box(X):
        out = np.zeros(len(X))
        for W_h, v_h in zip(W, v):
            s = np.einsum("bnd,de,be->bn", X, W_h, X[:, -1])
            a = np.exp(s - s.max(1, keepdims=True))
            out += np.einsum("bn,bn->b", a / a.sum(1, keepdims=True), X @ v_h)
        out = out + noise * rng.standard_normal(len(X))
        return out if decimals is None else np.round(out, decimals)
    return box


@pytest.mark.parametrize("options, match", [
    ({"decimals": 16}, "decimals must be an integer in 0..15"),
    ({"decimals": 40}, "decimals must be an integer in 0..15"),
    ({"decimals": 4, "output_dtype": "float32"}, "not both"),
])
def test_multi_head_refuses_bad_precision_options_before_any_query(options, match):
    # docs/low-precision.md: --decimals 40 and both options are usage errors; multi-head
    # took them and ran (decimals=40 "rounded to 40 decimals", both: float32 won)
    oracle = Oracle(_batched(*_heads(2, 4, 0)), 4)
    with pytest.raises(InputError, match=match):
        attnextract.extract(oracle, "multi-head", heads=2, **options)
    assert oracle.queries == 0


def test_a_refusal_before_any_query_asks_nothing_and_hints_nothing():
    # heads > d is the learner's limit: the box was not queried, so no zero token is sent
    # and no hint about the box's precision or biases is added
    oracle = Oracle(_batched(*_heads(2, 4, 0)), 4)
    with pytest.raises(RecoveryFailedError, match="was not queried") as info:
        attnextract.extract(oracle, "multi-head", heads=5)
    assert oracle.queries == 0
    assert "--biases" not in str(info.value) and "--output-dtype" not in str(info.value)


def test_a_noisy_box_is_not_blamed_on_biases():
    # its zero-token answer is noise, not a constant c: it was refused as "adds a
    # constant ... extract with --biases", which would not help
    noisy = _batched(*_heads(2, 8, 1), noise=1e-6)
    with pytest.raises(ModelMismatchError, match="not a function of the sequence") as info:
        attnextract.extract(Oracle(noisy, 8), "multi-head", heads=2, seed=5)
    assert "adds a constant" not in str(info.value)


def test_answers_rounded_to_decimals_name_the_decimals():
    # multi-head detects float32 answers but not K decimals: the refusal says which K
    rounded = _batched(*_heads(2, 8, 1), decimals=6)
    with pytest.raises(ModelMismatchError, match="--decimals 6") as info:
        attnextract.extract(Oracle(rounded, 8), "multi-head", heads=2, seed=2)
    assert str(info.value).startswith("every answer is a multiple of 1e-6")
    assert "--biases" not in str(info.value)


def test_serve_takes_the_boxes_extract_takes(tmp_path):
    # a FILE.py:NAME box written for one sequence (docs/bring-your-own-model.md) failed
    # every served batch with HTTP 500; served as the oracle asks it, it answers batches
    path = tmp_path / "one_sequence.py"
    path.write_text(
        "import numpy as np\n"
        "W = np.eye(4) / 2\n"
        "v = np.arange(4.0)\n"
        "def secret(X):\n"
        "    s = X @ W @ X[-1]\n"
        "    a = np.exp(s - s.max())\n"
        "    return a @ (X @ v) / a.sum()\n"
        "secret.dim = 4\n"
        "def as_list(X):\n"
        "    return [float(secret(x)) for x in X]\n"
        "as_list.dim = 4\n")
    X = np.random.default_rng(0).standard_normal((3, 5, 4))
    expected = _batched(np.eye(4)[None] / 2, np.arange(4.0)[None])(X)
    for name in ("secret", "as_list"):
        served = load_spec(f"{path}:{name}")
        assert served.dim == 4 and served.kind == "custom"
        assert np.allclose(served(X), expected, rtol=1e-13, atol=1e-13)


def test_canonical_error_takes_a_users_own_truth():
    W, v = _heads(2, 4, 3)
    model = attnextract.MultiHeadAttention(W[::-1], v[::-1])

    class Truth:
        pass
    truth = Truth()
    truth.W, truth.v = W, v
    assert canonical_error(model, (W, v)) < 1e-15 and canonical_error(model, truth) < 1e-15
    with pytest.raises(InputError, match=r"a \(W, v\) pair"):
        canonical_error(model, "W")


def test_more_heads_than_d_is_not_sent_to_heads():
    # not told the count at d = 4 the search stops at d heads; "give heads=" led to a
    # refusal (heads above d), so the message names the learner's limit instead
    W, v = _heads(5, 4, 2)
    with pytest.raises(ModelMismatchError, match="beyond this learner") as info:
        attnextract.extract(Oracle(_batched(W, v), 4), "multi-head", seed=1)
    assert "give heads=" not in str(info.value)


def _outside(W, v, act="softmax", residual=False, dtype=np.float64, post=1.0):
    """Attention with act(X W_h x_N) / N in place of the softmax (ReLU, sigmoid), or a
    residual x_N^T r added, or a softmax forward pass in float32 (dtype) whose readout is
    multiplied by ``post`` in float64: out-of-class boxes of a new user's audit."""
    r = np.random.default_rng(7).standard_normal(W.shape[1])
    W, v = W.astype(dtype), v.astype(dtype)

    def box(X):
        X = X.astype(dtype)
        out = np.zeros(len(X), dtype=dtype)
        for W_h, v_h in zip(W, v):
            s = np.einsum("bnd,de,be->bn", X, W_h, X[:, -1])
            if act == "relu":
                a = np.maximum(s, 0) / X.shape[1]
            elif act == "sigmoid":
                a = 1 / (1 + np.exp(-s)) / X.shape[1]
            else:
                a = np.exp(s - s.max(1, keepdims=True))
                a /= a.sum(1, keepdims=True)
            out += np.einsum("bn,bn->b", a, X @ v_h)
        out = out.astype(np.float64) * post
        return out + X[:, -1].astype(np.float64) @ r if residual else out
    return box


@pytest.mark.parametrize("act, heads, seed", [("relu", 2, 1), ("sigmoid", 2, 1),
                                              ("relu", None, 5)])
def test_attention_that_is_not_a_softmax_is_a_mismatch(act, heads, seed, capfd):
    # ReLU and sigmoid attention were refused as the learner's failure ("the black box
    # is not judged"); one token x shows it: multi-head attention answers x^T v
    # there, these boxes act(x^T W_h x) x^T v_h. Not told, seed 5 also printed LAPACK's
    # "On entry to DLASCL parameter number 4 had an illegal value" 6 times (a NaN step)
    box = _outside(*_heads(2, 8, 1), act=act)
    with pytest.raises(ModelMismatchError, match="answers to single tokens miss it") as info:
        attnextract.extract(Oracle(box, 8), "multi-head", heads=heads, seed=seed)
    message = str(info.value)
    assert "not judged" not in message and "--biases" not in message
    assert "DLASCL" not in capfd.readouterr().err


def test_a_residual_not_told_may_be_outside_the_class():
    # a residual x_N^T r answers single tokens linearly: the learner cannot tell it from
    # its own failure, so the refusal stays its own and says the box may be outside
    box = _outside(*_heads(2, 8, 1), residual=True)
    with pytest.raises(RecoveryFailedError, match="outside the class .* may also end here") \
            as info:
        attnextract.extract(Oracle(box, 8), "multi-head", seed=1)
    assert "are linear in the token" in str(info.value) and "--biases" in str(info.value)
    assert info.value.result.report.details["single-token misfit"] < 1e-12


def test_an_error_bar_refusal_names_no_box_and_no_biases():
    # max_error_bar below what the fits give is the user's choice, the box is in the
    # class: no biases hint (it ended every bias-free refusal), no "outside the class",
    # and its single tokens fit to float64 rounding
    with pytest.raises(RecoveryFailedError, match="max_error_bar") as info:
        attnextract.extract(Oracle(_batched(*_heads(2, 8, 1)), 8), "multi-head", heads=2,
                            seed=1, max_error_bar=1e-17)
    message = str(info.value)
    assert "--biases" not in message and "outside the class" not in message
    assert info.value.result.report.details["single-token misfit"] < 1e-14


def test_a_float32_pass_read_out_in_float64_is_named():
    # float64 answers hide a float32 forward pass from detection; the base rows' misfit
    # (relative 1e-6, a float32 pass's) names --output-dtype float32, and stated, it runs
    W, v = _heads(2, 8, 3)
    box = _outside(W, v, dtype=np.float32, post=1 + 1e-7)
    with pytest.raises(ModelMismatchError, match="--output-dtype float32") as info:
        attnextract.extract(Oracle(box, 8), "multi-head", heads=2, seed=1)
    assert 1e-8 <= info.value.result.report.details["base rows' relative misfit"] <= 1e-5
    result = attnextract.extract(Oracle(box, 8), "multi-head", heads=2, seed=1,
                                 output_dtype="float32")
    assert canonical_error(result.model, (W, v)) <= result.report.details["error bar"]
    # a float64 box whose rows miss by far less than a float32 pass (a residual, 7e-5 of
    # its noise) gets no such hint
    with pytest.raises(ModelMismatchError) as info:
        attnextract.extract(Oracle(_outside(*_heads(2, 8, 1), residual=True), 8),
                            "multi-head", heads=2, seed=1)
    assert info.value.result.report.details["base rows' misfit in float32 noise"] < 1e-3
    assert "--output-dtype" not in str(info.value)
