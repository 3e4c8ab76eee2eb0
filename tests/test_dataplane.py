"""The TCP data plane: mutual handshake, verified chunk frames, dead-peer detection, rate limit.

Real sockets on 127.0.0.1, real Ed25519 keys; hostile peers are written by hand at the byte
level with the module's own wire constants.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import blake3
import pytest
import trio

from echo2.protocol import dataframe as df
from echo2.protocol import handshake as hs
from echo2.protocol.dataframe import HEADER, FrameType, chunk_key, parse_addr, parse_error
from echo2.protocol.errors import (
    ChunkMismatch,
    HandshakeError,
    Timeout,
    TooLarge,
    TransportError,
)
from echo2.protocol.handshake import HandshakeRefused
from echo2.protocol.identity import Identity
from echo2.protocol.net import connection as dpconn
from echo2.protocol.net import dataplane as dp
from echo2.protocol.net import rxthread
from echo2.protocol.net.connection import DataConnection
from echo2.protocol.net.dataplane import DataPlaneServer, connect
from echo2.protocol.net.ratelimit import UploadLimiter

MiB = 1024 * 1024


def run(fn: Callable[[], Awaitable[Any]], limit_s: float = 15.0) -> Any:
    async def main() -> Any:
        with trio.fail_after(limit_s):
            return await fn()

    return trio.run(main)


@asynccontextmanager
async def serving(server: DataPlaneServer) -> AsyncIterator[DataPlaneServer]:
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        yield server
        nursery.cancel_scope.cancel()


async def raw_hello(stream: trio.SocketStream, pub: bytes, nonce: bytes) -> tuple[bytes, bytes]:
    """Send a hello claiming ``pub``; return the listener's (key, nonce)."""
    await stream.send_all(hs.HELLO.pack(hs.HELLO_MAGIC, hs.PROTOCOL_VERSION, pub, nonce))
    data = await dp._recv_exact(stream, hs.HELLO.size, "hello")
    _, _, key, peer_nonce = hs.HELLO.unpack(data)
    return key, peer_nonce


async def read_all(stream: trio.SocketStream) -> bytes:
    out = bytearray()
    while True:
        try:
            data = await stream.receive_some(65536)
        except trio.BrokenResourceError:
            break
        if not data:
            break
        out += data
    return bytes(out)


# --- handshake --------------------------------------------------------------------------------


def test_handshake_and_roundtrip() -> None:
    server_id, client_id = Identity.generate(), Identity.generate()
    seen: dict[str, Any] = {}
    chunk = os.urandom(3 * MiB + 17)

    async def handler(conn: DataConnection) -> None:
        seen["server_sees"] = conn.peer_id
        frames = [f async for f in conn]  # until BYE
        seen["frames"] = frames
        await conn.send_message(b"manifest-envelope")

    async def main() -> None:
        async with serving(DataPlaneServer(server_id, handler)) as server:
            assert server.port > 0 and server.addr == f"127.0.0.1:{server.port}"
            conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            assert conn.peer_id == server_id.peer_id
            assert conn.local_peer_id == client_id.peer_id
            await conn.send_request(b"\x92\x01\x02")
            await conn.send_chunk(chunk)
            await conn.send_chunk(b"")
            await conn.send_error("chunk_mismatch", "bad chunk 3 \u2603")
            await conn.send_bye()
            reply = await conn.receive()
            assert (reply.type, bytes(reply.payload)) == (FrameType.MESSAGE, b"manifest-envelope")
            assert (await conn.receive()).type is FrameType.BYE
            with pytest.raises(TransportError):
                await conn.receive()
            await conn.aclose()
            assert (
                conn.bytes_sent
                == 4 * df.HEADER_SIZE
                + 3
                + len(chunk)
                + len(df.encode_error("chunk_mismatch", "bad chunk 3 \u2603"))
                + df.HEADER_SIZE
            )
            assert server.stats.connections == 1
            assert server.stats.bytes_received >= len(chunk)

    run(main)
    assert seen["server_sees"] == client_id.peer_id
    frames = seen["frames"]
    assert [f.type for f in frames] == [FrameType.REQUEST, FrameType.CHUNK, FrameType.CHUNK, FrameType.ERROR]
    assert bytes(frames[1].payload) == chunk and frames[1].key == blake3.blake3(chunk).digest()
    assert frames[2].payload == b""
    assert parse_error(frames[3].payload) == ("chunk_mismatch", "bad chunk 3 \u2603")


