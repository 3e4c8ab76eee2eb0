"""A1 inflight-reserve: announced request lengths hold no budget; bytes are charged as they arrive,
per peer, strangers apart from admitted peers, and a body slower than the minimum rate is cut.

Real ControlHosts on 127.0.0.1; the attacker speaks raw frames over a libp2p stream, as a hostile
implementation would.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol

from echo2.protocol.framing import RemoteError, decode_response, encode_header
from echo2.protocol.identity import Identity
from echo2.protocol.net.control import ControlHost, RequestLimits
from echo2.protocol.net.libp2p_host import parse_peer_id
from echo2.protocol.net.reqresp import read_frame
from echo2.protocol.peerlimit import ByteBudget, Charge

ECHO = "/echo2/test-a1/1.0.0"
MiB = 1024 * 1024


def run(fn: Callable[[], Awaitable[Any]], limit_s: float = 30.0) -> Any:
    async def main() -> Any:
        with trio.fail_after(limit_s):
            return await fn()

    return trio.run(main)


async def echo(_peer: str, data: bytes) -> bytes:
    return data[:16]


async def open_raw(attacker: ControlHost, server: ControlHost) -> INetStream:
    return await attacker.libp2p_host.new_stream(parse_peer_id(server.peer_id), [TProtocol(ECHO)])


def test_a1_byte_budget_per_key_and_total() -> None:
    b = ByteBudget(per_key=100, total=150)
    assert b.take("a", 100) and not b.take("a", 1)  # a's own cap
    assert b.take("b", 50) and not b.take("c", 1)  # the total
    b.give("a", 60)
    assert b.take("c", 10) and b.held("a") == 40 and b.total_held == 100
    b.give("a", 1000)  # never below zero, and the key is forgotten
    assert b.held("a") == 0 and b.total_held == 60 and len(b) == 2


def test_a1_charge_is_all_or_nothing_across_budgets() -> None:
    per_peer, per_ip = ByteBudget(per_key=100, total=1000), ByteBudget(per_key=150, total=1000)
    a, b = Charge([(per_peer, "a"), (per_ip, "ip")]), Charge([(per_peer, "b"), (per_ip, "ip")])
    assert a.cap == 100 and a.take(90) and b.take(61) is False  # the shared IP budget is short
    assert per_peer.held("b") == 0 and per_ip.held("ip") == 90  # nothing taken from either
    a.release()
    assert b.take(61) and per_peer.total_held == 61 and per_ip.held("ip") == 61


def test_a1_announced_lengths_do_not_starve_honest_requests() -> None:
    """Eight streams announcing 64 MiB each and sending nothing: an honest request is still answered."""

    async def main() -> None:
        async with (
            ControlHost(Identity.generate(), gossip=False) as server,
            ControlHost(Identity.generate(), gossip=False) as attacker,
            ControlHost(Identity.generate(), gossip=False) as honest,
        ):
            server.set_handler(ECHO, echo, max_request=64 * MiB)
            addr = server.addrs[0]
            await attacker.connect(addr)
            streams = []
            for _ in range(8):
                s = await open_raw(attacker, server)
                await s.write(encode_header(64 * MiB, max_size=64 * MiB))
                streams.append(s)
            await trio.sleep(0.3)  # the server has read every header
            assert server._inflight_bytes == 0
            t0 = trio.current_time()
            # 1 MiB: above what the old code had left after 8 x 64 MiB of its 512 MiB budget
            assert await honest.request(addr, ECHO, b"h" * MiB, max_response=64) == b"h" * 16
            assert trio.current_time() - t0 < 5.0
            assert server.refusals["busy"] == 0
            for s in streams:
                await s.reset()

    run(main)


def test_a1_trickling_body_is_cut() -> None:
    async def main() -> None:
        limits = RequestLimits(body_grace_s=0.5, min_body_rate_Bps=20_000)
        async with (
            ControlHost(Identity.generate(), gossip=False, limits=limits) as server,
            ControlHost(Identity.generate(), gossip=False) as attacker,
        ):
            server.set_handler(ECHO, echo, max_request=4 * MiB)
            await attacker.connect(server.addrs[0])
            s = await open_raw(attacker, server)
            await s.write(encode_header(MiB, max_size=4 * MiB))
            reply: list[bytes] = []

            async def trickle() -> None:
                for _ in range(100):
                    try:
                        await s.write(b"x" * 10)
                    except Exception:
                        return
                    await trio.sleep(1.0)

            t0 = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trickle)
                with trio.move_on_after(5.0):
                    reply.append(await read_frame(s, max_size=4096))
                nursery.cancel_scope.cancel()
            assert reply, "a body trickling at 10 B/s was not cut within 5 s"
            assert trio.current_time() - t0 < 3.0
            with pytest.raises(RemoteError) as err:
                decode_response(reply[0])
            assert err.value.code == "too_slow"
            assert server.refusals["too_slow"] == 1 and server._inflight_bytes == 0
            await s.reset()

    run(main)


def test_a1_strangers_share_nothing_with_admitted_peers() -> None:
    """Strangers filling every stranger budget with real bytes cannot make an admitted peer busy,
    and a stranger cannot send more than its small allowance."""

    async def main() -> None:
        limits = RequestLimits(
            stranger_inflight_per_peer=64 * 1024, stranger_inflight_per_ip=128 * 1024,
            stranger_inflight_bytes=128 * 1024, max_inflight_per_peer=4 * MiB, max_inflight_bytes=8 * MiB,
        )
        release = trio.Event()

        async def slow(_peer: str, data: bytes) -> bytes:
            if data[:1] == b"s":
                await release.wait()
            return data[:16]

        async with (
            ControlHost(Identity.generate(), gossip=False, limits=limits) as server,
            ControlHost(Identity.generate(), gossip=False) as honest,
            ControlHost(Identity.generate(), gossip=False) as s1,
            ControlHost(Identity.generate(), gossip=False) as s2,
        ):
            server.is_trusted = lambda peer: peer == honest.peer_id
            server.set_handler(ECHO, slow, max_request=8 * MiB)
            addr = server.addrs[0]
            results: list[Any] = []

            async def ask(host: ControlHost, payload: bytes) -> None:
                try:
                    results.append(await host.request(addr, ECHO, payload, max_response=64))
                except RemoteError as exc:
                    results.append(exc.code)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, s1, b"s" * 60_000)
                nursery.start_soon(ask, s2, b"s" * 60_000)
                while server._stranger_peer_bytes.total_held < 120_000:
                    await trio.sleep(0.01)
                # the stranger pool and this IP's stranger budget are full...
                await ask(s1, b"s" * 100_000)  # above one stranger's allowance: refused from its header
                # ...yet an admitted peer's 2 MiB request (16x the whole stranger pool) is answered
                assert await honest.request(addr, ECHO, b"h" * 2 * MiB, max_response=64) == b"h" * 16
                release.set()
            assert results.count("too_large") == 1 and results.count(b"s" * 16) == 2
            assert server.refusals["busy"] == 0 and server._inflight_bytes == 0

    run(main)
