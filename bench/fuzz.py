"""``echo2 bench fuzz``: hostile peers against a real training swarm on 127.0.0.1.

A real LocalSwarm (hub + 2 honest node processes, tiny model, copy task) trains while attackers
in this process hit every port the hub and the nodes listen on:

- libp2p control protocols of the hub (admission, work, result, decline, holds, probe): random
  bytes, mutated valid envelopes, envelopes signed by a key other than the stream's peer,
  replayed envelopes, forged results from an admitted attacker, oversized and truncated frames;
- GossipSub announce topic: random, malformed and oversized messages, faster than allowed;
- the hub's policy data plane and probe data plane: garbage before the handshake, a bad
  signature, garbage frames after it, oversized frame headers, truncated frames;
- the status HTTP port: garbage, wrong methods, oversized heads;
- the nodes' libp2p port: raw garbage, unknown protocols;
- one short flood burst beyond every limit (requests, connections, HTTP).

Each attacker is paced (the point is hostile input, not starving a 2-core machine of CPU).
Measured: hub and nodes alive, their RSS over time, learner steps and honest tasks during the
attack, refusals by reason (hub status.json, hub /metrics, what the attackers were told).

The nodes' libp2p listen port is found from /proc (the listening sockets of the node process),
since the node does not publish it in its state file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import struct
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

MiB = 1024 * 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=60.0, help="attack duration (default 60)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nodes", type=int, default=2, help="honest node processes (default 2)")
    parser.add_argument("--startup-timeout", type=float, default=240.0, help="wait this long for honest progress")
    parser.add_argument("--dir", type=Path, default=None, help="keep the swarm's files here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")


# --- process observation (/proc) ------------------------------------------------------------------


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def listen_ports(pid: int) -> set[int]:
    """TCP ports process ``pid`` listens on (its socket inodes matched in /proc/net/tcp*)."""
    inodes: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


# --- the attack -----------------------------------------------------------------------------------


class Fuzz:
    def __init__(self, root: Path, seconds: float, seed: int, hub_pid: int, node_pids: list[int]) -> None:
        self.root = root
        self.seconds = seconds
        self.rng = random.Random(seed)
        self.hub_pid = hub_pid
        self.node_pids = node_pids
        self.sent: Counter[str] = Counter()
        self.saw: Counter[str] = Counter()
        self.rss: dict[str, list[float]] = {"hub": [], **{f"node{i}": [] for i in range(len(node_pids))}}
        self.errors: Counter[str] = Counter()

    # --- targets ------------------------------------------------------------------------------
    def discover(self) -> None:
        hub_dir = self.root / "hub"
        self.hub_addr = (hub_dir / "hub.addrs").read_text().split()[0]
        self.hub_peer = self.hub_addr.rsplit("/p2p/", 1)[1]
        self.hub_libp2p_port = int(self.hub_addr.split("/tcp/")[1].split("/")[0])
        log_text = (hub_dir / "hub.log").read_text(errors="replace")
        m = re.search(r"data plane (\S+):(\d+)", log_text)
        self.hub_data_port = int(m.group(2)) if m else 0
        st = read_json(hub_dir / "status.json") or {}
        m2 = re.search(r":(\d+)/", str(st.get("status_url", "")))
        self.status_port = int(m2.group(1)) if m2 else 0
        others = listen_ports(self.hub_pid) - {self.hub_libp2p_port, self.hub_data_port, self.status_port}
        self.probe_port = min(others) if others else 0
        self.node_addrs: list[str] = []
        self.node_peers: list[str] = []
        for i, pid in enumerate(self.node_pids):
            state = read_json(self.root / f"node{i}" / "node.state.json") or {}
            peer = str(state.get("peer_id", ""))
            self.node_peers.append(peer)
            for port in sorted(listen_ports(pid)):
                self.node_addrs.append(f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer}")

    def honest_tasks(self) -> int:
        total = 0
        for i in range(len(self.node_pids)):
            st = read_json(self.root / f"node{i}" / "node.state.json") or {}
            total += int(st.get("tasks_done", 0) or 0)
        return total

    def hub_step(self) -> int:
        st = read_json(self.root / "hub" / "status.json") or {}
        return int(st.get("step", 0) or 0)

    # --- helpers ------------------------------------------------------------------------------
    async def pace(self, per_s: float) -> None:
        import trio

        await trio.sleep(self.rng.expovariate(per_s))

    def _saw_exc(self, surface: str, exc: BaseException) -> None:
        from echo2.protocol.net.control import RemoteError
        from echo2.protocol.net.dataplane import HandshakeRefused

        if isinstance(exc, RemoteError):
            self.saw[f"{surface}:{exc.code}"] += 1
        elif isinstance(exc, HandshakeRefused):
            self.saw[f"{surface}:handshake.{exc.reason}"] += 1
        else:
            self.saw[f"{surface}:{getattr(exc, 'code', type(exc).__name__)}"] += 1

    def announce(self, ident: Any, peer_id: str | None = None) -> Any:
        from echo2.protocol.messages import Announce

        return Announce(
            peer_id=peer_id or ident.peer_id, software_version="fuzz", accelerator="", accelerator_count=0,
            accelerator_memory_bytes=0, cpu_model="fuzz", cpu_cores=1, ram_bytes=1, free_disk_bytes=1, engine="fuzz",
            engine_version="", tokens_per_s=0.0, rollouts_per_s=0.0, upload_MBps=0.0, download_MBps=0.0,
            price_usd_per_hour=0.0, listen_addrs=[], data_addr="", reachable=False, versions_held=[],
            max_upload_MBps=0.0,
        )

    def valid_envelopes(self, ident: Any) -> list[tuple[str, bytes]]:
        """(protocol, envelope) pairs that are well formed and signed by ``ident``."""
        from echo2.learner_hub.probe_service import PROBE
        from echo2.protocol import envelope, wire
        from echo2.protocol.messages import (
            AdmissionRequest,
            Completion,
            Heartbeat,
            HoldsVersion,
            Result,
            TaskDecline,
        )

        me = ident.peer_id
        h = os.urandom(32)
        comp = Completion(prompt_index=0, token_ids=[1, 2], logprobs=[-0.1, -0.2], finish_reason="stop")
        msgs: list[tuple[str, Any]] = [
            (wire.ADMISSION, AdmissionRequest(peer_id=me, join_token="", announce=self.announce(ident, self.node_peers[0]))),
            (wire.WORK, Heartbeat(peer_id=me, seq=1, versions_held=[0], busy_tasks=0, queue_free=1)),
            (wire.RESULT, Result(task_id="t-fuzz", task_hash=h, node_id=me, version=0, completions=[comp],
                                 started_at=time.time(), gen_seconds=0.1, tokens=2)),
            (wire.DECLINE, TaskDecline(task_id="t-fuzz", task_hash=h, node_id=me, reason_code="x", reason="fuzz")),
            (wire.HOLDS, HoldsVersion(peer_id=me, version=0, seconds=0.1)),
            (PROBE, self.announce(ident)),
        ]
        return [(p, envelope.seal(ident, m)) for p, m in msgs]

    def mutate(self, data: bytes) -> bytes:
        b = bytearray(data)
        op = self.rng.randrange(4)
        if op == 0 and b:
            for _ in range(self.rng.randint(1, 4)):
                b[self.rng.randrange(len(b))] ^= 1 << self.rng.randrange(8)
        elif op == 1:
            b = b[: self.rng.randrange(len(b) + 1)]
        elif op == 2:
            b += os.urandom(self.rng.randint(1, 64))
        elif b:
            i = self.rng.randrange(len(b))
            b[i : i + 1] = os.urandom(self.rng.randint(0, 8))
        return bytes(b)

    async def raw_stream(self, host: Any, peer: str, protocol: str, data: bytes, kind: str) -> None:
        """Write raw bytes on a libp2p stream (e.g. a frame header claiming 4 GiB), then read a bit."""
        import trio
        from libp2p.custom_types import TProtocol
        from libp2p.peer.id import ID

        self.sent[kind] += 1
        with trio.move_on_after(5):
            try:
                stream = await host.libp2p_host.new_stream(ID.from_base58(peer), [TProtocol(protocol)])
            except Exception as exc:
                self.saw[f"control:open_failed:{type(exc).__name__}"] += 1
                return
            try:
                await stream.write(data)
                if kind == "control.truncated_frame":
                    await stream.close()
                reply = await stream.read(4096)
                if len(reply) > 5 and reply[4] == 1:
                    m = re.search(rb"code.([a-z_]+)", reply)
                    self.saw[f"control:{m.group(1).decode() if m else 'error'}"] += 1
                else:
                    self.saw["control:closed_without_reply"] += 1
            except Exception as exc:
                self.saw[f"control:stream:{type(exc).__name__}"] += 1
            finally:
                with trio.move_on_after(1):
                    try:
                        await stream.reset()
                    except Exception:
                        pass

    # --- attackers ----------------------------------------------------------------------------
    async def control_fuzzer(self, rate: float) -> None:
        """Random bytes, mutated envelopes, foreign signers and raw frames at the hub's protocols."""

        from echo2.learner_hub.probe_service import PROBE
        from echo2.protocol import wire
        from echo2.protocol.errors import Echo2Error
        from echo2.protocol.identity import Identity
        from echo2.protocol.net.control import ControlHost

        protocols = [wire.ADMISSION, wire.WORK, wire.RESULT, wire.DECLINE, wire.HOLDS, PROBE]
        async with ControlHost(Identity.generate(), gossip=False, dial_timeout_s=5) as host:
            other = Identity.generate()
            while True:
                await self.pace(rate)
                kind = self.rng.choice(["random", "mutated", "foreign_signer", "oversized", "truncated"])
                proto = self.rng.choice(protocols)
                if kind == "oversized":
                    await self.raw_stream(host, self.hub_peer, proto, struct.pack(">I", 0xFFFFFFF0) + b"x" * 64,
                                          "control.oversized_frame")
                    continue
                if kind == "truncated":
                    await self.raw_stream(host, self.hub_peer, proto, struct.pack(">I", 1000) + os.urandom(10),
                                          "control.truncated_frame")
                    continue
                if kind == "random":
                    payload = os.urandom(self.rng.choice([0, 1, 7, 100, 4096]))
                elif kind == "mutated":
                    proto, env = self.rng.choice(self.valid_envelopes(host.identity))
                    payload = self.mutate(env)
                else:  # signed by a key that is not the stream's peer
                    proto, payload = self.rng.choice(self.valid_envelopes(other))
                self.sent[f"control.{kind}"] += 1
                try:
                    await host.request(self.hub_addr, proto, payload, max_response=wire.MAX_TASK, timeout_s=10)
                    self.saw["control:accepted"] += 1
                except Echo2Error as exc:
                    self._saw_exc("control", exc)

    async def admitted_attacker(self, rate: float) -> None:
        """Gets admitted (open admission), then replays envelopes and forges results."""
        import trio

        from echo2.protocol import envelope, wire
        from echo2.protocol.errors import Echo2Error
        from echo2.protocol.identity import Identity
        from echo2.protocol.messages import AdmissionRequest, Heartbeat, HoldsVersion, Result
        from echo2.protocol.net.control import ControlHost

        ident = Identity.generate()
        async with ControlHost(ident, gossip=False, dial_timeout_s=5) as host:
            async def ask(proto: str, payload: bytes, kind: str) -> None:
                self.sent[kind] += 1
                try:
                    await host.request(self.hub_addr, proto, payload, max_response=wire.MAX_TASK, timeout_s=10)
                    self.saw["control:accepted"] += 1
                except Echo2Error as exc:
                    self._saw_exc("control", exc)

            while True:
                adm = envelope.seal(ident, AdmissionRequest(peer_id=ident.peer_id, join_token="", announce=self.announce(ident)))
                await ask(wire.ADMISSION, adm, "control.admission")
                await ask(wire.ADMISSION, adm, "control.replayed")
                for _ in range(10):
                    await self.pace(rate)
                    choice = self.rng.randrange(3)
                    if choice == 0:
                        holds = envelope.seal(ident, HoldsVersion(peer_id=ident.peer_id, version=10**9, seconds=0.0))
                        await ask(wire.HOLDS, holds, "control.holds_unpublished")
                        await ask(wire.HOLDS, holds, "control.replayed")
                    elif choice == 1:
                        hb = envelope.seal(ident, Heartbeat(peer_id=ident.peer_id, seq=1, versions_held=[], busy_tasks=0, queue_free=0))
                        # the first is a real long poll (up to 5 s); the copy must be refused at once
                        async with trio.open_nursery() as n:
                            n.start_soon(ask, wire.WORK, hb, "control.heartbeat")
                            await trio.sleep(0.2)
                            n.start_soon(ask, wire.WORK, hb, "control.replayed")
                    else:
                        forged = Result(task_id=f"t{self.rng.randrange(10**6)}", task_hash=os.urandom(32),
                                        node_id=self.node_peers[0] or ident.peer_id, version=0, completions=[],
                                        started_at=time.time(), gen_seconds=0.0, tokens=0)
                        await ask(wire.RESULT, envelope.seal(ident, forged), "control.forged_result")

    async def gossip_spammer(self, rate: float) -> None:
        import trio

        from echo2.protocol import envelope
        from echo2.protocol.identity import Identity
        from echo2.protocol.net.control import ANNOUNCE_TOPIC, ControlHost

        ident = Identity.generate()
        async with ControlHost(ident, dial_timeout_s=5) as host:
            await host.connect(self.hub_addr)
            await host.subscribe(ANNOUNCE_TOPIC, self._ignore)
            with trio.move_on_after(5):
                await host.wait_topic_peers(ANNOUNCE_TOPIC, 1, timeout_s=5)
            pubsub = host._require_pubsub()  # bypass our own size check: the point is to send oversize
            while True:
                await self.pace(rate)
                kind = self.rng.choice(["random", "malformed", "oversized", "foreign_announce"])
                if kind == "random":
                    data = os.urandom(self.rng.randint(1, 2048))
                elif kind == "malformed":
                    data = self.mutate(envelope.seal(ident, self.announce(ident)))
                elif kind == "oversized":
                    data = os.urandom(100 * 1024)
                else:
                    data = envelope.seal(Identity.generate(), self.announce(ident))
                self.sent[f"gossip.{kind}"] += 1
                try:
                    await pubsub.publish(ANNOUNCE_TOPIC, data)
                except Exception as exc:
                    self.saw[f"gossip:publish_failed:{type(exc).__name__}"] += 1

    async def _ignore(self, _peer: str, _data: bytes) -> None:
        return None

    async def dataplane_fuzzer(self, port: int, name: str, rate: float) -> None:
        import trio

        from echo2.protocol.errors import Echo2Error
        from echo2.protocol.identity import Identity
        from echo2.protocol.net import dataplane as dp

        addr = f"127.0.0.1:{port}"
        while True:
            await self.pace(rate)
            kind = self.rng.choice(["garbage", "bad_signature", "after_handshake", "slow"])
            self.sent[f"dataplane.{name}.{kind}"] += 1
            try:
                with trio.move_on_after(12):
                    if kind in ("garbage", "bad_signature", "slow"):
                        stream = await trio.open_tcp_stream("127.0.0.1", port)
                        try:
                            if kind == "garbage":
                                await stream.send_all(os.urandom(self.rng.randint(1, 200)))
                            elif kind == "bad_signature":
                                ident = Identity.generate()
                                await stream.send_all(dp._HELLO.pack(dp.HELLO_MAGIC, dp.PROTOCOL_VERSION,
                                                                     ident.public_bytes, os.urandom(32)))
                                await stream.send_all(os.urandom(64))
                            else:
                                await trio.sleep(11)  # say nothing: the handshake must time out
                            data = await stream.receive_some(4096)
                            self.saw[f"dataplane:{'closed' if not data else 'replied'}"] += 1
                        finally:
                            await trio.aclose_forcefully(stream)
                    else:
                        # a real handshake (the policy plane refuses strangers; the probe plane
                        # serves them), then hostile frames
                        conn = await dp.connect(addr, Identity.generate(), self._server_peer(), timeout_s=5)
                        try:
                            sock = conn._stream
                            frame = self.rng.choice([
                                dp.HEADER.pack(dp.FrameType.REQUEST, dp.ZERO_KEY, 2**40),  # oversized
                                dp.HEADER.pack(99, dp.ZERO_KEY, 4) + b"abcd",  # unknown type
                                dp.HEADER.pack(dp.FrameType.REQUEST, dp.ZERO_KEY, 1000) + b"trunc",  # truncated
                                dp.HEADER.pack(dp.FrameType.CHUNK, os.urandom(32), 8) + b"12345678",  # wrong hash
                                dp.HEADER.pack(dp.FrameType.REQUEST, dp.ZERO_KEY, 14) + b"bw-down 999999",
                            ])
                            await sock.send_all(frame)
                            await sock.send_eof()
                            data = await sock.receive_some(4096)
                            self.saw[f"dataplane:{'closed' if not data else 'replied'}"] += 1
                        finally:
                            await conn.abort()
            except Echo2Error as exc:
                self._saw_exc("dataplane", exc)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self.saw[f"dataplane:{type(exc).__name__}"] += 1

    def _server_peer(self) -> str:
        return self.hub_peer

    async def http_fuzzer(self, rate: float) -> None:
        import trio

        requests = [
            b"GET /status.json HTTP/1.1\r\nHost: x\r\n\r\n",
            b"POST /status.json HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello",
            b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n",
            b"\x00\xff garbage \r\n\r\n",
            b"GET /../../etc/passwd HTTP/1.1\r\n\r\n",
            b"GET /metrics HTTP/1.0\r\nX: " + b"y" * 9000 + b"\r\n\r\n",
            b"GET / HTTP/1.1\r\n",  # never finished
        ]
        while True:
            await self.pace(rate)
            req = self.rng.choice(requests)
            self.sent["http.request"] += 1
            try:
                with trio.move_on_after(8):
                    stream = await trio.open_tcp_stream("127.0.0.1", self.status_port)
                    try:
                        await stream.send_all(req)
                        data = await stream.receive_some(64)
                        m = re.match(rb"HTTP/1\.1 (\d{3})", data or b"")
                        self.saw[f"http:{m.group(1).decode() if m else 'no_reply'}"] += 1
                    finally:
                        await trio.aclose_forcefully(stream)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self.saw[f"http:{type(exc).__name__}"] += 1

    async def node_fuzzer(self, rate: float) -> None:
        """The nodes serve no echo2 protocol: raw garbage at their port, unknown protocols, pings."""
        import trio

        from echo2.protocol import wire
        from echo2.protocol.errors import Echo2Error
        from echo2.protocol.identity import Identity
        from echo2.protocol.net.control import ControlHost

        if not self.node_addrs:
            return
        async with ControlHost(Identity.generate(), gossip=False, dial_timeout_s=5) as host:
            while True:
                await self.pace(rate)
                addr = self.rng.choice(self.node_addrs)
                kind = self.rng.choice(["garbage", "unknown_protocol", "ping"])
                self.sent[f"node.{kind}"] += 1
                try:
                    if kind == "garbage":
                        port = int(addr.split("/tcp/")[1].split("/")[0])
                        with trio.move_on_after(5):
                            stream = await trio.open_tcp_stream("127.0.0.1", port)
                            try:
                                await stream.send_all(os.urandom(self.rng.randint(1, 512)))
                                await stream.receive_some(64)
                            finally:
                                await trio.aclose_forcefully(stream)
                    elif kind == "unknown_protocol":
                        await host.request(addr, self.rng.choice([wire.WORK, wire.RESULT]), os.urandom(64),
                                           max_response=1024, timeout_s=5)
                    else:
                        await host.ping(addr, timeout_s=5)
                        self.saw["node:ping_ok"] += 1
                except Echo2Error as exc:
                    self._saw_exc("node", exc)
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    self.saw[f"node:{type(exc).__name__}"] += 1

    async def flood(self, duration_s: float) -> None:
        """One short burst beyond every limit: requests from one peer, data-plane and HTTP connections."""
        import trio

        from echo2.protocol import wire
        from echo2.protocol.errors import Echo2Error
        from echo2.protocol.identity import Identity
        from echo2.protocol.net.control import ControlHost

        async def requests(host: ControlHost) -> None:
            for _ in range(300):
                self.sent["flood.control_request"] += 1
                try:
                    await host.request(self.hub_addr, wire.HOLDS, os.urandom(32), max_response=1024, timeout_s=5)
                except Echo2Error as exc:
                    self._saw_exc("flood", exc)

        async def connections(port: int, n: int, kind: str) -> None:
            streams = []
            try:
                for _ in range(n):
                    self.sent[kind] += 1
                    try:
                        streams.append(await trio.open_tcp_stream("127.0.0.1", port))
                    except OSError as exc:
                        self.saw[f"flood:{type(exc).__name__}"] += 1
                await trio.sleep(duration_s)
            finally:
                for s in streams:
                    await trio.aclose_forcefully(s)

        with trio.move_on_after(duration_s + 10):
            async with ControlHost(Identity.generate(), gossip=False, dial_timeout_s=5) as host:
                await host.connect(self.hub_addr)
                async with trio.open_nursery() as n:
                    for _ in range(4):
                        n.start_soon(requests, host)
                    n.start_soon(connections, self.hub_data_port, 300, "flood.dataplane_connection")
                    n.start_soon(connections, self.probe_port, 60, "flood.probe_connection")
                    n.start_soon(connections, self.status_port, 120, "flood.http_connection")

    async def sampler(self) -> None:
        import trio

        pids = {"hub": self.hub_pid, **{f"node{i}": p for i, p in enumerate(self.node_pids)}}
        while True:
            for name, pid in pids.items():
                v = rss_mb(pid)
                if v is not None:
                    self.rss[name].append(v)
            await trio.sleep(1.0)

    async def run(self) -> None:
        import trio

        async def guarded(fn: Any, *args: Any) -> None:
            # An attacker that breaks (a bug here, not in the target) must not end the run.
            while True:
                try:
                    await fn(*args)
                    return
                except Exception as exc:
                    self.errors[f"{fn.__name__}:{type(exc).__name__}"] += 1
                    await trio.sleep(1.0)

        async with trio.open_nursery() as n:
            n.start_soon(self.sampler)
            n.start_soon(guarded, self.control_fuzzer, 6.0)
            n.start_soon(guarded, self.control_fuzzer, 6.0)
            n.start_soon(guarded, self.admitted_attacker, 2.0)
            n.start_soon(guarded, self.gossip_spammer, 15.0)
            if self.hub_data_port:
                n.start_soon(guarded, self.dataplane_fuzzer, self.hub_data_port, "policy", 3.0)
            if self.probe_port:
                n.start_soon(guarded, self.dataplane_fuzzer, self.probe_port, "probe", 3.0)
            if self.status_port:
                n.start_soon(guarded, self.http_fuzzer, 5.0)
            n.start_soon(guarded, self.node_fuzzer, 3.0)
            await trio.sleep(self.seconds / 2)
            await self.flood(min(5.0, self.seconds / 6))
            await trio.sleep(max(0.0, self.seconds / 2 - min(5.0, self.seconds / 6)))
            n.cancel_scope.cancel()


