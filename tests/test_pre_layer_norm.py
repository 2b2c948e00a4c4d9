"""Pre-LayerNorm attention (GPT-2 style): the model, its restriction to the sphere where
LayerNorm is affine, and the learner that recovers that restriction (issue 26, stretch)."""

import numpy as np
import pytest

from attnextract import extract
from attnextract.adapters.targets import random_pre_layer_norm, random_single_head, with_biases
from attnextract.errors import InputError, ModelMismatchError, NotIdentifiableError
from attnextract.models import PreLayerNormAttention, SphereAttention, layer_norm
from attnextract.oracle import Oracle
from attnextract.report import load_model

from conftest import grid, rel_err, run_cli


def sphere(count, length, dim, radius, rng):
    """(count, length, d) tokens with zero mean and norm ``radius``."""
    X = rng.standard_normal((count, length, dim))
    X -= X.mean(axis=-1, keepdims=True)
    return radius * X / np.linalg.norm(X, axis=-1, keepdims=True)


def identified_errors(model: SphereAttention, truth: SphereAttention) -> dict:
    """Relative errors of every identified part (c against max(|c|, |v|): c may be 0)."""
    errors = {name: rel_err(getattr(model, name), getattr(truth, name)) for name in "Wbvr"}
    errors["c"] = abs(model.c - truth.c) / max(abs(truth.c), np.linalg.norm(truth.v))
    return errors


@pytest.mark.parametrize("heads, dim", [(1, 8), (2, 16)])
def test_the_merged_model_and_its_sphere_form_are_torch_forward_pass(heads, dim):
    import torch
    from attnextract.adapters.torch_target import TorchPreLayerNormBlackBox
    torch.manual_seed(heads * 100 + dim)
    norm = torch.nn.LayerNorm(dim, eps=1e-5)
    attention = torch.nn.MultiheadAttention(dim, heads, bias=True, batch_first=True)
    with torch.no_grad():                         # every bias and LN parameter nonzero
        norm.weight.copy_(1 + 0.3 * torch.randn(dim))
        norm.bias.copy_(0.3 * torch.randn(dim))
        attention.in_proj_bias.copy_(torch.randn(3 * dim))
        attention.out_proj.bias.copy_(torch.randn(dim))
    box = TorchPreLayerNormBlackBox(norm, attention, readout=3)
    model = box.merged_parameters()
    rng = np.random.default_rng(dim)
    X = 2.0 * rng.standard_normal((40, 6, dim)) + 0.5          # anywhere
    assert np.max(np.abs(model(X) - box(X))) < 1e-14 * np.max(np.abs(box(X)))
    radius = 1.3 * np.sqrt(dim)
    S = sphere(40, 6, dim, radius, rng)
    on_sphere = model.on_sphere(radius)
    assert np.max(np.abs(on_sphere(S) - box(S))) < 1e-14 * np.max(np.abs(box(S)))
    with pytest.raises(InputError, match="zero mean and norm"):
        on_sphere(X)


def test_sphere_form_is_projected_and_reloads():
    box = random_pre_layer_norm(2, 8, seed=1)
    truth = box.on_sphere(np.sqrt(8))
    ones = np.ones(8)
    assert np.abs(truth.W @ ones).max() < 1e-15 and np.abs(truth.v @ ones).max() < 1e-15
    assert abs(truth.r @ ones) < 1e-15 and np.abs(truth.b @ ones).max() < 1e-15
    again = SphereAttention(**truth.parameters())
    S = sphere(5, 4, 8, np.sqrt(8), np.random.default_rng(0))
    assert np.allclose(again(S), truth(S), rtol=1e-14, atol=0)     # P is applied again
    with pytest.raises(InputError):
        PreLayerNormAttention(np.ones(8), np.zeros(8), box.W, box.b, box.v, eps=0.0)


def test_layer_norm_is_affine_on_the_sphere_only():
    rng = np.random.default_rng(3)
    gamma, beta, radius = 1 + rng.standard_normal(6), rng.standard_normal(6), 2.0
    x = sphere(1, 1, 6, radius, rng)[0, 0]
    scale = np.sqrt(radius ** 2 / 6 + 1e-5)
    assert np.allclose(layer_norm(x, gamma, beta, 1e-5), gamma * x / scale + beta, rtol=1e-15)
    assert np.allclose(layer_norm(3 * x + 1, gamma, beta, 0.0), layer_norm(x, gamma, beta, 0.0))


@pytest.mark.parametrize("dim, seed", [(d, s) for d in (8, 16)
                                       for s in grid(range(20), (0, 7, 11))])
