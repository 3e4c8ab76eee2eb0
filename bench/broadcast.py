"""``echo2 bench broadcast``: time to get one policy version to every node, star vs pipelined.

Units: ``--mbytes`` in MB (10**6 bytes) and ``--link-MBps`` in MB/s (10**6 bytes/s), so
``ideal_seconds = mbytes / link_MBps`` exactly; ``--chunk-bytes`` in bytes. Every node and the
hub upload at ``--link-MBps`` (unless ``--hub-MBps`` is given).

``--simulate`` runs the discrete-event simulation (``echo2.bench.broadcast_sim``); without it,
:func:`run_real` starts one real node process per node on 127.0.0.1 and a hub in this process
(star: ``StarSender``; pipelined: ``echo2.learner_hub.broadcast.PipelinedSender``) and publishes a
version of ``--mbytes`` MB of random (incompressible) bytes. ``--netns`` puts the hub and each node in
its own network namespace with the kernel's tbf on its upload instead (``echo2.bench.netns``).
The chunk size defaults to the publisher's rule (``echo2.protocol.chunking``: from M and N).
``--trace`` (real pipelined runs) has the hub and every node write a per-chunk trace
(``echo2.node.relay_trace``) and prints where the tail went (``echo2.bench.broadcast_trace``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from types import SimpleNamespace
from typing import Any

from echo2.bench import plotting
from echo2.bench.attack_cpu import cpu_seconds

log = logging.getLogger(__name__)
MB = 1_000_000
TBF_GOODPUT = 1448 / 1514


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from e
    if not out or any(n < 1 for n in out):
        raise argparse.ArgumentTypeError("node counts must be >= 1")
    return out


def _rates(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(":"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"LO:HI in MB/s, got {text!r}") from e
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError("need 0 < LO <= HI")
    return lo, hi


def _wide_area(args: argparse.Namespace) -> bool:
    return bool(args.rates or args.nat_share or args.churn or args.nat_relay)


def _mode_list(text: str) -> list[str]:
    out = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in out if m not in ("star", "pipelined")]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"modes are star and pipelined, got {text!r}")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=_int_list, default=[8], help="node count, or a comma list (e.g. 8,64,512)")
    parser.add_argument("--mbytes", type=float, default=256.0, help="version size in MB (10^6 bytes)")
    parser.add_argument("--link-MBps", dest="link_MBps", type=float, default=10.0,
                        help="upload limit of every node and the hub, MB/s (10^6 bytes/s)")
    parser.add_argument("--hub-MBps", dest="hub_MBps", type=float, default=None, help="hub upload (default: --link-MBps)")
    parser.add_argument("--chunk-bytes", dest="chunk_bytes", type=int, default=None,
                        help="chunk size in bytes (default: the publisher's rule from M and N, protocol.chunking)")
    parser.add_argument("--mode", type=_mode_list, default=["star", "pipelined"], help="star,pipelined")
    parser.add_argument("--simulate", action="store_true", help="discrete-event simulation instead of real processes")
    parser.add_argument("--latency-ms", dest="latency_ms", type=float, default=None,
                        help="per-chunk hop overhead in the simulation (default 2 ms)")
    parser.add_argument("--nat", type=int, default=0,
                        help="with --netns: this many nodes live in homes behind their own NAT router (MASQUERADE)")
    parser.add_argument("--punch", action="store_true",
                        help="with --nat: NATed nodes in different homes are joined by TCP hole punching that the hub "
                             "coordinates (hub nat_punch; node/punch.py); a failed punch falls back to a reachable parent")
    parser.add_argument("--isolate-homes", dest="isolate_homes", action="store_true",
                        help="with --nat: home routers drop traffic to other homes (every punch fails: the fallback)")
    parser.add_argument("--upnp", action="store_true",
                        help="with --nat: each home router runs miniupnpd (UPnP IGD + NAT-PMP) and the nodes ask it to "
                             "forward their data port (node --port-map auto, node/portmap.py)")
    parser.add_argument("--netns", action="store_true",
                        help="real runs in network namespaces (root): hub and nodes each on a host whose upload the "
                             "kernel's tbf shapes at --link-MBps, no token bucket (bench/netns.py)")
    parser.add_argument("--tbf-burst", dest="tbf_burst", default=None,
                        help="with --netns: depth of each host's token bucket, in tc's units (default: "
                             "bench/netns.py DEFAULT_BURST, 128kb; 32kb reproduces the earlier runs)")
    wan = parser.add_argument_group("wide area (--simulate only; bench/wan_sim.py)")
    wan.add_argument("--rates", type=_rates, default=None, metavar="LO:HI",
                     help="node uploads drawn log-uniform in LO..HI MB/s (e.g. 2:125); the hub at --hub-MBps or --link-MBps")
    wan.add_argument("--nat-share", dest="nat_share", type=float, default=0.0, help="share of NATed nodes (0..1)")
    wan.add_argument("--punch-p", dest="punch_p", type=float, default=0.6,
                     help="probability that hole punching joins two NATed nodes")
    wan.add_argument("--nat-relay", dest="nat_relay", action="store_true",
                     help="plan NATed nodes as relays (what NAT traversal will allow); default: leaves, as today")
    wan.add_argument("--churn", type=float, default=0.0, help="this share of nodes leaves, as many join, during the broadcast")
    wan.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", action="store_true",
                        help="real pipelined runs: a per-chunk trace of the hub and every node (node/relay_trace.py), "
                             "and where the tail goes (bench/broadcast_trace.py) under each row")
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument("--plot", default=None, help="PNG: seconds against N for each mode, with the floor M/B")



def _spawn_nodes(n: int, hub_addr: str, hub_peer: str, link_MBps: float, root: str,
                 corrupt: frozenset[int] = frozenset(), net: Any = None, punch: bool = False,
                 trace: bool = False) -> list[Any]:
    """Node ``i`` on 127.0.0.1 behind its token bucket, or (``net``: a ``bench.netns.Net``) in
    host ``i + 1``'s namespace, its upload shaped by the kernel only (it announces the link rate)."""
    import subprocess
    import sys

    procs = []
    for i in range(n):
        d = os.path.join(root, f"node{i}")
        os.makedirs(d, exist_ok=True)
        cmd = [sys.executable, "-m", "echo2.node.relay_main", "--hub-addr", hub_addr, "--hub-peer", hub_peer, "--dir", d]
        if net is None:
            cmd += ["--upload-MBps", str(link_MBps)]
        else:
            cmd += ["--announce-MBps", str(link_MBps), "--host", net.ip(i + 1)]
        if i in corrupt:
            cmd.append("--corrupt")
        if punch:
            cmd.append("--punch")
        if trace:
            cmd += ["--trace", os.path.join(d, "trace.txt")]
        if net is not None and net.upnp:
            cmd += ["--port-map", "auto"]
        with open(os.path.join(d, "log.txt"), "wb") as logf:
            if net is None:
                procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=logf))
            else:
                procs.append(net.popen(i + 1, cmd, stdout=subprocess.DEVNULL, stderr=logf))
    return procs


