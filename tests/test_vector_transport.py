"""Vector answers, (B, m) at the last position and (B, N, m) at every position, through
every way a black box is reached: Python callables and targets, torch modules, the
journal (SIGKILL resume included), HTTP in JSON and npy, the server's byte bounds, Ray
replicas. VectorAttention models are the boxes; answers are compared bit for bit."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc

import numpy as np
import pytest
from test_remote_adapters import FakeRay

from attnextract import Oracle
from attnextract.adapters.journal import QueryJournal, read_entries
from attnextract.adapters.remote import HttpBlackBox, JsonApiBlackBox, json_numbers
from attnextract.adapters.replicas import RayReplicas, ServedBox
from attnextract.adapters.server import ANSWER_BYTES, make_server
from attnextract.adapters.targets import load_target, random_single_head
from attnextract.errors import (
    BlackBoxError,
    JournalMismatchError,
    MalformedOutputError,
    NonFiniteOutputError,
)
from attnextract.models import VectorAttention

D, M, H = 5, 3, 2
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def vector_model(positions="last", seed=0, m=M, causal=False):
    rng = np.random.default_rng(seed)
    return VectorAttention(rng.standard_normal((H, D, D)), rng.standard_normal((H, m, D)),
                           rng.standard_normal((H, D)), rng.standard_normal(m), positions,
                           causal)


def batches(seed=1):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((b, n, D)) for b, n in ((4, 3), (6, 5), (4, 3), (1, 7))]


@pytest.fixture
def serve(start_server):
    return start_server


# -- HTTP: JSON and npy ---------------------------------------------------------------

@pytest.mark.parametrize("positions", ["last", "all"])
@pytest.mark.parametrize("transport", ["json", "npy"])
def test_http_answers_vectors_exactly(serve, positions, transport):
    model = vector_model(positions, causal=positions == "all")
    server = serve(model)
    box = HttpBlackBox(server.url, transport=transport)
    health = box.health()
    assert (health["outputs"], health["out_dim"]) == (positions, M)
    assert (box.output_kind, box.out_dim, box.causal) == (positions, M, positions == "all")
    oracle = Oracle(box, D)
    assert oracle.outputs == positions            # declared before the first query
    for X in batches():
        assert np.array_equal(oracle.query(X), model(X))      # bit for bit
    assert oracle.numbers == sum(a.size for a in map(model, batches()))
    assert box.transport == transport


def test_server_replays_vector_answers_by_key(serve):
    model = vector_model("all")
    server = serve(model)
    X = batches()[1]
    first = server.state.answer(X, key="k1")
    again = server.state.answer(X, key="k1")
    assert again["replayed"] and again["charged"] == len(X)
    assert np.array_equal(first["outputs"], again["outputs"]) and again["outputs"].shape == \
        (6, 5, M)
    assert server.state.health()["replayed"] == len(X)


def test_scalar_server_health_is_unchanged(serve):
    server = serve(random_single_head(D, seed=3))
    health = HttpBlackBox(server.url).health()
    assert "outputs" not in health and HttpBlackBox(server.url).output_kind is None


def test_served_box_of_a_file_keeps_its_kind(serve, tmp_path):
    """A FILE.py:NAME box that declares nothing: the server fixes its kind at its first
    answer and refuses (500, not charged) an answer of another shape later."""
    model = vector_model("last")
    calls = []

    class Box:
        dim = D

        def __call__(self, X):
            calls.append(len(X))
            out = model(X)
            return out if len(calls) < 3 else out[:, :2]       # m changes at the 3rd call
    server = serve(ServedBox(Box()))
    box = HttpBlackBox(server.url, retries=0)
    oracle = Oracle(box, D)
    X = batches()[1]
    assert np.array_equal(oracle.query(X), model(X)) and oracle.outputs == "last"
    assert box.health()["outputs"] == "last"
    oracle.query(X)
    with pytest.raises(BlackBoxError, match="500"):
        oracle.query(X)
    assert server.state.served == 2 * len(X)


def scripted(answers, declared=None):
    """An HttpBlackBox whose server answers ``answers`` in turn (no network)."""
    box = HttpBlackBox("http://127.0.0.1:9")
    box._declaration = declared or {}
    replies = iter(answers)

    def request(method, path, body, headers, batch=0, cap=None):
        if path == "/health":
            return b"{}", {"content-type": "application/json"}
        return json.dumps({"outputs": next(replies)}).encode(), {
            "content-type": "application/json", "x-charged": str(batch)}
    box._request = request
    box.transport = "json"
    return box


def test_http_typed_errors_for_bad_vector_answers():
    X = np.zeros((2, 3, D))
    last2 = {"outputs": "last", "out_dim": 2}
    # vectors from a server that declares none in /health: nested lists, refused
    with pytest.raises(MalformedOutputError, match="nested lists"):
        scripted([[[1.0, 2.0], [3.0, 4.0]]])(X)
    # a shape that changes between calls
    box = scripted([[[1.0, 2.0], [3.0, 4.0]], [[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]]], last2)
    assert box(X).shape == (2, 2)
    with pytest.raises(MalformedOutputError, match="length 3"):
        box(X)
    # m that disagrees with what the server declared
    box = scripted([[[1.0, 2.0], [3.0, 4.0]]], {"outputs": "last", "out_dim": 4})
    with pytest.raises(MalformedOutputError, match="length 2"):
        box(X)
    # strings, booleans, nulls, ragged nested lists: never converted
    for bad, what in (([["1.5", 2.0], [3.0, 4.0]], "str"), ([[True, 2.0], [3.0, 4.0]], "bool"),
                      ([[None, 2.0], [3.0, 4.0]], "null"),
                      ([[1.0, 2.0], [3.0]], "length 1"), ([[[1.0], [2.0, 3.0]], [[1.0], [2.0]]],
                                                           "nested lists")):
        with pytest.raises(MalformedOutputError, match=what):
            scripted([bad], last2)(X)
    # NaN (JSON's NaN token) is the oracle's NonFiniteOutputError
    oracle = Oracle(scripted([[[float("nan"), 2.0], [3.0, 4.0]]], last2), D)
    with pytest.raises(NonFiniteOutputError):
        oracle.query(X)
    assert json_numbers([[1, 2.5]], (1, 2), "u").dtype == np.float64


def test_stated_m_that_disagrees_is_refused_through_http(serve):
    server = serve(vector_model("last"))
    oracle = Oracle(HttpBlackBox(server.url), D, out_dim=M + 1)
    with pytest.raises(MalformedOutputError, match=f"m = {M}"):
        oracle.query(batches()[0])


def test_json_api_decoder_may_answer_vectors():
    model = vector_model("all")
    box = JsonApiBlackBox("http://127.0.0.1:9/score", lambda X: X.tolist(),
                          lambda answer: answer["y"])
    box._request = lambda method, path, body, headers, batch=0, cap=None: (
        json.dumps({"y": model(np.array(json.loads(body))).tolist()}).encode(),
        {"content-type": "application/json"})
    X = batches()[1]
    oracle = Oracle(box, D)
    assert np.array_equal(oracle.query(X), model(X)) and oracle.outputs == "all"


# -- the server's byte bounds ---------------------------------------------------------

@pytest.mark.parametrize("positions", ["last", "all"])
def test_body_cost_counts_every_number_of_the_answer(serve, positions):
    """body_cost reserves ANSWER_BYTES per number of the answer, m per sequence (last) or
    m per token (every position), and LIST_BYTES per list; the JSON answer's encoding
    (measured by tracemalloc) stays within the request's reservation."""
    m = 16
    server = serve(vector_model(positions, m=m))
    scalar = serve(random_single_head(D, seed=3))
    B, N = 2000, 4
    X = np.random.default_rng(0).standard_normal((B, N, D))
    body = json.dumps({"sequences": X.tolist()}).encode()
    cost = server.body_cost(len(body), "application/json")
    base = scalar.body_cost(len(body), "application/json")
    numbers = B * m if positions == "last" else B * N * m
    assert cost - base >= (numbers - B * N) * ANSWER_BYTES   # at least the extra numbers
    out = server.state.answer(X)["outputs"]
    tracemalloc.start()
    data = json.dumps({"outputs": out.tolist(), "remaining": None}).encode()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(data) <= peak <= cost
    assert server.state.answer_bytes(B, B * N) >= numbers * ANSWER_BYTES


