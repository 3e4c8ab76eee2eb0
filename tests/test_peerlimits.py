"""Per-peer limits: the sans-IO limiters, and their use in ControlHost and DataPlaneServer.

Real libp2p hosts and real TCP sockets on 127.0.0.1; limits are set small so each one trips.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from echo2.protocol.errors import Echo2Error, HandshakeError
from echo2.protocol.framing import RemoteError
from echo2.protocol.identity import Identity
from echo2.protocol.net.connection import DataConnection
from echo2.protocol.net.control import ControlHost, RequestLimits
from echo2.protocol.net.dataplane import DataPlaneServer, connect
from echo2.protocol.peerlimit import ConcurrencyLimiter, KeyedRateLimiter, LogThrottle

ECHO = "/echo2/test-limits/1.0.0"


def run(fn: Callable[[], Awaitable[Any]], limit_s: float = 20.0) -> Any:
    async def main() -> Any:
        with trio.fail_after(limit_s):
            return await fn()

    return trio.run(main)


# --- sans-IO ------------------------------------------------------------------------------------


def test_keyed_rate_limiter_burst_refill_and_keys_apart() -> None:
    lim = KeyedRateLimiter(rate_per_s=2.0, burst=3, max_keys=10)
    assert [lim.allow("a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert lim.allow("b", 0.0)  # another key has its own bucket
    assert not lim.allow("a", 0.4)  # 0.8 token: still short
    assert lim.allow("a", 0.5)  # one token back after 1/rate
    assert not lim.allow("a", 0.5)
    assert lim.allow("a", 100.0) and lim.allow("a", 100.0) and lim.allow("a", 100.0)
    assert not lim.allow("a", 100.0)  # refill is capped at the burst
    assert lim.refused == 4


def test_keyed_rate_limiter_is_bounded() -> None:
    lim = KeyedRateLimiter(rate_per_s=1.0, burst=1, max_keys=100)
    for i in range(10_000):
        lim.allow(f"peer{i}", 0.0)
    assert len(lim) == 100
    with pytest.raises(ValueError):
        KeyedRateLimiter(rate_per_s=0.0, burst=1)
    with pytest.raises(ValueError):
        KeyedRateLimiter(rate_per_s=1.0, burst=0.5)


def test_concurrency_limiter_pairs_and_forgets() -> None:
    lim = ConcurrencyLimiter(2)
    assert lim.acquire("a") and lim.acquire("a")
    assert not lim.acquire("a")
    assert lim.acquire("b")
    lim.release("a")
    assert lim.acquire("a")
    lim.release("a")
    lim.release("a")
    lim.release("b")
    assert len(lim) == 0 and lim.refused == 1


def test_log_throttle_thins_a_flood(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("echo2.test.throttle")
    thr = LogThrottle(logger, per_s=3)
    with caplog.at_level(logging.WARNING, logger="echo2.test.throttle"):
        for i in range(100):
            thr.log(logging.WARNING, "rate_limited", 10.0 + i / 1000, "refused %d", i)
        thr.log(logging.WARNING, "rate_limited", 11.5, "refused late")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == ["refused 0", "refused 1", "refused 2"]
    assert "97 more [rate_limited] lines suppressed" in lines[3]
    assert lines[4] == "refused late"
    assert len(lines) == 5


# --- control plane ------------------------------------------------------------------------------


async def _echo(_peer: str, data: bytes) -> bytes:
    return data


def test_control_rate_limit_per_peer_and_protocol() -> None:
    async def main() -> None:
        limits = RequestLimits(rate_per_s=0.5, burst=3, per_protocol={ECHO + "/big": (100.0, 100.0)})
        async with (
            ControlHost(Identity.generate(), gossip=False, limits=limits) as server,
            ControlHost(Identity.generate(), gossip=False) as client,
            ControlHost(Identity.generate(), gossip=False) as other,
        ):
            server.set_handler(ECHO, _echo, max_request=1024)
            server.set_handler(ECHO + "/big", _echo, max_request=1024)
            addr = server.addrs[0]
            for _ in range(3):
                assert await client.request(addr, ECHO, b"hi", max_response=64) == b"hi"
            with pytest.raises(RemoteError) as err:
                await client.request(addr, ECHO, b"hi", max_response=64)
            assert err.value.code == "rate_limited"
            assert server.refusals["rate_limited"] == 1
            # another peer, and another protocol with its own figures, are not affected
            assert await other.request(addr, ECHO, b"yo", max_response=64) == b"yo"
            for _ in range(10):
                assert await client.request(addr, ECHO + "/big", b"x", max_response=64) == b"x"
            assert server.refusals["rate_limited"] == 1

    run(main)


def test_control_concurrent_streams_and_inflight_bytes_capped() -> None:
    async def main() -> None:
        release = trio.Event()

        async def slow(_peer: str, data: bytes) -> bytes:
            await release.wait()
            return data

        limits = RequestLimits(max_streams_per_peer=2, max_inflight_bytes=1000)
        async with (
            ControlHost(Identity.generate(), gossip=False, limits=limits) as server,
            ControlHost(Identity.generate(), gossip=False) as client,
        ):
            server.set_handler(ECHO, slow, max_request=4096)
            addr = server.addrs[0]
            await client.connect(addr)
            results: list[Any] = []

            async def ask(payload: bytes) -> None:
                try:
                    results.append(await client.request(addr, ECHO, payload, max_response=4096))
                except Echo2Error as exc:
                    results.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, b"a" * 10)
                nursery.start_soon(ask, b"b" * 10)
                while server._streams.count(client.peer_id) < 2:
                    await trio.sleep(0.01)
                await ask(b"c")  # a third concurrent stream from the same peer
                release.set()
            codes = [r.code for r in results if isinstance(r, RemoteError)]
            assert codes == ["too_many_streams"]
            assert sorted(r for r in results if isinstance(r, bytes)) == [b"a" * 10, b"b" * 10]
            # a body above the in-flight budget is refused once its bytes pass it (charged as they arrive)
            with pytest.raises(RemoteError) as err:
                await client.request(addr, ECHO, b"z" * 2000, max_response=4096)
            assert err.value.code == "busy"
            assert server.refusals["too_many_streams"] == 1 and server.refusals["busy"] == 1
            # a stream's slot is held until its requester has ended its side too (reqresp._await_peer_end)
            with trio.move_on_after(5):
                while len(server._streams):
                    await trio.sleep(0.01)
            assert server._inflight_bytes == 0 and len(server._streams) == 0

    run(main)


# --- data plane ---------------------------------------------------------------------------------


def test_dataplane_caps_per_ip_per_peer_and_handshake_rate() -> None:
    async def main() -> None:
        hold = trio.Event()

        async def handler(conn: DataConnection) -> None:
            await hold.wait()

        server_id = Identity.generate()
        server = DataPlaneServer(
            server_id, handler, max_connections_per_ip=3, max_connections_per_peer=1,
            handshakes_per_ip_per_s=None,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            same = Identity.generate()
            conns = [await connect(server.addr, same, server_id.peer_id, timeout_s=5)]
            with pytest.raises(HandshakeError):  # the same peer ID twice
                await connect(server.addr, same, server_id.peer_id, timeout_s=5)
            assert server.stats.refusals["too_many_connections.peer"] == 1
            conns += [await connect(server.addr, Identity.generate(), server_id.peer_id, timeout_s=5) for _ in range(2)]
            with pytest.raises(Echo2Error):  # a fourth from 127.0.0.1: closed before the handshake
                await connect(server.addr, Identity.generate(), server_id.peer_id, timeout_s=5)
            assert server.stats.refusals["too_many_connections.ip"] == 1
            hold.set()
            for c in conns:
                await c.aclose()
            with trio.fail_after(5):
                while server.active:
                    await trio.sleep(0.01)
            assert len(server.per_ip) == 0 and len(server.per_peer) == 0
            nursery.cancel_scope.cancel()

        rated = DataPlaneServer(server_id, handler, handshakes_per_ip_per_s=0.1, handshake_burst=2)
        hold = trio.Event()
        hold.set()
        async with trio.open_nursery() as nursery:
            await nursery.start(rated.serve)
            for _ in range(2):
                c = await connect(rated.addr, Identity.generate(), server_id.peer_id, timeout_s=5)
                await c.aclose()
            with pytest.raises(Echo2Error):
                await connect(rated.addr, Identity.generate(), server_id.peer_id, timeout_s=5)
            assert rated.stats.refusals["handshake.rate_limited"] == 1
            nursery.cancel_scope.cancel()

    run(main)
