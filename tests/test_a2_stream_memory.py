"""A2 leftovers: what a refused request leaves in py-libp2p's Yamux buffers.

Two holes below our request code, both measured with `bench attack` A2 (4 MB bad frames from one
stranger, refused from the header): py-libp2p kept every refused stream and the unread window
its requester pushed (~300 KB each, for the connection's life: +85 MiB hub RSS in 60 s), and it
does not enforce the receive window at all (a peer ignoring flow control is buffered without
bound). Real ControlHosts on 127.0.0.1; the window overrun is written as raw Yamux frames, as a
hostile implementation would.
"""

from __future__ import annotations

import struct
from typing import Any

import trio
from libp2p.custom_types import TProtocol
from libp2p.stream_muxer.yamux.yamux import TYPE_DATA, YAMUX_HEADER_FORMAT
from test_a1_inflight import MiB, echo, run  # the same trio runner and echo handler

from echo2.protocol.errors import Echo2Error
from echo2.protocol.framing import encode_header
from echo2.protocol.identity import Identity
from echo2.protocol.net.control import ControlHost, RequestLimits
from echo2.protocol.net.libp2p_host import parse_peer_id
from echo2.protocol.net.yamux_guard import WindowedYamux

ECHO = "/echo2/test-a2/1.0.0"


def muxers(host: ControlHost) -> list[Any]:
    out = []
    for conns in host.libp2p_host.get_network().connections.values():
        for c in conns if isinstance(conns, list) else [conns]:
            out.append(c.muxed_conn)
    return out


def held(host: ControlHost) -> tuple[int, int]:
    """(streams, buffered bytes) py-libp2p keeps on all of ``host``'s connections."""
    ms = muxers(host)
    return sum(len(m.streams) for m in ms), sum(len(b) for m in ms for b in m.stream_buffers.values())


def test_a2_refused_streams_leave_nothing_behind() -> None:
    """A stranger's oversized requests are refused from the header; within the end grace their
    streams and the window of bytes they pushed are gone, while the connection stays up."""

    async def main() -> None:
        limits = RequestLimits(end_grace_s=0.5)
        async with (
            ControlHost(Identity.generate(), gossip=False, limits=limits) as server,
            ControlHost(Identity.generate(), gossip=False) as attacker,
        ):
            server.is_trusted = lambda _peer: False
            server.set_handler(ECHO, echo, max_request=64 * MiB)
            await attacker.connect(server.addrs[0])
            pushed = 0
            for _ in range(6):
                s = await attacker.libp2p_host.new_stream(parse_peer_id(server.peer_id), [TProtocol(ECHO)])
                await s.write(encode_header(4 * MiB, max_size=64 * MiB))
                # what the window lets through before the refusal stops granting credit
                with trio.move_on_after(0.5):
                    await s.write(b"\0" * (200 * 1024))
                    pushed += 200 * 1024
                # a hostile requester never ends its side: no close, no reset
            assert pushed > 0
            assert server.refusals["too_large"] == 6
            streams, buffered = held(server)
            for _ in range(100):
                streams, buffered = held(server)
                if streams == 0 and buffered == 0:
                    break
                await trio.sleep(0.05)
            assert (streams, buffered) == (0, 0), f"{streams} streams, {buffered} bytes still held"
            assert server.is_connected(attacker.peer_id)
            # and the connection still serves
            assert await attacker.request(server.peer_id, ECHO, b"x" * 10, max_response=64) == b"x" * 10

    run(main, 40.0)


def test_a2_honest_request_not_reset() -> None:
    """An honest requester ends its side after the reply: it gets every reply, nothing is reset."""

    async def main() -> None:
        async with (
            ControlHost(Identity.generate(), gossip=False) as server,
            ControlHost(Identity.generate(), gossip=False) as client,
        ):
            server.set_handler(ECHO, echo, max_request=64 * MiB)
            await client.connect(server.addrs[0])
            for i in range(20):
                body = bytes([i]) * (1 + i * 1000)
                assert await client.request(server.peer_id, ECHO, body, max_response=64) == body[:16]
            for _ in range(100):
                if held(server) == (0, 0):
                    break
                await trio.sleep(0.05)
            assert held(server) == (0, 0)
            assert server.refusals["transport"] == 0

    run(main, 40.0)


def test_a2_window_overrun_closes_the_connection() -> None:
    """A peer that sends beyond the receive window we granted is cut off (as go-yamux does) and
    never buffered past the window; an honest peer on its own connection is untouched."""

    async def main() -> None:
        async with (
            ControlHost(Identity.generate(), gossip=False) as server,
            ControlHost(Identity.generate(), gossip=False) as attacker,
            ControlHost(Identity.generate(), gossip=False) as honest,
        ):
            async def ok(_peer: str, _data: bytes) -> bytes:
                return b"ok"

            server.set_handler(ECHO, ok, max_request=64 * MiB)
            server.is_trusted = lambda peer: peer == honest.peer_id
            await attacker.connect(server.addrs[0])
            await honest.connect(server.addrs[0])
            (mux,) = [m for m in muxers(server) if str(m.peer_id) == attacker.peer_id]
            assert isinstance(mux, WindowedYamux)
            s = await attacker.libp2p_host.new_stream(parse_peer_id(server.peer_id), [TProtocol(ECHO)])
            ys = s.muxed_stream
            await s.write(encode_header(8 * MiB, max_size=64 * MiB))
            # Flow control ignored: 24 MiB in 1 MiB DATA frames, past any window py-libp2p grants
            # (16 MiB at most) on a stream the server stopped reading (refused from the header).
            overrun = 24 * MiB
            with trio.move_on_after(5):
                while overrun > 0:
                    data = b"\1" * min(MiB, overrun)
                    frame = struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_DATA, 0, ys.stream_id, len(data)) + data
                    try:
                        await ys.conn._write_frame(frame)
                    except Exception:  # the server cut us off: what this test wants
                        break
                    overrun -= len(data)
            for _ in range(100):
                if not server.is_connected(attacker.peer_id):
                    break
                await trio.sleep(0.05)
            assert not server.is_connected(attacker.peer_id)
            assert mux.window_violation is not None
            assert max((len(b) for b in mux.stream_buffers.values()), default=0) <= 16 * MiB
            assert await honest.request(server.peer_id, ECHO, b"y" * 300_000, max_response=64) == b"ok"
            try:
                await attacker.request(server.peer_id, ECHO, b"z", max_response=64, timeout_s=3)
            except Echo2Error:
                pass  # the attacker may redial; what matters is that its overrun was cut

    run(main, 40.0)