def _stop_nodes(procs: list[Any], net: Any = None) -> None:
    import subprocess

    if net is not None:
        for p in procs:
            net.kill(p)
        return
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def _dial_back(sender: Any, timeout_s: float = 3.0) -> dict[str, bool]:
    """Which nodes accept a data-plane connection, as the hub learns it (AutoNAT-like): dial the
    announced port at the IP the hub observes the node at (never the announced host, A10), from a
    throw-away identity; a refusal after the handshake still proves reachability."""
    import trio

    from echo2.learner_hub.probe_service import data_dial_target
    from echo2.protocol.errors import Echo2Error, HandshakeError
    from echo2.protocol.identity import Identity
    from echo2.protocol.net import dataplane

    prober = Identity.generate()
    out: dict[str, bool] = {}

    async def one(peer: str) -> None:
        link, hello = sender.driver.links.get(peer), sender.hello.get(peer)  # star and pipelined alike
        target = data_dial_target(hello.data_addr if hello else "", link.conn.remote_ip() if link else None)
        ok = False
        if target is not None:
            try:
                with trio.move_on_after(timeout_s + 1):
                    conn = await dataplane.connect(target, prober, peer, timeout_s=timeout_s)
                    await conn.abort()
                    ok = True
            except HandshakeError as exc:
                ok = getattr(exc, "reason", "") == "not_allowed"
            except Echo2Error:
                ok = False
        out[peer] = ok

    async with trio.open_nursery() as nursery:
        for peer in sorted(sender.hello):
            nursery.start_soon(one, peer)
    return out


