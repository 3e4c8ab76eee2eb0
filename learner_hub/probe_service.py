"""The hub's side of ``echo2 node doctor`` and of a node's self-measurement; what it learns
feeds the broadcast planner (``links``: observed address, proven reachability, measured upload).

Control plane, ``/echo2/probe/1.0.0`` (:data:`PROBE`): the node sends a signed
:class:`~echo2.protocol.messages.Announce` (its listen addresses and data-plane address); the hub
dials it back from a fresh, throw-away libp2p host at the IP it sees the node at, on each
announced port (the announced hosts are never dialled, so a node cannot make the hub dial a third
party's address; when the hub cannot see the node's IP it dials nothing), and answers a signed
:class:`ProbeReply` with its wall time (clock skew), whether the dial-back worked and why not, and
the address of its bandwidth responder. The node is not required to be admitted: the doctor runs
before joining. For an admitted node, a data plane whose handshake proved the node's peer ID at
the observed IP is recorded as verified (:meth:`LinkBook.verified`): only then may the planner
make it a parent. Each peer may probe once every ``min_interval_s``; dial-backs run at most
``max_concurrent`` at a time and each is bounded by ``dial_timeout_s``.

Data plane, bandwidth responder (:class:`BandwidthResponder`), for admitted nodes only (others
are refused in the handshake verdict, before any byte moves): small ASCII REQUEST frames

- ``bw-down N``  the hub sends N bytes as CHUNK frames (<= 1 MiB each), then ``bw-down-done N``;
- ``bw-up N``    the node then sends N bytes as CHUNK frames; the hub answers
  ``bw-up-ack N SECONDS`` (SECONDS from the first chunk's arrival to the last one's) and records
  the rate it timed (request to last byte) as the node's upload;
- anything else  an ERROR frame ``bad_request`` and the connection ends.

N is at most :data:`MAX_TRANSFER`, a connection moves at most :data:`MAX_CONNECTION_BYTES` and
lives at most :data:`MAX_CONNECTION_S`, and each peer may move at most :data:`PEER_BUDGET_BYTES`
per :data:`PEER_WINDOW_S` (token bucket; ``rate_limited`` beyond), so neither an outsider nor an
admitted node can turn the hub into a traffic source or sink.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
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
from echo2.protocol.peerlimit import KeyedRateLimiter, LogThrottle
from echo2.protocol.wire import PROBE as PROBE

from .links import LinkBook, ip_scope

log = logging.getLogger(__name__)

MAX_PROBE_REQUEST = 64 * 1024  # an Announce envelope
PROBE_TTL_S = 3600.0  # long, so a node whose clock is minutes off still learns by how much
MiB = 1024 * 1024
MAX_TRANSFER = 64 * MiB
MAX_CONNECTION_BYTES = 256 * MiB
MAX_CONNECTION_S = 60.0
IDLE_S = 10.0
MAX_TARGETS = 4
# A node's self-measurement moves up to 2 x 63 MiB; this leaves room for a doctor run as well.
PEER_BUDGET_BYTES = 256 * MiB
PEER_WINDOW_S = 600.0


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
    """The multiaddrs to dial to test a node's reachability: the node's observed IP on each
    announced port. The question is whether the hub can reach the node where it sees it, and a
    node must not be able to point the hub at someone else's host, so without an observed IP
    (or with one that is no unicast address) nothing is dialled. Addresses naming another peer
    are ignored."""
    if not observed_ip or ip_scope(observed_ip) is None:
        return []
    ip = ipaddress.ip_address(observed_ip)
    family = "ip6" if ip.version == 6 else "ip4"
    out: list[str] = []
    for a in listen_addrs[:16]:
        parsed = _split_multiaddr(a)
        if parsed is None:
            continue
        _family, _host, port, pid = parsed
        if pid and pid != peer:
            continue
        target = f"/{family}/{observed_ip}/tcp/{port}/p2p/{peer}"
        if target not in out:
            out.append(target)
    return out[:MAX_TARGETS]


def data_dial_target(data_addr: str, observed_ip: str | None) -> str | None:
    """``host:port`` to dial for the node's data plane: the observed IP with the announced port
    (the announced host is never dialled); None without an observed unicast IP."""
    if not data_addr or not observed_ip or ip_scope(observed_ip) is None:
        return None
    try:
        _host, port = parse_addr(data_addr)
    except Echo2Error:
        return None
    return f"[{observed_ip}]:{port}" if ":" in observed_ip else f"{observed_ip}:{port}"


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
    ``probe_data_addr`` is the ``host:port`` of a DataPlaneServer running a
    :class:`BandwidthResponder` ("" if the hub runs none). ``links`` and ``admitted``: where the
    dial-back results of admitted peers are recorded for the planner (None: nowhere).
    """

    def __init__(
        self,
        identity: Identity,
        *,
        control_host: Any = None,
        probe_data_addr: str = "",
        links: LinkBook | None = None,
        admitted: Callable[[str], bool] | None = None,
        dial_timeout_s: float = 3.0,
        min_interval_s: float = 2.0,
        max_concurrent: int = 4,
        max_tracked_peers: int = 100_000,
    ) -> None:
        self.identity = identity
        self.control_host = control_host
        self.probe_data_addr = probe_data_addr
        self.links = links
        self.admitted = admitted
        self.dial_timeout_s = dial_timeout_s
        self.min_interval_s = min_interval_s
        self.max_tracked_peers = max_tracked_peers
        self.replay = envelope.ReplayGuard(window_s=2 * PROBE_TTL_S, max_entries=100_000, evict=True)  # strangers: a flood evicts, never refuses all (A3)
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
            reachable, reason, data_port = await self._dial_back(peer, ann, ip)
        if ip and self.links is not None and self.admitted is not None and self.admitted(peer):
            # Only admitted peers: a stranger's throw-away keys must not fill the book.
            self.links.observed(peer, ip)
            if data_port is not None:
                self.links.verified(peer, ip, data_port)
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

    async def _dial_back(self, peer: str, ann: Announce, ip: str | None) -> tuple[bool, str, int | None]:
        """(reachable, why, the data-plane port proven at ``ip`` or None)."""
        from echo2.protocol.net.control import ControlHost

        if not ip:
            return False, "the hub cannot see the address this request comes from; it dials nothing else", None
        targets = dial_back_targets(list(ann.listen_addrs), peer, ip)
        if not targets:
            return False, f"no dialable listen address at {ip} in the announce (want /ip4/HOST/tcp/PORT/p2p/<your id>)", None
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
        data_port: int | None = None
        if data_target is not None:
            data_ok, note = await self._dial_data(data_target, peer, prober)
            notes.append(note)
            ok = ok and data_ok
            if data_ok:
                data_port = parse_addr(data_target)[1]
        return ok, "; ".join(notes), data_port

    async def verify_loop(
        self,
        *,
        interval_s: float = 1.0,
        retry_s: float = 30.0,
        per_round: int = 16,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Dial back, from the hub, the data plane of every admitted node the planner asked
        about and nobody proved yet (``LinkBook.unproven``): a node becomes a possible parent
        without having to probe (after a hub restart, say), and only where the hub itself
        reached it at its observed IP and the handshake proved its key."""
        prober = Identity.generate()
        task_status.started()
        if self.links is None:
            return
        while True:
            await trio.sleep(interval_s)
            todo = self.links.unproven(trio.current_time(), retry_s, per_round)
            async with trio.open_nursery() as nursery:
                for peer, addr in todo:
                    if self.admitted is None or self.admitted(peer):
                        nursery.start_soon(self._verify_one, peer, addr, prober)

    async def _verify_one(self, peer: str, addr: str, prober: Identity) -> None:
        async with self._limit:
            ok, note = await self._dial_data(addr, peer, prober)
        if ok and self.links is not None:
            host, port = parse_addr(addr)
            self.links.verified(peer, host, port)
        log.info("dial-back of %s: %s", peer, note)

    async def _dial_data(self, addr: str, peer: str, prober: Identity) -> tuple[bool, str]:
        try:
            conn = await dataplane.connect(addr, prober, peer, timeout_s=self.dial_timeout_s)
        except HandshakeError as exc:
            # Refused after both keys were proven (the dialer checks the listener's signature
            # before it reads the verdict): the node is there and reachable, it just does not
            # serve strangers.
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


class BandwidthResponder:
    """Serves bandwidth probes to admitted peers only, within a byte budget per peer.

    Run it as ``DataPlaneServer(identity, responder.handle, allow=responder.allow, ...)``: a peer
    that is not admitted is refused in the handshake verdict (after it proved its key, before
    any byte of a probe moves); ``handle`` checks again, as admission may have ended since. Every
    transfer, either way, is charged to the peer's token bucket of ``budget_bytes`` per
    ``window_s``. The rate the hub times for ``bw-up`` goes to ``links`` (the planner's upload).
    """

    def __init__(
        self,
        admitted: Callable[[str], bool],
        *,
        links: LinkBook | None = None,
        budget_bytes: int = PEER_BUDGET_BYTES,
        window_s: float = PEER_WINDOW_S,
        max_peers: int = 65_536,
    ) -> None:
        self.admitted = admitted
        self.links = links
        self.budget_bytes = budget_bytes
        self.window_s = window_s
        self.budget = KeyedRateLimiter(budget_bytes / window_s, float(budget_bytes), max_keys=max_peers)
        self.refusals: Counter[str] = Counter()
        self.bytes_moved = 0
        self._log = LogThrottle(log)

    def allow(self, peer: str) -> bool:
        if self.admitted(peer):
            return True
        self.refusals["not_admitted"] += 1
        return False

    def _refuse(self, code: str, peer: str, why: str) -> None:
        self.refusals[code] += 1
        self._log.log(logging.WARNING, code, trio.current_time(), "bandwidth probe from %s refused: %s", peer, why)

    async def handle(self, conn: DataConnection) -> None:
        """Serve bandwidth probes on one data-plane connection."""
        peer = conn.peer_id
        if not self.allow(peer):
            await conn.send_error("not_admitted", "the hub measures bandwidth for admitted nodes only")
            return
        moved = 0
        with trio.move_on_after(MAX_CONNECTION_S) as scope:
            while True:
                frame = await conn.receive(timeout_s=IDLE_S)
                t0 = time.perf_counter()
                if frame.type is FrameType.BYE:
                    return
                if frame.type is not FrameType.REQUEST:
                    await conn.send_error("bad_request", f"expected a REQUEST frame, got {frame.type.name}")
                    return
                try:
                    verb, n = parse_request(frame.payload)
                except SchemaError as exc:
                    self._refuse("bad_request", peer, exc.message)
                    await conn.send_error("bad_request", exc.message)
                    return
                if moved + n > MAX_CONNECTION_BYTES:
                    self._refuse("too_much", peer, f"{moved + n} bytes on one connection")
                    await conn.send_error("too_much", f"a probe connection moves at most {MAX_CONNECTION_BYTES} bytes")
                    return
                if not self.budget.allow(peer, trio.current_time(), cost=n):
                    why = f"at most {self.budget_bytes} probe bytes per {self.window_s:g} s per peer"
                    self._refuse("rate_limited", peer, why)
                    await conn.send_error("rate_limited", why)
                    return
                moved += n
                self.bytes_moved += n
                if verb == "bw-down":
                    await send_filler(conn, n)
                    await conn.send_request(f"bw-down-done {n}".encode())
                else:
                    seconds = await receive_bytes(conn, n)
                    if self.links is not None:
                        # Timed by the hub from the request on: a node cannot claim a faster link.
                        self.links.record_upload(peer, n, time.perf_counter() - t0)
                    await conn.send_request(f"bw-up-ack {n} {seconds:.6f}".encode())
        if scope.cancelled_caught:
            log.info("bandwidth probe connection from %s reached its %gs limit", peer, MAX_CONNECTION_S)
