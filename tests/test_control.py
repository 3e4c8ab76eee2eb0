"""Control plane on real py-libp2p hosts over 127.0.0.1 (no mocks)."""

from __future__ import annotations

import random
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.abc import INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.exceptions import SwarmException
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from echo2.protocol.backoff import backoff_delay
from echo2.protocol.errors import (
    DecodeError,
    HandshakeError,
    MeaningError,
    Timeout,
    TooLarge,
    TransportError,
)
from echo2.protocol.framing import (
    FrameDecoder,
    RemoteError,
    decode_header,
    decode_response,
    encode_error,
    encode_frame,
    encode_ok,
)
from echo2.protocol.identity import Identity
from echo2.protocol.net.control import ANNOUNCE_TOPIC, ControlHost
from echo2.protocol.net.libp2p_host import keypair_from_identity

ECHO = "/echo2/test-echo/1.0.0"


def run(main: Callable[[], Awaitable[None]], limit_s: float = 20.0) -> None:
    async def bounded() -> None:
        with trio.fail_after(limit_s):
            await main()

    trio.run(bounded)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------- sans-IO parts


def test_framing_roundtrip_and_limits() -> None:
    frames = [b"", b"x", bytes(range(256)) * 10]
    wire = b"".join(encode_frame(f) for f in frames)
    dec = FrameDecoder(max_size=4096)
    got: list[bytes] = []
    for i in range(0, len(wire), 7):  # arbitrary slicing must not matter
        got += dec.feed(wire[i : i + 7])
    assert got == frames and dec.pending == 0
    with pytest.raises(TooLarge):
        encode_frame(b"x" * 11, max_size=10)
    # The limit is enforced on the header alone, before any body byte arrives.
    with pytest.raises(TooLarge):
        FrameDecoder(max_size=100).feed((101).to_bytes(4, "big"))
    with pytest.raises(TooLarge):
        decode_header(b"\xff\xff\xff\xff", max_size=2**20)
    with pytest.raises(DecodeError):
        decode_header(b"\x00\x00", max_size=10)
    part = FrameDecoder(max_size=100)
    assert part.feed(encode_frame(b"abcdef")[:6]) == [] and part.pending == 6


def test_response_encoding() -> None:
    assert decode_response(encode_ok(b"payload")) == b"payload"
    with pytest.raises(RemoteError) as info:
        decode_response(encode_error("meaning", "no such task"))
    assert info.value.code == "meaning" and info.value.message == "no such task"
    for bad in (b"", b"\x02abc", b"\x01\xc1", b"\x01" + b"\x00" * 3000):
        with pytest.raises((DecodeError, TooLarge)):
            decode_response(bad)


def test_backoff_is_capped_exponential_with_jitter() -> None:
    rng = random.Random(1)
    delays = [backoff_delay(n, base_s=0.5, cap_s=8.0, rng=rng) for n in range(1, 12)]
    for n, d in enumerate(delays, start=1):
        step = min(8.0, 0.5 * 2 ** (n - 1))
        assert step / 2 <= d <= step
    assert max(delays) <= 8.0
    assert backoff_delay(10_000, cap_s=30.0) <= 30.0


def test_libp2p_peer_id_is_identity_peer_id() -> None:
    ident = Identity.generate()
    from libp2p.peer.id import ID

    assert ID.from_pubkey(keypair_from_identity(ident).public_key).to_base58() == ident.peer_id


# ----------------------------------------------------------------------------- real hosts


