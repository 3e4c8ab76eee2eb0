"""Hole punching between two NAT-bound nodes (issue 18 item 1): the sockets, over trio.

Which peers to punch to, and each end's role in the handshake, is the pure rule
:meth:`echo2.node.relay_state.WirePlan.punch_targets`; the hub plans the edge and signs both ends'
public addresses into the plan (``BroadcastPlan.punch_addrs``). This module only moves bytes:

- every connection that matters leaves from the data plane's **listen port** (the listener has
  SO_REUSEPORT, see ``DataPlaneServer(reuse_port=True)``, and the outgoing socket binds the same
  port with SO_REUSEADDR/SO_REUSEPORT): the node's hub link, so that the hub sees the port its NAT
  maps the listen port to (Linux MASQUERADE keeps it when free: measured here, BRIEF section 11),
  and the punch itself;
- :func:`punch_stream`: both ends connect from their listen port to the other's public address
  at the moment the plan reaches them. The first SYN to leave a home opens its NAT's mapping; the
  other side's SYN, dropped by a router with no mapping yet or let through by one that has it,
  meets a socket in SYN_SENT: TCP simultaneous open, one connection. One ``connect`` is held open
  for the whole window (the kernel retransmits the SYN at 1, 3, 7 s), so this end is never without
  a SYN_SENT socket while its mapping lives (a SYN reaching our listener instead would be served
  with the listener's handshake role); an error (a RST) retries after a short pause, all within
  ``window_s``;
- :func:`punch_link`: the data plane's normal authenticated handshake on that connection, the
  lower peer ID speaking as the dialer (it names the peer it expects), the other as the listener
  through :meth:`DataPlaneServer.adopt` (its limits, and the node's A4 gate: the peer must be in a
  plan). Bulk data then flows on it exactly as on a dialled connection.

py-libp2p 0.8.1's DCUtR (``libp2p.relay.circuit_v2.dcutr``) punches a libp2p connection between
the same homes (examples/nat_libp2p: it also binds its listen port), but it needs a circuit relay
reservation to coordinate over, and what it yields is a Noise/Yamux connection (about 75 MB/s
and a core per stream here, BRIEF section 9), not a socket the data plane can use; the hub, which
every node already talks to, coordinates instead, and the punched socket is the data plane's own.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from echo2.protocol.dataframe import parse_addr
from echo2.protocol.errors import Echo2Error
from echo2.protocol.identity import Identity
from echo2.protocol.net import dataplane
from echo2.protocol.net.connection import DataConnection
from echo2.protocol.net.ratelimit import UploadLimiter

from .relay_state import PunchEdge

log = logging.getLogger(__name__)

PUNCH_WINDOW_S = 4.0  # SYNs at +0, +1 and +3 s (kernel retransmits): the two ends may start ~3 s apart
RETRY_PAUSE_S = 0.25  # after a connect error (RST, unreachable) before the next SYN


class PunchFailed(Echo2Error):
    """No TCP connection through the two NATs within the window."""

    code = "punch_failed"


@dataclass(frozen=True)
class PunchOutcome:
    peer: str
    ok: bool
    seconds: float
    why: str = ""


async def _bound_socket(local_host: str, local_port: int, family: int) -> trio.socket.SocketType:
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await sock.bind((local_host, local_port))
    except BaseException:
        sock.close()
        raise
    return sock


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


async def bound_stream(local_host: str, local_port: int, addr: str) -> trio.SocketStream:
    """A TCP connection to ``addr`` leaving from ``local_host:local_port`` (our listen port, so
    the NAT in front of us maps that port and the far end observes the mapping). OSError if the
    port cannot be shared or the connect fails; the caller bounds the time."""
    host, port = parse_addr(addr)
    sock = await _bound_socket(local_host, local_port, _family(host))
    try:
        await sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


async def hub_stream(local_host: str, local_port: int, hub_addr: str, timeout_s: float) -> tuple[trio.SocketStream | None, int]:
    """The node's hub link leaving from our listen port (the hub then sees the port our NAT maps
    it to) and that port, for the hello; ``(None, 0)`` if that fails (an ordinary dial follows:
    e.g. the same 4-tuple still in TIME_WAIT after a reconnect)."""
    try:
        with trio.fail_after(timeout_s):
            return await bound_stream(local_host, local_port, hub_addr), local_port
    except (OSError, trio.TooSlowError, Echo2Error) as exc:
        log.info("hub link from our listen port failed (%r); dialling from any port", exc)
        return None, 0


async def punch_stream(local_host: str, local_port: int, addr: str, window_s: float = PUNCH_WINDOW_S) -> trio.SocketStream:
    """TCP simultaneous open from our listen port to ``addr`` (the other end does the same to us
    at about the same moment), retried within ``window_s``; PunchFailed when the window ends."""
    host, port = parse_addr(addr)
    deadline = trio.current_time() + window_s
    last: BaseException | None = None
    attempts = 0
    while trio.current_time() < deadline:
        attempts += 1
        sock = await _bound_socket(local_host, local_port, _family(host))
        try:
            with trio.move_on_after(max(0.0, deadline - trio.current_time())):
                await sock.connect((host, port))
                return trio.SocketStream(sock)
            sock.close()
            break
        except OSError as exc:
            sock.close()
            last = exc
            if exc.errno == errno.EADDRINUSE:
                break  # our port's 4-tuple to that peer is taken (a connection exists): no use retrying
            await trio.sleep(min(RETRY_PAUSE_S, max(0.0, deadline - trio.current_time())))
        except BaseException:
            sock.close()
            raise
    raise PunchFailed(f"no connection to {addr} from port {local_port} within {window_s:g}s "
                      f"({attempts} attempt(s); last error: {last!r})")


OnDialed = Callable[..., Awaitable[Any]]


async def punch_link(
    server: dataplane.DataPlaneServer,
    identity: Identity,
    edge: PunchEdge,
    *,
    nursery: trio.Nursery,
    on_dialed: OnDialed,
    linked: Callable[[str], bool],
    window_s: float = PUNCH_WINDOW_S,
    handshake_timeout_s: float = 5.0,
    upload_limiter: UploadLimiter | None = None,
) -> PunchOutcome:
    """Punch a hole to ``edge.peer`` and run the data plane's handshake on it in ``edge``'s role.
    As the dialer, the authenticated connection goes to ``nursery.start(on_dialed, conn)``; as the
    listener, ``server.adopt`` serves it (its handler links it) and we wait for ``linked(peer)``.
    Never raises for a network failure: the outcome says what happened (the hub is told)."""
    t0 = trio.current_time()

    def out(ok: bool, why: str = "") -> PunchOutcome:
        return PunchOutcome(edge.peer, ok, trio.current_time() - t0, why)

    try:
        stream = await punch_stream(server.host, server.port, edge.addr, window_s)
    except (PunchFailed, OSError) as exc:
        log.warning("hole punch to %s at %s failed: %s", edge.peer, edge.addr, exc)
        return out(False, str(exc))
    log.info("punched a hole to %s at %s in %.2fs (%s)", edge.peer, edge.addr, trio.current_time() - t0,
             "dialer" if edge.dialer else "listener")
    if edge.dialer:
        try:
            conn: DataConnection = await dataplane.connect(
                edge.addr, identity, edge.peer, timeout_s=handshake_timeout_s, upload_limiter=upload_limiter, stream=stream,
            )
        except (Echo2Error, OSError) as exc:
            return out(False, f"handshake on the punched connection failed: {exc}")
        await nursery.start(on_dialed, conn)
        return out(True)
    nursery.start_soon(server.adopt, stream)
    with trio.move_on_after(handshake_timeout_s):
        while not linked(edge.peer):
            await trio.sleep(0.02)
        return out(True)
    return out(False, "no authenticated link on the punched connection (handshake refused or timed out)")


__all__ = ["PUNCH_WINDOW_S", "PunchFailed", "PunchOutcome", "bound_stream", "hub_stream", "punch_link", "punch_stream"]