def scrape_metrics(port: int) -> dict[str, float]:
    """``echo2_results_refused_total{reason=...}`` from the hub's /metrics."""
    import socket

    out: dict[str, float] = {}
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            buf = b""
            while True:
                data = s.recv(65536)
                if not data:
                    break
                buf += data
    except OSError:
        return out
    for m in re.finditer(rb'echo2_results_refused_total\{reason="([^"]+)"\} ([0-9.e+]+)', buf):
        out[m.group(1).decode()] = float(m.group(2))
    return out


_LOG_PATTERNS = [
    (re.compile(r"refused \S+ from \S+: \[([\w.]+)\]"), "{0}"),
    (re.compile(r"data plane full"), "dataplane.too_many_connections"),
    (re.compile(r"data-plane handshakes from \S+ above"), "dataplane.handshake.rate_limited"),
    (re.compile(r"more than \d+ data-plane connections from \d"), "dataplane.too_many_connections.ip"),
    (re.compile(r"data-plane handshake from \S+ timed out"), "dataplane.handshake.timeout"),
    (re.compile(r"data-plane handshake from \S+ refused"), "dataplane.handshake.refused"),
    (re.compile(r"refused frame from \S+: ([\w.]+)"), "dataplane.{0}"),
    (re.compile(r"lines suppressed"), "log_lines_suppressed"),
]


