"""The socket side of hole punching on 127.0.0.1 (node.punch, the data plane's hooks): a
connection leaves from a listening port (SO_REUSEPORT on both) and the far end sees that very
port (what the hub's punch_addr relies on); the handshake runs on a connection made elsewhere, as
the dialer (``connect(stream=)``) or as the listener (``DataPlaneServer.adopt``: its ``allow`` and
limits apply). Across real NATs: tests/test_netns_nat.py."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from echo2.node import punch
from echo2.protocol.handshake import HandshakeRefused
from echo2.protocol.identity import Identity
from echo2.protocol.net import dataplane
from echo2.protocol.net.connection import DataConnection


def test_connection_leaves_from_the_shared_listen_port_and_authenticates() -> None:
    a_id, b_id = Identity.generate(), Identity.generate()
    seen: list[tuple[str, int | None]] = []

    async def on_b(conn: DataConnection) -> None:
        seen.append((conn.peer_id, conn.remote_port()))

    async def on_a(conn: DataConnection) -> None:
        return None

    async def main() -> None:
        a = dataplane.DataPlaneServer(a_id, on_a, reuse_port=True)
        b = dataplane.DataPlaneServer(b_id, on_b, reuse_port=True)
        async with trio.open_nursery() as nursery:
            await nursery.start(a.serve)
            await nursery.start(b.serve)
            with trio.fail_after(10):
                stream, lport = await punch.hub_stream(a.host, a.port, b.addr, 5.0)
                assert stream is not None and lport == a.port  # a listens on that port all along
                conn = await dataplane.connect(b.addr, a_id, b_id.peer_id, stream=stream)
                while not seen:
                    await trio.sleep(0.01)
                await conn.aclose()
            nursery.cancel_scope.cancel()
        assert seen == [(a_id.peer_id, a.port)]  # b saw a at a's listen port

    trio.run(main)


@pytest.mark.parametrize("allowed", [True, False])
def test_adopted_connection_runs_the_listener_side_and_its_gate(allowed: bool) -> None:
    a_id, b_id = Identity.generate(), Identity.generate()
    served: list[str] = []

    async def on_b(conn: DataConnection) -> None:
        served.append(conn.peer_id)

    async def main() -> Any:
        b = dataplane.DataPlaneServer(b_id, on_b, allow=lambda peer: allowed)
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")  # stands in for the punched socket pair
        port = listeners[0].socket.getsockname()[1]
        try:
            async with trio.open_nursery() as nursery:
                with trio.fail_after(10):
                    a_end = await trio.open_tcp_stream("127.0.0.1", port)
                    b_end = await listeners[0].accept()
                    nursery.start_soon(b.adopt, b_end)
                    try:
                        conn = await dataplane.connect(f"127.0.0.1:{port}", a_id, b_id.peer_id, stream=a_end)
                    except HandshakeRefused as exc:
                        return exc
                    while not served:
                        await trio.sleep(0.01)
                    await conn.aclose()
        finally:
            await listeners[0].aclose()
        return None

    refused = trio.run(main)
    if allowed:
        assert refused is None and served == [a_id.peer_id]
    else:
        assert isinstance(refused, HandshakeRefused) and refused.reason == "not_allowed" and served == []


def test_punch_gives_up_within_its_window() -> None:
    async def main() -> float:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        await listeners[0].aclose()  # nobody there: every SYN is answered by a RST
        t0 = trio.current_time()
        with pytest.raises(punch.PunchFailed), trio.fail_after(10):
            await punch.punch_stream("127.0.0.1", 0, f"127.0.0.1:{port}", window_s=0.6)
        return trio.current_time() - t0

    assert 0.5 <= trio.run(main) < 3.0
