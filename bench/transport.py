"""``echo2 bench transport``: raw trio TCP vs one py-libp2p stream vs the echo2 data plane.

All legs run on loopback inside one trio run (sender and receiver in the same process, as the
libp2p leg needs anyway), so they share the same handicap and the ratios are fair:

1. raw trio TCP: 1 MiB ``send_all`` calls, large ``receive_some`` reads, nothing checked;
2. one py-libp2p stream between two real hosts (TCP + Noise + Yamux only), 1 MiB writes;
3. the echo2 data plane: mutual handshake, then CHUNK frames of ``--chunk-mib`` each, every
   chunk blake3-verified at the receiver before it is counted (the sender passes the key it
   already knows, as a relay does with the manifest's ``enc_hash``); the receiver is the data
   plane's own code path, which reads and hashes a large body on a worker thread;
4. the data plane again with the sender's upload limited to ``--limit-MBps`` (the receiver
   requests, the server sends, as when a node serves chunks to its children).

Sizes: ``--mbytes`` in MiB for legs 1-3; the limited leg moves ``--limit-mbytes`` MB (10**6 bytes,
like its rate). Throughputs are reported in MB/s = 10**6 bytes/s.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import Any

MiB = 1024 * 1024
MB = 1_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mbytes", type=int, default=256, help="MiB moved by each unlimited leg")
    parser.add_argument(
        "--libp2p-mbytes",
        type=int,
        default=64,
        help="MiB moved over the libp2p stream (it is ~15x slower; capped to keep the run short)",
    )
    parser.add_argument("--chunk-mib", type=float, default=4.0, help="data-plane chunk size in MiB")
    parser.add_argument("--limit-MBps", type=float, default=20.0, help="upload limit of the limited leg")
    parser.add_argument(
        "--limit-mbytes", type=float, default=100.0, help="MB (10**6) moved by the limited leg"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs of the raw and data-plane legs, interleaved; the best of each is reported "
        "(best-of: other load on the machine only ever slows a run down)",
    )
    parser.add_argument("--skip-libp2p", action="store_true", help="leave out the libp2p leg")
    parser.add_argument("--json", default=None, help="write the figures to this JSON file")


def _payload_pool(chunk: int, count: int = 8) -> list[bytes]:
    # Distinct random chunks so no layer can benefit from repeated or compressible data.
    return [os.urandom(chunk) for _ in range(count)]


async def _raw_tcp(nbytes: int) -> float:
    import trio

    piece = bytes(os.urandom(MiB))
    done = trio.Event()
    got = 0

    async def handler(stream: trio.SocketStream) -> None:
        nonlocal got
        while True:
            data = await stream.receive_some(4 * MiB)
            if not data:
                break
            got += len(data)
        done.set()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handler, 0)
        port = listeners[0].socket.getsockname()[1]
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        t0 = time.perf_counter()
        sent = 0
        while sent < nbytes:
            n = min(MiB, nbytes - sent)
            await stream.send_all(piece[:n] if n < MiB else piece)
            sent += n
        await stream.aclose()
        with trio.fail_after(120):
            await done.wait()
        elapsed = time.perf_counter() - t0
        nursery.cancel_scope.cancel()
    assert got == nbytes, (got, nbytes)
    return nbytes / elapsed / MB


async def _libp2p(nbytes: int) -> float:
    import multiaddr
    import trio
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
    from libp2p.custom_types import TProtocol
    from libp2p.network.stream.exceptions import StreamEOF
    from libp2p.peer.peerinfo import PeerInfo
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport
    from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
    from libp2p.stream_muxer.yamux.yamux import Yamux

    proto = TProtocol("/echo2/bench-transport/1.0.0")

    def build() -> Any:
        kp = create_new_key_pair()
        noise = NoiseTransport(kp, noise_privkey=create_new_x25519_key_pair().private_key)
        return new_host(
            key_pair=kp,
            sec_opt={NOISE_PROTOCOL_ID: noise},  # Noise only: no plaintext fallback
            muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
            listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")],
        )

    sender, receiver = build(), build()
    done = trio.Event()
    got = 0

    async def handler(stream: Any) -> None:
        nonlocal got
        try:
            while True:
                try:
                    data = await stream.read(MiB)
                except StreamEOF:  # how py-libp2p reports the writer's close
                    break
                if not data:
                    break
                got += len(data)
        except Exception as exc:  # a raising handler would kill the host
            logging.getLogger(__name__).warning("libp2p bench reader: %r", exc)
        finally:
            done.set()

    receiver.set_stream_handler(proto, handler)
    piece = os.urandom(MiB)
    listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
    async with receiver.run(listen), sender.run(listen):
        with trio.fail_after(30):
            await sender.connect(PeerInfo(receiver.get_id(), receiver.get_addrs()))
            stream = await sender.new_stream(receiver.get_id(), [proto])
        t0 = time.perf_counter()
        with trio.fail_after(600):
            sent = 0
            while sent < nbytes:
                n = min(MiB, nbytes - sent)
                await stream.write(piece[:n] if n < MiB else piece)
                sent += n
            await stream.close()
            await done.wait()
        elapsed = time.perf_counter() - t0
        await sender.close()
        await receiver.close()
    assert got == nbytes, (got, nbytes)
    return nbytes / elapsed / MB


async def _data_plane(nbytes: int, chunk: int, *, limit_MBps: float | None = None) -> float:
    """Move ``nbytes`` in CHUNK frames; the receiver verifies each. Unlimited: the dialer
    pushes. Limited: the dialer sends one REQUEST and the rate-limited server answers."""
    import trio

    from echo2.protocol.dataframe import FrameType, chunk_key
    from echo2.protocol.identity import Identity
    from echo2.protocol.net.connection import DataConnection
    from echo2.protocol.net.dataplane import DataPlaneServer, connect

    pool = _payload_pool(chunk)
    keys = [chunk_key(c) for c in pool]
    sizes: list[int] = []
    left = nbytes
    while left > 0:
        sizes.append(min(chunk, left))
        left -= sizes[-1]
    # A short last chunk needs its own key.
    tail_key = chunk_key(pool[0][: sizes[-1]]) if sizes and sizes[-1] != chunk else None

    async def push(conn: DataConnection) -> None:
        for i, size in enumerate(sizes):
            j = i % len(pool)
            if size == chunk:
                await conn.send_chunk(pool[j], key=keys[j])
            else:
                await conn.send_chunk(pool[0][:size], key=tail_key)

    async def pull(conn: DataConnection) -> int:
        got = 0
        async for frame in conn:
            if frame.type is FrameType.CHUNK:  # already verified against its key
                got += len(frame.payload)
        return got

    server_id, client_id = Identity.generate(), Identity.generate()
    result: dict[str, int] = {}
    done = trio.Event()

    async def server_handler(conn: DataConnection) -> None:
        if limit_MBps is None:
            result["got"] = await pull(conn)
            done.set()
        else:
            await conn.receive()  # the request
            await push(conn)

    server = DataPlaneServer(server_id, server_handler, upload_limit_MBps=limit_MBps if limit_MBps else None)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        conn = await connect(server.addr, client_id, server_id.peer_id, timeout_s=10)
        t0 = time.perf_counter()
        with trio.fail_after(600):
            if limit_MBps is None:
                await push(conn)
                await conn.aclose()
                await done.wait()
            else:
                await conn.send_request(b"all")
                result["got"] = await pull(conn)
                await conn.aclose()
        elapsed = time.perf_counter() - t0
        nursery.cancel_scope.cancel()
    assert result["got"] == nbytes, (result, nbytes)
    return nbytes / elapsed / MB


def run(args: argparse.Namespace) -> int:
    import trio

    nbytes = args.mbytes * MiB
    chunk = int(args.chunk_mib * MiB)
    out: dict[str, Any] = {"mbytes": args.mbytes, "chunk_bytes": chunk}

    async def main() -> None:
        raw_runs: list[float] = []
        dp_runs: list[float] = []
        for _ in range(max(1, args.repeat)):
            raw_runs.append(await _raw_tcp(nbytes))
            dp_runs.append(await _data_plane(nbytes, chunk))
        out["raw_tcp_runs_MBps"] = raw_runs
        out["data_plane_runs_MBps"] = dp_runs
        out["raw_tcp_MBps"] = max(raw_runs)
        out["data_plane_MBps"] = max(dp_runs)
        out["data_plane_vs_raw"] = out["data_plane_MBps"] / out["raw_tcp_MBps"]
        if args.skip_libp2p:
            out["libp2p_MBps"] = None
        else:
            out["libp2p_mbytes"] = args.libp2p_mbytes
            out["libp2p_MBps"] = await _libp2p(args.libp2p_mbytes * MiB)
        out["rate_limit_asked_MBps"] = args.limit_MBps
        out["rate_limit_mbytes"] = args.limit_mbytes
        out["rate_limit_measured_MBps"] = await _data_plane(
            int(args.limit_mbytes * MB), chunk, limit_MBps=args.limit_MBps
        )
        out["rate_limit_error"] = out["rate_limit_measured_MBps"] / args.limit_MBps - 1.0

    trio.run(main)
    lib = out["libp2p_MBps"]
    rows = [
        ("raw trio TCP", f"{args.mbytes} MiB", f"{out['raw_tcp_MBps']:.0f}"),
        (
            "py-libp2p stream (Noise+Yamux)",
            f"{args.libp2p_mbytes} MiB" if lib is not None else "-",
            f"{lib:.0f}" if lib is not None else "skipped",
        ),
        (
            f"echo2 data plane ({args.chunk_mib:g} MiB chunks, verified)",
            f"{args.mbytes} MiB",
            f"{out['data_plane_MBps']:.0f}",
        ),
        (
            f"data plane limited to {args.limit_MBps:g} MB/s",
            f"{args.limit_mbytes:g} MB",
            f"{out['rate_limit_measured_MBps']:.2f}",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'transport':<{width}}  {'moved':>9}  {'MB/s':>9}")
    for name, moved, rate in rows:
        print(f"{name:<{width}}  {moved:>9}  {rate:>9}")
    print(
        f"data plane / raw TCP: {out['data_plane_vs_raw']:.2f} (target >= 0.5; best of "
        f"{len(out['raw_tcp_runs_MBps'])} interleaved runs each)"
    )
    print(
        f"rate limit: asked {args.limit_MBps:g}, measured {out['rate_limit_measured_MBps']:.2f} MB/s "
        f"({out['rate_limit_error'] * 100:+.1f} %, target within +-10 %)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0