def test_fingerprinted_ledger_of_a_vector_model(serve, tmp_path):
    state = tmp_path / "ledger.sqlite"
    server = serve(vector_model("all"), state=str(state))
    X = batches()[0]
    assert np.array_equal(Oracle(HttpBlackBox(server.url), D).query(X),
                          vector_model("all")(X))
    server.shutdown()
    server.server_close()
    with pytest.raises(Exception, match="another model"):
        make_server(vector_model("all", seed=5), "127.0.0.1", 0, state=str(state))


# -- Ray replicas ---------------------------------------------------------------------

@pytest.mark.parametrize("positions", ["last", "all"])
def test_replicas_pass_vector_answers_through(positions):
    model = vector_model(positions)
    replicas = RayReplicas(model, 3, ray_module=FakeRay())
    assert (replicas.output_kind, replicas.out_dim) == (positions, M)
    oracle = Oracle(replicas, D)
    for X in batches():      # the model on parts of a batch: equal to the last bits or so
        assert np.allclose(oracle.query(X), model(X), rtol=1e-14, atol=1e-14)


# -- Python targets --------------------------------------------------------------------

def test_file_targets_answering_vectors(tmp_path):
    (tmp_path / "boxes.py").write_text(textwrap.dedent(f"""
        import numpy as np
        from attnextract.models import VectorAttention
        rng = np.random.default_rng(0)
        model = VectorAttention(rng.standard_normal(({H}, {D}, {D})),
                                rng.standard_normal(({H}, {M}, {D})),
                                rng.standard_normal(({H}, {D})), rng.standard_normal({M}),
                                "all")
        def per_sequence_last(x):          # (N, d) -> (m,)
            return model(x[None])[0, -1]
        def per_sequence_all(x):           # (N, d) -> (N, m)
            return model(x[None])[0]
        def batched(X):
            return model(X)
    """))
    from attnextract.adapters.targets import FirstBatchHint
    truth = load_target(f"{tmp_path / 'boxes.py'}:model")
    for name, kind in (("per_sequence_last", "last"), ("per_sequence_all", "all"),
                       ("batched", "all"), ("model", "all")):
        spec = f"{tmp_path / 'boxes.py'}:{name}"
        oracle = Oracle(FirstBatchHint(load_target(spec), spec), D)
        for X in batches():
            want = truth(X)
            assert np.array_equal(oracle.query(X), want[:, -1] if kind == "last" else want)
        assert oracle.outputs == kind and oracle.out_dim == M