def test_chunk_key_is_the_project_hash() -> None:
    hashing = pytest.importorskip("echo2.protocol.hashing")
    data = os.urandom(100_000)
    assert chunk_key(data) == hashing.digest(data)


def test_dialer_refuses_listener_with_other_identity() -> None:
    server_id, client_id, expected = Identity.generate(), Identity.generate(), Identity.generate()

    async def handler(conn: DataConnection) -> None:
        raise AssertionError("must not be reached")

    async def main() -> None:
        async with serving(DataPlaneServer(server_id, handler)) as server:
            with pytest.raises(HandshakeError) as err:
                await connect(server.addr, client_id, expected.peer_id, timeout_s=5)
            assert isinstance(err.value, HandshakeRefused) and err.value.reason == "wrong_peer"
            with trio.fail_after(5):
                while server.stats.refusals["handshake.eof"] == 0:
                    await trio.sleep(0.01)

    run(main)


def test_listener_claiming_a_key_it_does_not_hold_is_refused() -> None:
    """An impostor listener announces the expected peer's public key but signs with its own."""
    victim, impostor, client_id = Identity.generate(), Identity.generate(), Identity.generate()

    async def fake_listener(stream: trio.SocketStream) -> None:
        their = await dp._recv_exact(stream, hs.HELLO.size, "hello")
        _, _, dialer_key, dialer_nonce = hs.HELLO.unpack(their)
        nonce = os.urandom(32)
        await stream.send_all(hs.HELLO.pack(hs.HELLO_MAGIC, 1, victim.public_bytes, nonce))
        transcript = hs.transcript(dialer_nonce, nonce, dialer_key, victim.public_bytes)
        await stream.send_all(impostor.sign(transcript + b"L"))
        await read_all(stream)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(trio.serve_tcp, fake_listener, 0)
            port = listeners[0].socket.getsockname()[1]
            with pytest.raises(HandshakeRefused) as err:
                await connect(f"127.0.0.1:{port}", client_id, victim.peer_id, timeout_s=5)
            assert err.value.reason == "bad_signature"
            nursery.cancel_scope.cancel()

    run(main)


@pytest.mark.parametrize("attack", ["impostor", "garbage_sig", "reflected_role", "stale_nonce"])
def test_listener_refuses_dialer_that_cannot_prove_its_key(attack: str) -> None:
    server_id, victim, attacker = Identity.generate(), Identity.generate(), Identity.generate()
    allowed: list[str] = []

    def allow(peer: str) -> bool:
        allowed.append(peer)
        return True

    async def handler(conn: DataConnection) -> None:
        raise AssertionError("must not be reached")

    async def main() -> None:
        async with serving(DataPlaneServer(server_id, handler, allow=allow)) as server:
            stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            my_nonce = os.urandom(32)
            lkey, lnonce = await raw_hello(stream, victim.public_bytes, my_nonce)
            transcript = hs.transcript(my_nonce, lnonce, victim.public_bytes, lkey)
            if attack == "impostor":  # claims the victim's key, signs with its own
                sig = attacker.sign(transcript + b"D")
            elif attack == "garbage_sig":
                sig = os.urandom(64)
            elif attack == "reflected_role":  # a listener-role signature is no dialer proof
                sig = victim.sign(transcript + b"L")
            else:  # a signature over another session's nonces
                sig = victim.sign(hs.transcript(my_nonce, os.urandom(32), victim.public_bytes, lkey) + b"D")
            await stream.send_all(sig)
            await dp._recv_exact(stream, 64, "listener signature")
            assert await read_all(stream) == b""  # no verdict byte: closed on us
            with trio.fail_after(5):
                while server.stats.refusals["handshake.bad_signature"] == 0:
                    await trio.sleep(0.01)
            assert allowed == []  # allow() is only asked about proven identities
            assert server.stats.connections == 0

    run(main)