def test_request_response_errors_and_guarded_handlers() -> None:
    async def main() -> None:
        async with (
            ControlHost(Identity.generate(), gossip=False) as server,
            ControlHost(Identity.generate(), gossip=False, dial_timeout_s=5.0) as client,
        ):
            assert all(a.endswith("/p2p/" + server.peer_id) for a in server.addrs)

            async def echo(peer: str, req: bytes) -> bytes:
                assert peer == client.peer_id  # the Noise-authenticated peer ID
                if req == b"meaning":
                    raise MeaningError("not today")
                if req == b"boom":
                    raise RuntimeError("bug in handler")
                return b"echo:" + req

            server.set_handler(ECHO, echo, max_request=1024)
            addr = server.addrs[0]
            assert await client.request(addr, ECHO, b"hi", max_response=64, timeout_s=5) == b"echo:hi"
            assert client.is_connected(server.peer_id) and server.is_connected(client.peer_id)
            # By peer ID once connected.
            assert await client.request(server.peer_id, ECHO, b"", max_response=64) == b"echo:"

            with pytest.raises(RemoteError) as info:
                await client.request(addr, ECHO, b"meaning", max_response=64)
            assert info.value.code == "meaning"
            with pytest.raises(RemoteError) as info:
                await client.request(addr, ECHO, b"boom", max_response=64)
            assert info.value.code == "internal"
            # The raising handler did not take the host down.
            assert await client.request(addr, ECHO, b"again", max_response=64) == b"echo:again"

            # Oversized request: refused from the header, larger than a Yamux window so the
            # requester is still writing when the refusal arrives.
            with pytest.raises(RemoteError) as info:
                await client.request(addr, ECHO, b"x" * 600_000, max_response=64, timeout_s=5)
            assert info.value.code == "too_large"
            # Oversized response: refused by the requester's limit.
            with pytest.raises(TooLarge):
                await client.request(addr, ECHO, b"y" * 100, max_response=10)
            assert server.refusals == {"meaning": 1, "internal": 1, "too_large": 1}

            # A truncated request frame (peer closes mid-frame) is refused and logged, no crash.
            raw = await client.libp2p_host.new_stream(
                info_from_p2p_addr(multiaddr.Multiaddr(addr)).peer_id, [TProtocol(ECHO)]
            )
            await raw.write((100).to_bytes(4, "big") + b"abc")
            await raw.close()
            with trio.fail_after(5):
                while server.refusals["transport"] < 1:
                    await trio.sleep(0.02)

            # Unknown protocol: a transport failure, not a hang.
            with pytest.raises(TransportError):
                await client.request(addr, "/echo2/nope/1.0.0", b"", max_response=64, timeout_s=5)

            # Standard ping and identify are served.
            rtt = await client.ping(server.peer_id)
            assert 0 <= rtt < 2
            with trio.fail_after(5):
                while not client.libp2p_host.get_peerstore().get_protocols(
                    info_from_p2p_addr(multiaddr.Multiaddr(addr)).peer_id
                ):
                    await trio.sleep(0.05)  # filled in by identify
            assert await client.request(addr, ECHO, b"end", max_response=64) == b"echo:end"

    run(main)


def test_gossip_among_three_hosts_and_oversize_refused() -> None:
    async def main() -> None:
        hosts = [ControlHost(Identity.generate()) for _ in range(3)]
        a, b, c = hosts
        async with a, b, c:
            got: dict[str, list[tuple[str, bytes]]] = {h.peer_id: [] for h in hosts}
            # b and c know only a: messages between b and c must be relayed by a.
            b.add_bootstrap(a.addrs[0])
            await c.connect(a.addrs[0])
            for h in hosts:

                async def on_msg(origin: str, data: bytes, me: str = h.peer_id) -> None:
                    if data == b"crash":
                        raise RuntimeError("bad subscriber")
                    got[me].append((origin, data))

                await h.subscribe(ANNOUNCE_TOPIC, on_msg)
            await a.wait_topic_peers(ANNOUNCE_TOPIC, 2)
            await b.wait_topic_peers(ANNOUNCE_TOPIC, 1)
            await c.wait_topic_peers(ANNOUNCE_TOPIC, 1)
            await trio.sleep(1.5)  # a heartbeat or so, for the mesh to form

            await a.publish(ANNOUNCE_TOPIC, b"crash")  # raising subscriber handlers are guarded
            await a.publish(ANNOUNCE_TOPIC, b"from-a")
            await c.publish(ANNOUNCE_TOPIC, b"from-c")
            with trio.fail_after(8):
                while not (
                    (a.peer_id, b"from-a") in got[b.peer_id]
                    and (a.peer_id, b"from-a") in got[c.peer_id]
                    and (c.peer_id, b"from-c") in got[a.peer_id]
                    and (c.peer_id, b"from-c") in got[b.peer_id]
                ):
                    await trio.sleep(0.05)
            assert not got[a.peer_id] or all(o != a.peer_id for o, _ in got[a.peer_id])
            assert b.refusals["internal"] == 1 and c.refusals["internal"] == 1

            with pytest.raises(TooLarge):
                await a.publish(ANNOUNCE_TOPIC, b"z" * (a.gossip_config.max_message_size + 1))
            await trio.sleep(0.3)
            assert all(len(d) < 1000 for v in got.values() for _, d in v)

    run(main, 30)