def test_a_pre_ln_head_is_recovered_on_the_sphere_at_the_floor(dim, seed):
    box = random_pre_layer_norm(1, dim, seed)
    oracle = Oracle(box, dim)
    result = extract(oracle, "pre-ln", seed=seed)
    model, report = result.model, result.report
    assert isinstance(model, SphereAttention) and model.radius == np.sqrt(dim)
    errors = identified_errors(model, box.on_sphere(model.radius))
    assert max(errors.values()) < 1e-10, errors
    floor = dim * dim + dim - 1                       # (d-1)^2 + 3(d-1) + 1
    assert report.floor == floor
    assert report.breakdown["recovery"] == floor
    assert report.breakdown["rescaling"] <= floor // 4      # a few columns at a shorter chord
    assert result.queries == oracle.queries == floor + report.breakdown["rescaling"] + \
        report.breakdown["verification"]
    assert report.verification.passed
    assert report.details["error_bar_W"] < 1e-10 and errors["W"] <= report.details["error_bar_W"]


@pytest.mark.parametrize("dim, seed", [(8, 0), (16, 1)])
@pytest.mark.parametrize("hostile", ["W x100", "W x1e-6", "v x1e-8", "residual x100"])
def test_hostile_blocks_are_recovered_within_their_error_bars(dim, seed, hostile):
    """Saturating or vanishing scores, heights drowned by the residual: the sphere leaves no
    scale knob, so the precision is what it is, and the report's bars must cover it."""
    block = random_pre_layer_norm(1, dim, seed)
    factor = float(hostile.split("x")[1])
    parts = block.parameters()
    name = {"W": "W", "v": "v", "residual": "r"}[hostile.split()[0]]
    parts[name] = factor * parts[name]
    box = PreLayerNormAttention(**parts)
    result = extract(Oracle(box, dim), "pre-ln", seed=seed)
    truth, bars = box.on_sphere(result.model.radius), result.report.details
    errors = identified_errors(result.model, truth)
    b_error = np.linalg.norm(result.model.b - truth.b) / max(
        np.linalg.norm(truth.b), truth.radius * np.linalg.norm(truth.W))
    assert errors["W"] <= bars["error_bar_W"] and errors["v"] <= bars["error_bar_v"], errors
    assert b_error <= bars["error_bar_b"], (b_error, bars)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_torch_pre_ln_block_with_a_custom_radius(seed):
    import torch
    from attnextract.adapters.torch_target import TorchPreLayerNormBlackBox
    torch.manual_seed(seed)
    dim = 8
    norm = torch.nn.LayerNorm(dim)
    attention = torch.nn.MultiheadAttention(dim, 1, bias=True)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dim))
        norm.bias.copy_(0.3 * torch.randn(dim))
        attention.in_proj_bias.copy_(torch.randn(3 * dim))
    box = TorchPreLayerNormBlackBox(norm, attention, readout=seed)
    result = extract(Oracle(box, dim), "pre-ln", seed=seed, radius=5.0)
    errors = identified_errors(result.model, box.merged_parameters().on_sphere(5.0))
    assert max(errors.values()) < 1e-10, errors


def _post_ln(box):
    def post_ln(X):                     # LayerNorm after the residual sum: not affine there
        X = np.asarray(X)
        y = X[:, -1, :] + box.attention.outputs(X)[:, None] * box.r
        return layer_norm(y, box.gamma, box.beta, box.eps) @ box.r
    return post_ln


def _plain(dim, seed):
    head, r = with_biases(random_single_head(dim, seed), seed), random_pre_layer_norm(1, dim, seed).r
    return lambda X: head(X) + np.asarray(X)[:, -1] @ r       # no LayerNorm at all


@pytest.mark.parametrize("dim, seed", [(8, 0), (16, 1)])
@pytest.mark.parametrize("impostor", ["post-LN", "plain attention + residual", "two heads"])
def test_boxes_that_are_not_a_pre_ln_head_are_refused(dim, seed, impostor):
    box = {"post-LN": lambda: _post_ln(random_pre_layer_norm(1, dim, seed)),
           "plain attention + residual": lambda: _plain(dim, seed),
           "two heads": lambda: random_pre_layer_norm(2, dim, seed)}[impostor]()
    with pytest.raises(ModelMismatchError, match="not a pre-LayerNorm attention head") as info:
        extract(Oracle(box, dim), "pre-ln", seed=seed)
    if impostor == "plain attention + residual":   # right on the sphere, wrong off it
        assert "no LayerNorm in front" in str(info.value)


