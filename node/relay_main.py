"""A broadcast-only node process, for benches and tests:
``python -m echo2.node.relay_main --hub-addr H:P --hub-peer ID --dir D`` prints
``READY <peer id> <data address>`` once its data plane listens, and serves until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import trio

from echo2.keyfile import load_or_create_identity

from . import relay_trace
from .chunkstore import ChunkStore
from .portmap import MODES, PortMapper
from .relay_runtime import RelayNode
from .relay_state import RelayConfig

log = logging.getLogger(__name__)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m echo2.node.relay_main", description="broadcast-only node")
    p.add_argument("--hub-addr", required=True, help="hub data plane host:port")
    p.add_argument("--hub-peer", required=True, help="hub peer ID")
    p.add_argument("--dir", required=True, help="data directory (key and chunk store)")
    p.add_argument("--upload-MBps", dest="upload_MBps", type=float, default=0.0)
    p.add_argument("--announce-MBps", dest="announce_MBps", type=float, default=0.0,
                   help="upload told the hub's planner (default: --upload-MBps); for links shaped by the kernel")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--stall-s", dest="stall_s", type=float, default=RelayConfig.stall_timeout_s)
    p.add_argument("--punch", action="store_true",
                   help="hole punching: share the listen port, leave from it to the hub, punch to NAT-bound plan peers")
    p.add_argument("--port-map", dest="port_map", choices=MODES, default="off",
                   help="ask the home router to forward the data port (node.portmap); off here: a bench's choice")
    p.add_argument("--corrupt", action="store_true", help="fault injection: corrupt every chunk sent")
    p.add_argument("--trace", default=None, help="write a per-chunk trace here (node.relay_trace; benches)")
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    os.makedirs(args.dir, exist_ok=True)
    identity = load_or_create_identity(os.path.join(args.dir, "node.key"))
    store = ChunkStore(os.path.join(args.dir, "store"))
    cfg = RelayConfig(upload_MBps=args.upload_MBps, announce_MBps=args.announce_MBps, stall_timeout_s=args.stall_s, corrupt_sends=args.corrupt,
                      punch=args.punch)

    async def amain() -> None:
        node = RelayNode(identity, store, args.hub_peer, args.hub_addr, cfg, host=args.host)
        if args.trace:
            relay_trace.install(node.driver, args.trace, node.me)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            port = node.server.port
            mapper = PortMapper(args.port_map, lambda: [port], args.hub_addr.rpartition(":")[0].strip("[]"), host=args.host,
                                on_change=lambda: node.set_public_addr(mapper.external_addr(port)))
            await nursery.start(mapper.run)
            print(f"READY {identity.peer_id} {node.data_addr}", flush=True)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
                async for _ in sigs:
                    nursery.cancel_scope.cancel()
                    break

    t0 = time.time()
    trio.run(amain)
    log.info("node exits after %.1fs", time.time() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
