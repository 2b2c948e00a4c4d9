"""A real torch.nn.MultiheadAttention as the black box: extraction matches its outputs."""

import json
import textwrap

import numpy as np
import pytest
import torch

from attnextract import InputError, ModelMismatchError, Oracle, extract_single_head
from attnextract.models import SingleHeadAttention
from attnextract.adapters.torch_target import TorchAttentionBlackBox, merged_head_parameters
from attnextract.adapters.journal import CHALLENGES
from attnextract.report import verification_count

from conftest import rel_err, run_cli


def mha(embed, heads, seed, **kw):
    torch.manual_seed(seed)
    module = torch.nn.MultiheadAttention(embed, heads, bias=kw.pop("bias", False),
                                         batch_first=kw.pop("batch_first", True), **kw)
    with torch.no_grad():   # torch's init gives tiny scores; make the attention non-trivial
        module.in_proj_weight.mul_(3.0)
    return module


@pytest.mark.parametrize("seed", range(4))
def test_single_head_module_is_extracted_exactly(seed):
    module = mha(8, 1, seed, batch_first=bool(seed % 2))
    box = TorchAttentionBlackBox(module, readout=seed)
    result = extract_single_head(Oracle(box, 8), seed=seed)
    W, v = box.merged_parameters()
    assert rel_err(result.model.W, W) < 1e-9 and rel_err(result.model.v, v) < 1e-12
    X = np.random.default_rng(seed).standard_normal((50, 7, 8))
    assert np.max(np.abs(result.model(X) - box(X))) < 1e-10 * np.max(np.abs(box(X)))
    # the formula W = K^T Q / sqrt(hd), v = V^T O^T r reproduces the module itself
    assert np.max(np.abs(SingleHeadAttention(W, v)(X) - box(X))) < 1e-12


@pytest.mark.parametrize("head", range(4))
def test_one_head_of_a_multi_head_module(head):
    module = mha(12, 4, seed=10 + head)               # head_dim 3: W of rank 3
    box = TorchAttentionBlackBox(module, readout=np.linspace(-1, 1, 12), head=head)
    result = extract_single_head(Oracle(box, 12), seed=head)
    W, v = merged_head_parameters(module, np.linspace(-1, 1, 12), head)
    assert np.linalg.matrix_rank(W) == 3
    assert rel_err(result.model.W, W) < 1e-9 and rel_err(result.model.v, v) < 1e-12
    # the module itself is untouched by the wrapper
    assert torch.count_nonzero(module.out_proj.weight) == 12 * 12


def test_the_whole_multi_head_module_is_reported_as_a_mismatch():
    box = TorchAttentionBlackBox(mha(8, 2, seed=1), readout=0)
    with pytest.raises(ModelMismatchError):
        extract_single_head(Oracle(box, 8), seed=0)


def test_biases_are_outside_the_model_class():
    module = mha(6, 1, seed=2, bias=True)
    with torch.no_grad():
        module.in_proj_bias.normal_()
        module.out_proj.bias.normal_()
    with pytest.raises(ModelMismatchError):
        extract_single_head(Oracle(TorchAttentionBlackBox(module, readout=1), 6), seed=0)


def test_float32_forward_is_too_coarse_for_exact_extraction():
    box = TorchAttentionBlackBox(mha(6, 1, seed=3), readout=1, dtype="float32")
    with pytest.raises(ModelMismatchError) as info:
        extract_single_head(Oracle(box, 6), seed=0)
    assert info.value.result.report.verification.max_relative_error > 1e-7


def test_bad_arguments():
    with pytest.raises(InputError, match="MultiheadAttention"):
        TorchAttentionBlackBox(torch.nn.Linear(4, 4))
    with pytest.raises(InputError, match="head must be in 0..1"):
        TorchAttentionBlackBox(mha(4, 2, seed=0), head=2)
    with pytest.raises(InputError, match="readout must be 4"):
        TorchAttentionBlackBox(mha(4, 2, seed=0), readout=np.ones(3))
    with pytest.raises(InputError, match="kdim"):
        TorchAttentionBlackBox(torch.nn.MultiheadAttention(4, 1, kdim=3, vdim=3))
    with pytest.raises(InputError, match="several heads"):
        TorchAttentionBlackBox(mha(4, 2, seed=0)).merged_parameters()
    with pytest.raises(InputError, match=r"\(B, N, 4\)"):
        TorchAttentionBlackBox(mha(4, 1, seed=0))(np.ones((2, 3, 5)))


@pytest.mark.slow
def test_torch_target_file_on_the_command_line(tmp_path):
    (tmp_path / "layer.py").write_text(textwrap.dedent("""
        import torch
        from attnextract.adapters.torch_target import TorchAttentionBlackBox

        torch.manual_seed(0)
        layer = torch.nn.MultiheadAttention(16, 4, bias=False, batch_first=True)
        black_box = TorchAttentionBlackBox(layer, readout=7, head=1)
    """))
    proc = run_cli("extract", "--target", f"{tmp_path / 'layer.py'}:black_box", "--dim", "16",
                   "--out", str(tmp_path / "r.npz"), "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    # d^2 + d, the held-out check, and the journal's challenges (asked of the box, so counted)
    assert report["queries"] == 16 * 16 + 16 + verification_count(272, 272) + CHALLENGES
    assert report["verification"]["passed"]
    torch.manual_seed(0)
    layer = torch.nn.MultiheadAttention(16, 4, bias=False, batch_first=True)
    W, v = merged_head_parameters(layer, 7, 1)
    with np.load(tmp_path / "r.npz") as r:
        assert rel_err(r["W"], W) < 1e-9 and rel_err(r["v"], v) < 1e-12


@pytest.mark.parametrize("seed", range(2))
def test_one_torch_head_by_the_low_rank_learner_at_its_floor(seed):
    from attnextract.learners.low_rank import extract_low_rank
    module = mha(64, 8, seed=20 + seed)                       # head_dim 8: rank 8 of 64
    box = TorchAttentionBlackBox(module, readout=seed, head=seed + 2)
    result = extract_low_rank(Oracle(box, 64), seed=seed)
    W, v = box.merged_parameters()
    floor = 64 + 8 * (2 * 64 - 8)                             # d + r(2d - r) = 1024
    recovery = result.queries - result.report.breakdown["verification"]
    assert result.report.details["rank"] == 8
    assert floor <= recovery <= 1.05 * floor + 32 < 64 * 64 + 64
    assert rel_err(result.model.W, W) < 1e-9 and rel_err(result.model.v, v) < 1e-12