@pytest.mark.parametrize("name", ["second head 1e-8", "two heads x1e200", "attention sink",
                                  "sliding window 16", "cubic scores"])
def test_zoo_impostors_behind_a_layer_norm_are_refused(name):
    from attnextract.testing.impostors import BehindLayerNorm
    box = BehindLayerNorm(random_pre_layer_norm(1, 8, 2), name, np.random.default_rng(2), 71)
    with pytest.raises(ModelMismatchError):
        extract(Oracle(box, 8), "pre-ln", seed=2)


@pytest.mark.parametrize("factor", [1e200, 1e-200])
def test_huge_and_tiny_outputs_are_recovered(factor):
    from attnextract.models import scale_outputs
    from attnextract.verification import safe_norm
    box = scale_outputs(random_pre_layer_norm(1, 8, 1), factor)
    result = extract(Oracle(box, 8), "pre-ln", seed=1)
    truth = box.on_sphere(result.model.radius)
    for name in "Wbvr":
        error = safe_norm(getattr(result.model, name) - getattr(truth, name))
        assert error <= 1e-10 * safe_norm(getattr(truth, name)), name


def test_a_value_along_the_ones_direction_is_not_identifiable():
    box = random_pre_layer_norm(1, 8, 0)
    flat = PreLayerNormAttention(np.ones(8), box.beta, box.W, box.b, np.ones((1, 8)), box.c,
                                 box.r, box.eps)          # gamma = 1: A v = v / s is along 1
    with pytest.raises(NotIdentifiableError, match="P v = 0"):
        extract(Oracle(flat, 8), "pre-ln", seed=0)


def test_bad_radius_and_dimension_are_input_errors():
    with pytest.raises(InputError, match="radius"):
        extract(Oracle(random_pre_layer_norm(1, 8, 0), 8), "pre-ln", radius=-1.0)
    with pytest.raises(NotIdentifiableError, match="d = 2"):
        extract(Oracle(random_pre_layer_norm(1, 2, 0), 2), "pre-ln")


def test_the_command_line_extracts_a_pre_ln_box_and_the_result_refuses_off_the_sphere(tmp_path):
    target = tmp_path / "box.py"
    target.write_text("from attnextract.adapters.targets import random_pre_layer_norm\n"
                      "box = random_pre_layer_norm(1, 6, seed=4)\n")
    out = tmp_path / "r.npz"
    proc = run_cli("extract", "--target", f"{target}:box", "--dim", 6, "--model", "pre-ln",
                   "--radius", 3, "--seed", 1, "--out", out, "--no-progress", check=0)
    assert "pre-ln-sphere" in proc.stdout and "PASSED" in proc.stdout
    model = load_model(out)
    truth = random_pre_layer_norm(1, 6, seed=4).on_sphere(3.0)
    assert max(identified_errors(model, truth).values()) < 1e-10
    with pytest.raises(InputError):
        model(np.ones((3, 6)))


def test_attnextract_verify_checks_a_saved_pre_ln_model_on_its_sphere(tmp_path):
    target = tmp_path / "box.py"
    target.write_text("from attnextract.adapters.targets import random_pre_layer_norm\n"
                      "box = random_pre_layer_norm(1, 6, seed=5)\n"
                      "other = random_pre_layer_norm(1, 6, seed=6)\n")
    out = tmp_path / "r.npz"
    run_cli("extract", "--target", f"{target}:box", "--dim", 6, "--model", "pre-ln",
            "--seed", 2, "--out", out, "--no-progress", check=0)
    match = run_cli("verify", "--target", f"{target}:box", "--result", out, "--seed", 3,
                    "--no-progress", check=0)
    assert "MATCH" in match.stdout
    mismatch = run_cli("verify", "--target", f"{target}:other", "--result", out, "--seed", 3,
                       "--no-progress", check=1)
    assert "MISMATCH" in mismatch.stderr


def test_a_served_pre_ln_block_is_extracted_over_http():
    import threading
    from attnextract.adapters.remote import HttpBlackBox
    from attnextract.adapters.server import make_server
    block = random_pre_layer_norm(1, 8, seed=9)
    server = make_server(block, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    try:
        host, port = server.server_address[:2]
        result = extract(Oracle(HttpBlackBox(f"http://{host}:{port}"), 8), "pre-ln", seed=9)
    finally:
        server.shutdown()
        server.server_close()
    assert max(identified_errors(result.model, block.on_sphere(result.model.radius)).values()) \
        < 1e-10
