"""Extract a head behind an HTTP API that is not attnextract's: a custom JSON schema.

The API here (started on loopback by this script, standing in for a real one) takes

    POST /v1/score  {"inputs": [{"tokens": [[...], ...]}, ...], "model": "head-7"}

and answers

    {"results": [{"score": 0.123}, ...]}

Two small functions map a batch (b, N, d) to the request and the answer to b numbers;
:class:`attnextract.adapters.remote.JsonApiBlackBox` does the rest (chunking,
concurrency, retries with an Idempotency-Key, accounting).

Run: ``python examples/custom_api.py``
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from attnextract import Oracle, extract_single_head
from attnextract.adapters.remote import JsonApiBlackBox
from attnextract.adapters.targets import random_single_head


def encode(X):
    """A batch (b, N, d) as the API's request body."""
    return {"model": "head-7", "inputs": [{"tokens": seq.tolist()} for seq in X]}


def decode(answer):
    """The API's answer as b numbers, in order."""
    return [item["score"] for item in answer["results"]]


def start_fake_api(model):
    """The stand-in API on a free loopback port (a real one would be at its own URL)."""
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            X = np.array([item["tokens"] for item in request["inputs"]], dtype=np.float64)
            body = json.dumps({"results": [{"score": s} for s in model(X).tolist()]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main():
    d = 8
    secret = random_single_head(d, seed=1)
    api = start_fake_api(secret)
    url = f"http://127.0.0.1:{api.server_address[1]}/v1/score"
    black_box = JsonApiBlackBox(url, encode, decode,
                                headers={"Authorization": "Bearer <token>"}, concurrency=2)
    result = extract_single_head(Oracle(black_box, d), seed=0)
    print(result.report.render())
    print("http", black_box.accounting())
    error = np.linalg.norm(result.model.W - secret.W) / np.linalg.norm(secret.W)
    print(f"relative error of W against the secret: {error:.1e}")
    api.shutdown()


if __name__ == "__main__":
    main()
