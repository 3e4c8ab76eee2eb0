"""The attackers of ``echo2 bench fuzz``: paced hostile peers hitting every port the hub and the
nodes listen on (libp2p control protocols, GossipSub, data planes, status HTTP), then one flood."""

from __future__ import annotations

import os
import random
import re
import struct
import time
from collections import Counter
from pathlib import Path
from typing import Any

from echo2.bench.fuzz_observe import listen_ports, read_json, rss_mb


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
        from echo2.protocol.framing import RemoteError
        from echo2.protocol.handshake import HandshakeRefused

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

        from echo2.protocol import dataframe as dp
        from echo2.protocol.errors import Echo2Error
        from echo2.protocol.handshake import encode_hello
        from echo2.protocol.identity import Identity
        from echo2.protocol.net.dataplane import connect

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
                                await stream.send_all(encode_hello(ident.public_bytes, os.urandom(32)))
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
                        conn = await connect(addr, Identity.generate(), self._server_peer(), timeout_s=5)
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
            b"GET /status.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
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
