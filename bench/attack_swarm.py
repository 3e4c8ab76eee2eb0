"""The live swarm ``echo2 bench attack`` measures: a hub and honest nodes on 127.0.0.1, what is
read from them (honest accepted rollouts, RSS, liveness, refusals) and how they are brought back
when an attack killed or tainted one.

Process launching is :class:`echo2.bench.swarm.LocalSwarm`; ports, RSS, JSON files and the
hub's refusals are read with :mod:`echo2.bench.fuzz_observe` and the target discovery of
:class:`echo2.bench.fuzz_attacks.Fuzz`. The hub listens on a fixed port so that a restarted hub
keeps the address the nodes dial.

Attackers dial from 127.0.0.2 (:func:`attacker_source`): loopback is one machine, but per-IP
limits of a fixed hub must be able to tell the attacker's IP from the honest one (127.0.0.1),
as they would on a real network.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from echo2.bench.fuzz_attacks import Fuzz
from echo2.bench.fuzz_observe import hub_log_refusals, listen_ports, read_json, rss_mb, scrape_metrics

ATTACKER_IP = "127.0.0.2"
_SOURCE: contextvars.ContextVar[str | None] = contextvars.ContextVar("echo2_attack_source", default=None)
_patched = False
# a node's log line saying the hub (or a peer) refused or failed it, with the error code: "[busy]"
_NODE_REFUSAL = re.compile(r"^.*(?:refused|failed|not delivered|deferred).*?\[([\w.]+)\]", re.M)


def _patch_dials() -> None:
    """Make trio TCP dials of this (bench) process leave from ``_SOURCE`` when it is set."""
    global _patched
    if _patched:
        return
    import trio

    original = trio.open_tcp_stream

    async def open_tcp_stream(host: Any, port: int, **kw: Any) -> Any:
        src = _SOURCE.get()
        if src is not None and "local_address" not in kw:
            kw["local_address"] = src
        return await original(host, port, **kw)

    trio.open_tcp_stream = open_tcp_stream  # type: ignore[assignment]
    _patched = True


@contextlib.contextmanager
def attacker_source(ip: str | None = ATTACKER_IP) -> Iterator[None]:
    """Within this block (and the trio tasks it starts) this process dials from ``ip``."""
    _patch_dials()
    token = _SOURCE.set(ip)
    try:
        yield
    finally:
        _SOURCE.reset(token)


def raw_connect(port: int, src: str | None = ATTACKER_IP, timeout_s: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    if src:
        s.bind((src, 0))
    s.connect(("127.0.0.1", port))
    return s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Harness:
    """A hub and ``n_nodes`` honest nodes, kept running across attacks."""

    def __init__(self, root: Path, n_nodes: int = 2, seed: int = 0, threads: int = 1) -> None:
        self.base = root
        self.n_nodes = n_nodes
        self.seed = seed
        self.threads = threads
        self.fz: Fuzz | None = None
        self.restarts: list[str] = []
        self.rebuilds = 0
        self._new_swarm(root)

    def _new_swarm(self, root: Path) -> None:
        from echo2.bench.swarm import LocalSwarm
        from echo2.learner_hub.config import HubConfig

        self.root = root
        seed, n_nodes, threads = self.seed, self.n_nodes, self.threads
        # pipelined, with a hub uplink (20 MB/s) too small to serve every node itself: the planner
        # chooses parents among the nodes (A9 and A10 need a plan to be in);
        # fixed control and data ports: a restarted hub keeps the addresses the nodes dial
        cfg = HubConfig(steps=1_000_000, prompts_per_step=4, group_size=4, max_new_tokens=4, staleness=2,
                        task="copy", seed=seed, checkpoint_every=20, broadcast="pipelined",
                        listen_port=free_port(), data_port=free_port(), task_deadline_s=10.0, upload_limit_MBps=20.0)
        self.swarm = LocalSwarm(root, cfg, n_nodes, threads=threads)

    def rebuild(self, timeout_s: float = 240.0) -> None:
        """A new swarm (new hub directory and key, new nodes) beside the old one: for a hub an
        attack left unable to start again (e.g. a poisoned database it resumes from)."""
        self.swarm.stop()
        self.rebuilds += 1
        self._new_swarm(self.base / f"swarm{self.rebuilds}")
        self.restarts.append("swarm")
        self.start(timeout_s)

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout_s: float = 240.0) -> None:
        self.swarm.start()
        self.wait_progress(timeout_s)

    def wait_progress(self, timeout_s: float) -> None:
        """Until every honest node has a result accepted since now (and the hub reports status)."""
        deadline = time.monotonic() + timeout_s
        start = {p: self.node_rollouts(p) or 0 for p in self.honest_peers()}
        while time.monotonic() < deadline:
            peers = self.honest_peers()
            if len(peers) == self.n_nodes and all((self.node_rollouts(p) or 0) > start.get(p, 0) for p in peers):
                break
            hub = self.swarm.hub
            if hub is None or hub.poll() is not None:
                raise RuntimeError(f"hub exited during start-up; see {self.root / 'hub' / 'hub.log'}")
            time.sleep(0.5)
        else:
            raise TimeoutError(f"no honest progress within {timeout_s:g}s ({self.root})")
        self.discover()

    def discover(self) -> None:
        assert self.swarm.hub is not None
        fz = Fuzz(self.root, 0.0, 0, self.swarm.hub.pid, [p.pid for p in self.swarm.nodes])
        fz.discover()
        self.fz = fz
        self.node_data_addrs: list[str] = []
        for i, p in enumerate(self.swarm.nodes):
            st = read_json(self.root / f"node{i}" / "node.state.json") or {}
            libp2p = {int(m) for a in st.get("addrs", []) for m in re.findall(r"/tcp/(\d+)", str(a))}
            data = sorted(listen_ports(p.pid) - libp2p)
            self.node_data_addrs.append(f"127.0.0.1:{data[0]}" if data else "")

    def stop(self) -> None:
        self.swarm.stop()

    def dead(self) -> list[str]:
        out = []
        if self.swarm.hub is None or self.swarm.hub.poll() is not None:
            out.append("hub")
        out += [f"node{i}" for i, p in enumerate(self.swarm.nodes[: self.n_nodes]) if p.poll() is not None]
        return out

    def heal(self, restart_nodes: bool = False, timeout_s: float = 180.0) -> list[str]:
        """Restart what died (and, if asked, every honest node with a fresh data directory: an
        attack may have left a node holding something hostile); wait for honest progress."""
        redo = self.dead()
        if restart_nodes:
            redo += [f"node{i}" for i in range(self.n_nodes) if f"node{i}" not in redo]
        if not redo:
            return []
        if "hub" in redo:
            self.swarm.kill_hub()
            try:
                self.swarm.start_hub()
            except (RuntimeError, TimeoutError):
                self.rebuild()
                return ["swarm"]
        for i in range(self.n_nodes):
            if f"node{i}" in redo:
                self.swarm.kill_node(i)
                d = self.root / f"node{i}"
                if d.exists():
                    d.rename(self.root / f"node{i}.{int(time.time() * 1000)}")
                p = self.swarm.start_node(i)
                self.swarm.nodes.pop()
                self.swarm.nodes[i] = p
        self.restarts.extend(redo)
        try:
            self.wait_progress(timeout_s)
        except (RuntimeError, TimeoutError):
            if "hub" not in redo:
                raise
            self.rebuild()
            return ["swarm"]
        return redo

    # --- readings ----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return self.swarm.status() or {}

    def honest_peers(self) -> list[str]:
        out = []
        for i in range(self.n_nodes):
            st = read_json(self.root / f"node{i}" / "node.state.json") or {}
            if st.get("peer_id"):
                out.append(str(st["peer_id"]))
        return out

    def node_rollouts(self, peer: str, status: dict[str, Any] | None = None) -> int | None:
        for n in (status or self.status()).get("nodes", []):
            if n.get("peer_id") == peer:
                return int(n.get("rollouts", 0))
        return None

    def honest_rollouts(self) -> int | None:
        """Rollouts the hub accepted from the honest nodes (None while it writes no status)."""
        st = self.status()
        if not st:
            return None
        peers = set(self.honest_peers())
        return sum(int(n.get("rollouts", 0)) for n in st.get("nodes", []) if n.get("peer_id") in peers)

    def rss(self) -> tuple[float | None, list[float | None]]:
        hub = self.swarm.hub
        return (rss_mb(hub.pid) if hub else None), [rss_mb(p.pid) for p in self.swarm.nodes[: self.n_nodes]]

    def node_log(self, i: int) -> str:
        try:
            return (self.root / f"node{i}" / "node.log").read_text(errors="replace")
        except OSError:
            return ""

    def refusals(self) -> dict[str, dict[str, float]]:
        """Every refusal counter the hub exposes (status.json, /metrics, its log) and what the
        honest nodes' logs say the hub refused them."""
        st = self.status()
        fz = self.fz
        nodes: dict[str, float] = {}
        for i in range(self.n_nodes):
            for m in _NODE_REFUSAL.finditer(self.node_log(i)):
                key = f"node{i}.{m.group(1)}"
                nodes[key] = nodes.get(key, 0) + 1
        return {
            "hub_status": {k: float(v) for k, v in st.get("refused_by_reason", {}).items()},
            "hub_metrics": scrape_metrics(fz.status_port) if fz and fz.status_port else {},
            "hub_log": {k: float(v) for k, v in hub_log_refusals(self.root / "hub" / "hub.log").items()},
            "honest_nodes_log": nodes,
        }