def hub_log_refusals(path: Path) -> dict[str, int]:
    """Refusals the hub logged (its log is thinned under a flood: a lower bound per reason)."""
    out: Counter[str] = Counter()
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    for line in text.splitlines():
        for pat, fmt in _LOG_PATTERNS:
            m = pat.search(line)
            if m:
                out[fmt.format(*m.groups())] += 1
                break
    return dict(sorted(out.items()))


def fuzz_swarm(root: Path, seconds: float, seed: int = 0, n_nodes: int = 2, startup_timeout_s: float = 240.0) -> dict[str, Any]:
    """Start a swarm under ``root``, attack it for ``seconds`` once it makes progress, report."""
    import trio

    from echo2.bench.swarm import LocalSwarm
    from echo2.learner_hub.config import HubConfig

    cfg = HubConfig(steps=1_000_000, prompts_per_step=4, group_size=4, max_new_tokens=4, staleness=2,
                    task="copy", seed=seed, checkpoint_every=50)
    with LocalSwarm(root, cfg, n_nodes, threads=1) as swarm:
        swarm.start()
        assert swarm.hub is not None
        deadline = time.monotonic() + startup_timeout_s
        fz = Fuzz(root, seconds, seed, swarm.hub.pid, [p.pid for p in swarm.nodes])
        while time.monotonic() < deadline:
            if fz.honest_tasks() >= n_nodes and fz.hub_step() >= 1:
                break
            if swarm.hub.poll() is not None:
                raise RuntimeError("hub exited during start-up")
            time.sleep(1.0)
        else:
            raise TimeoutError(f"no honest progress within {startup_timeout_s:g}s")
        fz.discover()
        step0, tasks0 = fz.hub_step(), fz.honest_tasks()
        t0 = time.monotonic()
        trio.run(fz.run)
        attack_s = time.monotonic() - t0
        # progress is read a little after the attack: status.json is written once a second
        time.sleep(2.0)
        step1, tasks1 = fz.hub_step(), fz.honest_tasks()
        hub_alive = swarm.hub.poll() is None
        nodes_alive = [p.poll() is None for p in swarm.nodes]
        status = swarm.status() or {}
        metrics = scrape_metrics(fz.status_port) if fz.status_port else {}
        hub_rss = fz.rss["hub"] or [0.0]
        report: dict[str, Any] = {
            "seconds": round(attack_s, 1),
            "seed": seed,
            "targets": {
                "hub": fz.hub_addr, "hub_data_port": fz.hub_data_port, "probe_data_port": fz.probe_port,
                "status_port": fz.status_port, "node_addrs": fz.node_addrs,
            },
            "attacks_sent": dict(sorted(fz.sent.items())),
            "attacks_sent_total": sum(fz.sent.values()),
            "refusals_by_reason": {
                "hub_status": status.get("refused_by_reason", {}),
                "hub_metrics": metrics,
                "hub_log": hub_log_refusals(root / "hub" / "hub.log"),
                "attackers_saw": dict(sorted(fz.saw.items())),
            },
            "attacker_errors": dict(fz.errors),
            "hub_alive": hub_alive,
            "nodes_alive": nodes_alive,
            "hub_rss_max_MB": round(max(hub_rss), 1),
            "hub_rss_growth_MB": round(hub_rss[-1] - hub_rss[0], 1),
            "node_rss_max_MB": [round(max(fz.rss[f"node{i}"] or [0.0]), 1) for i in range(n_nodes)],
            "node_rss_growth_MB": [
                round((fz.rss[f"node{i}"] or [0.0])[-1] - (fz.rss[f"node{i}"] or [0.0])[0], 1) for i in range(n_nodes)
            ],
            "steps_during_attack": step1 - step0,
            "honest_tasks_during_attack": tasks1 - tasks0,
        }
        return report


