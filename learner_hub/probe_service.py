"""The hub's side of ``echo2 node doctor`` and of a node's self-measurement.

Control plane, ``/echo2/probe/1.0.0`` (:data:`PROBE`): the node sends a signed
:class:`~echo2.protocol.messages.Announce` (its listen addresses and data-plane address); the hub
dials it back from a fresh, throw-away libp2p host at the IP it sees the node at (so a node
cannot make the hub dial a third party's address) and answers a signed :class:`ProbeReply` with
its wall time (clock skew), whether the dial-back worked and why not, and the address of its
bandwidth responder. The node is not required to be admitted: the doctor runs before joining.
Each peer may probe once every ``min_interval_s``; dial-backs run at most ``max_concurrent`` at
a time and each is bounded by ``dial_timeout_s``.

Data plane, bandwidth responder (:func:`handle_probe_connection`): small ASCII REQUEST frames

- ``bw-down N``  the hub sends N bytes as CHUNK frames (<= 1 MiB each), then ``bw-down-done N``;
- ``bw-up N``    the node then sends N bytes as CHUNK frames; the hub answers
  ``bw-up-ack N SECONDS`` (SECONDS from the first chunk's arrival to the last one's);
- anything else  an ERROR frame ``bad_request`` and the connection ends.

N is at most :data:`MAX_TRANSFER`, a connection moves at most :data:`MAX_CONNECTION_BYTES` and
lives at most :data:`MAX_CONNECTION_S`, so a prober cannot turn the hub into a traffic source.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import OrderedDict
from typing import Any

import trio

from echo2.protocol import envelope
from echo2.protocol.dataframe import FrameType, parse_addr
from echo2.protocol.errors import Echo2Error, HandshakeError, MeaningError, SchemaError
from echo2.protocol.identity import Identity
from echo2.protocol.messages import (
    Announce,
    ProbeReply,
)
from echo2.protocol.net import dataplane
from echo2.protocol.net.connection import DataConnection, send_filler
from echo2.protocol.wire import PROBE as PROBE

log = logging.getLogger(__name__)

MAX_PROBE_REQUEST = 64 * 1024  # an Announce envelope
PROBE_TTL_S = 3600.0  # long, so a node whose clock is minutes off still learns by how much
MiB = 1024 * 1024
MAX_TRANSFER = 64 * MiB
MAX_CONNECTION_BYTES = 256 * MiB
MAX_CONNECTION_S = 60.0
IDLE_S = 10.0
MAX_TARGETS = 4


class ProbeRateLimited(MeaningError):
    """The peer probed again too soon."""

    code = "rate_limited"


# --- dial-back targets (pure) -----------------------------------------------------------------


def _split_multiaddr(addr: str) -> tuple[str, str, int, str] | None:
    """``/ip4|ip6/HOST/tcp/PORT[/p2p/ID]`` -> (family, host, port, peer or ""); None otherwise."""
    parts = addr.strip().split("/")
    if len(parts) not in (5, 7) or parts[0] != "" or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    if len(parts) == 7 and parts[5] != "p2p":
        return None
    try:
        ipaddress.ip_address(parts[2])
        port = int(parts[4])
    except ValueError:
        return None
    if not 0 < port < 65536:
        return None
    return parts[1], parts[2], port, parts[6] if len(parts) == 7 else ""


def dial_back_targets(listen_addrs: list[str], peer: str, observed_ip: str | None) -> list[str]:
    """The multiaddrs to dial to test a node's reachability.

    With the node's observed IP known, only that IP is dialled (on each announced port): the
    question is whether the hub can reach the node where it sees it, and a node must not be
    able to point the hub at someone else's host. Addresses naming another peer are ignored.
    """
    out: list[str] = []
    for a in listen_addrs[:16]:
        parsed = _split_multiaddr(a)
        if parsed is None:
            continue
        family, host, port, pid = parsed
        if pid and pid != peer:
            continue
        if observed_ip:
            ip = ipaddress.ip_address(observed_ip)
            family, host = ("ip6" if ip.version == 6 else "ip4"), observed_ip
        elif ipaddress.ip_address(host).is_unspecified:
            continue
        target = f"/{family}/{host}/tcp/{port}/p2p/{peer}"
        if target not in out:
            out.append(target)
    return out[:MAX_TARGETS]


def data_dial_target(data_addr: str, observed_ip: str | None) -> str | None:
    """``host:port`` to dial for the node's data plane (at the observed IP when known)."""
    if not data_addr:
        return None
    try:
        host, port = parse_addr(data_addr)
    except Echo2Error:
        return None
    if observed_ip:
        host = observed_ip
    try:
        if ipaddress.ip_address(host).is_unspecified:
            return None
    except ValueError:
        return None  # names are not dialled: the hub does no DNS on a node's behalf
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def observed_ip(control_host: Any, peer: str) -> str | None:
    """The remote IP of our libp2p connection from ``peer`` (best effort; None if unknown)."""
    if control_host is None:
        return None
    try:
        from libp2p.peer.id import ID

        for conn in control_host.libp2p_host.get_network().get_connections(ID.from_base58(peer)):
            remote = conn.muxed_conn.get_remote_address()
            if remote:
                return str(ipaddress.ip_address(remote[0]))
    except Exception as exc:  # py-libp2p internals: never let the lookup break the probe
        log.debug("observed address of %s unknown: %r", peer, exc)
    return None