def test_allow_list_refusal_reaches_the_dialer() -> None:
    server_id, good, bad = Identity.generate(), Identity.generate(), Identity.generate()

    async def handler(conn: DataConnection) -> None:
        await conn.send_message(b"hi")

    async def main() -> None:
        server = DataPlaneServer(server_id, handler, allow=lambda p: p == good.peer_id)
        async with serving(server):
            with pytest.raises(HandshakeRefused) as err:
                await connect(server.addr, bad, server_id.peer_id, timeout_s=5)
            assert err.value.reason == "not_allowed"
            conn = await connect(server.addr, good, server_id.peer_id, timeout_s=5)
            assert bytes((await conn.receive()).payload) == b"hi"
            await conn.aclose()
            assert server.stats.refusals["handshake.not_allowed"] == 1

    run(main)


def test_connect_to_silent_listener_times_out() -> None:
    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(trio.serve_tcp, silent, 0)
            port = listeners[0].socket.getsockname()[1]
            with pytest.raises(Timeout):
                await connect(
                    f"127.0.0.1:{port}", Identity.generate(), Identity.generate().peer_id, timeout_s=0.3
                )
            nursery.cancel_scope.cancel()

    run(main)


def test_parse_addr() -> None:
    assert parse_addr("127.0.0.1:80") == ("127.0.0.1", 80)
    assert parse_addr("[::1]:9000") == ("::1", 9000)
    for bad in ["", "host", ":80", "h:0", "h:70000", "h:-1", "h:8x"]:
        with pytest.raises(TransportError):
            parse_addr(bad)


def test_server_survives_garbage_and_silent_clients() -> None:
    server_id, honest = Identity.generate(), Identity.generate()
    served: list[str] = []

    async def handler(conn: DataConnection) -> None:
        frame = await conn.receive()
        served.append(conn.peer_id)
        await conn.send_chunk(bytes(frame.payload) * 2)

    async def main() -> None:
        server = DataPlaneServer(server_id, handler, handshake_timeout_s=0.5)
        async with serving(server):
            silent = await trio.open_tcp_stream("127.0.0.1", server.port)  # never speaks
            for junk in [os.urandom(hs.HELLO.size), b"GET / HTTP/1.1\r\n\r\n" * 5, b"\x00"]:
                s = await trio.open_tcp_stream("127.0.0.1", server.port)
                try:
                    await s.send_all(junk)
                    await s.send_eof()
                except trio.BrokenResourceError:
                    pass  # already refused and reset by the server
                await read_all(s)
                await s.aclose()
            # wrong protocol version, right magic
            s = await trio.open_tcp_stream("127.0.0.1", server.port)
            await s.send_all(hs.HELLO.pack(hs.HELLO_MAGIC, 99, honest.public_bytes, os.urandom(32)))
            await read_all(s)
            await s.aclose()
            conn = await connect(server.addr, honest, server_id.peer_id, timeout_s=5)
            await conn.send_request(b"ab")
            frame = await conn.receive()
            assert bytes(frame.payload) == b"abab"
            assert (await conn.receive()).type is FrameType.BYE
            await conn.aclose()
            with trio.fail_after(5):
                while server.stats.refusals["handshake.timeout"] == 0:
                    await trio.sleep(0.02)
            await silent.aclose()
            r = server.stats.refusals
            assert r["handshake.bad_hello"] == 2  # random bytes, HTTP
            assert r["handshake.eof"] == 1  # the single byte
            assert r["handshake.version"] == 1

    run(main)
    assert served == [honest.peer_id]


def test_handler_crash_is_contained() -> None:
    server_id, client_id = Identity.generate(), Identity.generate()
    calls = 0

    async def handler(conn: DataConnection) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("bug in handler")
        await conn.send_message(b"ok")

    async def main() -> None:
        server = DataPlaneServer(server_id, handler)
        async with serving(server):
            first = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            with pytest.raises(TransportError):  # aborted: no BYE
                await first.receive()
            second = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            assert bytes((await second.receive()).payload) == b"ok"
            await second.aclose()
            assert server.stats.refusals["handler.crash"] == 1

    run(main)