def run(args: argparse.Namespace) -> int:
    root = args.dir or Path(tempfile.mkdtemp(prefix="echo2-fuzz-"))
    report = fuzz_swarm(Path(root), args.seconds, args.seed, args.nodes, args.startup_timeout)
    print(f"echo2 fuzz: {report['seconds']} s of attack on hub + {args.nodes} nodes ({root})")
    print(f"  attacks sent        {report['attacks_sent_total']}")
    for k, v in report["attacks_sent"].items():
        print(f"    {k:36s} {v}")
    print("  hub refusals (status.json)")
    for k, v in sorted(report["refusals_by_reason"]["hub_status"].items()):
        print(f"    {k:36s} {v}")
    print("  attackers were told")
    for k, v in report["refusals_by_reason"]["attackers_saw"].items():
        print(f"    {k:36s} {v}")
    print(f"  hub alive {report['hub_alive']}, nodes alive {report['nodes_alive']}")
    print(f"  hub RSS max {report['hub_rss_max_MB']} MB, growth {report['hub_rss_growth_MB']} MB")
    print(f"  learner steps during attack {report['steps_during_attack']}, "
          f"honest tasks during attack {report['honest_tasks_during_attack']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    ok = report["hub_alive"] and all(report["nodes_alive"])
    return 0 if ok else 1