# --- the service ------------------------------------------------------------------------------


class ProbeService:
    """Answers ``/echo2/probe/1.0.0``; register :meth:`handle_control` on the hub's ControlHost.

    ``control_host`` (the hub's) is used only to look up the IP a request came from.
    ``probe_data_addr`` is the ``host:port`` of a DataPlaneServer running
    :func:`handle_probe_connection` ("" if the hub runs none).
    """

    def __init__(
        self,
        identity: Identity,
        *,
        control_host: Any = None,
        probe_data_addr: str = "",
        dial_timeout_s: float = 3.0,
        min_interval_s: float = 2.0,
        max_concurrent: int = 4,
        max_tracked_peers: int = 100_000,
    ) -> None:
        self.identity = identity
        self.control_host = control_host
        self.probe_data_addr = probe_data_addr
        self.dial_timeout_s = dial_timeout_s
        self.min_interval_s = min_interval_s
        self.max_tracked_peers = max_tracked_peers
        self.replay = envelope.ReplayGuard(window_s=2 * PROBE_TTL_S, max_entries=100_000)
        self._last: OrderedDict[str, float] = OrderedDict()
        self._limit = trio.Semaphore(max_concurrent)
        self.probes = 0

    def _rate_limit(self, peer: str, now: float) -> None:
        last = self._last.get(peer)
        if last is not None and now - last < self.min_interval_s:
            raise ProbeRateLimited(f"probe again in {self.min_interval_s - (now - last):.1f}s")
        self._last[peer] = now
        self._last.move_to_end(peer)
        while len(self._last) > self.max_tracked_peers:
            self._last.popitem(last=False)

    async def handle_control(self, peer: str, data: bytes) -> bytes:
        v = envelope.open_envelope(
            data,
            Announce,
            replay=self.replay,
            allowed=lambda signer, _t: signer == peer,
            clock_skew_s=PROBE_TTL_S,
        )
        ann = v.message
        if ann.peer_id != peer:
            raise MeaningError("probe announce names another peer")
        self._rate_limit(peer, time.monotonic())
        self.probes += 1
        ip = observed_ip(self.control_host, peer)
        async with self._limit:
            reachable, reason = await self._dial_back(peer, ann, ip)
        log.info("probe from %s (seen at %s): reachable=%s (%s)", peer, ip or "?", reachable, reason)
        reply = ProbeReply(
            peer_id=peer,
            request_nonce=v.nonce,
            hub_time=time.time(),
            reachable=reachable,
            reason=reason[:1024],
            probe_data_addr=self.probe_data_addr,
        )
        return envelope.seal(self.identity, reply, ttl_s=PROBE_TTL_S)

    async def _dial_back(self, peer: str, ann: Announce, ip: str | None) -> tuple[bool, str]:
        from echo2.protocol.net.control import ControlHost

        targets = dial_back_targets(list(ann.listen_addrs), peer, ip)
        if not targets:
            return False, "no dialable listen address in the announce (want /ip4/HOST/tcp/PORT/p2p/<your id>)"
        notes: list[str] = []
        ok = False
        prober = Identity.generate()  # a throw-away host: the dial must not reuse our connection
        try:
            with trio.fail_after(self.dial_timeout_s * (len(targets) + 1) + 2.0):
                # gossip on: the node runs GossipSub and would log a refused meshsub stream otherwise
                async with ControlHost(prober, dial_timeout_s=self.dial_timeout_s) as host:
                    for t in targets:
                        try:
                            await host.connect(t)
                            rtt = await host.ping(peer, timeout_s=self.dial_timeout_s)
                            notes.append(f"dialled back {t.rsplit('/p2p/', 1)[0]} (rtt {rtt * 1000:.1f} ms)")
                            ok = True
                            break
                        except Echo2Error as exc:
                            notes.append(f"cannot dial {t.rsplit('/p2p/', 1)[0]}: {exc}")
        except trio.TooSlowError:
            notes.append("dial-back timed out")
        except Echo2Error as exc:
            notes.append(f"dial-back host failed: {exc}")
        data_target = data_dial_target(ann.data_addr, ip)
        if data_target is not None:
            data_ok, note = await self._dial_data(data_target, peer, prober)
            notes.append(note)
            ok = ok and data_ok
        return ok, "; ".join(notes)

    async def _dial_data(self, addr: str, peer: str, prober: Identity) -> tuple[bool, str]:
        try:
            conn = await dataplane.connect(addr, prober, peer, timeout_s=self.dial_timeout_s)
        except HandshakeError as exc:
            # Refused after both keys were proven: the node is there and reachable, it just
            # does not serve strangers.
            if getattr(exc, "reason", "") == "not_allowed":
                return True, f"data plane {addr} reachable (it refused the prober, as it may)"
            return False, f"data plane {addr}: {exc}"
        except Echo2Error as exc:
            return False, f"cannot reach data plane {addr}: {exc}"
        await conn.abort()
        return True, f"data plane {addr} reachable"


