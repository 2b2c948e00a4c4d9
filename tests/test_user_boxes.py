"""Issue 22: boxes written by a user, outside the project (tests/user_boxes.py), through the
API and the command line. The whole set is benchmarks/check_user_boxes.py
(benchmarks/results/check_user_boxes.md)."""

import numpy as np
import pytest

import attnextract
from attnextract import Oracle
from attnextract.errors import (BlackBoxError, MalformedOutputError, ModelMismatchError,
                                NonFiniteOutputError)

import user_boxes as ub
from conftest import run_cli


def _probes(d, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((5, 3, d))


@pytest.mark.parametrize("style", ["float", "0d", "(1,)", "float32"])
def test_a_box_written_for_one_sequence_is_asked_one_sequence_at_a_time(style):
    W, v = ub.draw_heads(4, 2, seed=1)
    oracle = Oracle(ub.numpy_box(W, v, style), 4)
    X = _probes(4)
    answers = oracle.query(X)
    assert oracle.per_sequence is True and oracle.queries == 5 and answers.shape == (5,)
    tol = 1e-5 if style == "float32" else 1e-13
    assert np.allclose(answers, ub.formula_batched(X, W, v), rtol=tol, atol=tol)
    # later batches of other sizes go the same way
    assert oracle.query(X[:2]).shape == (2,) and oracle.queries == 7


def test_a_batched_box_stays_batched_and_a_column_is_its_answers():
    W, v = ub.draw_heads(4, 2, seed=1)
    batched = Oracle(ub.numpy_box(W, v, "batched"), 4)
    X = _probes(4)
    expected = ub.formula_batched(X, W, v)
    assert np.array_equal(batched.query(X), expected) and batched.per_sequence is False
    column = Oracle(lambda X: ub.formula_batched(X, W, v)[:, None], 4)       # (B, 1)
    assert np.array_equal(column.query(X), expected)


def test_a_per_sequence_box_is_extracted():
    W, v = ub.draw_heads(4, 1, seed=2)
    result = attnextract.extract(Oracle(ub.numpy_box(W, v, "float"), 4), model="single-head")
    assert np.linalg.norm(result.model.W - W[0]) <= 1e-9 * np.linalg.norm(W[0])
    assert np.linalg.norm(result.model.v - v[0]) <= 1e-9 * np.linalg.norm(v[0])


def test_boxes_outside_the_class_are_refused_with_typed_errors():
    W, v = ub.draw_heads(4, 2, seed=1)
    X = _probes(4)
    with pytest.raises(MalformedOutputError, match="2 numbers .* for one sequence"):
        Oracle(ub.outside_box("two numbers", W, v), 4, outputs="scalar").query(X)
    # not stated: two numbers per sequence are a vector answer (m = 2), held to from then on
    two = Oracle(ub.outside_box("two numbers", W, v), 4)
    assert two.query(X).shape == (len(X), 2) and (two.outputs, two.out_dim) == ("last", 2)
    nan_once = Oracle(ub.outside_box("NaN once", W, v), 4)
    for _ in range(9):                    # 45 sequences answered one at a time
        nan_once.query(X)
    with pytest.raises(NonFiniteOutputError, match="non-finite"):
        nan_once.query(X)
    # neither a batch nor one sequence: the box's own error, with what one sequence gave
    with pytest.raises(BlackBoxError, match="given one sequence .* it raised"):
        Oracle(lambda X: 1 / 0, 4).query(X)


def test_relu_after_attention_is_not_returned():
    W, v = ub.draw_heads(8, 2, seed=0)
    with pytest.raises((ModelMismatchError, attnextract.errors.RecoveryFailedError)):
        attnextract.extract(Oracle(ub.outside_box("relu after attention", W, v), 8),
                            model="multi-head", heads=2, seed=0)


def test_module_name_targets_on_the_command_line(tmp_path):
    (tmp_path / "mybox.py").write_text(
        "import numpy as np\n"
        "rng = np.random.default_rng(3)\n"
        "W, v = rng.standard_normal((4, 4)) / 2, rng.standard_normal(4)\n"
        "def box(X):                       # one sequence (N, 4) -> a float\n"
        "    s = X @ W @ X[-1]\n"
        "    a = np.exp(s - s.max())\n"
        "    return float(a @ (X @ v) / a.sum())\n")
    proc = run_cli("extract", "--target", "mybox:box", "--dim", 4, "--out", tmp_path / "r",
                   "--no-progress", "--no-journal", "--seed", 0, cwd=tmp_path, check=0)
    assert "wrote" in proc.stdout + proc.stderr
    missing = run_cli("extract", "--target", "nosuchmodule:box", "--dim", 4, "--out",
                      tmp_path / "s", "--no-progress", "--no-journal", cwd=tmp_path, check=2)
    assert "no module 'nosuchmodule'" in missing.stderr


# -- PyTorch -------------------------------------------------------------------------------

def test_default_torch_layer_float64_copy_no_heads_told():
    import torch  # noqa: F401  (a test-all package: see conftest.py)
    from attnextract.adapters.torch_target import TorchAttentionBlackBox
    layer = ub.torch_layer(8, 2)            # PyTorch's defaults: float32, zero biases
    box = TorchAttentionBlackBox(layer, readout=0)
    result = attnextract.extract(Oracle(box, 8), model="multi-head", seed=0)
    W, v, b, c = ub.torch_truth(layer, ub.unit_readout(8, 0))
    assert ub.canonical_errors(result.model, W, v, b, c)["W"] <= 1e-10
    assert result.report.details["recovery queries"] <= 4 * 2 * 8 ** 2 - 2 * 2 + 1


def test_trained_biases_name_biases_and_are_recovered_with_them():
    import torch  # noqa: F401  (a test-all package: see conftest.py)
    from attnextract.adapters.torch_target import TorchAttentionBlackBox
    layer = ub.torch_layer(8, 2, trained_biases=True)
    box = TorchAttentionBlackBox(layer, readout=0)
    with pytest.raises(ModelMismatchError, match="zero token.*--biases"):
        attnextract.extract(Oracle(box, 8), model="multi-head", heads=2, seed=0)
    result = attnextract.extract(Oracle(box, 8), model="multi-head", heads=2, seed=0,
                                 biases=True)
    errors = ub.canonical_errors(result.model, *ub.torch_truth(layer, ub.unit_readout(8, 0)))
    assert max(errors["W"], errors["v"], errors["c"]) <= 1e-9


def test_a_float32_layer_in_the_users_own_wrapper():
    import torch  # noqa: F401  (a test-all package: see conftest.py)
    layer = ub.torch_layer(8, 2, batch_first=True)
    r = ub.unit_readout(8, 1)
    result = attnextract.extract(Oracle(ub.torch_user_box(layer, r), 8), model="multi-head",
                                 heads=2, seed=0, output_dtype="float32")
    r32 = r.astype(np.float32).astype(np.float64)
    errors = ub.canonical_errors(result.model, *ub.torch_truth(layer, r32))
    assert max(errors["W"], errors["v"]) <= 1e-3


def test_torch_modules_handed_over_directly():
    import torch

    class Readout(torch.nn.Module):       # a user's module: (B, N, d) -> (B,)
        def __init__(self):
            super().__init__()
            self.attention = torch.nn.MultiheadAttention(4, 1, batch_first=True)
            self.r = torch.nn.Linear(4, 1, bias=False)

        def forward(self, X):
            out, _ = self.attention(X, X, X)
            return self.r(out[:, -1]).squeeze(-1)     # a tensor that requires grad

    torch.manual_seed(0)
    module = Readout()
    oracle = Oracle(module, 4)
    X = _probes(4)
    with torch.no_grad():
        expected = module(torch.as_tensor(X, dtype=torch.float32)).double().numpy()
    assert np.array_equal(oracle.query(X), expected)
    # a bare MultiheadAttention needs no readout: it answers its vectors, (B, N, 4)
    vectors = Oracle(module.attention, 4)
    assert vectors.query(X).shape == X.shape and vectors.outputs == "all"
    # a box that returns a tensor needing grad, in bfloat16
    bf16 = Oracle(lambda X: torch.as_tensor(X.sum((1, 2)), dtype=torch.bfloat16)
                  .requires_grad_(), 4)
    assert bf16.query(X).dtype == np.float64


def test_a_bare_multihead_attention_on_the_command_line_answers_vectors(tmp_path):
    import torch  # noqa: F401  (a test-all package: see conftest.py)
    (tmp_path / "layer.py").write_text(
        "import torch\nlayer = torch.nn.MultiheadAttention(8, 2)\n")
    from attnextract.adapters.targets import load_target
    box = load_target(f"{tmp_path / 'layer.py'}:layer")
    assert (box.output_kind, box.out_dim, box.dtype_name) == ("all", 8, "float32")
