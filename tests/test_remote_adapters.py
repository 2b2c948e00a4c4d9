"""The hook for foreign HTTP APIs (JsonApiBlackBox) and Ray replicas (with a stand-in Ray)."""

import json
import pickle
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from attnextract import BlackBoxError, InputError, MalformedOutputError, Oracle, extract_single_head
from attnextract.adapters.remote import JsonApiBlackBox
from attnextract.adapters.replicas import RayReplicas
from attnextract.adapters.targets import random_single_head

from conftest import rel_err

ROOT = Path(__file__).resolve().parents[1]


class CustomSchemaApi:
    """A server with its own schema: {"items": [{"x": ...}]} -> {"data": {"scores": [...]}}."""

    def __init__(self, model, fail_first=0):
        outer = self
        self.calls, self.keys, self.fail_first = 0, [], fail_first
        self.longest = 0            # the longest sequence asked (tokens)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.calls += 1
                outer.keys.append(self.headers.get("Idempotency-Key"))
                if self.path != "/api/v2/run" or self.headers.get("X-Api-Key") != "s3cret":
                    status, answer = 403, {"error": "forbidden"}
                elif outer.calls <= outer.fail_first:
                    status, answer = 502, {"error": "bad gateway"}
                else:
                    X = np.array([item["x"] for item in json.loads(body)["items"]])
                    outer.longest = max(outer.longest, X.shape[1])
                    status, answer = 200, {"data": {"scores": model(X).tolist()}}
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api/v2/run"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def encode(X):
    return {"items": [{"x": seq.tolist()} for seq in X]}


def decode(answer):
    return answer["data"]["scores"]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.slow
def test_extraction_through_a_custom_schema_api(seed):
    model = random_single_head(5, seed=seed)
    api = CustomSchemaApi(model, fail_first=2)
    try:
        box = JsonApiBlackBox(api.url, encode, decode, headers={"X-Api-Key": "s3cret"},
                              concurrency=2, max_floats=60, backoff=0.001)
        result = extract_single_head(Oracle(box, 5), seed=seed)
        assert rel_err(result.model.W, model.W) < 1e-10
        account = box.accounting()
        assert account["queries_answered"] == result.queries and account["retries"] == 2
        assert account["queries_charged_by_server"] is None          # the API does not say
        assert len(set(api.keys)) == api.calls - 2                   # keys reused on retries
    finally:
        api.close()


def test_custom_api_errors_are_typed():
    model = random_single_head(5, seed=0)
    api = CustomSchemaApi(model)
    try:
        X = np.ones((3, 2, 5))
        with pytest.raises(BlackBoxError, match="HTTP 403"):
            JsonApiBlackBox(api.url, encode, decode)(X)
        with pytest.raises(MalformedOutputError, match="decode failed.*KeyError"):
            JsonApiBlackBox(api.url, encode, lambda a: a["nope"],
                            headers={"X-Api-Key": "s3cret"})(X)
        with pytest.raises(MalformedOutputError, match="2 numbers for 3"):
            JsonApiBlackBox(api.url, encode, lambda a: decode(a)[:2],
                            headers={"X-Api-Key": "s3cret"})(X)
        with pytest.raises(InputError):
            JsonApiBlackBox(api.url, "not a function", decode)
    finally:
        api.close()


def test_a_stated_max_length_bounds_every_query_and_the_verified_domain():
    """A foreign API has no /health: its context length is stated to JsonApiBlackBox,
    the Oracle takes it, no query is longer and verification covers lengths up to it."""
    model = random_single_head(5, seed=3)
    api = CustomSchemaApi(model)
    try:
        box = JsonApiBlackBox(api.url, encode, decode, headers={"X-Api-Key": "s3cret"},
                              max_length=24)
        assert box.max_length == 24 and box.health()["max_length"] == 24
        oracle = Oracle(box, 5)
        assert oracle.max_length == 24
        result = extract_single_head(oracle, seed=0)
        check = result.report.verification
        assert check.passed and check.max_length == 24 and check.lengths[1] == 24
        assert api.longest == 24
        assert JsonApiBlackBox(api.url, encode, decode).max_length is None
    finally:
        api.close()


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "100"])
def test_a_bad_max_length_is_an_input_error(bad):
    with pytest.raises(InputError, match="max_length"):
        JsonApiBlackBox("http://127.0.0.1:9/x", encode, decode, max_length=bad)


@pytest.mark.slow
def test_the_custom_api_example_runs():
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_api.py")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    error = float(done.stdout.split("relative error of W against the secret: ")[1])
    assert error < 1e-10