# --- frames -----------------------------------------------------------------------------------


def test_corrupted_chunk_is_refused_and_connection_stays_in_sync() -> None:
    server_id, client_id = Identity.generate(), Identity.generate()
    outcome: dict[str, Any] = {}

    async def handler(conn: DataConnection) -> None:
        with pytest.raises(ChunkMismatch):
            await conn.receive()
        good = await conn.receive()  # the next frame still parses
        outcome["good"] = bytes(good.payload)
        outcome["refusals"] = dict(conn.refusals)

    async def main() -> None:
        server = DataPlaneServer(server_id, handler)
        async with serving(server):
            conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            data = bytearray(os.urandom(2 * MiB))
            key = chunk_key(data)
            data[12345] ^= 1  # one bit flipped in transit
            await conn.send_chunk(data, key=key)
            await conn.send_chunk(b"fine")
            assert (await conn.receive()).type is FrameType.BYE
            await conn.aclose()

    run(main)
    assert outcome["good"] == b"fine"
    assert outcome["refusals"] == {"chunk_mismatch": 1}


@pytest.mark.parametrize("ftype", [FrameType.CHUNK, FrameType.REQUEST, FrameType.ERROR, FrameType.BYE])
def test_oversized_frame_refused_before_body(ftype: FrameType) -> None:
    server_id, client_id = Identity.generate(), Identity.generate()
    outcome: dict[str, Any] = {}

    async def handler(conn: DataConnection) -> None:
        with pytest.raises(TooLarge):
            # No body follows the header: reading it would hang, so this proves the size is
            # checked first (the test's fail_after would fire otherwise).
            await conn.receive()
        outcome["usable"] = conn.usable
        with pytest.raises(TransportError):
            await conn.receive()

    async def main() -> None:
        server = DataPlaneServer(server_id, handler)
        async with serving(server):
            conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            too_big = df.DEFAULT_MAX_SIZES[ftype] + 1
            await conn._stream.send_all(HEADER.pack(ftype, bytes(32), too_big))
            with pytest.raises(TransportError):
                await conn.receive()  # the server aborts: no BYE
            assert server.stats.refusals["frame.too_large"] == 1

    run(main)
    assert outcome["usable"] is False


def test_unknown_frame_type_refused() -> None:
    server_id, client_id = Identity.generate(), Identity.generate()

    async def handler(conn: DataConnection) -> None:
        await conn.receive()

    async def main() -> None:
        server = DataPlaneServer(server_id, handler)
        async with serving(server):
            conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            await conn._stream.send_all(HEADER.pack(200, bytes(32), 0))
            with pytest.raises(TransportError):
                await conn.receive()
            assert server.stats.refusals["frame.bad_type"] == 1
            assert server.stats.refusals["handler.decode"] == 1

    run(main)


def test_sender_refuses_oversized_frame_locally() -> None:
    server_id, client_id = Identity.generate(), Identity.generate()

    async def handler(conn: DataConnection) -> None:
        async for _ in conn:
            pass

    async def main() -> None:
        async with serving(DataPlaneServer(server_id, handler)) as server:
            conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            with pytest.raises(TooLarge):
                await conn.send_request(bytes(df.DEFAULT_MAX_SIZES[FrameType.REQUEST] + 1))
            assert conn.usable
            await conn.aclose()

    run(main)


