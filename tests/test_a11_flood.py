"""A11 connection-flood: control-plane connections are capped per remote IP (admitted peers are never
closed for it), and the hub's admission bucket is per IP, so one source drains only its own.

Real ControlHosts on 127.0.0.1; the admission part calls a real hub's handler with the remote IP a
ControlHost would have set (every test peer is 127.0.0.1, so the address is set by hand there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from hubkit import announce as _announce
from hubkit import small_hub_cfg

from echo2.learner_hub.hub import Hub
from echo2.protocol import envelope
from echo2.protocol.errors import RateLimited
from echo2.protocol.identity import Identity
from echo2.protocol.messages import AdmissionRequest
from echo2.protocol.net import reqresp
from echo2.protocol.net.control import ControlHost, RequestLimits, address_key

ECHO = "/echo2/test-a11/1.0.0"


def run(fn: Callable[[], Awaitable[Any]], limit_s: float = 40.0) -> Any:
    async def main() -> Any:
        with trio.fail_after(limit_s):
            return await fn()

    return trio.run(main)


async def echo(_peer: str, data: bytes) -> bytes:
    # the handler sees the address of the stream it serves (what the hub's admission bucket keys on)
    assert reqresp.remote_ip() == "127.0.0.1"
    return data


def test_a11_address_key_groups_an_ipv6_64() -> None:
    assert address_key("203.0.113.7") == "203.0.113.7"
    assert address_key("2001:db8:1:2::1") == address_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key("::ffff:203.0.113.7") == "203.0.113.7"
    assert address_key("not-an-ip") == "not-an-ip"


def test_a11_connections_capped_per_ip() -> None:
    async def main() -> None:
        limits = RequestLimits(max_connections_per_ip=2)
        async with ControlHost(Identity.generate(), gossip=False, limits=limits) as server:
            server.set_handler(ECHO, echo, max_request=1024)
            addr = server.addrs[0]
            async with ControlHost(Identity.generate(), gossip=False) as honest:
                server.is_trusted = lambda peer: peer == honest.peer_id
                await honest.connect(addr)
                async with contextlib.AsyncExitStack() as stack:
                    attackers = [
                        await stack.enter_async_context(ControlHost(Identity.generate(), gossip=False)) for _ in range(4)
                    ]
                    for a in attackers:
                        try:
                            await a.connect(addr)
                        except Exception:
                            pass  # a refused connection may fail the dial itself
                    with trio.move_on_after(5.0):
                        while server.refusals["too_many_connections"] < 3:
                            await trio.sleep(0.05)
                    await trio.sleep(0.3)
                    connected = set(server.connected_peers())
                    assert server.refusals["too_many_connections"] == 3
                    assert len(connected & {a.peer_id for a in attackers}) == 1  # 2 per IP, the honest one included
                    assert sum(server._ip_conns.values()) == 2
                    assert server.remote_ip(honest.peer_id) == "127.0.0.1" and reqresp.remote_ip() is None
                    # the admitted peer is still served, and may add connections past the cap
                    assert await honest.request(addr, ECHO, b"hi", max_response=64) == b"hi"
                    async with ControlHost(Identity.generate(), gossip=False) as late:
                        server.is_trusted = lambda peer: peer in {honest.peer_id, late.peer_id}
                        assert await late.request(addr, ECHO, b"yo", max_response=64) == b"yo"

    run(main)



def test_a11_stranger_streams_rate_limited_per_ip_before_negotiation() -> None:
    """Fresh keys from one address open streams faster than the address may: the excess is reset
    before its protocol is negotiated (the handler never runs for it); an admitted peer on the
    same address is not counted."""
    served: list[str] = []

    async def counting_echo(peer: str, data: bytes) -> bytes:
        served.append(peer)
        return data

    async def main() -> None:
        limits = RequestLimits(stranger_streams_per_ip_s=0.01, stranger_streams_burst=6)
        async with ControlHost(Identity.generate(), gossip=False, limits=limits) as server:
            server.set_handler(ECHO, counting_echo, max_request=1024)
            addr = server.addrs[0]
            async with ControlHost(Identity.generate(), gossip=False) as honest:
                server.is_trusted = lambda peer: peer == honest.peer_id
                answered = failed = 0
                for _ in range(4):  # throwaway keys, a few requests each (identify streams count too)
                    async with ControlHost(Identity.generate(), gossip=False) as stranger:
                        for _ in range(4):
                            try:
                                answered += await stranger.request(addr, ECHO, b"x", max_response=64, timeout_s=3) == b"x"
                            except Exception:
                                failed += 1
                assert server.refusals["rate_limited"] >= 10 and failed >= 10
                assert len(served) == answered <= 6  # at most the burst was negotiated and served
                for _ in range(10):  # the admitted peer, same address, is not counted
                    assert await honest.request(addr, ECHO, b"hi", max_response=64) == b"hi"

    run(main, 60.0)


@pytest.fixture()
def hub(tmp_path: Path) -> Hub:
    cfg = small_hub_cfg(tmp_path)
    return Hub(cfg)


def test_a11_admission_bucket_is_per_ip(hub: Hub) -> None:
    async def admit_from(ip: str, node: Identity) -> bool:
        token = reqresp._REMOTE_IP.set(ip)  # what ControlHost sets while serving a stream from ip
        try:
            req = AdmissionRequest(peer_id=node.peer_id, join_token="", announce=_announce(node.peer_id))
            await hub.on_admission(node.peer_id, envelope.seal(node, req))
            return True
        except RateLimited as exc:  # code rate_limited: a node retries it
            assert "too many admission requests" in exc.message
            return False
        finally:
            reqresp._REMOTE_IP.reset(token)

    async def main() -> None:
        # one address floods until it is throttled (bounded: the bucket must empty)...
        refused_in_a_row = tries = 0
        while refused_in_a_row < 5:
            tries += 1
            assert tries < 300, "the flooding address was never throttled"
            refused_in_a_row = 0 if await admit_from("198.51.100.9", Identity.generate()) else refused_in_a_row + 1
        # ...and an honest node on another address is admitted at once (one shared bucket refused it)
        assert await admit_from("203.0.113.5", Identity.generate())
        assert not await admit_from("198.51.100.9", Identity.generate())

    try:
        run(main)
    finally:
        hub.store.close()


async def _held_and_closed(port: int, n: int, wait_s: float = 1.5) -> tuple[list[trio.SocketStream], int]:
    """Open ``n`` raw TCP connections that never start the handshake; those the server closes
    (EOF or reset within ``wait_s``) are counted and closed here, the others are returned open."""
    streams = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(n)]
    closed: list[trio.SocketStream] = []

    async def watch(s: trio.SocketStream) -> None:
        with trio.move_on_after(wait_s):
            try:
                if await s.receive_some(64) == b"":
                    closed.append(s)
            except (trio.BrokenResourceError, OSError):
                closed.append(s)

    async with trio.open_nursery() as nursery:
        for s in streams:
            nursery.start_soon(watch, s)
    for s in closed:
        await s.aclose()
    return [s for s in streams if s not in closed], len(closed)


def test_a11_stranger_connections_refused_before_the_handshake() -> None:
    """An address with no admitted peer opens connections faster than it may, or holds more mid-
    handshake than it may: the excess is closed before Noise starts (a refusal costs an accept and
    a close: ~0.3 ms of the host's CPU against ~20 ms for a handshake, identify and gossip)."""

    async def main() -> None:
        # refused ones held unread for a minute, two of them at most: the other three closed at once
        limits = RequestLimits(stranger_conns_per_ip_s=0.01, stranger_conns_burst=3, max_pending_per_ip=100,
                               refused_hold_s=60.0, max_held_per_ip=2)
        async with ControlHost(Identity.generate(), gossip=False, limits=limits) as server:
            server.set_handler(ECHO, echo, max_request=1024)
            held, closed = await _held_and_closed(server.listen_addr[1], 8)
            assert len(held) == 5 and closed == 3  # 3 within the burst, 2 refused and held
            assert server.refusals["rate_limited"] == 5 and server._inbound.held.count("127.0.0.1") == 2
            for s in held:
                await s.aclose()

        limits = RequestLimits(stranger_conns_burst=100, max_pending_per_ip=2, refused_hold_s=0.0)
        async with ControlHost(Identity.generate(), gossip=False, limits=limits) as server:
            server.set_handler(ECHO, echo, max_request=1024)
            held, closed = await _held_and_closed(server.listen_addr[1], 6)
            assert len(held) == 2 and closed == 4
            assert server.refusals["too_many_connections"] == 4
            for s in held:  # their slots come back: a real peer is served again
                await s.aclose()
            with trio.move_on_after(5.0):
                while server._inbound.pending.count("127.0.0.1"):
                    await trio.sleep(0.05)
            async with ControlHost(Identity.generate(), gossip=False) as peer:
                assert await peer.request(server.addrs[0], ECHO, b"hi", max_response=64) == b"hi"

    run(main)


def test_a11_stranger_over_the_stream_rate_is_disconnected() -> None:
    """A stranger's stream past its address's rate is reset unnegotiated and its connection closed:
    on a kept connection every further stream still cost the host ~2 ms (bench attack A3/A11); a
    new connection meets the accept gate. An admitted peer on the same address stays connected."""

    async def main() -> None:
        limits = RequestLimits(stranger_streams_per_ip_s=0.01, stranger_streams_burst=4, refused_hold_s=0.0)
        async with ControlHost(Identity.generate(), gossip=False, limits=limits) as server:
            server.set_handler(ECHO, echo, max_request=1024)
            addr = server.addrs[0]
            async with ControlHost(Identity.generate(), gossip=False) as honest, \
                    ControlHost(Identity.generate(), gossip=False) as stranger:
                server.is_trusted = lambda peer: peer == honest.peer_id
                await honest.connect(addr)
                await stranger.connect(addr)
                failed = 0
                for _ in range(10):
                    try:
                        await stranger.request(addr, ECHO, b"x", max_response=64, timeout_s=3)
                    except Exception:
                        failed += 1
                        break
                assert failed == 1 and server.refusals["rate_limited"] >= 1
                with trio.move_on_after(5.0):
                    while stranger.peer_id in server.connected_peers():
                        await trio.sleep(0.05)
                assert stranger.peer_id not in server.connected_peers()
                assert honest.peer_id in server.connected_peers()
                for _ in range(10):
                    assert await honest.request(addr, ECHO, b"hi", max_response=64) == b"hi"

    run(main)
