"""Hub CPU per request/reply pair on three transports (issue 20, item 2: the channel's choice).

``python -m echo2.bench.channel_cost [N] [K]``: a hub process serves one 300-byte reply per
300-byte request; K client processes send N requests each, one at a time, over (1) a fresh
py-libp2p stream per request (what the control plane does), (2) one persistent libp2p stream
with length-prefixed frames, (3) one data-plane connection (authenticated TCP). The hub
process's CPU (utime + stime from /proc, connection set-up included) divided by the requests
served is printed per transport, each measured twice. The figures are what
:mod:`echo2.protocol.channel` cites for choosing the data plane.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
from typing import Any

from echo2.bench.attack_cpu import process_cpu_s

PAYLOAD = b"x" * 300
REPLY = b"y" * 300
MODES = ("fresh", "persist", "dataplane")


def _hub(q: Any, stop: Any) -> None:
    import trio
    from libp2p.custom_types import TProtocol

    from echo2.protocol.framing import encode_frame
    from echo2.protocol.identity import Identity
    from echo2.protocol.net.connection import DataConnection
    from echo2.protocol.net.control import ControlHost
    from echo2.protocol.net.dataplane import DataPlaneServer
    from echo2.protocol.net.reqresp import read_frame

    ident = Identity.generate()

    async def main() -> None:
        async with ControlHost(ident, gossip=False) as host:
            async def fresh(peer: str, data: bytes) -> bytes:
                return REPLY

            host.set_handler("/bench/fresh", fresh, max_request=1 << 20)

            async def persistent(stream: Any) -> None:
                try:
                    while True:
                        await read_frame(stream, max_size=1 << 20)
                        await stream.write(encode_frame(REPLY))
                except Exception:
                    return

            host.libp2p_host.set_stream_handler(TProtocol("/bench/persist"), persistent)

            async def dataplane(conn: DataConnection) -> None:
                async for _frame in conn:
                    await conn.send_message(REPLY)

            async with trio.open_nursery() as nursery:
                srv = DataPlaneServer(ident, dataplane)
                await nursery.start(srv.serve)
                q.put((host.addrs[0], srv.addr, ident.peer_id))
                while not stop.is_set():
                    await trio.sleep(0.2)
                nursery.cancel_scope.cancel()

    trio.run(main)


def _client(addr: str, data_addr: str, hub_id: str, mode: str, n: int) -> None:
    import trio
    from libp2p.custom_types import TProtocol

    from echo2.protocol.framing import encode_frame
    from echo2.protocol.identity import Identity
    from echo2.protocol.net.control import ControlHost
    from echo2.protocol.net.dataplane import connect
    from echo2.protocol.net.libp2p_host import parse_peer_id
    from echo2.protocol.net.reqresp import read_frame

    ident = Identity.generate()

    async def main() -> None:
        async with ControlHost(ident, gossip=False) as host:
            await host.connect(addr)
            if mode == "fresh":
                for _ in range(n):
                    await host.request(hub_id, "/bench/fresh", PAYLOAD, max_response=1 << 20)
            elif mode == "persist":
                s = await host.libp2p_host.new_stream(parse_peer_id(hub_id), [TProtocol("/bench/persist")])
                for _ in range(n):
                    await s.write(encode_frame(PAYLOAD))
                    await read_frame(s, max_size=1 << 20)
            else:
                conn = await connect(data_addr, ident, hub_id)
                for _ in range(n):
                    await conn.send_request(PAYLOAD)
                    await conn.receive()
                await conn.aclose()

    trio.run(main)


def main(n: int = 500, k: int = 2) -> dict[str, list[float]]:
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    hub = ctx.Process(target=_hub, args=(q, stop))
    hub.start()
    addr, data_addr, hub_id = q.get(timeout=60)
    out: dict[str, list[float]] = {}
    try:
        for mode in MODES * 2:
            c0, t0 = process_cpu_s(hub.pid or 0), time.perf_counter()
            clients = [ctx.Process(target=_client, args=(addr, data_addr, hub_id, mode, n)) for _ in range(k)]
            for p in clients:
                p.start()
            for p in clients:
                p.join()
            ms = (process_cpu_s(hub.pid or 0) - c0) * 1e3 / (n * k)
            out.setdefault(mode, []).append(round(ms, 3))
            print(f"{mode:>9}: hub CPU {ms:.3f} ms per request (wall {time.perf_counter() - t0:.1f} s)", flush=True)
    finally:
        stop.set()
        hub.join(10)
    return out


if __name__ == "__main__":
    print(json.dumps(main(*(int(a) for a in sys.argv[1:3]))))