# --- dead peers -------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["mid_body", "mid_header", "at_boundary"])
def test_peer_dying_is_never_a_clean_end(where: str) -> None:
    server_id, client_id = Identity.generate(), Identity.generate()
    outcome: dict[str, Any] = {}

    async def handler(conn: DataConnection) -> None:
        first = await conn.receive()
        outcome["first"] = bytes(first.payload)
        try:
            await conn.receive()
        except TransportError as exc:
            outcome["error"] = exc

    async def main() -> None:
        server = DataPlaneServer(server_id, handler)
        async with serving(server):
            conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            await conn.send_message(b"one")
            if where == "mid_body":
                await conn._stream.send_all(HEADER.pack(FrameType.CHUNK, bytes(32), 1 * MiB) + bytes(1000))
            elif where == "mid_header":
                await conn._stream.send_all(HEADER.pack(FrameType.CHUNK, bytes(32), 10)[:20])
            await trio.sleep(0.05)
            await conn.abort()  # killed: no BYE
            with trio.fail_after(5):
                while "error" not in outcome:
                    await trio.sleep(0.01)

    run(main)
    assert outcome["first"] == b"one"
    assert isinstance(outcome["error"], TransportError)


def test_clean_eof_without_bye_is_an_error() -> None:
    server_id, client_id = Identity.generate(), Identity.generate()
    outcome: dict[str, Any] = {}

    async def handler(conn: DataConnection) -> None:
        try:
            async for _ in conn:
                pass
        except TransportError as exc:
            outcome["error"] = str(exc)

    async def main() -> None:
        async with serving(DataPlaneServer(server_id, handler)) as server:
            conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            await conn.send_message(b"x")
            await conn._stream.send_eof()  # FIN, orderly at the TCP level, but no BYE
            with trio.fail_after(5):
                while "error" not in outcome:
                    await trio.sleep(0.01)
            await conn.abort()

    run(main)
    assert "without BYE" in outcome["error"]


def test_sender_gets_an_error_when_receiver_dies() -> None:
    server_id, client_id = Identity.generate(), Identity.generate()

    async def handler(conn: DataConnection) -> None:
        await conn.receive()
        await conn.abort()  # the receiver dies after one chunk

    async def main() -> None:
        async with serving(DataPlaneServer(server_id, handler)) as server:
            conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            data = os.urandom(1 * MiB)
            key = chunk_key(data)
            with pytest.raises(TransportError):
                for _ in range(256):
                    await conn.send_chunk(data, key=key)
            assert not conn.usable
            with pytest.raises(TransportError):
                await conn.send_chunk(b"x")

    run(main)


def test_receive_timeout_keeps_connection_usable() -> None:
    server_id, client_id = Identity.generate(), Identity.generate()
    go = trio.Event()

    async def handler(conn: DataConnection) -> None:
        await go.wait()
        await conn.send_message(b"late")

    async def main() -> None:
        async with serving(DataPlaneServer(server_id, handler)) as server:
            conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            with pytest.raises(Timeout):
                await conn.receive(timeout_s=0.1)
            assert conn.usable
            go.set()
            assert bytes((await conn.receive(timeout_s=5)).payload) == b"late"
            await conn.aclose()

    run(main)


# --- large bodies: received and hashed on a worker thread ------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_body_larger_than_one_buffer_arrives_whole_and_verified() -> None:
    # 8 MiB + 5 spans two receive buffers (and two worker hand-offs) but one hash.
    server_id, client_id = Identity.generate(), Identity.generate()
    data = os.urandom(dpconn._ALLOC_STEP + 5)
    outcome: dict[str, Any] = {}

    async def handler(conn: DataConnection) -> None:
        frame = await conn.receive()
        outcome["ok"] = frame.payload == data and frame.key == chunk_key(data)
        outcome["received"] = conn.bytes_received

    async def main() -> None:
        async with serving(DataPlaneServer(server_id, handler)) as server:
            conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            await conn.send_chunk(data)
            assert (await conn.receive()).type is FrameType.BYE
            await conn.aclose()

    run(main)
    assert outcome["ok"] is True
    # Handshake bytes are not counted; exactly one header and one body were received.
    assert outcome["received"] == len(data) + HEADER.size