# --- bandwidth responder ----------------------------------------------------------------------



def parse_request(payload: bytes | bytearray) -> tuple[str, int]:
    """``b"bw-down N"`` / ``b"bw-up N"`` -> (verb, N); SchemaError for anything else."""
    try:
        text = bytes(payload[:64]).decode("ascii")
    except UnicodeDecodeError as exc:
        raise SchemaError("probe request is not ASCII") from exc
    verb, _, n = text.partition(" ")
    if len(payload) > 64 or verb not in ("bw-down", "bw-up") or not n.isdigit() or len(n) > 12:
        raise SchemaError(f"bad probe request {text[:40]!r} (want 'bw-down N' or 'bw-up N')")
    size = int(n)
    if not 0 < size <= MAX_TRANSFER:
        raise SchemaError(f"probe transfer of {size} bytes outside 1..{MAX_TRANSFER}")
    return verb, size




async def receive_bytes(conn: DataConnection, n: int, *, idle_s: float = IDLE_S) -> float:
    """Receive N bytes of CHUNK frames; seconds from the first chunk's arrival to the last one's."""
    got = 0
    first: float | None = None
    while got < n:
        frame = await conn.receive(timeout_s=idle_s)
        if frame.type is not FrameType.CHUNK:
            raise SchemaError(f"expected CHUNK frames, got {frame.type.name}")
        if first is None:
            first = time.perf_counter()
        got += len(frame.payload)
        if got > n:
            raise SchemaError(f"peer sent {got} bytes, more than the {n} announced")
    return time.perf_counter() - (first if first is not None else time.perf_counter())


async def handle_probe_connection(conn: DataConnection) -> None:
    """Serve bandwidth probes on one data-plane connection (for a ``DataPlaneServer``)."""
    moved = 0
    with trio.move_on_after(MAX_CONNECTION_S) as scope:
        while True:
            frame = await conn.receive(timeout_s=IDLE_S)
            if frame.type is FrameType.BYE:
                return
            if frame.type is not FrameType.REQUEST:
                await conn.send_error("bad_request", f"expected a REQUEST frame, got {frame.type.name}")
                return
            try:
                verb, n = parse_request(frame.payload)
            except SchemaError as exc:
                await conn.send_error("bad_request", exc.message)
                log.warning("bad bandwidth probe from %s: %s", conn.peer_id, exc.message)
                return
            if moved + n > MAX_CONNECTION_BYTES:
                await conn.send_error("too_much", f"a probe connection moves at most {MAX_CONNECTION_BYTES} bytes")
                return
            moved += n
            if verb == "bw-down":
                await send_filler(conn, n)
                await conn.send_request(f"bw-down-done {n}".encode())
            else:
                seconds = await receive_bytes(conn, n)
                await conn.send_request(f"bw-up-ack {n} {seconds:.6f}".encode())
    if scope.cancelled_caught:
        log.info("bandwidth probe connection from %s reached its %gs limit", conn.peer_id, MAX_CONNECTION_S)
