"""Pre-LayerNorm blocks with several heads (issue 26, stretch): what the block shows on the
sphere where LayerNorm is affine, recovered with ``heads=H``; boxes outside that class
refused."""

import itertools

import numpy as np
import pytest

from attnextract import extract
from attnextract.adapters.targets import random_multi_head, random_pre_layer_norm
from attnextract.errors import (InputError, ModelMismatchError, NotIdentifiableError,
                                RecoveryFailedError)
from attnextract.learners.pre_layer_norm_heads import parameter_count
from attnextract.models import BiasedMultiHeadAttention, PreLayerNormAttention, layer_norm
from attnextract.oracle import Oracle
from attnextract.report import load_model

from conftest import run_cli


def identified_errors(model, truth) -> dict:
    """Relative errors of the identified parts, heads matched by the best permutation."""
    assert model.heads == truth.heads
    best = None
    for perm in itertools.permutations(range(truth.heads)):
        p = list(perm)
        errors = {name: float(np.linalg.norm(getattr(model, name)[p] - getattr(truth, name))
                              / np.linalg.norm(getattr(truth, name))) for name in "Wbv"}
        if best is None or max(errors.values()) < max(best.values()):
            best = errors
    best["r"] = float(np.linalg.norm(model.r - truth.r) / np.linalg.norm(truth.r))
    best["c"] = abs(model.c - truth.c) / max(abs(truth.c), float(np.linalg.norm(truth.v)))
    return best


def altered(block: PreLayerNormAttention, **changes) -> PreLayerNormAttention:
    parts = {name: getattr(block, name) for name in PreLayerNormAttention.PARAMETERS}
    parts.update(changes)
    return PreLayerNormAttention(**parts)


@pytest.mark.parametrize("heads, dim, seed", [(2, 8, 0), (2, 8, 1), (2, 8, 2), (4, 8, 3)])
def test_a_block_with_several_heads_is_recovered_on_the_sphere(heads, dim, seed):
    box = random_pre_layer_norm(heads, dim, seed)
    result = extract(Oracle(box, dim), "pre-ln", heads=heads, seed=seed)
    model = result.model
    assert model.kind == "pre-ln-sphere" and model.heads == heads
    errors = identified_errors(model, box.on_sphere(model.radius))
    assert max(errors.values()) < 1e-9, errors
    report = result.report
    assert report.floor == parameter_count(heads, dim) == heads * (dim * dim - 1) + dim
    assert sum(report.breakdown.values()) == result.queries
    assert report.verification.passed
    assert report.details["heads seen"] == f"{heads} of at most {heads}"


@pytest.mark.parametrize("hostile", ["gamma with zeros", "tiny beta", "saturating W",
                                     "large query bias", "tiny W"])
def test_hostile_blocks_with_two_heads(hostile):
    box = random_pre_layer_norm(2, 8, seed=5)
    gamma = box.gamma.copy()
    gamma[[1, 4]] = 0.0                     # LN zeroes two coordinates: A is singular
    box = {"gamma with zeros": lambda: altered(box, gamma=gamma),
           "tiny beta": lambda: altered(box, beta=1e-12 * box.beta),
           "saturating W": lambda: altered(box, W=30.0 * box.W),
           "large query bias": lambda: altered(box, b=10.0 * box.b),
           "tiny W": lambda: altered(box, W=0.01 * box.W)}[hostile]()
    result = extract(Oracle(box, 8), "pre-ln", heads=2, seed=5)
    errors = identified_errors(result.model, box.on_sphere(result.model.radius))
    assert max(errors.values()) < 1e-9, errors


def test_the_model_answers_on_its_sphere_only():
    box = random_pre_layer_norm(2, 8, seed=6)
    model = extract(Oracle(box, 8), "pre-ln", heads=2, seed=6).model
    rng = np.random.default_rng(0)
    X = rng.standard_normal((5, 4, 8))
    X -= X.mean(axis=-1, keepdims=True)
    X *= model.radius / np.linalg.norm(X, axis=-1, keepdims=True)
    assert np.max(np.abs(model(X) - box(X))) < 1e-9 * np.max(np.abs(box(X)))
    with pytest.raises(InputError, match="zero mean and norm"):
        model(2.0 * X)


def post_layer_norm(dim, seed):
    pre = random_pre_layer_norm(2, dim, seed)

    def box(X):
        X = np.asarray(X)
        y = X[:, -1, :] + pre.attention.outputs(X)[:, None] * pre.r
        return layer_norm(y, pre.gamma, pre.beta, pre.eps) @ pre.r
    return box


def plain_attention(dim, seed):
    """Biased attention plus the residual, no LayerNorm: in the class on the sphere (gamma
    = 1, beta = 0), refused off it."""
    heads = random_multi_head(2, dim, seed)
    rng = np.random.default_rng(seed)
    biased = BiasedMultiHeadAttention(heads.W, heads.v, rng.standard_normal((2, dim)), 0.5)
    r = rng.standard_normal(dim)
    return lambda X: biased(X) + np.asarray(X)[:, -1] @ r


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("impostor", ["post-LN", "plain attention + residual",
                                      "four heads told two"])
def test_boxes_outside_the_class_are_refused(impostor, seed):
    box = {"post-LN": lambda: post_layer_norm(8, seed),
           "plain attention + residual": lambda: plain_attention(8, seed),
           "four heads told two": lambda: random_pre_layer_norm(4, 8, seed)}[impostor]()
    with pytest.raises((ModelMismatchError, RecoveryFailedError)):
        extract(Oracle(box, 8), "pre-ln", heads=2, seed=seed)


def test_the_one_head_learner_refuses_two_heads_and_names_the_option():
    box = random_pre_layer_norm(2, 8, seed=0)
    with pytest.raises(ModelMismatchError, match="--heads"):
        extract(Oracle(box, 8), "pre-ln", seed=0)


def test_a_one_head_block_told_two_heads_is_seen_with_one():
    box = random_pre_layer_norm(1, 8, seed=2)
    result = extract(Oracle(box, 8), "pre-ln", heads=2, seed=2)
    assert result.model.heads == 1 and result.report.details["heads seen"] == "1 of at most 2"
    errors = identified_errors(result.model, box.on_sphere(result.model.radius))
    assert max(errors.values()) < 1e-9, errors


def test_bad_arguments():
    box = random_pre_layer_norm(1, 3, seed=0)
    with pytest.raises(NotIdentifiableError):
        extract(Oracle(box, 3), "pre-ln", heads=2)
    with pytest.raises(InputError):
        extract(Oracle(random_pre_layer_norm(2, 8, seed=0), 8), "pre-ln", heads=0)


def test_the_command_line_extracts_with_heads_and_verifies(tmp_path):
    target = tmp_path / "block.py"
    target.write_text("from attnextract.adapters.targets import random_pre_layer_norm\n"
                      "box = random_pre_layer_norm(2, 8, seed=3)\n")
    out = tmp_path / "block.npz"
    run_cli("extract", "--target", f"{target}:box", "--dim", "8", "--model", "pre-ln",
            "--heads", "2", "--seed", "1", "--out", str(out), "--no-progress", check=0,
            cwd=tmp_path)
    model = load_model(out)
    assert model.kind == "pre-ln-sphere" and model.heads == 2
    proc = run_cli("verify", "--target", f"{target}:box", "--result", str(out), "--seed", "2",
                   "--no-progress", check=0, cwd=tmp_path)
    assert "MATCH" in proc.stdout