@pytest.mark.parametrize("workers", [16, 0])
def test_large_bodies_verified_with_and_without_free_workers(
    workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With every worker slot taken, a large body is received in the trio thread: same checks.
    monkeypatch.setattr(rxthread, "MAX_WORKERS", workers)
    server_id, client_id = Identity.generate(), Identity.generate()
    good, bad = os.urandom(3 * MiB), bytearray(os.urandom(3 * MiB))
    bad_key = chunk_key(bad)
    bad[-1] ^= 0x80
    outcome: dict[str, Any] = {}

    async def handler(conn: DataConnection) -> None:
        with pytest.raises(ChunkMismatch):
            await conn.receive()
        outcome["good"] = (await conn.receive()).payload == good

    async def main() -> None:
        async with serving(DataPlaneServer(server_id, handler)) as server:
            conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            await conn.send_chunk(bad, key=bad_key)
            await conn.send_chunk(good)
            assert (await conn.receive()).type is FrameType.BYE
            await conn.aclose()

    run(main)
    assert outcome["good"] is True
    assert rxthread._active == 0


def test_chunk_trickling_in_wakes_the_worker_rarely_and_the_next_small_frame_promptly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A 512 KiB chunk (the rule's size for 32 MB on 8 nodes until session 11; 384 KiB since) is received on a worker that asks
    # the kernel to wake it only once RCVLOWAT_BYTES have landed (rxthread.py). The mark must be
    # back at 1 when the body is in: a small frame that follows (fewer bytes than the mark) would
    # otherwise never wake the trio side, and the connection would hang.
    started: list[int] = []

    class Counting(rxthread.ThreadedReceive):
        def start(self) -> None:
            started.append(len(self._view))
            super().start()

    monkeypatch.setattr(dpconn, "ThreadedReceive", Counting)
    server_id, client_id = Identity.generate(), Identity.generate()
    data = os.urandom(512 * 1024)
    outcome: dict[str, Any] = {}

    async def handler(conn: DataConnection) -> None:
        frame = await conn.receive(timeout_s=5)
        outcome["chunk"] = frame.payload == data and frame.key == chunk_key(data)
        outcome["lowat"] = conn._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)
        t0 = time.monotonic()
        small = await conn.receive(timeout_s=2)
        outcome["small"] = (small.type, bytes(small.payload), time.monotonic() - t0)

    async def main() -> None:
        async with serving(DataPlaneServer(server_id, handler)) as server:
            conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            await conn._stream.send_all(HEADER.pack(FrameType.CHUNK, chunk_key(data), len(data)))
            for pos in range(0, len(data), 64 * 1024):  # trickles in, as over a shaped link
                await conn._stream.send_all(data[pos : pos + 64 * 1024])
                await trio.sleep(0.01)
            await conn.send_request(b"after")
            assert (await conn.receive()).type is FrameType.BYE
            await conn.aclose()

    run(main)
    assert started == [len(data)]  # on a worker, not in the trio thread
    assert outcome["chunk"] is True
    assert outcome["lowat"] == 1
    assert outcome["small"][:2] == (FrameType.REQUEST, b"after")
    assert rxthread._active == 0


def test_timeout_in_the_middle_of_a_large_body() -> None:
    # The worker must give up with the timeout (not linger reading), release its descriptor,
    # and the connection must be marked unusable: the byte stream is out of sync.
    server_id, client_id = Identity.generate(), Identity.generate()
    outcome: dict[str, Any] = {}
    hold = trio.Event()

    async def handler(conn: DataConnection) -> None:
        t0 = time.monotonic()
        try:
            await conn.receive(timeout_s=0.3)
        except Timeout as exc:
            outcome["error"] = exc
        outcome["elapsed"] = time.monotonic() - t0
        outcome["usable"] = conn.usable
        outcome["worker"] = conn._rx_thread
        await hold.wait()

    async def main() -> None:
        async with serving(DataPlaneServer(server_id, handler)) as server:
            conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            fds_before = _open_fds()
            await conn._stream.send_all(HEADER.pack(FrameType.CHUNK, bytes(32), 4 * MiB) + bytes(MiB))
            with trio.fail_after(5):
                while "elapsed" not in outcome:
                    await trio.sleep(0.01)
            outcome["fds_after"] = _open_fds() - fds_before
            hold.set()
            await conn.abort()

    run(main)
    assert isinstance(outcome["error"], Timeout)
    assert outcome["elapsed"] < 2.0
    assert outcome["usable"] is False
    assert outcome["worker"] is None
    assert outcome["fds_after"] <= 0  # the worker's duplicate descriptor is closed
    assert rxthread._active == 0


def test_closing_while_a_large_body_arrives_stops_the_receiver() -> None:
    server_id, client_id = Identity.generate(), Identity.generate()
    outcome: dict[str, Any] = {}

    async def main() -> None:
        got_conn: list[DataConnection] = []

        async def handler(conn: DataConnection) -> None:
            got_conn.append(conn)
            t0 = time.monotonic()
            try:
                await conn.receive()
            except TransportError as exc:
                outcome["error"] = exc
            outcome["elapsed"] = time.monotonic() - t0

        async with serving(DataPlaneServer(server_id, handler)) as server:
            conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            # Half a body, then silence: the server's worker waits for the rest.
            await conn._stream.send_all(HEADER.pack(FrameType.CHUNK, bytes(32), 4 * MiB) + bytes(MiB))
            with trio.fail_after(5):
                while not got_conn or got_conn[0]._rx_thread is None:
                    await trio.sleep(0.01)
            await got_conn[0].abort()  # another task closes the connection under the receiver
            with trio.fail_after(5):
                while "elapsed" not in outcome:
                    await trio.sleep(0.01)
            await conn.abort()

    run(main)
    assert isinstance(outcome["error"], TransportError)
    assert outcome["elapsed"] < 2.0
    assert rxthread._active == 0


def test_relay_pattern_sending_while_a_worker_receives() -> None:
    # Both ends send large chunks and receive the other's at the same time, as a relay does
    # (chunks in from its parent, out to its children) on one trio thread.
    server_id, client_id = Identity.generate(), Identity.generate()
    chunks = [os.urandom(2 * MiB + i) for i in range(6)]
    outcome: dict[str, Any] = {}

    async def exchange(conn: DataConnection, who: str) -> None:
        async def send() -> None:
            for c in chunks:
                await conn.send_chunk(c)
            await conn.send_bye()

        async def receive() -> None:
            got = [bytes(f.payload) async for f in conn if f.type is FrameType.CHUNK]
            outcome[who] = got == chunks

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            nursery.start_soon(receive)

    async def main() -> None:
        async with serving(DataPlaneServer(server_id, lambda c: exchange(c, "server"))) as server:
            conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            await exchange(conn, "client")
            await conn.aclose()
            with trio.fail_after(5):
                while "server" not in outcome:
                    await trio.sleep(0.01)

    run(main)
    assert outcome == {"client": True, "server": True}
    assert rxthread._active == 0


def test_graceful_close_from_another_task_while_a_worker_receives() -> None:
    server_id, client_id = Identity.generate(), Identity.generate()
    outcome: dict[str, Any] = {}

    async def main() -> None:
        got_conn: list[DataConnection] = []
        receiving = trio.Event()

        async def handler(conn: DataConnection) -> None:
            got_conn.append(conn)
            receiving.set()
            try:
                await conn.receive()
            except TransportError as exc:
                outcome["error"] = exc

        async with serving(DataPlaneServer(server_id, handler)) as server:
            conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            await conn._stream.send_all(HEADER.pack(FrameType.CHUNK, bytes(32), 4 * MiB) + bytes(MiB))
            await receiving.wait()
            with trio.fail_after(5):
                while got_conn[0]._rx_thread is None:
                    await trio.sleep(0.01)
                await got_conn[0].aclose(grace_s=0.2)
                while "error" not in outcome:
                    await trio.sleep(0.01)
            await conn.abort()

    run(main)
    assert isinstance(outcome["error"], TransportError)
    assert rxthread._active == 0


def test_no_worker_thread_falls_back_to_the_trio_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # When no worker can be started (here: trio refuses), the body is received in the trio
    # thread instead, and nothing is lost or read twice.
    from echo2.protocol.net import rxthread as rx

    def refuse(*_a: Any, **_k: Any) -> None:
        raise RuntimeError("no threads today")

    monkeypatch.setattr(rx.trio.lowlevel, "start_thread_soon", refuse)
    server_id, client_id = Identity.generate(), Identity.generate()
    data = os.urandom(3 * MiB)
    outcome: dict[str, Any] = {}

    async def handler(conn: DataConnection) -> None:
        frame = await conn.receive()
        outcome["ok"] = frame.payload == data

    async def main() -> None:
        async with serving(DataPlaneServer(server_id, handler)) as server:
            conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5)
            fds = _open_fds()
            await conn.send_chunk(data)
            assert (await conn.receive()).type is FrameType.BYE
            outcome["fds"] = _open_fds() - fds
            await conn.aclose()

    run(main)
    assert outcome["ok"] is True
    assert outcome["fds"] <= 0  # the duplicate made for the worker was released
    assert rx._active == 0


