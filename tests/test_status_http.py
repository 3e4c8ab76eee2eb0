"""The status HTTP server, started for real on 127.0.0.1 and spoken to over TCP."""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from typing import Any

import pytest
import trio

from echo2.learner_hub.status_http import (
    Metric,
    StatusServer,
    host_name,
    hub_metrics,
    render_html,
    render_metrics,
)

STATUS: dict[str, Any] = {
    "peer_id": "12D3KooWhub",
    "step": 3,
    "steps": 10,
    "staleness": 1,
    "latest_version": 3,
    "learner_busy_fraction": 0.8,
    "results_accepted": 12,
    "rollouts_accepted": 96,
    "stale_dropped": 1,
    "refused_by_reason": {"stale": 1, "logprob_mismatch": 2},
    "wall_s": 12.5,
    "nodes": [
        {"peer_id": "12D3KooWa<script>", "state": "active", "price_usd_per_hour": 1.5, "tokens": 100},
        {"peer_id": "12D3KooWb", "state": "standby", "price_usd_per_hour": 0.5, "tokens": 0},
    ],
    "broadcast": {"recent": [{"version": 3, "first_s": 0.1, "median_s": 0.2, "last_s": 0.4}]},
    "history": [{"step": i, "reward": r, "train_s": 0.5} for i, r in enumerate([0.1, 0.3, 0.2, 0.6], start=1)],
    "ledger": {"cost_usd": 0.25, "accepted_tokens": 1000, "usd_per_token": 0.00025, "usd_per_million_tokens": 250.0},
    "weird": math.nan,
}


async def raw_request(port: int, data: bytes, *, half_close: bool = False) -> bytes:
    with trio.fail_after(5):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(data)
            if half_close:
                await stream.send_eof()
            out = bytearray()
            while chunk := await stream.receive_some(65536):
                out += chunk
            return bytes(out)


def status_code(resp: bytes) -> int:
    m = re.match(rb"HTTP/1\.1 (\d{3}) ", resp)
    assert m, resp[:100]
    return int(m.group(1))


def body(resp: bytes) -> bytes:
    return resp.split(b"\r\n\r\n", 1)[1]


