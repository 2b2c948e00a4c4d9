"""Prototype measurement: request heads of the hostile suite judged by h11 (the sans-IO
parser under uvicorn and httpx) and by the server's own head parser. Run with h11:

    PYTHONPATH=src python benchmarks/parsers/h11_heads.py [--out FILE.md]

(writes benchmarks/results/h11_heads.md)

For each case: h11's verdict (it passes the head, refuses it with a status, or waits for
more data) against the server's (the same three), given all the bytes at once.
"""

import argparse
import asyncio
import json
import sys
from pathlib import Path

import h11

from attnextract.adapters.server import (MAX_BODY_BYTES, MAX_HEADER_BYTES, BlackBoxServer,
                                         RequestError, _content_length, _parse_head)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _results  # noqa: E402
from hostile_http import CASES  # noqa: E402


def by_h11(data: bytes, shut: bool):
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
    conn.receive_data(data)
    if shut:
        conn.receive_data(b"")
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError as exc:
        return exc.error_status_hint, str(exc)
    if event is h11.NEED_DATA:
        return "wait", ""
    if isinstance(event, h11.Request):
        if event.method == b"POST" and event.target.startswith(b"/query"):
            headers = {}
            for k, v in event.headers:
                headers.setdefault(k.decode().lower(), []).append(v.decode("latin-1"))
            if "content-length" not in headers and "transfer-encoding" not in headers:
                return 411, "(the application's check)"
        return "pass", f"HTTP/{event.http_version.decode()}"
    return type(event).__name__, ""


async def ours_async(data: bytes):
    reader = asyncio.StreamReader(limit=MAX_HEADER_BYTES)
    reader.feed_data(data)
    reader.feed_eof()
    server = BlackBoxServer.__new__(BlackBoxServer)
    try:
        first = await reader.read(1)
        if not first:
            return "wait", ""
        head = await server._read_head(reader, first)
        method, path, version, headers = _parse_head(head)
        if method == "POST" and path == "/query":
            _content_length(headers, MAX_BODY_BYTES)
    except RequestError as exc:
        return exc.status, exc.reason
    except asyncio.IncompleteReadError:
        return "wait", ""
    return "pass", version


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _results.add_out_option(parser, __file__)
    args = parser.parse_args()
    with _results.Run(__file__, args.out) as results:
        results.capture()
        compare()


def compare():
    agree = 0
    for name, data, expected, *mode in CASES:
        mine = asyncio.run(ours_async(data))
        theirs = by_h11(data, bool(mode) and mode[0] == "shut")
        same = mine[0] == theirs[0]
        agree += same
        print(json.dumps({"case": name, "documented": expected, "ours": mine[0],
                          "h11": theirs[0], "h11_reason": theirs[1][:70], "agree": same}))
    print(json.dumps({"agree": agree, "cases": len(CASES)}))


if __name__ == "__main__":
    main()