class FakeRay:
    """Ray's API as RayReplicas uses it, run in this process; actors are pickled copies."""

    def __init__(self):
        self.initialized, self.init_options, self.calls = False, None, []
        self.killed = 0

    def is_initialized(self):
        return self.initialized

    def init(self, **options):
        self.initialized, self.init_options = True, options

    def shutdown(self):
        self.initialized = False

    def put(self, obj):
        return ("ref", pickle.dumps(obj))

    def get(self, refs):
        return [ref() for ref in refs]

    def kill(self, actor):
        self.killed += 1

    def remote(self, **options):
        fake = self

        def wrap(cls):
            class Handle:
                def __init__(self, instance, index):
                    self.instance, self.index = instance, index

                @property
                def evaluate(self):
                    handle = self

                    class Method:
                        @staticmethod
                        def remote(X):
                            fake.calls.append((handle.index, len(X)))
                            return lambda: handle.instance.evaluate(X)
                    return Method

            class Factory:
                count = 0

                @staticmethod
                def remote(shipped):
                    model = pickle.loads(shipped[1]) if isinstance(shipped, tuple) else shipped
                    Factory.count += 1
                    return Handle(cls(model), Factory.count - 1)
            return Factory
        return wrap


def test_replicas_split_batches_in_order_and_answer_exactly():
    model = random_single_head(6, seed=1)
    ray = FakeRay()
    replicas = RayReplicas(model, 3, ray_module=ray)
    assert ray.init_options["num_cpus"] == 3 and replicas.dim == 6
    X = np.random.default_rng(0).standard_normal((10, 4, 6))
    assert np.allclose(replicas(X), model(X), rtol=1e-14, atol=0)
    assert sorted(ray.calls) == [(0, 4), (1, 3), (2, 3)]
    ray.calls.clear()
    # sub-batches may round differently from the whole batch (BLAS blocking): 1e-14
    assert np.allclose(replicas(X[:2]), model(X[:2]), rtol=1e-14, atol=0) and len(ray.calls) == 2
    result = extract_single_head(Oracle(replicas, 6), seed=0)
    assert rel_err(result.model.W, model.W) < 1e-10
    replicas.close()
    assert ray.killed == 3 and not ray.initialized


def test_replicas_join_an_existing_cluster_and_load_a_spec_on_each_node(tmp_path):
    model = random_single_head(4, seed=2)
    np.savez(tmp_path / "secret.npz", W=model.W, v=model.v)
    ray = FakeRay()
    replicas = RayReplicas(str(tmp_path / "secret.npz"), 2, address="ray://head:10001",
                           ray_module=ray)
    assert ray.init_options["address"] == "ray://head:10001"
    X = np.random.default_rng(1).standard_normal((5, 3, 4))
    assert np.allclose(replicas(X), model(X), rtol=1e-14, atol=0)
    ray.initialized = True                     # a cluster someone else started is left running
    other = RayReplicas(model, 2, ray_module=ray)
    other.close()
    assert ray.initialized


class Broken:
    dim = 3

    def __call__(self, X):
        raise RuntimeError("CUDA out of memory")


def test_replica_failures_and_bad_arguments_are_typed():
    broken = Broken()
    replicas = RayReplicas(broken, 2, ray_module=FakeRay())
    with pytest.raises(BlackBoxError, match="replica failed.*CUDA out of memory"):
        replicas(np.ones((4, 1, 3)))
    with pytest.raises(InputError):
        RayReplicas(broken, 0, ray_module=FakeRay())
    with pytest.raises(InputError, match="dim"):
        RayReplicas(lambda X: X, 2, ray_module=FakeRay())


@pytest.mark.slow
def test_serve_options_on_the_command_line(tmp_path):
    from conftest import run_cli
    target = tmp_path / "t.py"
    target.write_text("from attnextract.adapters.targets import random_single_head\n"
                      "head = random_single_head(3, seed=4)\n"
                      "def nodim(X):\n    return X[:, -1, 0]\n")
    server = subprocess.Popen([sys.executable, "-m", "attnextract", "serve", "--secret",
                               f"{target}:head", "--port", "0", "--max-connections", "8",
                               "--idle-timeout", "0.5", "--workers", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = server.stdout.readline()
        assert "serving single-head d = 3 on http://127.0.0.1:" in banner, server.stderr.read()
        url = banner.split(" on ")[1].split()[0]
        done = run_cli("extract", "--target", url, "--dim", 3, "--out", tmp_path / "r.npz",
                       "--http-transport", "json", "--no-journal", "--json")   # no challenges
        assert done.returncode == 0, done.stderr
        http = json.loads(done.stdout)["details"]["http"]
        from attnextract.report import verification_count
        assert http["transport"] == "json"
        assert http["queries_charged_by_server"] == 12 + verification_count(12, 12)
    finally:
        server.kill()
        server.communicate(timeout=10)
    assert run_cli("serve", "--secret", f"{target}:nodim", "--port", 0).returncode == 2
    assert run_cli("serve", "--secret", f"{target}:head", "--port", 0, "--ray-address",
                   "auto").returncode == 2
