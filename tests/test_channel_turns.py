"""The hub's channel reads a bounded number of frames per pass of its loop (issue 20): 1,000
heartbeats landing together were 1,000 reads in one pass (35-55 ms of loop at 10,000 nodes). A
turn is held only while a frame already in the kernel's buffer is read (frame_ready), never while
a peer is waited for. Real sockets, a real ChannelServer and ChannelClients on 127.0.0.1."""

from __future__ import annotations

import socket

import trio
import trio.abc

from echo2.protocol.dataframe import HEADER, FrameType
from echo2.protocol.identity import Identity
from echo2.protocol.net.channel import ChannelClient, ChannelServer, frame_ready
from echo2.protocol.wire import RESULT, WORK


def test_frame_ready_only_when_the_whole_frame_is_buffered() -> None:
    a, b = socket.socketpair()
    with a, b:
        frame = HEADER.pack(FrameType.REQUEST, bytes(32), 300) + b"x" * 300

        def peek() -> bytes:
            try:
                return b.recv(HEADER.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return b""

        assert not frame_ready(peek(), b.fileno())  # nothing yet
        a.sendall(frame[:20])
        assert not frame_ready(peek(), b.fileno())  # part of the header
        a.sendall(frame[20:200])
        assert not frame_ready(peek(), b.fileno())  # the header, part of the body
        a.sendall(frame[200:])
        assert frame_ready(peek(), b.fileno())
        assert b.recv(1000) == frame  # peeking took nothing


class _CallsPerPass(trio.abc.Instrument):
    def __init__(self) -> None:
        self.now = self.most = self.total = 0

    def before_io_wait(self, timeout: float) -> None:
        self.most, self.now = max(self.most, self.now), 0


def test_requests_landing_together_are_read_a_few_per_pass() -> None:
    hub, k, per_pass = Identity.generate(), 120, 8
    calls = _CallsPerPass()

    async def handler(peer: str, data: bytes) -> bytes:
        calls.now += 1
        calls.total += 1
        return b"ok"

    async def ask(ch: ChannelClient) -> None:
        assert await ch.request(WORK, b"hello", max_response=100, timeout_s=10.0) == b"ok"

    async def main() -> None:
        server = ChannelServer(hub, {WORK: handler, RESULT: handler}, allow=lambda p: True, handshakes_per_ip_per_s=None,
                               reads_per_pass=per_pass)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            clients = [await ChannelClient.open(server.addr, Identity.generate(), hub.peer_id) for _ in range(k)]
            for ch in clients:
                nursery.start_soon(ch.run)
            await trio.sleep(0.2)
            trio.lowlevel.add_instrument(calls)
            with trio.fail_after(30):
                async with trio.open_nursery() as asks:
                    for ch in clients:
                        asks.start_soon(ask, ch)
            trio.lowlevel.remove_instrument(calls)
            calls.before_io_wait(0.0)
            for ch in clients:
                await ch.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert calls.total == k and 0 < calls.most <= per_pass, calls.most


def test_a_server_taking_only_small_requests_still_replies() -> None:
    """Replies are MESSAGE frames; a server with no MESSAGE-sized operation accepts none, and used
    to refuse to send its own replies too (its receive limit of 0 applied to what it sent)."""
    hub = Identity.generate()

    async def handler(peer: str, data: bytes) -> bytes:
        return b"ok" * 100

    async def main() -> None:
        server = ChannelServer(hub, {WORK: handler}, allow=lambda p: True, handshakes_per_ip_per_s=None)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            ch = await ChannelClient.open(server.addr, Identity.generate(), hub.peer_id)
            nursery.start_soon(ch.run)
            with trio.fail_after(10):
                assert await ch.request(WORK, b"hello", max_response=1000, timeout_s=5.0) == b"ok" * 100
            await ch.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