def test_plaintext_peer_is_refused() -> None:
    async def main() -> None:
        kp = create_new_key_pair()
        plain = new_host(
            key_pair=kp,
            sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(kp)},
            muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        )
        listen = multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{free_port()}")
        async with ControlHost(Identity.generate(), gossip=False, dial_timeout_s=5) as ours:
            ours.set_handler(ECHO, lambda _p, r: _echo(r), max_request=64)
            async with plain.run([listen]):
                try:
                    # The plaintext peer cannot reach us ...
                    with pytest.raises(SwarmException), trio.fail_after(10):
                        await plain.connect(info_from_p2p_addr(multiaddr.Multiaddr(ours.addrs[0])))
                    assert ours.connected_peers() == []
                    # ... and we refuse to talk to it.
                    plain_addr = f"{listen}/p2p/{plain.get_id().to_base58()}"
                    with pytest.raises(HandshakeError):
                        await ours.connect(plain_addr)
                    assert ours.connected_peers() == []
                finally:
                    await plain.close()
            # Our host is still up and serving.
            async with ControlHost(Identity.generate(), gossip=False) as other:
                assert await other.request(ours.addrs[0], ECHO, b"ok", max_response=64) == b"ok"

    run(main)


async def _echo(req: bytes) -> bytes:
    return req


def test_silent_listener_times_out_quickly() -> None:
    async def main() -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        held: list[trio.SocketStream] = []

        async def accept_and_hold() -> None:
            while True:
                held.append(await listeners[0].accept())  # accepts, never answers

        silent = f"/ip4/127.0.0.1/tcp/{port}/p2p/{Identity.generate().peer_id}"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept_and_hold)
            async with ControlHost(Identity.generate(), gossip=False, dial_timeout_s=2.0) as h:
                t0 = trio.current_time()
                with pytest.raises(Timeout):
                    await h.connect(silent)
                assert 1.5 < trio.current_time() - t0 < 4.0
                t0 = trio.current_time()
                with pytest.raises(Timeout):
                    await h.request(silent, ECHO, b"x", max_response=10, timeout_s=10)
                assert trio.current_time() - t0 < 4.0  # the dial timeout, not the request's
            nursery.cancel_scope.cancel()
        for s in held:
            await s.aclose()
        await listeners[0].aclose()

    run(main)