async def _real_mode(mode: str, n: int, mbytes: float, link_MBps: float, hub_MBps: float, chunk: int,
                     root: str, connect_timeout_s: float = 180.0, net: Any = None, punch: bool = False,
                     trace: bool = False) -> dict[str, object]:
    """One broadcast of ``mbytes`` to ``n`` real node processes. Under ``net`` (a netns LAN), the
    hub first learns each node's reachability by dialing it back, so NATed nodes (``net.nat``)
    are planned as such."""
    import numpy as np
    import torch
    import trio

    from echo2.learner_hub.broadcast import PipelinedSender, StarWithHolds
    from echo2.learner_hub.publisher import PolicyPublisher, StarSender
    from echo2.protocol.identity import Identity
    from echo2.protocol.net.dataplane import DataPlaneServer
    from echo2.protocol.net.ratelimit import UploadLimiter

    identity = Identity.generate()
    cfg = SimpleNamespace(chunk_bytes=chunk, full_every=10)  # 0: the publisher's rule (protocol.chunking)
    publisher = PolicyPublisher(identity, "{}", {}, cfg)
    sender: Any
    if mode == "star":
        sender = StarWithHolds(StarSender(publisher))
    else:
        # NATed nodes relay too (reverse connections to reachable children) when there are homes
        sender = PipelinedSender(publisher, identity, hub_upload_MBps=hub_MBps, nat_relay=bool(net and net.nat),
                                 nat_punch=punch)
    # under --netns the hub's upload is the kernel's tbf on host 0, not a token bucket
    server = DataPlaneServer(identity, sender.serve_connection, upload_limiter=None if net else UploadLimiter(hub_MBps),
                             max_connections=max(256, 4 * n), host=net.ip(0) if net else "127.0.0.1")
    total = int(round(mbytes * MB))
    # Incompressible: zstd stores random bytes as they are, so M MB really travel.
    state = {"w": torch.from_numpy(np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8))}
    procs: list[Any] = []
    trace = trace and mode == "pipelined"
    hub_trace = os.path.join(root, mode, "hub_trace.txt")
    t_pub = 0.0
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            if mode == "pipelined":
                sender.data_addr = server.addr
            procs = _spawn_nodes(n, server.addr, identity.peer_id, link_MBps, os.path.join(root, mode), net=net,
                                 punch=punch, trace=trace)
            with trio.fail_after(connect_timeout_s):
                while len(sender.hello) < n:
                    await sender.changed.wait()
            await trio.sleep(0.5)
            if net is not None and net.upnp:  # until every home's node told its mapped address (bounded)
                with trio.move_on_after(15):
                    while any(h.data_addr.startswith("192.168.") for h in sender.hello.values()):
                        await sender.changed.wait()
            reachable: dict[str, bool] = {}
            if net is not None:
                from echo2.learner_hub.broadcast_book import PeerInfo

                reachable = await _dial_back(sender)
                hello = dict(sender.hello)
                sender.node_info = lambda p: (PeerInfo(hello[p].data_addr, hello[p].upload_Bps, reachable.get(p, False))
                                              if p in hello else None)
                log.info("dial-back: %d of %d nodes reachable", sum(reachable.values()), len(reachable))
            # NATed nodes whose hub link came from their listen port unchanged (their NAT keeps it)
            punchable = sum(1 for p, v in reachable.items() if not v and sender.punch_addr_of(p)) if punch else 0
            await publisher.publish(1, state)
            # CPU of the broadcast only (packing is the publisher's, before): every node process
            # (``ip netns exec`` execs the node in place, so the pid is the node's) and this hub.
            pids = [p.pid for p in procs] + [os.getpid()]
            cpu0, hub_cpu0 = cpu_seconds(pids), cpu_seconds([os.getpid()])
            if trace:
                import time

                from echo2.node import relay_trace

                trace_file = relay_trace.install(sender.driver, hub_trace, identity.peer_id)
                t_pub = time.monotonic()
            sender.notify()
            limit = 20 * mbytes / min(link_MBps, hub_MBps) * max(1.0, n / 4) + 60
            with trio.fail_after(limit):
                while sender.holders(1) < n:
                    await sender.changed.wait()
            cpu_s = cpu_seconds(pids) - cpu0
            hub_cpu_s = cpu_seconds([os.getpid()]) - hub_cpu0
            load1 = os.getloadavg()[0]
            await trio.sleep(1.0)  # late stats reports
            m = sender.version_metrics(1)
            peer_sent = dict(sender.metrics[1].peer_sent) if 1 in sender.metrics else {}
            home_ips = {net.public_ip(j) for j in net.nat} if net is not None else set()
            homes = {p for p, lk in sender.driver.links.items() if lk.conn.remote_ip() in home_ips}
            per_node = _per_node(sender)
            plan = sender.cur.plan if trace else None  # before the nodes stop (each leave repairs it)
            nursery.cancel_scope.cancel()
    finally:
        _stop_nodes(procs, net)
        if trace and t_pub:
            trace_file.close()
    assert m is not None
    assert publisher.latest is not None
    chunk = publisher.latest.packed.manifest.chunk_size
    ideal = mbytes / min(link_MBps, hub_MBps)
    hub_sent = int(sender.bytes_sent)
    chunk_s = chunk / (min(link_MBps, hub_MBps) * MB * (TBF_GOODPUT if net else 1.0))
    tail = _tail(sender, plan, root, mode, n, hub_trace, t_pub, chunk_s) if trace else []
    return {
        "mode": mode,
        "nodes": n,
        "seconds": m["last_s"],
        "median_seconds": m["median_s"],
        "first_seconds": m["first_s"],
        "ideal_seconds": ideal,
        "ratio": m["last_s"] / ideal,
        "hub_sent_bytes": hub_sent,
        "peer_sent_bytes": int(m["peer_sent_bytes"]),
        "chunks": -(-total // chunk),
        "chunk_bytes": chunk,
        "simulated": False,
        "netns": net is not None,
        "tbf_burst": net.burst if net is not None else None,
        "nat_nodes": sum(1 for v in reachable.values() if not v),
        "nat_sent_bytes": sum(int(peer_sent.get(p, 0)) for p, v in reachable.items() if not v),
        # nodes in homes behind NAT routers, reachable or not (--upnp: their routers forward a port)
        "upnp": bool(net is not None and net.upnp),
        "home_nodes": len(homes),
        "home_sent_bytes": sum(int(peer_sent.get(p, 0)) for p in homes),
        # CPU of the node processes and the hub from publication until the last node held the
        # version, per GB (10**9 bytes) of chunk bytes relayed (sent by the hub and by peers).
        # Kernel work outside these processes (softirqs, tbf) is not in it.
        "cpu_seconds": cpu_s,
        "hub_cpu_seconds": hub_cpu_s,
        "cpu_s_per_GB": cpu_s / (max(1, hub_sent + int(m["peer_sent_bytes"])) / 1e9),
        "loadavg_1m": load1,
        # hole punching (--punch): NAT<->NAT pairs planned, punched, and fallen back to other parents
        "punch": punch,
        "punchable_nodes": punchable,
        "punch_planned": int(m.get("punch_planned", 0)),
        "punched": int(m.get("punched", 0)),
        "punch_fallbacks": int(m.get("punch_fallbacks", 0)),
        "per_node": per_node,
        "trace": tail,
    }


def _tail(sender: Any, plan: Any, root: str, mode: str, n: int, hub_trace: str, t_pub: float,
          chunk_seconds: float) -> list[str]:
    """Where the tail went (bench/broadcast_trace.py), from the traces the hub and nodes wrote."""
    from echo2.bench.broadcast_trace import tail_report
    from echo2.node import relay_trace

    cur, m = getattr(sender, "cur", None), sender.metrics.get(1)
    if cur is None or plan is None or m is None or not t_pub:
        return ["no trace: no plan or no version"]
    traces: dict[str, list[Any]] = {}
    for path in [hub_trace] + [os.path.join(root, mode, f"node{i}", "trace.txt") for i in range(n)]:
        evs = relay_trace.read(path)
        me = next((e[4] for e in evs if e[1] == "me"), None)
        if me is not None:
            traces[me] = evs
    names = {p: f"n{i}" for i, p in enumerate(sorted(m.holds))}
    names[plan.hub] = "hub"
    return tail_report(traces, plan, t_pub, version=1, n_chunks=len(cur.pub.packed.manifest.chunks), names=names,
                       chunk_seconds=chunk_seconds)


def _per_node(sender: Any) -> list[dict[str, object]]:
    """Each node's finish (seconds after publication) with its place in the plan: its parent and
    depth per stripe and its children count where it is interior, slowest first, to see whether
    the last node is always under the same kind of relay."""
    m = sender.metrics.get(1)
    cur = getattr(sender, "cur", None)
    if m is None:
        return []
    plan = cur.plan if cur is not None else None
    short = {p: f"n{i}" for i, p in enumerate(sorted(m.holds))}
    short[getattr(plan, "hub", "")] = "hub"
    out = []
    for peer, t in sorted(m.holds.items(), key=lambda kv: -kv[1]):
        row: dict[str, object] = {"node": short[peer], "seconds": round(t, 3), "sent_MB": round(m.peer_sent.get(peer, 0) / 1e6, 1)}
        if plan is not None:
            row["parents"] = [short.get(plan.parent[s].get(peer, ""), "?") for s in range(plan.stripes)]
            row["depth"] = [plan.depth(s).get(peer, -1) for s in range(plan.stripes)]
            row["children"] = [len(plan.children[s].get(peer, [])) for s in range(plan.stripes)]
        out.append(row)
    return out


def run_real(args: argparse.Namespace) -> list[dict[str, object]]:
    """Real node processes (``python -m echo2.node.relay_main``) on 127.0.0.1, every upload (the
    hub's too) limited by the data plane's token bucket; the hub runs in this process. Each row
    carries the simulator's prediction for the same parameters (``sim_seconds``, ``sim_vs_real``)."""
    import tempfile

    import trio

    from echo2.bench import broadcast_sim as sim

    chunk = args.chunk_bytes or 0
    hub_MBps = args.hub_MBps or args.link_MBps
    trace = bool(getattr(args, "trace", False))
    if getattr(args, "netns", False) and args.hub_MBps and args.hub_MBps != args.link_MBps:
        raise SystemExit("--netns shapes every host at --link-MBps; --hub-MBps is not supported there")
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="echo2-bcast-") as root:
        for n in args.nodes:
            for mode in args.mode:
                if getattr(args, "netns", False):
                    from echo2.bench.netns import Net

                    # a fresh LAN per row: host 0 is the hub, hosts 1..n the nodes
                    homes = frozenset(range(n + 1 - args.nat, n + 1))  # the last --nat nodes
                    burst = {"burst": args.tbf_burst} if getattr(args, "tbf_burst", None) else {}
                    with Net(n + 1, args.link_MBps, nat=homes, isolate_homes=getattr(args, "isolate_homes", False),
                             upnp=bool(getattr(args, "upnp", False)), **burst) as net, net.inside(0):
                        row = trio.run(_real_mode, mode, n, args.mbytes, args.link_MBps, hub_MBps, chunk, root,
                                       180.0, net, bool(getattr(args, "punch", False)), trace)
                else:
                    row = trio.run(_real_mode, mode, n, args.mbytes, args.link_MBps, hub_MBps, chunk, root, 180.0, None,
                                   False, trace)
                used = int(row["chunk_bytes"])  # type: ignore[call-overload]
                # tbf shapes whole frames: 1448 TCP payload bytes per 1514 on the wire (MTU 1500
                # with timestamps), so the simulator gets the goodput of a shaped link
                eff = TBF_GOODPUT if getattr(args, "netns", False) else 1.0
                p = sim.simulate(mode, n, args.mbytes, args.link_MBps * eff, used,
                                 hub_MBps=args.hub_MBps * eff if args.hub_MBps else None)
                row["sim_seconds"] = p.seconds
                row["sim_median_seconds"] = p.median_seconds
                row["sim_vs_real"] = p.seconds / float(row["seconds"])  # type: ignore[arg-type]
                rows.append(row)
                log.info("real %s N=%d: %.2fs (simulated %.2fs)", mode, n, row["seconds"], p.seconds)
    return rows