# -- torch -----------------------------------------------------------------------------

def test_torch_multihead_attention_answers_vectors():
    import torch
    from attnextract.adapters.torch_target import TorchAttentionBlackBox
    torch.manual_seed(0)
    layer = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    with torch.no_grad():
        layer.in_proj_bias.normal_()
        layer.out_proj.bias.normal_()
    X = np.random.default_rng(0).standard_normal((3, 4, 8))
    # the bare module: self-attention at every position, in its own float32
    layer.eval()
    oracle = Oracle(layer, 8)
    out = oracle.query(X)
    assert (oracle.outputs, oracle.out_dim, out.shape) == ("all", 8, (3, 4, 8))
    with torch.no_grad():
        seq = torch.tensor(X, dtype=torch.float32)
        own = layer(seq, seq, seq, need_weights=False)[0].double().numpy()
    assert np.array_equal(out, own)                 # its own forward pass, bit for bit
    # float64 on request: exactly the VectorAttention it computes
    for positions, causal in (("last", False), ("all", False), ("all", True)):
        box = TorchAttentionBlackBox(layer, positions=positions, causal=causal, dtype="float64")
        oracle = Oracle(box, 8)
        assert oracle.outputs == positions and box.dtype_name == "float64"
        y = oracle.query(X)
        assert np.max(np.abs(y - box.vector_model()(X))) < 1e-13 * np.max(np.abs(y))
    assert TorchAttentionBlackBox(layer).dtype_name == "float32"
    assert TorchAttentionBlackBox(layer, readout=0).output_kind == "scalar"


