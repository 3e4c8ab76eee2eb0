"""A node measures itself: rollout throughput on the current policy, bandwidth to the hub,
reachability from the hub and clock skew against it (the figures its Announce carries).

Throughput is measured locally (blocking, run it through ``trio.to_thread.run_sync``); the hub
still times every node itself (BRIEF §6: measured, not claimed). Bandwidth and reachability
need the hub's probe responder (``echo2.learner_hub.probe_service``, protocol ``/echo2/probe/1.0.0``
and a data-plane bandwidth responder); the wire forms are repeated here because ``node`` and
``learner_hub`` never import each other. The bandwidth responder authenticates us by the
data-plane handshake (our node key) and serves admitted nodes only, within a byte budget per
node: a node measures once admitted, and what the hub timed there (not what we announce) is the
upload its broadcast planner uses.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import trio

from echo2.protocol import canonical, envelope
from echo2.protocol.dataframe import FrameType, parse_error
from echo2.protocol.errors import DecodeError, Echo2Error, HandshakeError, MeaningError, SchemaError, Timeout
from echo2.protocol.identity import Identity
from echo2.protocol.messages import (
    Announce,
    ProbeReply,
)
from echo2.protocol.net import dataplane
from echo2.protocol.net.connection import DataConnection, send_filler
from echo2.protocol.wire import PROBE

log = logging.getLogger(__name__)

PROBE_TTL_S = 3600.0
MAX_PROBE_REPLY = 8 * 1024
MiB = 1024 * 1024
MB = 1_000_000

FIXED_TEXTS = (
    "Copy the second digit: 4 7 1",
    "Reverse: 3 9 2",
    "What is 12 plus 30?",
    "Name a colour of the sky.",
    "Count to five:",
    "The quick brown fox",
    "Translate 'bonjour' to English.",
    "2 + 2 =",
)


# --- rollout throughput -------------------------------------------------------------------------


@dataclass(frozen=True)
class Throughput:
    tokens_per_s: float
    rollouts_per_s: float
    tokens: int
    rollouts: int
    seconds: float
    calls: int


def fixed_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """``n`` fixed prompts (token ids) from a tokenizer handle; the same on every node."""
    out: list[list[int]] = []
    for i in range(n):
        text = FIXED_TEXTS[i % len(FIXED_TEXTS)] + ("" if i < len(FIXED_TEXTS) else f" ({i})")
        ids = tokenizer.encode(text, add_bos=True)
        out.append(ids or [tokenizer.eos_id])
    return out


def measure_throughput(
    engine: Any,
    *,
    prompts: list[list[int]] | None = None,
    n_prompts: int = 8,
    group_size: int = 4,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    budget_s: float = 5.0,
    max_calls: int = 20,
) -> Throughput:
    """Tokens/s and rollouts/s of ``engine`` on the policy it holds (blocking).

    Calls ``generate`` on fixed prompts until ``budget_s`` is spent (at least once, at most
    ``max_calls``); the first call also pays warm-up, which a short budget keeps honest rather
    than flattering. Raises the engine's error when it holds no policy version.
    """
    if prompts is None:
        tok = getattr(engine, "tokenizer", None)
        if tok is None:
            raise MeaningError("engine holds no policy version (no tokenizer): load one first")
        prompts = fixed_prompts(tok, n_prompts)
    tokens = rollouts = calls = 0
    t0 = time.perf_counter()
    while True:
        comps = engine.generate(prompts, group_size, max_new_tokens, temperature, top_p, seed + calls)
        calls += 1
        tokens += sum(len(c.token_ids) for c in comps)
        rollouts += len(comps)
        elapsed = time.perf_counter() - t0
        if elapsed >= budget_s or calls >= max_calls:
            break
    return Throughput(
        tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0,
        rollouts_per_s=rollouts / elapsed if elapsed > 0 else 0.0,
        tokens=tokens,
        rollouts=rollouts,
        seconds=elapsed,
        calls=calls,
    )


# --- probe: reachability and clock skew ---------------------------------------------------------


@dataclass(frozen=True)
class ProbeResult:
    reachable: bool
    reason: str
    clock_skew_s: float  # hub clock minus ours (positive: the hub is ahead)
    skew_uncertainty_s: float  # half the round trip
    rtt_s: float
    probe_data_addr: str


def _envelope_created(data: bytes) -> float:
    env = canonical.decode(data, max_size=MAX_PROBE_REPLY)
    t = env.get("t") if isinstance(env, dict) else None
    if type(t) is not float:
        raise SchemaError("probe reply: envelope has no creation time")
    return t


def open_probe_reply(data: bytes, *, hub_peer: str, me: str, request_nonce: bytes) -> ProbeReply:
    """Verify the hub's reply. Freshness comes from the echoed request nonce, not from our
    clock, so a node whose clock is far off still gets the reply (and the skew)."""
    created = _envelope_created(data)
    v = envelope.open_envelope(
        data,
        ProbeReply,
        now=created,
        replay=None,
        allowed=lambda signer, _t: signer == hub_peer,
        max_size=MAX_PROBE_REPLY,
    )
    r = v.message
    if r.request_nonce != request_nonce:
        raise MeaningError("probe reply answers another request (nonce mismatch)")
    if r.peer_id != me:
        raise MeaningError("probe reply is addressed to another peer")
    return r


async def probe_hub(
    host: Any,
    hub: str,
    hub_peer: str,
    identity: Identity,
    announce: Announce,
    *,
    timeout_s: float = 20.0,
) -> ProbeResult:
    """Ask the hub (``hub``: multiaddr or peer ID) to dial us back and tell its time."""
    nonce = os.urandom(envelope.NONCE_SIZE)
    req = envelope.seal(identity, announce, ttl_s=PROBE_TTL_S, nonce=nonce)
    t0 = time.time()
    resp = await host.request(hub, PROBE, req, max_response=MAX_PROBE_REPLY, timeout_s=timeout_s)
    t1 = time.time()
    r = open_probe_reply(resp, hub_peer=hub_peer, me=identity.peer_id, request_nonce=nonce)
    # The hub stamps hub_time after its dial-back, so the midpoint of the whole exchange would
    # be off by the dial-back's duration: the reply's arrival minus half a round trip is closer.
    rtt = await _rtt(host, hub_peer, timeout_s)
    local_at_stamp = t1 - rtt / 2
    return ProbeResult(
        reachable=r.reachable,
        reason=r.reason,
        clock_skew_s=r.hub_time - local_at_stamp,
        skew_uncertainty_s=rtt / 2 + 0.05,
        rtt_s=rtt if rtt > 0 else t1 - t0,
        probe_data_addr=r.probe_data_addr,
    )


async def _rtt(host: Any, peer: str, timeout_s: float) -> float:
    try:
        return float(await host.ping(peer, timeout_s=timeout_s))
    except Echo2Error as exc:
        log.debug("ping to %s failed: %s", peer, exc)
        return 0.0


# --- bandwidth -----------------------------------------------------------------------------------


class BandwidthNotOffered(MeaningError):
    """The hub measures bandwidth for admitted nodes only (or this node's budget is spent)."""

    code = "not_admitted"


def _refused(code: str, message: str) -> MeaningError:
    if code in ("not_admitted", "rate_limited"):
        return BandwidthNotOffered(f"hub refused the bandwidth probe: [{code}] {message}")
    return MeaningError(f"hub refused the bandwidth probe: [{code}] {message}")


@dataclass(frozen=True)
class Bandwidth:
    upload_MBps: float  # 1 MB = 10**6 bytes, as the data plane's rate limits
    download_MBps: float
    bytes_up: int
    bytes_down: int
    seconds: float






async def _expect_request(conn: DataConnection, prefix: bytes, timeout_s: float) -> bytes:
    frame = await conn.receive(timeout_s=timeout_s)
    if frame.type is FrameType.ERROR:
        raise _refused(*parse_error(frame.payload))
    if frame.type is not FrameType.REQUEST or not bytes(frame.payload).startswith(prefix):
        raise DecodeError(f"unexpected {frame.type.name} frame in the bandwidth probe")
    return bytes(frame.payload)


async def _download(conn: DataConnection, n: int, timeout_s: float) -> float:
    t0 = time.perf_counter()
    await conn.send_request(f"bw-down {n}".encode())
    got = 0
    while got < n:
        frame = await conn.receive(timeout_s=timeout_s)
        if frame.type is FrameType.ERROR:
            raise _refused(*parse_error(frame.payload))
        if frame.type is not FrameType.CHUNK:
            raise DecodeError(f"unexpected {frame.type.name} frame while downloading")
        got += len(frame.payload)
    await _expect_request(conn, b"bw-down-done", timeout_s)
    return time.perf_counter() - t0


async def _upload(conn: DataConnection, n: int, timeout_s: float) -> float:
    t0 = time.perf_counter()
    await conn.send_request(f"bw-up {n}".encode())
    await send_filler(conn, n)
    await _expect_request(conn, b"bw-up-ack", timeout_s)
    return time.perf_counter() - t0


async def measure_bandwidth(
    addr: str,
    identity: Identity,
    hub_peer: str,
    *,
    target_s: float = 0.5,
    start_bytes: int = 1 * MiB,
    max_bytes: int = 32 * MiB,
    timeout_s: float = 10.0,
) -> Bandwidth:
    """Upload and download rate to the hub's bandwidth responder at ``addr`` (``host:port``).

    Each direction doubles the transfer from ``start_bytes`` until one takes ``target_s`` or
    reaches ``max_bytes``; the rate is that of the largest transfer (the small ones mostly
    measure the round trip).
    """
    t_start = time.perf_counter()
    try:
        conn = await dataplane.connect(addr, identity, hub_peer, timeout_s=timeout_s)
    except HandshakeError as exc:
        if getattr(exc, "reason", "") == "not_allowed":
            raise BandwidthNotOffered("the hub measures bandwidth for admitted nodes only") from exc
        raise
    async with conn:
        rates: dict[str, float] = {}
        moved = {"up": 0, "down": 0}
        for direction, fn in (("down", _download), ("up", _upload)):
            n = max(1, start_bytes)
            while True:
                seconds = await fn(conn, n, timeout_s)
                moved[direction] += n
                rates[direction] = n / max(seconds, 1e-6) / MB
                if seconds >= target_s or n * 2 > max_bytes:
                    break
                n *= 2
        await conn.send_bye()
    return Bandwidth(
        upload_MBps=rates["up"],
        download_MBps=rates["down"],
        bytes_up=moved["up"],
        bytes_down=moved["down"],
        seconds=time.perf_counter() - t_start,
    )


async def measure_all(
    host: Any,
    hub: str,
    hub_peer: str,
    identity: Identity,
    announce: Announce,
    *,
    timeout_s: float = 20.0,
    bandwidth: bool = True,
) -> tuple[ProbeResult, Bandwidth | None]:
    """Probe then (when the hub runs a bandwidth responder and serves us) measure bandwidth."""
    result = await probe_hub(host, hub, hub_peer, identity, announce, timeout_s=timeout_s)
    bw = None
    if bandwidth and result.probe_data_addr:
        try:
            with trio.fail_after(timeout_s * 4):
                bw = await measure_bandwidth(result.probe_data_addr, identity, hub_peer, timeout_s=timeout_s)
        except trio.TooSlowError as exc:
            raise Timeout(f"bandwidth probe took longer than {timeout_s * 4:g} s") from exc
        except BandwidthNotOffered as exc:
            log.info("bandwidth not measured: %s", exc)
    return result, bw
