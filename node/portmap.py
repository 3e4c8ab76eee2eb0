"""Ask the home router to forward a node's ports (issue 18 item 1): NAT-PMP (RFC 6886) or UPnP IGD.

A node behind a home NAT can accept no connection, so the broadcast planner makes it a leaf (or a
reverse-connection / hole-punched relay, node.punch). Many home routers forward a port on request;
with a mapping the node is a plain reachable parent. What is asked and what is believed:

- asked only where it can help: the node's address toward the hub is private (RFC 1918, carrier
  NAT) and the hub is not on the same loopback (:func:`skip_reason`); a node with a public address
  or on the hub's machine never sends a request;
- NAT-PMP first (one UDP round trip to the default gateway, :mod:`echo2.protocol.natpmp`; a
  router without it answers ICMP unreachable at once or not at all: 1.75 s at most), then UPnP IGD
  (``miniupnpc``: SSDP discovery waits ``DISCOVER_MS`` for answers, then SOAP over HTTP);
- a TCP mapping of each port the node listens on (the data plane; the libp2p port for a full
  node), external port = internal port when the router grants it, with a lease of
  :data:`LEASE_S`, renewed at half its life, deleted on a clean exit (bounded, :data:`UNMAP_TIMEOUT_S`);
- the external address goes into the node's hello and Announce, but the planner believes it only
  once the hub dialled it back and the handshake there proved the node's key (A10: observed and
  verified addresses only; the hub takes the port and dials the IP it sees the node at, never
  the announced host). A mapping on a router that is itself behind another NAT (its "external"
  address private) is asked for all the same and simply never verified.

Every call into a router blocks (sockets, miniupnpc's C code): each runs in a worker thread
(``trio.to_thread.run_sync``), abandoned on cancellation, so neither the loop nor start-up
waits on a silent router.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import trio

from echo2.protocol import natpmp
from echo2.protocol.errors import Echo2Error

log = logging.getLogger(__name__)
T = TypeVar("T")

MODES = ("auto", "upnp", "natpmp", "off")
#: Lease asked for (seconds). An hour: a node that dies without deleting its mapping (power cut)
#: leaves the port forwarded to an address that no longer listens for at most that long; renewals
#: at half-life cost one request per half hour.
LEASE_S = 3600
#: SSDP discovery wait (ms). miniupnpd in a home-router namespace answered in 1.06-1.10 s with
#: 1000 ms (the whole wait: miniupnpc collects answers until it ends); 2000 ms, miniupnpc's own
#: default, only delays start-up on a LAN without an IGD.
DISCOVER_MS = 1000
UNMAP_TIMEOUT_S = 3.0
RETRY_S = 60.0  # after a refused or failed mapping, ask again this much later
DESCRIPTION = "echo2 node"


class Gateway(Protocol):
    kind: str

    def external_ip(self) -> str: ...

    def map(self, internal_host: str, internal_port: int, external_port: int, lease_s: int) -> tuple[int, int]:
        """(external port, lease granted in s; 0: permanent); raises OSError/Echo2Error."""
        ...

    def unmap(self, internal_port: int, external_port: int) -> None: ...


# --- where a mapping can help (pure) ------------------------------------------------------------


def skip_reason(mode: str, local_ip: str | None, listen_host: str = "") -> str | None:
    """None when a mapping is worth asking for, else why not."""
    if mode == "off":
        return "port mapping off (--port-map off)"
    if listen_host.startswith("127.") or listen_host in ("::1", "localhost"):
        return f"listening on {listen_host} only: a router cannot forward to it (--listen-host 0.0.0.0)"
    if not local_ip:
        return "no route to the hub known"
    try:
        ip = ipaddress.ip_address(local_ip)
    except ValueError:
        return f"local address {local_ip!r} not understood"
    if ip.is_loopback:
        return "the hub is on this machine (loopback): no router between"
    if ip.version != 4:
        return "IPv6: no NAT to map through (NAT-PMP and UPnP IGD v1 map IPv4)"
    if mode == "auto" and not (ip.is_private or ip in ipaddress.ip_network("100.64.0.0/10")):
        return f"our address {local_ip} is public: nothing to map"
    return None


def parse_route_table(text: str) -> str | None:
    """The IPv4 default gateway from ``/proc/net/route`` text (Linux), or None."""
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) >= 8 and f[1] == "00000000" and f[7] == "00000000" and int(f[3], 16) & 0x2:  # RTF_GATEWAY
            return str(ipaddress.IPv4Address(int(f[2], 16).to_bytes(4, "little")))
    return None


# --- blocking clients (run in worker threads) ---------------------------------------------------


def local_ip_toward(ip: str) -> str | None:
    """The local address the kernel would use to reach ``ip`` (no packet is sent)."""
    try:
        fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return str(s.getsockname()[0])
    except (OSError, ValueError):
        return None


def default_gateway() -> str | None:
    try:
        with open("/proc/net/route") as f:
            return parse_route_table(f.read())
    except OSError:
        return None


class NatPmpGateway:
    kind = "NAT-PMP"

    def __init__(self, gateway: str, tries: int = 3) -> None:
        self.gateway = gateway
        self.tries = tries

    def _ask(self, request: bytes, parse: Callable[[bytes], Any]) -> Any:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((self.gateway, natpmp.PORT))  # replies from anyone else are not delivered
            for wait in natpmp.retry_timeouts(self.tries):
                s.send(request)
                s.settimeout(wait)
                try:
                    data = s.recv(64)  # replies are 12 or 16 bytes; more is malformed anyway
                except TimeoutError:
                    continue
                return parse(data)
        raise TimeoutError(f"no NAT-PMP answer from {self.gateway} in {sum(natpmp.retry_timeouts(self.tries)):g} s")

    def external_ip(self) -> str:
        return str(self._ask(natpmp.external_request(), natpmp.parse_external).ip)

    def map(self, internal_host: str, internal_port: int, external_port: int, lease_s: int) -> tuple[int, int]:
        m = self._ask(natpmp.map_request(internal_port, external_port, lease_s),
                      lambda d: natpmp.parse_map(d, internal_port))
        return int(m.external_port), int(m.lifetime_s)

    def unmap(self, internal_port: int, external_port: int) -> None:
        self._ask(natpmp.map_request(internal_port, 0, 0), lambda d: natpmp.parse_map(d, internal_port))


class UpnpGateway:
    kind = "UPnP IGD"

    def __init__(self, discover_ms: int = DISCOVER_MS) -> None:
        import miniupnpc  # a dependency of libp2p; imported here: only a node that maps loads it

        self.u = miniupnpc.UPnP()
        self.u.discoverdelay = discover_ms
        if self.u.discover() < 1:
            raise OSError(f"no UPnP device answered SSDP discovery in {discover_ms} ms")
        self.u.selectigd()  # raises Exception('No UPnP device discovered') and the like

    def external_ip(self) -> str:
        return str(self.u.externalipaddress() or "")

    def map(self, internal_host: str, internal_port: int, external_port: int, lease_s: int) -> tuple[int, int]:
        host = self.u.lanaddr if internal_host in ("", "0.0.0.0") else internal_host
        for lease in (lease_s, 0):  # IGDv1 routers may accept permanent leases only (error 725)
            try:
                if self.u.addportmapping(external_port, "TCP", host, internal_port, DESCRIPTION, "", lease):
                    return external_port, lease
            except Exception as exc:  # miniupnpc raises bare Exception with the UPnP error text
                why = str(exc)
                if "725" not in why and "OnlyPermanent" not in why:
                    raise OSError(f"UPnP AddPortMapping {external_port}->{host}:{internal_port}: {why}") from exc
        raise OSError("UPnP AddPortMapping refused")

    def unmap(self, internal_port: int, external_port: int) -> None:
        self.u.deleteportmapping(external_port, "TCP")


def open_gateway(mode: str, gateway_ip: str | None) -> tuple[Gateway | None, str]:
    """The first protocol the home router answers (NAT-PMP, then UPnP IGD), or None and why."""
    notes = []
    if mode in ("auto", "natpmp"):
        if gateway_ip is None:
            notes.append("NAT-PMP: no default gateway")
        else:
            g = NatPmpGateway(gateway_ip)
            try:
                g.external_ip()
                return g, ""
            except (OSError, Echo2Error) as exc:
                notes.append(f"NAT-PMP at {gateway_ip}: {exc}")
    if mode in ("auto", "upnp"):
        try:
            return UpnpGateway(), ""
        except Exception as exc:  # miniupnpc raises bare Exception
            notes.append(f"UPnP IGD: {exc}")
    return None, "; ".join(notes)


# --- the mapper (trio) --------------------------------------------------------------------------


@dataclass(frozen=True)
class Mapping:
    internal_port: int
    external_port: int
    external_ip: str
    lease_s: int  # granted; 0: permanent
    renew_at: float  # trio clock


class PortMapper:
    """Keeps a TCP mapping for each port in ``ports()`` while :meth:`run` runs.

    ``hub_ip``: where the hub is (the local address toward it decides whether to ask at all).
    ``on_change()`` is called when the set of external addresses changes. ``settled`` is set
    after the first attempt, mapped or not (a node measures its reachability after it).
    """

    def __init__(self, mode: str, ports: Callable[[], list[int]], hub_ip: str, *, host: str = "",
                 on_change: Callable[[], Any] | None = None, lease_s: int = LEASE_S) -> None:
        if mode not in MODES:
            raise ValueError(f"port map mode {mode!r}: one of {', '.join(MODES)}")
        self.mode, self.ports, self.hub_ip, self.host = mode, ports, hub_ip, host
        self.on_change = on_change
        self.lease_s = lease_s
        self.gateway: Gateway | None = None
        self.mappings: dict[int, Mapping] = {}
        self.status = "not tried yet"
        self.settled = trio.Event()
        self._poke = trio.Event()

    def external_addr(self, internal_port: int) -> str:
        m = self.mappings.get(internal_port)
        return f"{m.external_ip}:{m.external_port}" if m is not None and m.external_ip else ""

    def multiaddrs(self, internal_port: int, peer_id: str) -> list[str]:
        """``[/ip4/EXT/tcp/PORT/p2p/ID]`` for a mapped libp2p port (an Announce's listen_addrs: the
        hub dials that port back at the IP it sees us at), else []."""
        ip, _, port = self.external_addr(internal_port).rpartition(":")
        return [f"/ip4/{ip}/tcp/{port}/p2p/{peer_id}"] if ip else []

    def poke(self) -> None:
        """The ports may have changed (a restarted data plane): reconcile now."""
        self._poke.set()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            local = await _in_thread(lambda: local_ip_toward(self.hub_ip))
            why = skip_reason(self.mode, local, self.host)
            if why is not None:
                self.status = why
                log.info("port mapping not asked: %s", why)
                return
            gw_ip = await _in_thread(default_gateway)
            self.gateway, why = await _in_thread(lambda: open_gateway(self.mode, gw_ip))
            if self.gateway is None:
                self.status = f"no port mapping: {why}"
                log.info("%s (the node relays by reverse connection or hole punching instead)", self.status)
                return
            while True:
                try:
                    await self._reconcile()
                except Exception as exc:  # a bug here must not take the node down: it only stays unmapped
                    log.exception("port mapping failed")
                    self.status = f"port mapping failed: {exc!r}"
                    return
                self.settled.set()
                wake = min((m.renew_at for m in self.mappings.values()), default=trio.current_time() + RETRY_S)
                with trio.move_on_at(min(wake, trio.current_time() + RETRY_S)):
                    await self._poke.wait()
                self._poke = trio.Event()
        finally:
            self.settled.set()
            with trio.CancelScope(shield=True), trio.move_on_after(UNMAP_TIMEOUT_S):
                await self._unmap_all()

    async def _reconcile(self) -> None:
        assert self.gateway is not None
        gw = self.gateway
        wanted = {p for p in self.ports() if p}
        before = {p: self.external_addr(p) for p in self.mappings}
        for port in [p for p in self.mappings if p not in wanted]:
            m = self.mappings.pop(port)
            await self._call(gw.unmap, m.internal_port, m.external_port)
        now = trio.current_time()
        for port in sorted(wanted):
            old = self.mappings.get(port)
            if old is not None and now < old.renew_at:
                continue
            try:
                ext_port, lease = await self._call(gw.map, self.host, port, old.external_port if old else port, self.lease_s)
                ext_ip = await self._call(gw.external_ip)
            except (OSError, Echo2Error) as exc:
                self.status = f"{gw.kind} refused a mapping of port {port}: {exc}"
                log.warning("%s; trying again in %g s", self.status, RETRY_S)
                if old is not None:  # keep it until its lease ends; ask again sooner
                    self.mappings[port] = Mapping(port, old.external_port, old.external_ip, old.lease_s, now + RETRY_S)
                continue
            renew = now + (lease / 2 if lease else RETRY_S * 10)
            self.mappings[port] = Mapping(port, ext_port, ext_ip, lease, renew)
            if old is None:
                log.info("%s maps %s:%d to port %d (lease %s s)", gw.kind, ext_ip, ext_port, port, lease or "permanent")
            if ext_ip and not _public(ext_ip):
                log.warning("the router's external address %s is private: another NAT (carrier-grade?) is in front; "
                            "the hub's dial-back will tell whether the mapping helps", ext_ip)
        if self.mappings:
            self.status = f"{gw.kind}: " + ", ".join(f"{self.external_addr(p)} -> port {p}" for p in sorted(self.mappings))
        after = {p: self.external_addr(p) for p in self.mappings}
        if after != before and self.on_change is not None:
            r = self.on_change()
            if hasattr(r, "__await__"):
                await r

    async def _unmap_all(self) -> None:
        gw = self.gateway
        for port, m in list(self.mappings.items()):
            if gw is not None:
                try:
                    await self._call(gw.unmap, m.internal_port, m.external_port)
                    log.info("%s mapping of port %d deleted", gw.kind, port)
                except (OSError, Echo2Error) as exc:
                    log.info("could not delete the %s mapping of port %d: %s", gw.kind, port, exc)
            del self.mappings[port]

    @staticmethod
    async def _call(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await _in_thread(lambda: fn(*args))
        except Echo2Error:
            raise
        except Exception as exc:  # miniupnpc raises bare Exception; make it one the caller handles
            if isinstance(exc, OSError):
                raise
            raise OSError(str(exc)) from exc


@asynccontextmanager
async def mapped(mapper: PortMapper) -> AsyncIterator[PortMapper]:
    """Run ``mapper`` for the duration of the block (its mappings are deleted at the end)."""
    async with trio.open_nursery() as nursery:
        await nursery.start(mapper.run)
        try:
            yield mapper
        finally:
            nursery.cancel_scope.cancel()


async def _in_thread(fn: Callable[[], T]) -> T:
    """``fn()`` in a worker thread, abandoned (left to finish alone) if the caller is cancelled:
    every router call is bounded by its own timeout, but a cancelled node must not wait on it."""
    # mypy 2.4 misreads trio's ``*args: Unpack[Ts]`` signature as taking no keyword arguments
    return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)  # type: ignore[call-arg]


def _public(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_global
    except ValueError:
        return False


__all__ = ["MODES", "Mapping", "NatPmpGateway", "PortMapper", "UpnpGateway", "mapped", "open_gateway", "parse_route_table",
           "skip_reason"]
