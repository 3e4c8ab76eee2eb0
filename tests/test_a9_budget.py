"""A9 dataplane-exhaust (budget part): what one authenticated peer pins in a data-plane server with
half-sent frames is bounded by its own budget over all its connections; others are still served.

Real DataPlaneServer and real TCP on 127.0.0.1; the attacker writes raw frame headers and stalls.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

from echo2.protocol import dataframe as df
from echo2.protocol.dataframe import FrameType
from echo2.protocol.errors import Echo2Error
from echo2.protocol.identity import Identity
from echo2.protocol.net.connection import DataConnection
from echo2.protocol.net.dataplane import DataPlaneServer, connect

KiB = 1024


def run(fn: Callable[[], Awaitable[Any]], limit_s: float = 20.0) -> Any:
    async def main() -> Any:
        with trio.fail_after(limit_s):
            return await fn()

    return trio.run(main)


def test_a9_budget_half_sent_frames_bounded_per_peer() -> None:
    async def main() -> None:
        async def echo(conn: DataConnection) -> None:
            async for frame in conn:
                await conn.send_message(bytes(frame.payload[:8]))

        server_id = Identity.generate()
        server = DataPlaneServer(
            server_id, echo, handshakes_per_ip_per_s=None, max_connections_per_peer=4,
            max_buffered_per_peer=256 * KiB, max_buffered_per_ip=1024 * KiB, max_buffered_total=1024 * KiB,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            attacker = Identity.generate()
            conns = [await connect(server.addr, attacker, server_id.peer_id, timeout_s=5) for _ in range(4)]
            # each connection announces a 200 KiB message, sends 1 KiB of it, and stalls
            for c in conns:
                await c._stream.send_all(df.HEADER.pack(FrameType.MESSAGE, df.ZERO_KEY, 200 * KiB) + b"x" * KiB)
            with trio.move_on_after(5):
                while server.stats.refusals["frame.over_budget"] < 3:
                    await trio.sleep(0.02)
            # one half-sent frame fits the attacker's budget; the other three are over it and cut
            assert server.stats.refusals["frame.over_budget"] == 3
            assert server.rx_peer.held(attacker.peer_id) <= 256 * KiB
            assert server.buffered_bytes <= 256 * KiB
            # a frame that could never fit the budget is refused from its header
            big = await connect(server.addr, Identity.generate(), server_id.peer_id, timeout_s=5)
            await big._stream.send_all(df.HEADER.pack(FrameType.MESSAGE, df.ZERO_KEY, 300 * KiB))
            with trio.move_on_after(5):
                while server.stats.refusals["frame.over_budget"] < 4:
                    await trio.sleep(0.02)
            assert server.stats.refusals["frame.over_budget"] == 4
            # an honest peer is served while the attacker's last frame still stalls
            honest = await connect(server.addr, Identity.generate(), server_id.peer_id, timeout_s=5)
            await honest.send_message(b"hello, hub" + b"." * 100 * KiB)
            reply = await honest.receive(timeout_s=5)
            assert bytes(reply.payload) == b"hello, h"
            await honest.aclose()
            for c in [*conns, big]:
                await c.abort()
            with trio.fail_after(5):
                while server.active:
                    await trio.sleep(0.02)
            assert server.buffered_bytes == 0 and len(server.rx_peer) == 0 and len(server.rx_ip) == 0
            nursery.cancel_scope.cancel()

    try:
        run(main)
    except Echo2Error as exc:  # pragma: no cover - the message says which step failed
        raise AssertionError(str(exc)) from exc