def test_torch_module_returning_vectors_or_a_tuple():
    import torch

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = torch.nn.MultiheadAttention(D, 1, batch_first=True,
                                                         dtype=torch.float64)

        def forward(self, X):
            return self.attention(X, X, X)          # a tuple (out, weights)

    class Last(Layer):
        def forward(self, X):
            return self.attention(X[:, -1:], X, X)[0][:, 0]     # (B, m)
    X = batches()[1]
    for module, kind in ((Layer(), "all"), (Last(), "last")):
        oracle = Oracle(module, D)
        assert oracle.query(X).shape[1:] == ((X.shape[1], D) if kind == "all" else (D,))
        assert oracle.outputs == kind


# -- the journal ------------------------------------------------------------------------

@pytest.mark.parametrize("positions", ["last", "all"])
def test_journal_stores_and_answers_vectors(tmp_path, positions):
    path = tmp_path / "j.sqlite"
    model = vector_model(positions)
    with QueryJournal(path) as journal:
        oracle = Oracle(model, D, journal=journal)
        first = [oracle.query(X) for X in batches()]
    entries = read_entries(path)
    assert len(entries) == sum(len(X) for X in batches())
    assert entries[0][2].shape == ((M,) if positions == "last" else (3, M))
    with QueryJournal(path) as journal:
        oracle = Oracle(model, D, journal=journal)
        again = [oracle.query(X) for X in batches()]
        assert oracle.journal_queries == len(entries) and oracle.black_box_queries == 0
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    # another vector model, the other kind, and a scalar box: all refused
    for other in (vector_model(positions, seed=9), vector_model(
            "all" if positions == "last" else "last"), random_single_head(D, seed=1)):
        with QueryJournal(path) as journal, pytest.raises(JournalMismatchError):
            Oracle(other, D, journal=journal).query(batches()[0])


def test_scalar_journal_refused_for_a_vector_box(tmp_path):
    path = tmp_path / "j.sqlite"
    with QueryJournal(path) as journal:
        Oracle(random_single_head(D, seed=1), D, journal=journal).query(batches()[0])
    with QueryJournal(path) as journal, pytest.raises(JournalMismatchError,
                                                      match="one number per sequence"):
        Oracle(vector_model("last"), D, journal=journal).query(batches()[0])


def test_journal_row_shape_is_in_its_checksum(tmp_path):
    import sqlite3
    path = tmp_path / "j.sqlite"
    with QueryJournal(path) as journal:
        Oracle(vector_model("all"), D, journal=journal).query(batches()[0])
    with sqlite3.connect(path) as db:
        db.execute("UPDATE batches SET shape = ?", (np.array([1, 3 * M], np.int64).tobytes(),))
    from attnextract.errors import JournalError
    with pytest.raises(JournalError, match="checksum"):
        QueryJournal(path)


SCRIPT = textwrap.dedent("""
    import hashlib, sys, time
    import numpy as np
    from attnextract import Oracle
    from attnextract.adapters.journal import QueryJournal
    from attnextract.models import VectorAttention
    journal_path, marker, slow = sys.argv[1], sys.argv[2], sys.argv[3] == "slow"
    rng = np.random.default_rng(0)
    model = VectorAttention(rng.standard_normal((2, 5, 5)), rng.standard_normal((2, 3, 5)),
                            rng.standard_normal((2, 5)), rng.standard_normal(3), "all")
    calls = [0]
    def box(X):
        calls[0] += X.shape == (8, 4, 5)             # the learner's batches, not the checks
        if slow and calls[0] > 2:                    # two batches journaled, the third in flight
            open(marker, "w").close()
            time.sleep(60)                           # killed here
        return model(X)
    box.output_kind = "all"
    oracle = Oracle(box, 5, journal=QueryJournal(journal_path, context={"seed": 0}))
    # a tiny learner: deterministic probes, a least-squares fit of their answers
    probes = np.random.default_rng(1)
    answers = [oracle.query(probes.standard_normal((8, 4, 5))) for _ in range(6)]
    A = np.concatenate([a.reshape(8, -1) for a in answers])
    fit = np.linalg.lstsq(A, np.arange(len(A), dtype=float), rcond=None)[0]
    print(hashlib.sha256(A.tobytes() + fit.tobytes()).hexdigest(), oracle.black_box_queries)
""")