def run_wan(args: argparse.Namespace) -> list[dict[str, object]]:
    """Pipelined broadcast on a simulated wide area; the ratio against the fluid bound too."""
    from echo2.bench.sim_engine import DEFAULT_LATENCY_S
    from echo2.bench.wan_sim import simulate_wan

    lo, hi = args.rates or (args.link_MBps, args.link_MBps)
    hub = args.hub_MBps or args.link_MBps
    rows: list[dict[str, object]] = []
    for n in args.nodes:
        r = simulate_wan(n, args.mbytes, hub_MBps=hub, rate_lo=lo, rate_hi=hi, nat_share=args.nat_share,
                         punch_p=args.punch_p, churn=args.churn, nat_relay=args.nat_relay, seed=args.seed,
                         chunk_bytes=args.chunk_bytes,
                         latency_s=DEFAULT_LATENCY_S if args.latency_ms is None else args.latency_ms / 1000.0)
        rows.append({
            "mode": "pipelined", "nodes": n, "seconds": r.seconds, "median_seconds": r.median_seconds,
            "first_seconds": r.first_seconds, "ideal_seconds": r.hub_floor_seconds, "ratio": r.ratio_hub,
            "fluid_seconds": r.fluid_seconds, "ratio_fluid": r.ratio_fluid, "issue_bound_seconds": r.issue_bound_seconds,
            "hub_sent_bytes": r.hub_sent_bytes, "peer_sent_bytes": r.peer_sent_bytes,
            "nat_nodes": r.nat_nodes, "nat_sent_bytes": r.nat_sent_bytes, "punch_failures": r.punch_failures,
            "left": r.left, "joined": r.joined, "joiner_max_seconds": r.joiner_max_seconds,
            "chunks": r.n_chunks, "chunk_bytes": r.chunk_bytes, "stripes": r.stripes, "depth": r.depth,
            "simulated": True, "wide_area": True,
        })
    return rows


