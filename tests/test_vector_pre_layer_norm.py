"""vector-pre-ln: a pre-LayerNorm attention block answering vectors, on the sphere."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from attnextract import extract
from attnextract.errors import InputError, ModelMismatchError
from attnextract.learners.vector_pre_layer_norm import (
    extract_vector_pre_layer_norm,
    three_token_solve,
)
from attnextract.models import VectorSphereAttention
from attnextract.oracle import Oracle
from attnextract.report import ExtractionResult
from attnextract.verification import verify_model

TESTS = Path(__file__).resolve().parent
# a stored result's W etc. against the truth on the sphere, relative (Frobenius)
CANONICAL_TOLERANCE = 1e-9


def block(d, m, seed, residual=True, norm="ln", activation="softmax", every=False):
    """A numpy pre-LN block read at the last position, and its parameters on the sphere.

    norm "ln" (gamma, beta, eps), "rms" (RMSNorm: an impostor) or "none"; activation
    "softmax" or "relu" (ReLU attention: an impostor); ``every``: answers at every
    position under a causal mask, (B, N, m). Returns (box, truth) with the box mapping
    (B, N, d) to (B, m) and truth the projected W, b, O, c, R at radius sqrt(d)."""
    rng = np.random.default_rng(seed)
    gamma, beta, eps = 1 + 0.3 * rng.standard_normal(d), 0.2 * rng.standard_normal(d), 1e-5
    Wq, Wk, Wv = (rng.standard_normal((d, d)) / np.sqrt(d) for _ in range(3))
    bq, bk, bv = (0.2 * rng.standard_normal(d) for _ in range(3))
    Wo, bo = rng.standard_normal((m, d)) / np.sqrt(d), 0.2 * rng.standard_normal(m)
    Rm = np.eye(m, d) if residual else np.zeros((m, d))

    def box(X):
        X = np.asarray(X, dtype=float)
        if norm == "ln":
            C = X - X.mean(-1, keepdims=True)
            Y = gamma * C / np.sqrt((C * C).mean(-1, keepdims=True) + eps) + beta
        elif norm == "rms":
            Y = gamma * X / np.sqrt((X * X).mean(-1, keepdims=True) + eps)
        else:
            Y = X
        q, K, V = Y[:, -1] @ Wq.T + bq, Y @ Wk.T + bk, Y @ Wv.T + bv
        s = np.einsum("bnd,bd->bn", K, q) / np.sqrt(d)
        if activation == "softmax":
            a = np.exp(s - s.max(1, keepdims=True))
            a /= a.sum(1, keepdims=True)
        else:
            a = np.maximum(s, 0.0) / X.shape[1]
        out = X[:, -1] @ Rm.T + np.einsum("bn,bnd->bd", a, V) @ Wo.T + bo
        if not every:
            return out
        N = X.shape[1]
        S = np.einsum("bid,bjd->bji", Y @ Wk.T + bk, Y @ Wq.T + bq) / np.sqrt(d)
        S = np.where(np.triu(np.ones((N, N), dtype=bool), 1), -np.inf, S)
        a = np.exp(S - S.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        return X @ Rm.T + np.einsum("bji,bid->bjd", a, V) @ Wo.T + bo

    A = gamma / np.sqrt(1.0 + eps)                 # radius sqrt(d): rho^2 / d = 1
    W, b, O = Wk.T @ Wq / np.sqrt(d), Wk.T @ bq / np.sqrt(d), Wo @ Wv
    P = np.eye(d) - 1.0 / d
    truth = {"W": P @ (A[:, None] * W * A) @ P, "b": P @ (A * (W @ beta + b)),
             "O": (O * A) @ P, "c": Wo @ bv + bo + O @ beta, "R": Rm @ P}
    return box, truth


def canonical_error(model: VectorSphereAttention, truth: dict) -> float:
    """The largest relative (Frobenius) error of W, b, O, c, R (R = 0: absolute)."""
    return max(np.linalg.norm(np.squeeze(getattr(model, k)) - v)
               / (np.linalg.norm(v) if np.linalg.norm(v) > 0 else 1.0)
               for k, v in truth.items())


def test_three_token_solve_inverts_the_weights():
    h = np.array([[1.0, -2.0, 0.5], [0.3, 0.1, -1.0]])
    t = np.array([1.3, -2.1])
    def sigma(z):
        return 1.0 / (1.0 + np.exp(-z))

    gA, gB = sigma(t + np.log(2))[:, None] * h, sigma(t - np.log(2))[:, None] * h
    h2, t2, _ = three_token_solve(gA, gB)
    assert np.allclose(h2, h, rtol=1e-13) and np.allclose(t2, t, rtol=1e-12)


@pytest.mark.parametrize("d", [8, 16, 32])
def test_recovered_on_the_sphere_at_4d_minus_3(d):
    for seed in range(3):
        box, truth = block(d, d, seed)
        result = extract(Oracle(box, d, outputs="last"), model="pre-ln", seed=seed)
        report = result.report
        assert isinstance(result.model, VectorSphereAttention)
        assert report.breakdown["rescaling"] == 0
        # 34 on the sphere (the smallest check) and 8 rescaled off it
        assert report.breakdown["verification"] == 42
        assert result.queries == 4 * d - 3 + 42
        assert canonical_error(result.model, truth) <= CANONICAL_TOLERANCE
        assert report.verification.passed


def test_no_residual_and_a_wider_answer():
    d, m = 12, 20
    box, truth = block(d, m, 5, residual=False)
    oracle = Oracle(box, d, outputs="last")
    result = extract_vector_pre_layer_norm(oracle, seed=0)
    assert canonical_error(result.model, truth) <= CANONICAL_TOLERANCE
    assert np.linalg.norm(result.model.R) <= 1e-12
    assert result.queries == 4 * d - 3 + result.report.breakdown["verification"]


def test_result_saves_and_reloads_and_refuses_tokens_off_the_sphere(tmp_path):
    d = 8
    box, _ = block(d, d, 2)
    result = extract(Oracle(box, d, outputs="last"), model="pre-ln", seed=3)
    path = result.save(tmp_path / "vpreln.npz")
    again = ExtractionResult.load(path).model
    X = np.random.default_rng(0).standard_normal((4, 5, d))
    X -= X.mean(-1, keepdims=True)
    X *= np.sqrt(d) / np.linalg.norm(X, axis=-1, keepdims=True)
    assert np.allclose(again(X), result.model(X), rtol=0, atol=1e-14)
    assert np.allclose(again(X), box(X), rtol=0, atol=1e-9)
    with pytest.raises(InputError):
        again(2.0 * X)


def test_gpt2_block_attention_recovered():
    import torch
    import transformers
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    d = 16
    config = transformers.GPT2Config(n_embd=d, n_head=1, n_layer=1, attn_implementation="eager")
    torch.manual_seed(0)
    gpt = GPT2Block(config, layer_idx=0).double().eval()
    with torch.no_grad():      # weights of a trained layer's size (Conv1D's init is 0.02)
        gpt.attn.c_attn.weight.copy_(0.3 * torch.randn(d, 3 * d, dtype=torch.float64))
        gpt.attn.c_proj.weight.copy_(0.3 * torch.randn(d, d, dtype=torch.float64))
        gpt.ln_1.weight.copy_(1 + 0.3 * torch.randn(d, dtype=torch.float64))
        gpt.ln_1.bias.copy_(0.2 * torch.randn(d, dtype=torch.float64))
        gpt.attn.c_attn.bias.copy_(0.2 * torch.randn(3 * d, dtype=torch.float64))
        gpt.attn.c_proj.bias.copy_(0.2 * torch.randn(d, dtype=torch.float64))

    def box(X):
        with torch.no_grad():
            x = torch.as_tensor(np.asarray(X, dtype=float))
            return (x + gpt.attn(gpt.ln_1(x))[0])[:, -1].numpy()

    result = extract(Oracle(box, d, outputs="last"), model="pre-ln", seed=0)
    # the truth on the sphere of radius sqrt(d) from the checkpoint's own tensors
    Wa, ba = gpt.attn.c_attn.weight.detach().numpy(), gpt.attn.c_attn.bias.detach().numpy()
    Wq, Wk, Wv = Wa[:, :d].T, Wa[:, d:2 * d].T, Wa[:, 2 * d:].T
    bq, bv = ba[:d], ba[2 * d:]
    Wo, bo = gpt.attn.c_proj.weight.detach().numpy().T, gpt.attn.c_proj.bias.detach().numpy()
    gamma, beta = gpt.ln_1.weight.detach().numpy(), gpt.ln_1.bias.detach().numpy()
    A = gamma / np.sqrt(1.0 + config.layer_norm_epsilon)
    W, b, O = Wk.T @ Wq / np.sqrt(d), Wk.T @ bq / np.sqrt(d), Wo @ Wv
    P = np.eye(d) - 1.0 / d
    truth = {"W": P @ (A[:, None] * W * A) @ P, "b": P @ (A * (W @ beta + b)),
             "O": (O * A) @ P, "c": Wo @ bv + bo + O @ beta, "R": P}
    assert canonical_error(result.model, truth) <= CANONICAL_TOLERANCE
    assert result.queries == 4 * d - 3 + result.report.breakdown["rescaling"] \
        + result.report.breakdown["verification"]


@pytest.mark.parametrize("impostor", [{"norm": "none"}, {"norm": "rms"},
                                      {"activation": "relu"}])
def test_impostors_refused(impostor):
    d = 8
    box, _ = block(d, d, 1, **impostor)
    with pytest.raises(ModelMismatchError):
        extract(Oracle(box, d, outputs="last"), model="pre-ln", seed=0)


def test_refuses_scalar_oracles_and_bad_head_counts():
    d = 8
    box, _ = block(d, d, 0)
    with pytest.raises(InputError):
        extract_vector_pre_layer_norm(Oracle(box, d, outputs="last"), heads=0)
    with pytest.raises(InputError):
        extract_vector_pre_layer_norm(Oracle(lambda X: box(X)[:, 0], d, outputs="scalar"))


def test_an_oracle_not_told_finds_the_vectors_and_switches():
    d = 8
    box, truth = block(d, d, 0)
    result = extract(Oracle(box, d), model="pre-ln", seed=0)
    spent = result.report.breakdown["answers found to be vectors"]
    assert spent == d              # the scalar learner's first batch: d single tokens
    assert result.queries == spent + 4 * d - 3 + result.report.breakdown["verification"]
    assert canonical_error(result.model, truth) <= CANONICAL_TOLERANCE


def test_a_saved_model_is_verified_on_its_sphere_by_the_cli_and_the_api(tmp_path):
    from conftest import run_cli

    target = tmp_path / "box.py"
    target.write_text(f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
                      "from test_vector_pre_layer_norm import block\n"
                      "box = block(8, 8, 3)[0]\n")
    out = tmp_path / "r.npz"
    result = extract(Oracle(block(8, 8, 3)[0], 8, outputs="last"), model="pre-ln", seed=2)
    result.save(out)
    match = run_cli("verify", "--target", f"{target}:box", "--result", out, "--seed", 3,
                    "--no-progress", check=0)
    assert "MATCH" in match.stdout and "vector-pre-ln-sphere" in match.stdout
    other = Oracle(block(8, 8, 4)[0], 8, outputs="last")
    check = verify_model(other, ExtractionResult.load(out).model, count=30, seed=3)
    assert not check.passed and check.sequences == 30 + 7


def test_every_position_answers_are_read_at_the_last_position():
    d = 8
    box, truth = block(d, d, 6, every=True)
    result = extract(Oracle(box, d, outputs="all", causal=True), model="pre-ln", seed=0)
    assert canonical_error(result.model, truth) <= CANONICAL_TOLERANCE
    assert result.queries == 4 * d - 3 + result.report.breakdown["rescaling"] \
        + result.report.breakdown["verification"]