def test_journal_resume_after_sigkill_is_bit_identical(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": SRC}
    clean = subprocess.run([sys.executable, str(script), str(tmp_path / "clean.sqlite"),
                            str(tmp_path / "unused"), "fast"], capture_output=True, text=True,
                           env=env, timeout=120, check=True).stdout.split()
    marker = tmp_path / "marker"
    victim = subprocess.Popen([sys.executable, str(script), str(tmp_path / "j.sqlite"),
                               str(marker), "slow"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        for _ in range(1200):                       # the box blocks once the marker exists
            if marker.exists() or victim.poll() is not None:
                break
            time.sleep(0.05)
        assert marker.exists(), victim.communicate()[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(30)
    finally:
        if victim.poll() is None:
            victim.kill()
    assert victim.returncode == -signal.SIGKILL
    kept = len(read_entries(tmp_path / "j.sqlite"))
    assert kept == 16                                 # two batches of 8 were journaled
    resumed = subprocess.run([sys.executable, str(script), str(tmp_path / "j.sqlite"),
                              str(tmp_path / "unused"), "fast"], capture_output=True, text=True,
                             env=env, timeout=120, check=True).stdout.split()
    assert resumed[0] == clean[0]                     # the same bits
    assert int(resumed[1]) == int(clean[1]) - kept   # journaled answers were not asked again




# -- the command line ------------------------------------------------------------------

def save_secret(path, model):
    np.savez(path, **model.parameters(), kind=np.str_(model.kind))
    return str(path)


@pytest.fixture
def boxes(tmp_path, monkeypatch):
    """boxes.py: a causal every-position model, its bidirectional twin, its last position;
    secret.npz: the model saved."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "boxes.py").write_text(textwrap.dedent("""
        from attnextract.adapters.targets import random_vector_attention
        model = random_vector_attention(2, 6, 4, seed=3, positions="all", causal=True)
        other = random_vector_attention(2, 6, 4, seed=3, positions="all", causal=False)
        def last(X):
            return model(X)[:, -1]
    """))
    from attnextract.adapters.targets import random_vector_attention
    save_secret(tmp_path / "secret.npz",
                random_vector_attention(2, 6, 4, seed=3, positions="all", causal=True))
    return tmp_path


def test_cli_verify_a_saved_vector_model(boxes, capsys):
    from attnextract.cli import main
    args = ["verify", "--result", "secret.npz", "--no-progress", "--seed", "0", "--count", "16",
            "--max-length", "32"]
    assert main(args + ["--target", "boxes.py:model"]) == 0
    # bidirectional answers for a causal model: a mismatch (exit 1)
    assert main(args + ["--target", "boxes.py:other"]) == 1
    # last-position answers for an every-position model: the box's error (exit 3)
    assert main(args + ["--target", "boxes.py:last"]) == 3
    assert "MalformedOutputError" in capsys.readouterr().err


def test_cli_extract_vector_flags(boxes, capsys):
    from attnextract.cli import main
    base = ["extract", "--target", "boxes.py:last", "--dim", "6", "--out", "r.npz",
            "--no-journal", "--no-progress"]
    assert main(base + ["--outputs", "scalar"]) == 3          # the box answers vectors
    assert main(base + ["--out-dim", "3"]) == 3               # m = 4, not 3
    assert main(base + ["--outputs", "scalar", "--out-dim", "3"]) == 2
    assert main(base + ["--outputs", "last", "--causal"]) == 2
    err = capsys.readouterr().err
    assert "m = 4" in err and "--causal" in err and "contradicts" in err


def test_cli_cost_in_three_units():
    from attnextract.cli import _note_cost

    class Report:
        queries, floor, details = 10, 75, {}
    oracle = Oracle(vector_model("last", m=4), D)
    oracle.query(batches()[1])
    report = Report()
    _note_cost(report, oracle)
    assert report.details["cost"] == "10 queries, 24 numbers received, 30 tokens sent"
    assert report.details["floor in queries"].startswith("19 (75 free parameters / m = 4")


def test_cli_twins_of_a_vector_model(capsys):
    from attnextract.cli import main
    for outputs in ("last", "all"):
        assert main(["twins", "--outputs", outputs, "--seed", "2", "--count", "50",
                     "--out-dim", "3", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert (out["heads"], out["twin_heads"], out["twin_canonical_heads"]) == (3, 5, 3)
        assert out["canonical_error"] < 1e-12 and out["max_relative_output_difference"] < 1e-12
        assert out["largest_O_mismatch"] > 0.1


def test_cli_serve_a_saved_vector_model(boxes):
    env = {**os.environ, "PYTHONPATH": SRC}
    server = subprocess.Popen([sys.executable, "-m", "attnextract", "serve", "--secret",
                               "secret.npz", "--port", "0", "--outputs", "last"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=boxes)
    try:
        line = server.stdout.readline()
        url = next(word for word in line.split() if word.startswith("http://"))
        box = HttpBlackBox(url)
        assert (box.output_kind, box.out_dim) == ("last", 4)
        from attnextract.report import load_model
        saved = load_model(str(boxes / "secret.npz"))
        X = np.random.default_rng(0).standard_normal((3, 5, 6))
        # served at the last position: the same numbers as the model's last row, to rounding
        np.testing.assert_allclose(Oracle(box, 6).query(X), saved(X)[:, -1], rtol=1e-13,
                                   atol=1e-13)
    finally:
        server.terminate()
        server.wait(30)
    # --outputs on a scalar secret: bad input (exit 2)
    save_secret(boxes / "scalar.npz", random_single_head(6, seed=0))
    from attnextract.cli import main
    assert main(["serve", "--secret", "scalar.npz", "--port", "0", "--outputs", "all"]) == 2


# -- typed errors of Python boxes, and a refusal's partial answers ----------------------

def test_python_box_typed_errors_for_bad_vector_answers():
    model = vector_model("last")
    X = batches()[1]
    answers = iter([model(X), model(X)[:, :2]])
    oracle = Oracle(lambda X: next(answers), D)
    oracle.query(X)
    with pytest.raises(MalformedOutputError, match="m = 3"):     # m changed between calls
        oracle.query(X)
    for bad, error in (([["a", "b", "c"]] * 6, MalformedOutputError),        # strings
                       ([[1.0, 2.0, 3.0]] * 5 + [[1.0, [2.0], 3.0]], MalformedOutputError),
                       (np.where(np.arange(3) == 1, np.nan, model(X)), NonFiniteOutputError)):
        with pytest.raises(error):
            Oracle(lambda X, bad=bad: bad, D, outputs="last").query(X)


def test_refused_batch_journals_the_vector_answers_it_did_get(tmp_path):
    """A box refused mid-batch (a server's budget) hands back the answers (k, m) it got:
    they are journaled."""
    from attnextract.errors import BudgetExceededError
    model = vector_model("last")
    X = batches()[1]

    def refusing(X):
        if len(X) != 6:                            # the journal's fingerprint: answered
            return model(X)
        error = BudgetExceededError("budget", needed=len(X), remaining=2)
        error.partial_outputs = model(X)[:2]
        raise error
    refusing.output_kind = "last"
    path = tmp_path / "j.sqlite"
    with QueryJournal(path) as journal, pytest.raises(BudgetExceededError) as caught:
        Oracle(refusing, D, journal=journal).query(X)
    assert caught.value.journaled == 2
    entries = read_entries(path)
    assert len(entries) == 2 and np.array_equal(entries[1][2], model(X)[1])
