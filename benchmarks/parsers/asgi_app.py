"""Prototype: the attnextract protocol as a thin ASGI app under uvicorn (its h11 parser).

Only the HTTP framing moves to uvicorn; charging, limits, parsers, the byte budget and
the body rate are the server's own (imported). Run: python asgi_app.py PORT
"""

import asyncio
import json
import sys

import uvicorn

from attnextract.adapters.server import (IDLE_TIMEOUT, MIN_BODY_RATE, SLOT_TIMEOUT, ByteBudget,
                                         BlackBoxServer, JsonBatchParser, RequestError,
                                         ServerState, _content_length, KEY_PATTERN, NPY)
from attnextract.adapters.targets import random_single_head

state = ServerState(random_single_head(4, seed=3))
costs = BlackBoxServer.body_cost
budget = None


async def respond(send, status, payload, extra=()):
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *extra]})
    await send({"type": "http.response.body", "body": data})


async def app(scope, receive, send):
    global budget
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                budget = ByteBudget(96 << 20)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    headers = {}
    for name, value in scope["headers"]:
        headers.setdefault(name.decode("latin-1").lower(), []).append(value.decode("latin-1"))
    try:
        await route(scope, receive, send, headers)
    except RequestError as exc:
        extra = [(b"allow", exc.extra["allow"].encode())] if "allow" in exc.extra else []
        await respond(send, exc.status, {"error": exc.reason}, extra)


async def route(scope, receive, send, headers):
    path, method = scope["path"], scope["method"]
    if path not in ("/query", "/health"):
        raise RequestError(404, f"no such endpoint {path}")
    wanted = "POST" if path == "/query" else "GET"
    if method != wanted:
        raise RequestError(405, f"{path} takes {wanted}, not {method}", allow=wanted)
    if path == "/health":
        return await respond(send, 200, state.health())
    ctype = headers.get("content-type", ["application/json"])[0].split(";")[0].strip().lower()
    key = headers.get("idempotency-key", [None])[0]
    if key is not None and not KEY_PATTERN.match(key):
        raise RequestError(400, "Idempotency-Key must be 1-128 visible ASCII characters")
    length = _content_length(headers, state.max_body)
    parser = state.parser(ctype, length, headers.get("x-shape", [None])[0])

    class Costs:                     # body_cost needs only .state
        pass
    holder = Costs()
    holder.state = state
    try:
        held = await budget.acquire(costs(holder, length, ctype), SLOT_TIMEOUT)
    except asyncio.TimeoutError:
        raise RequestError(503, "server busy") from None
    try:
        loop = asyncio.get_running_loop()
        start, received = loop.time(), 0
        while received < length:
            due = start + IDLE_TIMEOUT + received / MIN_BODY_RATE
            wait = min(IDLE_TIMEOUT, due - loop.time())
            try:
                async with asyncio.timeout(max(wait, 0.001)):
                    message = await receive()
            except asyncio.TimeoutError:
                raise RequestError(408, f"body stalled after {received} of {length}") from None
            if message["type"] == "http.disconnect":
                raise RequestError(400, f"body ended after {received} of {length} bytes")
            chunk = message.get("body", b"")
            received += len(chunk)
            parser.feed(chunk)
            if not message.get("more_body") and received < length:
                raise RequestError(400, f"body ended after {received} of {length} bytes")
        X = parser.finish()
        answer = await loop.run_in_executor(None, state.answer, X, key)
        out = answer.pop("outputs")
        answer.pop("served")
        await respond(send, 200, {"outputs": out.tolist(), **answer})
    finally:
        held.release()


if __name__ == "__main__":
    config = uvicorn.Config(app, host="127.0.0.1", port=int(sys.argv[1]), http="h11",
                            limit_concurrency=2048, backlog=128, timeout_keep_alive=15,
                            h11_max_incomplete_event_size=16 << 10, log_level="warning",
                            lifespan="on")
    print("ready", flush=True)
    uvicorn.Server(config).run()
