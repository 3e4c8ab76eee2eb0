"""Attacks on the hub by peers with no admission (A1, A2, A3, A11, A12), as an attacker with one
machine would run them: echo2's own ControlHost, data plane and envelopes, or raw sockets, all
dialling from the attacker's IP (:data:`echo2.bench.attack_swarm.ATTACKER_IP`)."""

from __future__ import annotations

import os
import struct
import time
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio

from echo2.bench.attack_common import (
    HonestProbe,
    Responsiveness,
    RssPeak,
    admit,
    codes,
    control_host,
    stranger_connect,
)
from echo2.bench.attack_swarm import attacker_source, raw_connect

if TYPE_CHECKING:
    from echo2.bench.attack import Ctx, Effect

MiB = 1024 * 1024


def _node_busy_lines(ctx: Ctx) -> int:
    return sum(codes(ctx.node_log_since(i), "[busy]") for i in range(ctx.h.n_nodes))


# --- A1 -------------------------------------------------------------------------------------------


async def a1_inflight_reserve(ctx: Ctx) -> Effect:
    """Twelve streams announce 64 MiB bodies, then trickle a byte every 2 s; each is reopened every
    30 s (or when the hub drops it). Effect: honest requests answered ``busy``."""
    from libp2p.custom_types import TProtocol
    from libp2p.peer.id import ID

    from echo2.protocol import wire

    fz = ctx.fz
    stats: Counter[str] = Counter()
    open_now = [0]

    async def holder(host: Any) -> None:
        announce = wire.MAX_RESULT  # halved after each refusal: the largest the hub will take
        while True:
            if not host.is_connected(fz.hub_peer):
                try:
                    await host.connect(fz.hub_addr)
                except Exception as exc:
                    stats[f"connect_failed:{type(exc).__name__}"] += 1
                    await trio.sleep(1.0)
                    continue
            try:
                stream = await host.libp2p_host.new_stream(ID.from_base58(fz.hub_peer), [TProtocol(wire.RESULT)])
            except Exception as exc:
                stats[f"open_failed:{type(exc).__name__}"] += 1
                await trio.sleep(1.0)
                continue
            try:
                await stream.write(struct.pack(">I", announce))
                reply = b""
                with trio.move_on_after(0.5):  # a refusal (e.g. busy) comes back at once
                    reply = await stream.read(256)
                if reply:
                    stats["stream_refused"] += 1
                    announce = max(64 * 1024, announce // 2)
                    await trio.sleep(0.2)
                    continue
                stats[f"announced_{announce}"] += 1
                stats["streams_opened"] += 1
                open_now[0] += 1
                try:
                    t_open = trio.current_time()
                    while trio.current_time() - t_open < 30:
                        await trio.sleep(2.0)
                        await stream.write(b"\0")
                        stats["trickled_bytes"] += 1
                finally:
                    open_now[0] -= 1
            except Exception as exc:
                stats[f"stream_ended:{type(exc).__name__}"] += 1
            finally:
                with trio.move_on_after(1):
                    try:
                        await stream.reset()
                    except Exception:
                        pass

    probe = HonestProbe(fz.hub_addr)
    async with trio.open_nursery() as n:
        with attacker_source():
            # six throwaway identities, two streams each: eight fill the budget exactly, the others
            # retry until they hold a reservation and keep it full while one is being reopened
            for _ in range(6):
                host = await n.start(_host_task)
                for _ in range(2):
                    n.start_soon(holder, host)
        with trio.move_on_after(5):
            while open_now[0] < 12:
                await trio.sleep(0.1)
        n.start_soon(probe.run)
        await ctx.window()
        n.cancel_scope.cancel()
    busy_lines = _node_busy_lines(ctx)
    effect = {
        "honest_admissions_busy": probe.outcomes["busy"], "honest_admissions": dict(probe.outcomes),
        "honest_node_busy_lines": busy_lines, "attacker": dict(stats),
    }
    if stats["streams_opened"] == 0 and stats["stream_refused"] == 0:
        return effect, None  # the attack never got going: nothing was measured as prevented
    return effect, probe.outcomes["busy"] == 0 and busy_lines == 0 and probe.outcomes["admitted"] > 0


async def _host_task(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    async with control_host() as host:
        task_status.started(host)
        await trio.sleep_forever()


# --- A2 -------------------------------------------------------------------------------------------


def bad_signature_result(ident: Any, target_bytes: int) -> bytes:
    """An envelope of about ``target_bytes`` for the result protocol whose signature is wrong and
    whose payload is millions of empty maps: cheap to send, dear to decode (a verifier that
    checks the signature over the raw bytes first never decodes it)."""
    from echo2.protocol import canonical, envelope
    from echo2.protocol.messages import Result

    res = Result(task_id="t-attack", task_hash=os.urandom(32), node_id=ident.peer_id, version=0, completions=[],
                 started_at=time.time(), gen_seconds=1.0, tokens=0)
    env = canonical.decode(envelope.seal(ident, res, ttl_s=300), max_size=1 << 30)
    env["d"] = "echo2/attack/1.0.0"
    env["p"] = canonical.encode([{}] * max(1, target_bytes - 200))
    sig = bytearray(env["s"])
    sig[0] ^= 0xFF
    env["s"] = bytes(sig)
    return canonical.encode(env)


def big_requests() -> list[bytes]:
    """REQUEST frame payloads just under 1 MiB: a huge ``get`` and a huge ``have``."""
    from echo2.protocol.messages import ChunkHave, ChunkRequest
    from echo2.protocol.wire import REQ_GET, REQ_HAVE, encode_request

    get = encode_request(REQ_GET, m=ChunkRequest(version=1, indices=list(range(200_000))).to_wire())
    have = encode_request(REQ_HAVE, m=ChunkHave(peer_id="x", version=1, have=b"\xff" * (1000 * 1000)).to_wire())
    return [p for p in (get, have) if len(p) <= 1024 * 1024]


async def a2_decode_before_verify(ctx: Ctx) -> Effect:
    """4 MB Result frames with a bad signature to the hub's result protocol; 1 MiB REQUEST frames
    to a node's data plane. Effect: hub and node RSS, hub loop block (status RTT), node loop lag."""
    from echo2.protocol import wire
    from echo2.protocol.errors import Echo2Error
    from echo2.protocol.identity import Identity

    fz, h = ctx.fz, ctx.h
    sent: Counter[str] = Counter()
    saw: Counter[str] = Counter()
    resp = Responsiveness(fz.status_port)
    assert h.swarm.hub is not None
    hub_peak = RssPeak(h.swarm.hub.pid)
    node_peak = RssPeak(h.swarm.nodes[0].pid)
    node0_lag0 = _node_lag(ctx, 0)

    attacker = Identity.generate()
    frame = await trio.to_thread.run_sync(bad_signature_result, attacker, 4_000_000)
    sent["hub_frame_bytes"] = len(frame)

    async def hub_frames() -> None:
        async with control_host(attacker) as host:
            while True:
                sent["hub_bad_signature_frames"] += 1
                try:
                    await host.request(fz.hub_addr, wire.RESULT, frame, max_response=4096, timeout_s=30)
                    saw["hub:accepted"] += 1
                except Echo2Error as exc:
                    saw[f"hub:{getattr(exc, 'code', type(exc).__name__)}"] += 1
                await trio.sleep(0.5)

    payloads = await trio.to_thread.run_sync(big_requests)

    async def node_frames() -> None:
        addr, peer = h.node_data_addrs[0], fz.node_peers[0]
        while True:
            conn = await stranger_connect(addr, peer, saw, "node:")
            if conn is None:
                continue
            try:
                for p in payloads * 8:
                    await conn.send_request(p)
                    sent["node_request_frames"] += 1
                await trio.sleep(0.5)
            except Exception as exc:
                saw[f"node:send:{type(exc).__name__}"] += 1
            finally:
                await conn.abort()

    async with trio.open_nursery() as n:
        n.start_soon(resp.run)
        n.start_soon(hub_peak.run)
        n.start_soon(node_peak.run)
        with attacker_source():
            n.start_soon(hub_frames)
            if h.node_data_addrs and h.node_data_addrs[0]:
                n.start_soon(node_frames)
        await ctx.window()
        n.cancel_scope.cancel()
    node_lag = _node_lag(ctx, 0)
    effect = {
        "hub_rss_peak_growth_mib": round(hub_peak.peak, 1), "node_rss_peak_growth_mib": round(node_peak.peak, 1),
        "hub_status_rtt_max_ms": resp.max_ms(), "hub_status_failures": resp.failures,
        "node_loop_lag_max_ms": node_lag, "node_loop_lag_max_ms_before": node0_lag0,
        "sent": dict(sent), "saw": dict(saw),
    }
    grew_lag = node_lag is not None and node_lag > max(1000.0, node0_lag0 or 0.0)
    prevented = (hub_peak.peak <= 64 and node_peak.peak <= 64 and resp.max_ms() < 1000 and resp.failures == 0
                 and not grew_lag)
    if sum(v for k, v in saw.items() if k.startswith("hub:")) == 0:
        return effect, None if resp.max_ms() < 1000 else False  # no frame was answered within the window
    return effect, prevented


def _node_lag(ctx: Ctx, i: int) -> float | None:
    from echo2.bench.fuzz_observe import read_json

    st = read_json(ctx.h.root / f"node{i}" / "node.state.json") or {}
    v = st.get("loop_lag_max_ms")
    return float(v) if isinstance(v, (int, float)) else None


# --- A3 -------------------------------------------------------------------------------------------


def replay_guards(status: dict[str, Any]) -> dict[str, Any]:
    """Replay-guard figures the hub publishes in status.json, if any (keys naming ``replay``)."""
    return {k: v for k, v in status.items() if "replay" in k.lower()}


async def a3_replay_flood(ctx: Ctx) -> Effect:
    """Admission requests from throwaway keys, each key sending as fast as the hub lets it (every
    answered request left a nonce in a replay guard). Effect: honest messages refused as
    replay/full; and how fast the flood fills the guard."""
    from echo2.protocol.envelope import ReplayGuard
    from echo2.protocol.errors import Echo2Error

    fz, h = ctx.fz, ctx.h
    outcomes: Counter[str] = Counter()
    keys_admitted: set[str] = set()
    guards0 = replay_guards(h.status())

    async def flooder() -> None:
        while True:
            async with control_host() as host:
                for _ in range(200):  # a new key every 200 requests
                    try:
                        d = await admit(host, fz.hub_addr)
                        outcomes["admitted" if d.admitted else "refused"] += 1
                        if d.admitted:
                            keys_admitted.add(host.peer_id)
                    except Echo2Error as exc:
                        outcomes[_a3_outcome(exc)] += 1

    probe = HonestProbe(fz.hub_addr)
    async with trio.open_nursery() as n:
        with attacker_source():
            for _ in range(8):
                n.start_soon(flooder)
        n.start_soon(probe.run)
        await ctx.window()
        n.cancel_scope.cancel()
    guards1 = replay_guards(h.status())
    answered = sum(v for k, v in outcomes.items() if k in ("admitted", "refused"))
    per_s = answered / ctx.seconds
    capacity = ReplayGuard().max_entries
    honest_replay = sum(codes(ctx.node_log_since(i), "[replay]", "replay cache full") for i in range(h.n_nodes))
    honest_replay += sum(v for k, v in probe.outcomes.items() if "replay" in k)
    effect: dict[str, Any] = {
        "stranger_requests_answered": answered, "stranger_outcomes": dict(outcomes),
        "answered_per_s": round(per_s, 1), "shared_guard_capacity": capacity,
        # the flood's throwaway keys the hub admitted (open admission): what its per-address bound caps
        "new_keys_admitted": len(keys_admitted), "new_keys_admitted_per_s": round(len(keys_admitted) / ctx.seconds, 2),
        "projected_fill_s": round(capacity / per_s, 1) if per_s > 0 else None,
        "honest_refused_replay": honest_replay, "honest_admissions": dict(probe.outcomes),
        "hub_replay_guards": {"before": guards0, "after": guards1},
    }
    if not guards1:
        effect["note"] = ("the hub publishes no replay-guard figures: the flood cannot be shown to stay out of the "
                          "guard honest peers use (needs status.json 'replay_guards': {name: {entries, max_entries}})")
        return effect, False if per_s > 0 else None
    honest_guard_growth = _guard_growth(guards0, guards1, lambda name: "stranger" not in name and "unadmitted" not in name)
    stranger_guard_growth = _guard_growth(guards0, guards1, lambda name: "stranger" in name or "unadmitted" in name)
    effect["honest_guard_growth"] = honest_guard_growth  # the honest peers' own traffic: reported, not judged
    effect["stranger_guard_growth"] = stranger_guard_growth
    return effect, a3_prevented(outcomes, guards1, stranger_guard_growth, honest_replay)


#: What the hub answers a request its per-IP admission bucket refused: refused before the envelope
#: is opened, so it leaves no nonce in any guard (hub.on_admission).
A3_RATE_LIMITED = "too many admission requests"


def _a3_outcome(exc: Exception) -> str:
    if A3_RATE_LIMITED in str(exc):
        return "rate_limited"
    return str(getattr(exc, "code", type(exc).__name__))


def a3_prevented(outcomes: Mapping[str, int], guards1: dict[str, Any], stranger_growth: float, honest_replay: int) -> bool:
    """A3's verdict. Prevented: no honest message was refused as a replay, and the flood's nonces
    went to the strangers' own pool: it grew by at least half of the flood's requests that reached
    a guard (those the per-IP bucket refused never did), or it is full and evicting (bounded by
    design). The honest pool grows with the honest peers' own traffic whatever the flood does, so
    its growth is no evidence either way: the guards are separate objects (hub.py), and a flood
    nonce in the honest pool would show as an honest refusal once it filled, which is counted."""
    reached = sum(v for k, v in outcomes.items() if k != "rate_limited" and k not in _A3_NO_REQUEST)
    full = any(isinstance(v, dict) and ("stranger" in k or "unadmitted" in k) and v.get("entries", 0) >= v.get("max_entries", 1)
               for top in guards1.values() if isinstance(top, dict) for k, v in top.items())
    return honest_replay == 0 and (full or stranger_growth >= reached / 2)


#: Flood outcomes that mean no request reached the hub's handler (the connection failed first; a
#: connection past its address's allowance is closed before or right after Noise: "handshake").
_A3_NO_REQUEST = frozenset({"transport", "handshake", "timeout", "TooSlowError", "ConnectionError", "OSError"})


def _guard_growth(g0: dict[str, Any], g1: dict[str, Any], pick: Any) -> float:
    def entries(g: dict[str, Any]) -> dict[str, float]:
        out: dict[str, float] = {}
        for top in g.values():
            if isinstance(top, dict):
                for name, v in top.items():
                    if isinstance(v, dict) and isinstance(v.get("entries"), (int, float)):
                        out[str(name)] = float(v["entries"])
                    elif isinstance(v, (int, float)):
                        out[str(name)] = float(v)
        return out

    e0, e1 = entries(g0), entries(g1)
    return sum(max(0.0, v - e0.get(k, 0.0)) for k, v in e1.items() if pick(k))


# --- A11 ------------------------------------------------------------------------------------------


async def a11_connection_flood(ctx: Ctx) -> Effect:
    """From one IP: 600 TCP connections held open at the hub's control port, and admission
    requests from throwaway keys draining the admission bucket. Effect: honest admissions (from
    another IP) refused or timed out."""
    from echo2.protocol.errors import Echo2Error

    fz = ctx.fz
    socks: list[Any] = []
    flood: Counter[str] = Counter()
    drain: Counter[str] = Counter()

    def open_many(n: int) -> None:
        for _ in range(n):
            try:
                socks.append(raw_connect(fz.hub_libp2p_port, timeout_s=2))
                flood["connected"] += 1
            except OSError as exc:
                flood[f"refused:{type(exc).__name__}"] += 1

    async def drainer() -> None:
        while True:
            try:
                async with control_host() as host:
                    for _ in range(100):
                        try:
                            d = await admit(host, fz.hub_addr)
                            drain["admitted" if d.admitted else "refused"] += 1
                        except Echo2Error as exc:
                            drain[str(getattr(exc, "code", type(exc).__name__))] += 1
            except Echo2Error as exc:
                drain[f"host:{type(exc).__name__}"] += 1
                await trio.sleep(0.5)

    probe = HonestProbe(fz.hub_addr)
    try:
        await trio.to_thread.run_sync(open_many, 600)
        async with trio.open_nursery() as n:
            with attacker_source():
                for _ in range(6):
                    n.start_soon(drainer)
            n.start_soon(probe.run)
            await ctx.window()
            n.cancel_scope.cancel()
    finally:
        for s in socks:
            s.close()
    effect = {
        "honest_admissions": dict(probe.outcomes), "honest_admission_failures": probe.failed(),
        "honest_admission_latency_max_s": max(probe.latencies, default=None),
        "flood_connections": dict(flood), "drain": dict(drain),
    }
    return effect, probe.tried() >= 3 and probe.failed() == 0


# --- A12 ------------------------------------------------------------------------------------------


async def a12_probe_sink(ctx: Ctx) -> Effect:
    """A stranger (never admitted, never probed on the control plane) asks the hub's probe data
    plane for ``bw-down`` transfers over and over. Effect: bytes served to the stranger."""
    from echo2.protocol.dataframe import FrameType
    from echo2.protocol.errors import Echo2Error
    from echo2.protocol.identity import Identity
    from echo2.protocol.net.dataplane import connect

    fz = ctx.fz
    got = [0]
    saw: Counter[str] = Counter()

    async def sink() -> None:
        while True:
            try:
                conn = await connect(f"127.0.0.1:{fz.probe_port}", Identity.generate(), fz.hub_peer, timeout_s=5)
            except Echo2Error as exc:
                saw[f"connect:{getattr(exc, 'reason', getattr(exc, 'code', type(exc).__name__))}"] += 1
                await trio.sleep(0.5)
                continue
            try:
                await conn.send_request(b"bw-down 67108864")
                while True:
                    f = await conn.receive(timeout_s=10)
                    if f.type is FrameType.CHUNK:
                        got[0] += len(f.payload)
                    elif f.type is FrameType.REQUEST:
                        saw["transfer_done"] += 1
                        await conn.send_request(b"bw-down 67108864")
                    else:
                        saw[f"frame:{f.type.name}"] += 1
                        break
            except Exception as exc:
                saw[f"ended:{getattr(exc, 'code', type(exc).__name__)}"] += 1
            finally:
                await conn.abort()
            await trio.sleep(0.1)

    async with trio.open_nursery() as n:
        with attacker_source():
            for _ in range(4):
                n.start_soon(sink)
        await ctx.window()
        n.cancel_scope.cancel()
    effect = {"bytes_served_to_stranger": got[0], "served_MBps": round(got[0] / 1e6 / ctx.seconds, 1), "saw": dict(saw)}
    return effect, got[0] <= MiB