# --- rate limit -------------------------------------------------------------------------------


async def _timed_transfer(
    nbytes: int, *, server_kw: dict[str, Any], client_kw: dict[str, Any], server_sends: bool
) -> float:
    server_id, client_id = Identity.generate(), Identity.generate()
    piece = os.urandom(1_000_000)
    key = chunk_key(piece)
    done = trio.Event()

    async def push(conn: DataConnection) -> None:
        for _ in range(nbytes // len(piece)):
            await conn.send_chunk(piece, key=key)

    async def drain(conn: DataConnection) -> None:
        async for _ in conn:
            pass

    async def handler(conn: DataConnection) -> None:
        if server_sends:
            await conn.receive()
            await push(conn)
        else:
            await drain(conn)
            done.set()

    async with serving(DataPlaneServer(server_id, handler, **server_kw)) as server:
        conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=5, **client_kw)
        t0 = time.perf_counter()
        if server_sends:
            await conn.send_request(b"go")
            await drain(conn)
        else:
            await push(conn)
            await conn.send_bye()
            await done.wait()
        elapsed = time.perf_counter() - t0
        await conn.aclose()
    return elapsed


def test_rate_limit_per_connection_dialer_side() -> None:
    elapsed = run(
        lambda: _timed_transfer(
            6_000_000, server_kw={}, client_kw={"upload_limit_MBps": 20}, server_sends=False
        )
    )
    assert 0.3 * 0.7 < elapsed < 0.3 * 1.3, elapsed