def run_simulated(args: argparse.Namespace) -> list[dict[str, object]]:
    from echo2.bench import broadcast_sim as sim

    chunk = args.chunk_bytes or None  # None: the publisher's rule
    latency = sim.DEFAULT_LATENCY_S if args.latency_ms is None else args.latency_ms / 1000.0
    ideal = args.mbytes / (args.hub_MBps if args.hub_MBps else args.link_MBps)
    rows: list[dict[str, object]] = []
    for n in args.nodes:
        for mode in args.mode:
            r = sim.simulate(mode, n, args.mbytes, args.link_MBps, chunk, hub_MBps=args.hub_MBps, latency_s=latency)
            rows.append({
                "mode": mode,
                "nodes": n,
                "seconds": r.seconds,
                "median_seconds": r.median_seconds,
                "first_seconds": r.first_seconds,
                "ideal_seconds": ideal,
                "ratio": r.seconds / ideal,
                "hub_sent_bytes": r.hub_sent_bytes,
                "peer_sent_bytes": r.peer_sent_bytes,
                "chunks": r.n_chunks,
                "chunk_bytes": r.chunk_bytes,
                "stripes": r.stripes,
                "depth": r.depth,
                "simulated": True,
            })
    return rows


def run(args: argparse.Namespace) -> int:
    if args.mbytes <= 0 or args.link_MBps <= 0 or (args.chunk_bytes is not None and args.chunk_bytes <= 0):
        raise SystemExit("--mbytes, --link-MBps and --chunk-bytes must be positive")
    if args.plot:
        plotting.require()
    if _wide_area(args) and not args.simulate:
        raise SystemExit("--rates, --nat-share, --churn and --nat-relay are for --simulate")
    if not (0 <= args.nat_share <= 1 and 0 <= args.punch_p <= 1 and 0 <= args.churn < 1):
        raise SystemExit("--nat-share and --punch-p in [0, 1], --churn in [0, 1)")
    if args.nat and not (getattr(args, "netns", False) and 0 < args.nat <= min(args.nodes)):
        raise SystemExit("--nat K needs --netns and 0 < K <= --nodes")
    if getattr(args, "upnp", False) and not args.nat:
        raise SystemExit("--upnp needs --netns --nat K")
    if getattr(args, "punch", False) and not args.nat:
        raise SystemExit("--punch needs --netns --nat K")
    if args.simulate and _wide_area(args):
        args.mode = ["pipelined"]
        rows = run_wan(args)
    else:
        rows = run_simulated(args) if args.simulate else run_real(args)
    print(f"{'mode':<10} {'nodes':>6} {'seconds':>10} {'median':>10} {'ideal':>8} {'ratio':>7} {'hub MB':>9} {'peer MB':>10}")
    for r in rows:
        print(f"{r['mode']:<10} {r['nodes']:>6} {r['seconds']:>10.2f} {r['median_seconds']:>10.2f} "
              f"{r['ideal_seconds']:>8.2f} {r['ratio']:>7.3f} {int(r['hub_sent_bytes']) / 1e6:>9.1f} "  # type: ignore[call-overload]
              f"{int(r['peer_sent_bytes']) / 1e6:>10.1f}")  # type: ignore[call-overload]
        if "cpu_s_per_GB" in r:
            print(f"{'':<10} first {r['first_seconds']:.2f}s; CPU {r['cpu_seconds']:.2f}s (hub {r['hub_cpu_seconds']:.2f}s) = "
                  f"{r['cpu_s_per_GB']:.1f} CPU-s per GB relayed; load average {r['loadavg_1m']:.1f}")
        if r.get("upnp"):
            home_n = max(1, int(r["home_nodes"]))  # type: ignore[call-overload]
            print(f"{'':<10} UPnP/NAT-PMP: {r['home_nodes']} nodes in homes ({r['nat_nodes']} not reachable after mapping) "
                  f"uploaded {int(r['home_sent_bytes']) / 1e6:.1f} MB, {int(r['home_sent_bytes']) / home_n / 1e6:.1f} MB each")  # type: ignore[call-overload]
        for pn in r.get("per_node", []):  # type: ignore[attr-defined]
            print(f"{'':<10}   {pn}")
        for line in r.get("trace", []):  # type: ignore[attr-defined]
            print(f"{'':<10} trace: {line}")
        if "ratio_fluid" in r:
            print(f"{'':<10} fluid bound {r['fluid_seconds']:.2f}s, ratio to it {r['ratio_fluid']:.3f}; "
                  f"{r['nat_nodes']} NATed uploaded {int(r['nat_sent_bytes']) / 1e6:.1f} MB; "  # type: ignore[call-overload]
                  f"-{r['left']} +{r['joined']} nodes, joiners <= {r['joiner_max_seconds']:.2f}s after joining; "
                  f"{r['chunks']} chunks of {r['chunk_bytes']} B, depth {r['depth']}")
        elif r.get("nat_nodes"):
            nat_n = int(r["nat_nodes"])  # type: ignore[call-overload]
            print(f"{'':<10} {nat_n} NATed nodes (dial-back failed) uploaded {int(r['nat_sent_bytes']) / 1e6:.1f} MB, "  # type: ignore[call-overload]
                  f"{int(r['nat_sent_bytes']) / nat_n / 1e6:.1f} MB each")  # type: ignore[call-overload]
            if r.get("punch"):
                print(f"{'':<10} hole punching: {r['punchable_nodes']} NATed nodes kept their listen port; "
                      f"{r['punch_planned']} NAT<->NAT pairs planned, {r['punched']} punched, "
                      f"{r['punch_fallbacks']} fell back to other parents")
    if args.json:
        nodes: object = args.nodes[0] if len(args.nodes) == 1 else args.nodes
        doc = {"nodes": nodes, "mbytes": args.mbytes, "link_MBps": args.link_MBps, "hub_MBps": args.hub_MBps,
               "chunk_bytes": args.chunk_bytes or "rule", "simulated": bool(args.simulate),
               "results": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    if args.plot:
        plotting.broadcast_figure(rows, args.mode, mbytes=args.mbytes, link_MBps=args.link_MBps, hub_MBps=args.hub_MBps,
                                  simulated=bool(args.simulate), path=args.plot)
    return 0
