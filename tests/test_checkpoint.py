"""Model folders (config.json + model.safetensors) extracted layer by layer, run by their own code.

Every checkpoint is built here, offline, with transformers (random init, save_pretrained):
nothing is downloaded."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import run_cli

from attnextract.adapters.checkpoint import (
    Checkpoint,
    RotaryModelError,
    inspect_checkpoint,
    parse_layers,
)
from attnextract.errors import InputError, TargetLoadError


def _save(model, path):
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def _randomise_biases(model, seed):
    """Trained layers have biases; a fresh init has zeros: draw them, so they are tested."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_1.weight" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                     intermediate_size=64, vocab_size=64,
                                     max_position_embeddings=64)
    model = _randomise_biases(transformers.BertModel(config), 1)
    return _save(model, tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=64,
                                     n_positions=64)
    model = _randomise_biases(transformers.GPT2Model(config), 2)
    return _save(model, tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=4, num_hidden_layers=1,
                                      intermediate_size=64, vocab_size=64)
    return _save(transformers.LlamaModel(config), tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("which", ["bert_folder", "gpt2_folder"])
def test_the_box_is_the_canonical_form_of_the_weights(which, request):
    """The framework's own forward pass equals the canonical form at every position."""
    ck = Checkpoint(request.getfixturevalue(which))
    rng = np.random.default_rng(0)
    for layer in range(ck.info.layers):
        box, truth = ck.black_box(layer, "all"), ck.truth(layer)
        X = rng.standard_normal((9, 6, 32))
        F, G = box(X), truth.forward(X)
        assert F.shape == (9, 6, 32)
        assert np.abs(F - G).max() <= 1e-12 * np.abs(G).max()
        last = ck.black_box(layer, "last")(X)
        np.testing.assert_array_equal(last, F[:, -1])


def test_gpt2_box_is_causal_and_bert_is_not(bert_folder, gpt2_folder):
    rng = np.random.default_rng(1)
    X = rng.standard_normal((3, 5, 32))
    Y = X.copy()
    Y[:, -1] += 1.0                               # only the last token changes
    causal = Checkpoint(gpt2_folder).black_box(0, "all")
    np.testing.assert_array_equal(causal(X)[:, :-1], causal(Y)[:, :-1])
    both = Checkpoint(bert_folder).black_box(0, "all")
    assert np.abs(both(X)[:, 0] - both(Y)[:, 0]).max() > 1e-6


def test_families_from_config(bert_folder, gpt2_folder):
    bert, gpt2 = inspect_checkpoint(bert_folder), inspect_checkpoint(gpt2_folder)
    assert (bert.family, bert.causal, bert.heads, bert.head_dim) == ("bert", False, 4, 8)
    assert (gpt2.family, gpt2.causal, gpt2.layers) == ("gpt2", True, 2)
    assert parse_layers("all", 6) == list(range(6))
    assert parse_layers("5,0,3,3", 6) == [0, 3, 5]
    for bad in ("6", "x", "-1"):
        with pytest.raises(InputError):
            parse_layers(bad, 6)


def test_a_rotary_checkpoint_is_refused_before_any_query(llama_folder, tmp_path):
    with pytest.raises(RotaryModelError, match="rotary"):
        inspect_checkpoint(llama_folder)
    # refused from config.json alone: the weights are never read
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    with pytest.raises(RotaryModelError):
        inspect_checkpoint(tmp_path)
    proc = run_cli("checkpoint", llama_folder, "--no-progress", check=1, timeout=120)
    assert "rotary" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_bad_folders_get_one_line_and_exit_2(tmp_path, bert_folder):
    with pytest.raises(TargetLoadError, match="not a folder"):
        inspect_checkpoint(tmp_path / "missing")
    with pytest.raises(TargetLoadError, match="no config.json"):
        inspect_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(TargetLoadError, match="model.safetensors"):
        inspect_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(TargetLoadError, match="not supported"):
        inspect_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(TargetLoadError, match="JSON"):
        inspect_checkpoint(tmp_path)
    for folder in (tmp_path / "missing", tmp_path):
        proc = run_cli("checkpoint", folder, "--no-progress", check=2, timeout=120)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