def fetch(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def test_real_server_routes_and_garbage() -> None:
    async def main() -> None:
        server = StatusServer(lambda: STATUS, lambda: hub_metrics(STATUS), timeout_s=1.0)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve)
            assert port == server.port and port > 0
            base = f"http://127.0.0.1:{port}"
            # urllib in a worker thread: a real, independent HTTP client
            code, ctype, data = await trio.to_thread.run_sync(fetch, base + "/status.json")
            assert code == 200 and ctype == "application/json"
            got = json.loads(data)
            assert got["step"] == 3 and got["weird"] is None  # NaN becomes null: strict JSON
            code, ctype, data = await trio.to_thread.run_sync(fetch, base + "/")
            assert code == 200 and ctype.startswith("text/html")
            page = data.decode()
            assert "80.0%" in page and "$0.2500" in page and "12D3KooWb" in page
            # the charts' library is inlined (the page works offline), its tables also come alone
            assert "uPlot" in page and "<script src" not in page and 'id="curves-data"' in page
            code, ctype, data = await trio.to_thread.run_sync(fetch, base + "/tables.html")
            assert code == 200 and data.decode().startswith('<div id="tables">') and "12D3KooWb" in data.decode()
            assert "12D3KooWa<script>" not in page and "12D3KooWa&lt;script&gt;" in page  # node-supplied text is escaped
            code, ctype, data = await trio.to_thread.run_sync(fetch, base + "/metrics?x=1")
            assert code == 200 and "version=0.0.4" in ctype
            text = data.decode()
            assert 'echo2_results_refused_total{reason="logprob_mismatch"} 2' in text
            assert "echo2_learner_step 3" in text and "echo2_nodes_active 1" in text
            code, _, _ = await trio.to_thread.run_sync(fetch, base + "/nope")
            assert code == 404

            # hostile or wrong requests: each gets its answer and the server stays up
            assert status_code(await raw_request(port, b"POST / HTTP/1.1\r\nHost: x\r\n\r\n")) == 405
            post = b"POST /status.json HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100000
            assert status_code(await raw_request(port, post)) == 405
            assert status_code(await raw_request(port, b"\x00\xff\xfe garbage\r\n\r\n")) == 400
            assert status_code(await raw_request(port, b"GET /\r\n\r\n")) == 400
            assert status_code(await raw_request(port, b"GET / HTTP/1.1\r\nno colon here\r\n\r\n")) == 400
            assert status_code(await raw_request(port, b"GET http://evil/ HTTP/1.1\r\n\r\n")) == 400
            assert status_code(await raw_request(port, b"GET / HTTP/1.1\r\n", half_close=True)) == 400
            big = b"GET / HTTP/1.1\r\n" + b"X-A: " + b"a" * 20000 + b"\r\n\r\n"
            assert status_code(await raw_request(port, big)) == 431
            assert await raw_request(port, b"") == b""  # connect and close
            # a silent client is dropped after the timeout without answering
            with trio.fail_after(5):
                silent = await trio.open_tcp_stream("127.0.0.1", port)
                assert await silent.receive_some(100) == b""
                await silent.aclose()

            resp = await raw_request(port, b"GET /status.json HTTP/1.0\r\nHost: localhost\r\n\r\n")
            assert status_code(resp) == 200 and json.loads(body(resp))["peer_id"] == "12D3KooWhub"
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_provider_failure_is_500_and_server_survives() -> None:
    calls = {"n": 0}

    def flaky() -> dict[str, Any]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return {"step": 1}

    async def main() -> None:
        server = StatusServer(flaky, lambda: [])
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve)
            assert status_code(await raw_request(port, b"GET /status.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")) == 500
            resp = await raw_request(port, b"GET /status.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert status_code(resp) == 200 and json.loads(body(resp)) == {"step": 1}
            resp = await raw_request(port, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # an almost empty status still renders
            assert status_code(resp) == 200 and b"<i>none</i>" in body(resp) and b"echo2Live(" in body(resp)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_render_metrics_format() -> None:
    text = render_metrics(
        [
            Metric("echo2_x_total", "counter", 'help with \\ and\nnewline', [({"reason": 'a"b\\c\nd'}, 3.0)]),
            Metric("echo2_g", "gauge", "g", [({}, 0.25), ({"k": "v"}, math.inf)]),
            Metric("echo2_g", "gauge", "g", [({"k": "w"}, math.nan)]),
        ]
    )
    assert text == (
        "# HELP echo2_x_total help with \\\\ and\\nnewline\n"
        "# TYPE echo2_x_total counter\n"
        'echo2_x_total{reason="a\\"b\\\\c\\nd"} 3.0\n'
        "# HELP echo2_g g\n"
        "# TYPE echo2_g gauge\n"
        "echo2_g 0.25\n"
        'echo2_g{k="v"} +Inf\n'
        'echo2_g{k="w"} NaN\n'
    )
    with pytest.raises(ValueError):
        Metric("bad-name", "gauge", "x")
    with pytest.raises(ValueError):
        Metric("ok", "gauge", "x", [({"bad-label": "v"}, 1.0)])
    with pytest.raises(ValueError):
        Metric("ok", "histogram", "x")


def test_render_html_handles_odd_status() -> None:
    page = render_html({"nodes": "not a list", "history": [{"step": 1, "reward": math.inf}, "x"], "broadcast": 5})
    assert "<html" in page and "none" in page


def test_h11_edges_head_host_and_slow_clients() -> None:
    async def main() -> None:
        lag = {**STATUS, "loop_lag_p99_ms": 1.5, "loop_lag_max_ms": 12.0}
        server = StatusServer(lambda: lag, lambda: hub_metrics(lag), timeout_s=1.0)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve)
            resp = await raw_request(port, b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status_code(resp) == 405 and b"\r\nAllow: GET\r\n" in resp
            resp = await raw_request(port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert status_code(resp) == 200
            text = body(resp).decode()
            assert "echo2_loop_lag_p99_ms 1.5\n" in text and "echo2_loop_lag_max_ms 12.0\n" in text
            assert b"\r\nConnection: close\r\n" in resp and b"\r\nContent-Length: " in resp
            assert status_code(await raw_request(port, b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n")) == 400
            # the head limit is exact: a head just under it is served, one just over it is 431
            for size, code in ((8000, 200), (8300, 431), (12000, 431)):
                head = b"GET / HTTP/1.1\r\nHost: localhost\r\nX-A: " + b"a" * (size - 42) + b"\r\n\r\n"
                assert status_code(await raw_request(port, head)) == code, size
            assert status_code(await raw_request(port, b"GET /\xff HTTP/1.1\r\n\r\n")) == 400
            assert status_code(await raw_request(port, b"GET / HTTP/1.1\r\nHost: localhost\r\nX: \xff\r\n\r\n")) == 400
            assert status_code(await raw_request(port, b"GET / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n")) >= 400
            # a client dribbling a never-ending head one byte at a time is cut off at the timeout
            with trio.fail_after(4):
                slow = await trio.open_tcp_stream("127.0.0.1", port)
                t0 = trio.current_time()
                with trio.move_on_after(3):
                    try:
                        for b in b"GET / HTTP/1.1\r\nX-Slow: " + b"a" * 100:
                            await slow.send_all(bytes([b]))
                            await trio.sleep(0.05)
                    except trio.BrokenResourceError:
                        pass
                assert await slow.receive_some(100) == b""
                assert trio.current_time() - t0 < 2.5
                await slow.aclose()
            assert server.errors == 0
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a13_host_header_names_this_server_or_is_refused() -> None:
    """DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1 makes the
    browser send ``Host: evil.example``; that, and a request with no Host, are refused."""

    async def main() -> None:
        server = StatusServer(lambda: STATUS, lambda: hub_metrics(STATUS), timeout_s=1.0, allowed_hosts=("Status.Example",))
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve)

            async def code(host: bytes | None, version: bytes = b"1.1") -> int:
                head = b"GET /status.json HTTP/" + version + b"\r\n" + (b"Host: " + host + b"\r\n" if host is not None else b"")
                return status_code(await raw_request(port, head + b"\r\n"))

            p = str(port).encode()
            for refused in (b"evil.example", b"evil.example:" + p, b"127.0.0.1.evil.example", b"localhost.evil:" + p,
                            b"[::2]:" + p, b"10.0.0.1"):
                assert await code(refused) == 421, refused
                assert await code(refused, b"1.0") == 421, refused
            assert await code(None) == 400 and await code(None, b"1.0") == 400  # no Host is not "localhost"
            for ok in (b"127.0.0.1:" + p, b"127.0.0.1", b"localhost:" + p, b"LOCALHOST.", b"[::1]:" + p,
                       b"status.example:9000", b"127.0.0.1:1234"):  # any port: SSH tunnels renumber it
                assert await code(ok) == 200, ok
            # a real client names the server it dialled
            status, _, _ = await trio.to_thread.run_sync(fetch, f"http://127.0.0.1:{port}/status.json")
            assert status == 200
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a13_host_name_parsing() -> None:
    assert host_name(b"LocalHost:80") == "localhost"
    assert host_name(b"[::1]:8080") == "::1" and host_name(b"[::1]") == "::1"
    assert host_name(b"a.example.") == "a.example"
    for bad in (b"", b":80", b"a:b", b"[::1", b"[::1]x", b"\xff"):
        assert host_name(bad) is None, bad
    assert StatusServer(dict, list, host="0.0.0.0").allowed_hosts == {"localhost", "127.0.0.1", "::1"}
    assert "10.1.2.3" in StatusServer(dict, list, host="10.1.2.3").allowed_hosts


def test_page_embeds_curves_as_inert_json() -> None:
    """The curves go into the page as JSON no string can break out of (``</script>``), without
    NaN or infinity (strict JSON for the browser's parser)."""
    evil = "</script><script>alert(1)</script>"
    page = render_html({"curves": {"train": {"step": [1.0, 2.0], "series": {evil: [math.inf, 0.5]}}}})
    assert evil not in page
    start = page.index('<script type="application/json" id="curves-data">') + len('<script type="application/json" id="curves-data">')
    data = json.loads(page[start : page.index("</script>", start)])
    assert data == {"train": {"step": [1.0, 2.0], "series": {evil: [None, 0.5]}}}