def test_rate_limit_per_connection_server_side() -> None:
    elapsed = run(
        lambda: _timed_transfer(
            6_000_000, server_kw={"upload_limit_MBps": 20}, client_kw={}, server_sends=True
        )
    )
    assert 0.3 * 0.7 < elapsed < 0.3 * 1.3, elapsed


def test_rate_limit_per_process_is_shared_between_connections() -> None:
    async def main() -> float:
        shared = UploadLimiter(20)
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(
                    lambda: _timed_transfer(
                        3_000_000, server_kw={}, client_kw={"upload_limiter": shared}, server_sends=False
                    )
                )
        return time.perf_counter() - t0

    elapsed = run(main)
    # 2 x 3 MB through one 20 MB/s bucket: about 0.3 s, not the 0.15 s of two separate limits.
    assert 0.3 * 0.7 < elapsed < 0.3 * 1.3 + 0.1, elapsed


def test_counters_add_up() -> None:
    before_sent, before_recv = dpconn.STATS.bytes_sent, dpconn.STATS.bytes_received
    run(lambda: _timed_transfer(2_000_000, server_kw={}, client_kw={}, server_sends=False))
    moved = 2 * (1_000_000 + df.HEADER_SIZE)
    assert dpconn.STATS.bytes_sent - before_sent >= moved
    assert dpconn.STATS.bytes_received - before_recv >= moved


def test_frame_header_layout_is_stable() -> None:
    assert HEADER.size == 41
    assert HEADER.pack(FrameType.CHUNK, bytes(range(32)), 5) == b"\x01" + bytes(range(32)) + struct.pack(
        ">Q", 5
    )
