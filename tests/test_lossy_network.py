"""Exact accounting over a lossy network: idempotent retries, charges taken from the server.

A proxy on loopback (tests/netfaults.py) loses 10-30% of the requests before they
reach the server or of the answers after the server has charged them, with fixed
seeds. The extraction must still succeed within a server budget equal to the exact
number of queries it needs, and the client, the oracle and the server must agree on
that number.
"""

import json
import threading

import numpy as np
import pytest

from attnextract import BudgetExceededError, Oracle, extract_single_head
from attnextract.adapters.remote import HttpBlackBox
from attnextract.adapters.server import make_server
from attnextract.adapters.targets import random_single_head
from attnextract.report import verification_count

from conftest import rel_err, run_cli
from netfaults import LossyProxy

D = 5
NEEDED = D * D + D + verification_count(D * D + D, D * D + D)   # floor + held-out check


@pytest.fixture
def network():
    """start(model, proxy options, server limits) -> (server, proxy); all closed after."""
    opened = []

    def start(model, proxy=None, **limits):
        server = make_server(model, "127.0.0.1", 0, **limits)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        lossy = LossyProxy(server.server_address[:2], **(proxy or {}))
        opened.append((server, lossy))
        return server, lossy

    yield start
    for server, lossy in opened:
        lossy.close()
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("drop_before, drop_after, seed", [
    (0.1, 0.0, 0), (0.0, 0.1, 1), (0.15, 0.15, 2), (0.0, 0.3, 3), (0.3, 0.0, 4),
    (0.1, 0.2, 5)])
@pytest.mark.parametrize("transport", ["npy", "json"])
@pytest.mark.slow
def test_extraction_over_a_lossy_network_is_charged_exactly_once(network, drop_before,
                                                                  drop_after, seed, transport):
    model = random_single_head(D, seed=seed)
    server, proxy = network(model, {"drop_before": drop_before, "drop_after": drop_after,
                                    "seed": seed}, budget=NEEDED)
    # many small requests (two length-2 sequences each), so that every seed loses some
    box = HttpBlackBox(proxy.url, retries=12, backoff=0.001, concurrency=3, max_floats=20,
                       transport=transport)
    oracle = Oracle(box, D, budget=NEEDED)
    result = extract_single_head(oracle, seed=seed)
    assert rel_err(result.model.W, model.W) < 1e-10
    lost = proxy.counts["drop_before"] + proxy.counts["drop_after"]
    assert lost > 0 and box.retried >= lost          # every loss was retried
    account = box.accounting()
    assert (server.state.served == account["queries_charged_by_server"] == oracle.queries
            == result.queries == account["queries_answered"] == NEEDED)
    assert account["queries_sent"] > NEEDED            # retries re-sent sequences ...
    if proxy.counts["drop_after"]:
        assert server.state.replayed > 0               # ... answered from the cache, free
    assert box.transport == transport


class KeylessBox(HttpBlackBox):
    """The old client: retries without an Idempotency-Key."""

    def _request(self, method, path, body, headers, batch=0, **options):
        headers = {k: v for k, v in headers.items() if k != "Idempotency-Key"}
        return super()._request(method, path, body, headers, batch, **options)


def test_without_idempotency_keys_lost_answers_are_charged_again(network):
    """The failure the keys prevent: the same lossy run overspends a server budget."""
    model = random_single_head(D, seed=0)
    server, proxy = network(model, {"drop_after": 0.2, "seed": 7})
    box = KeylessBox(proxy.url, retries=12, backoff=0.001, concurrency=3, max_floats=40)
    extract_single_head(Oracle(box, D), seed=0)
    assert proxy.counts["drop_after"] > 0
    assert server.state.served > NEEDED and server.state.replayed == 0   # paid twice


@pytest.mark.slow
def test_command_line_report_counts_charged_queries_with_a_budget(network, tmp_path):
    model = random_single_head(D, seed=11)
    server, proxy = network(model, {"drop_before": 0.1, "drop_after": 0.2, "seed": 11},
                            budget=NEEDED)
    done = run_cli("extract", "--target", proxy.url, "--dim", D, "--budget", NEEDED,
                   "--http-retries", 12, "--out", tmp_path / "r.npz", "--json", "--seed", 1,
                   "--no-journal")   # a journal would spend its fingerprint challenges too
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    http = report["details"]["http"]
    assert report["queries"] == http["queries_charged_by_server"] == server.state.served == NEEDED
    assert http["retries"] > 0 and http["queries_sent"] > NEEDED and http["transport"] == "npy"
    text = run_cli("extract", "--target", server.url, "--dim", D, "--out", tmp_path / "s.npz")
    assert text.returncode == 1 and "budget exhausted" in text.stderr   # the budget is spent


@pytest.mark.parametrize("concurrency", [1, 4])
def test_budget_refusal_mid_batch_keeps_the_answers_received(network, concurrency):
    model = random_single_head(D, seed=2)
    server, proxy = network(model, {"drop_after": 0.2, "seed": 3}, budget=95)
    box = HttpBlackBox(proxy.url, retries=12, backoff=0.001, concurrency=concurrency,
                       max_floats=10 * 2 * D)                    # 10 sequences a request
    oracle = Oracle(box, D)
    X = np.random.default_rng(0).standard_normal((160, 2, D))
    with pytest.raises(BudgetExceededError, match="budget exhausted") as caught:
        oracle.query(X)
    partial = caught.value.partial_outputs
    k = len(partial)
    assert np.array_equal(partial, model(X[:k]))                  # in order, exact
    assert k % 10 == 0 and k <= 90 and oracle.queries == k        # only what was answered
    assert box.charged == server.state.served                     # the server's own count
    if concurrency == 1:
        assert k == 90 == server.state.served                     # nothing charged is lost
    assert server.state.served - k <= 3 * 10                      # at most what was in flight


def test_idempotency_key_semantics(network):
    model = random_single_head(D, seed=4)
    server, _ = network(model, cache_bytes=32)    # two answers of 2 sequences
    box = HttpBlackBox(server.url)
    X = np.random.default_rng(1).standard_normal((3, 2, D))
    for transport, key in (("npy", "k1"), ("json", "k1"), ("json", "k1")):
        body, headers = box._encode(X, transport)
        data, reply = box._request("POST", "/query", body, {**headers, "Idempotency-Key": key})
        assert np.array_equal(box._decode(data, reply["content-type"], 3), model(X))
        assert reply["x-charged"] == "3"              # the key's charge, reported every time
    assert (server.state.served, server.state.replayed) == (3, 6)
    body, headers = box._encode(X[:2], "json")        # the same key, other numbers
    with pytest.raises(Exception, match="422"):
        try:
            box._request("POST", "/query", body, {**headers, "Idempotency-Key": "k1"})
        except Exception as exc:
            raise Exception(f"{getattr(exc, 'status', '')} {exc}") from None
    for key in ("k2", "k3"):                          # 16 + 16 bytes: k1 (24) is evicted
        box._request("POST", "/query", body, {**headers, "Idempotency-Key": key})
    box._request("POST", "/query", body, {**headers, "Idempotency-Key": "k1"})
    assert server.state.served == 3 + 2 + 2 + 2
    for bad in ("", "a b", "x" * 129, "é"):
        with pytest.raises(Exception, match="Idempotency-Key"):
            box._request("POST", "/query", body, {**headers, "Idempotency-Key": bad})