def test_peer_vanishing_mid_reply_is_an_error() -> None:
    async def main() -> None:
        async with ControlHost(Identity.generate(), gossip=False) as client:
            # 1) The responder announces 1000 bytes, sends 10 and closes: a clean EOF mid-frame.
            async with ControlHost(Identity.generate(), gossip=False) as server:

                async def truncating(stream: INetStream) -> None:
                    await stream.read(64)
                    await stream.write((1000).to_bytes(4, "big") + b"0123456789")
                    await stream.close()

                server.libp2p_host.set_stream_handler(TProtocol(ECHO), truncating)
                with pytest.raises(TransportError, match="truncated"):
                    await client.request(server.addrs[0], ECHO, b"q", max_response=2000, timeout_s=5)

            # 2) The responder's whole host goes away while the request is in flight.
            started = trio.Event()
            stop = trio.Event()
            addr: list[str] = []
            errors: list[BaseException] = []

            async def slow(_peer: str, _req: bytes) -> bytes:
                started.set()
                await trio.sleep(30)
                return b"never"

            async def serve(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                async with ControlHost(Identity.generate(), gossip=False) as server:
                    server.set_handler(ECHO, slow, max_request=64)
                    addr.append(server.addrs[0])
                    task_status.started()
                    await stop.wait()

            async def ask() -> None:
                try:
                    await client.request(addr[0], ECHO, b"q", max_response=64, timeout_s=15)
                except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
                    errors.append(exc)

            t0 = trio.current_time()
            async with trio.open_nursery() as nursery:
                await nursery.start(serve)
                nursery.start_soon(ask)
                await started.wait()
                stop.set()
            assert len(errors) == 1 and isinstance(errors[0], TransportError), errors
            assert not isinstance(errors[0], Timeout)
            assert trio.current_time() - t0 < 10

            # The client host is unaffected.
            async with ControlHost(Identity.generate(), gossip=False) as again:
                again.set_handler(ECHO, lambda _p, r: _echo(r), max_request=64)
                assert await client.request(again.addrs[0], ECHO, b"ok", max_response=64) == b"ok"

    run(main, 30)


def test_shutdown_releases_port_and_leaves_no_tasks() -> None:
    async def main() -> None:
        root = trio.lowlevel.current_root_task()

        def task_count() -> int:
            todo, n = [root], 0
            while todo:
                t = todo.pop()
                n += 1
                for nursery in t.child_nurseries:
                    todo.extend(nursery.child_tasks)
            return n

        await trio.sleep(0.1)
        before = task_count()
        async with ControlHost(Identity.generate()) as server, ControlHost(Identity.generate()) as client:
            server.set_handler(ECHO, lambda _p, r: _echo(r), max_request=64)
            await server.subscribe(ANNOUNCE_TOPIC, lambda _o, _d: trio.sleep(0))
            client.add_bootstrap(server.addrs[0])
            assert await client.request(server.addrs[0], ECHO, b"x", max_response=64) == b"x"
            _, port = server.listen_addr
            assert task_count() > before
        assert not server.running and not client.running
        with pytest.raises(OSError):
            await trio.open_tcp_stream("127.0.0.1", port)
        with trio.fail_after(5):
            while task_count() > before:
                await trio.sleep(0.05)

        # py-libp2p only logs a failed listen; we refuse to run unreachable.
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            with pytest.raises(TransportError, match="could not listen"):
                async with ControlHost(Identity.generate(), listen_port=busy.getsockname()[1], gossip=False):
                    pass

    run(main)


def test_bootstrap_reconnects_with_backoff() -> None:
    async def main() -> None:
        hub_id = Identity.generate()
        port = free_port()
        hub_addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{hub_id.peer_id}"
        events: list[tuple[str, str]] = []
        node = ControlHost(
            Identity.generate(),
            gossip=False,
            dial_timeout_s=2,
            backoff_base_s=0.1,
            backoff_cap_s=0.4,
            bootstrap_check_s=0.1,
        )
        node.on_connect(lambda p: events.append(("up", p)))
        node.on_disconnect(lambda p: events.append(("down", p)))
        node.add_bootstrap(hub_addr)
        async with node:
            await trio.sleep(0.5)  # hub not up yet: dials fail and back off
            assert not node.is_connected(hub_id.peer_id)
            for round_ in range(2):
                hub = ControlHost(hub_id, listen_port=port, gossip=False)
                hub.set_handler(ECHO, lambda _p, r: _echo(r), max_request=64)  # before start
                async with hub:
                    with trio.fail_after(5):
                        while not node.is_connected(hub.peer_id):
                            await trio.sleep(0.05)
                    msg = b"round %d" % round_
                    assert await node.request(hub.peer_id, ECHO, msg, max_response=64) == msg
                with trio.fail_after(5):
                    while node.is_connected(hub_id.peer_id):
                        await trio.sleep(0.05)
        assert events.count(("up", hub_id.peer_id)) >= 2
        assert events.count(("down", hub_id.peer_id)) >= 2

    run(main, 30)


def test_request_by_id_after_the_peerstore_expired_the_peers_addresses() -> None:
    """A node knows its hub by peer ID once connected; after the hub was gone a while, py-libp2p's
    peerstore raises "peer ID is expired" for it. That exception killed a node in `bench crash`:
    now the addresses last dialled are used, and the request goes through."""

    async def main() -> None:
        async with (
            ControlHost(Identity.generate(), gossip=False) as server,
            ControlHost(Identity.generate(), gossip=False, dial_timeout_s=5.0) as client,
        ):
            server.set_handler(ECHO, lambda _p, r: _echo(r), max_request=64)
            assert await client.request(server.addrs[0], ECHO, b"a", max_response=64) == b"a"
            await client.disconnect(server.peer_id)
            with trio.fail_after(5):
                while client.is_connected(server.peer_id):
                    await trio.sleep(0.05)
            store = client._require_host().get_peerstore()
            pid = next(p for p in store.peer_ids() if str(p) == server.peer_id)
            data = store.peer_data_map[pid]
            data.set_ttl(1)
            data.last_identified -= 3600  # what an hour without a word does to a peer's entry
            assert store.peer_data_map[pid].is_expired()
            assert await client.request(server.peer_id, ECHO, b"b", max_response=64, timeout_s=10) == b"b"

    run(main)
