"""The node-to-hub channel over the data plane's authenticated TCP (issue 20, item 2): the trio
side of :mod:`echo2.protocol.channel` (why this transport: measured there).

:class:`ChannelServer` (hub): a :class:`~.dataplane.DataPlaneServer` that admits only the peers
``allow`` names, reads request frames (the key names the operation and so its size limit before
the body is read; bodies are charged to the server's per-peer and per-IP budgets as they arrive)
and serves each with the same handler the control host serves that protocol with, so a request
on the channel is judged exactly like one on a libp2p stream (signed envelope opened over its raw
bytes, replay, signer). Per peer: a token bucket per operation (the control host's figures,
``rate_limited``), a bound on requests served at once (``too_many_streams``) and a byte budget
for the bodies held while they are served (``busy``). A handler error becomes an error reply,
never an exception out of the connection.

:class:`ChannelClient` (node): requests with ids, replies matched by id, several outstanding at
once (the work long poll next to a result). When its connection ends every waiting request fails
with :class:`TransportError` and the caller falls back to the control plane.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import socket
import sys
import termios
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from ..channel import KIND_REPLY, KIND_REQUEST, OP_BY_PROTOCOL, RequestIds, pack_key, unpack_key
from ..dataframe import HEADER, HEADER_SIZE, Frame, FrameType
from ..errors import DecodeError, Echo2Error, Timeout, TooLarge, TransportError
from ..framing import MAX_ERROR_PAYLOAD, STATUS_OK, decode_response, encode_error, encode_ok
from ..identity import Identity
from ..peerlimit import ByteBudget, Charge, KeyedRateLimiter, LogThrottle
from .connection import DataConnection
from .dataplane import DataPlaneServer, connect

log = logging.getLogger(__name__)

Handler = Callable[[str, bytes], Awaitable[bytes]]

#: what one node may have served at once: its work long poll, results, holds, a decline, a pause
MAX_INFLIGHT_PER_PEER = 16
#: reply bodies: a Task is at most 8 MiB (wire.MAX_TASK), a BatchAck far less
MAX_REPLY = 8 * 1024 * 1024 + 64 * 1024
#: frames read (and their requests started) per pass of the trio loop, over all connections. Why:
#: 1,000 nodes whose heartbeats land together were 1,000 reads in one pass (35-55 ms of loop, the
#: heartbeat phase of `echo2 bench intake` at 10,000 nodes, trio instrument); a turn is held only
#: while a frame already in the kernel's buffer is read, never while a peer is waited for
READS_PER_PASS = 16
#: handshakes' signatures and checks per pass (~100 us each): 1,000 nodes dialing at once (a hub
#: restart, the bench's heartbeat phase) were hundreds of them in one pass (40-55 ms of loop)
HANDSHAKES_PER_PASS = 8


def frame_ready(head: bytes, fd: int) -> bool:
    """Whether a whole data-plane frame is in the kernel buffer of socket ``fd`` already, ``head``
    being what a peek at its first HEADER_SIZE bytes got: as many bytes as that header announces."""
    if len(head) < HEADER_SIZE:
        return False
    buf = bytearray(4)
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf)
    except OSError:
        return False
    return int.from_bytes(buf, sys.byteorder) >= HEADER_SIZE + HEADER.unpack(head)[2]


def _peek(sock: trio.socket.SocketType) -> bytes:
    """Up to a header's bytes of what ``sock`` holds, taking none and never waiting: through
    trio's socket object's own stdlib socket where it has one (a peek through trio's async recv
    is a pass of the loop per frame, ~+0.1 ms of hub CPU a heartbeat measured), else nothing."""
    raw = getattr(sock, "_sock", None)
    if not isinstance(raw, socket.socket):
        return b""  # the reader then waits for bytes and reads without a turn
    try:
        return raw.recv(HEADER_SIZE, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:  # BlockingIOError (nothing yet) among them; the receive says what is wrong
        return b""


class ChannelServer:
    """The hub's channel listener. ``handlers``: protocol ID -> the control host's handler."""

    def __init__(
        self,
        identity: Identity,
        handlers: Mapping[str, Handler],
        *,
        allow: Callable[[str], bool],
        host: str = "127.0.0.1",
        port: int = 0,
        rate: Mapping[str, tuple[float, float]] | None = None,
        default_rate: tuple[float, float] = (50.0, 100.0),
        max_inflight_per_peer: int = MAX_INFLIGHT_PER_PEER,
        max_held_per_peer: int = 96 * 1024 * 1024,
        max_held_total: int = 512 * 1024 * 1024,
        handler_timeout_s: float = 30.0,
        max_connections: int = 16_384,
        handshakes_per_ip_per_s: float | None = 20.0,
        refusals: collections.Counter[str] | None = None,
        reads_per_pass: int = READS_PER_PASS,
    ) -> None:
        unknown = set(handlers) - set(OP_BY_PROTOCOL)
        if unknown:
            raise ValueError(f"no channel operation for {sorted(unknown)}")
        self.handlers = dict(handlers)
        self.max_inflight = max_inflight_per_peer
        self.handler_timeout_s = handler_timeout_s
        self.refusals = refusals if refusals is not None else collections.Counter()
        self.requests_served = 0
        self._rates = {p: KeyedRateLimiter(*(rate or {}).get(p, default_rate), max_keys=100_000) for p in self.handlers}
        self._held = ByteBudget(max_held_per_peer, max_held_total)
        self._turns = trio.Semaphore(reads_per_pass)
        self._log = LogThrottle(log)
        largest = max((OP_BY_PROTOCOL[p].max_request for p in self.handlers
                       if OP_BY_PROTOCOL[p].frame is FrameType.MESSAGE), default=0)
        smallest = max((OP_BY_PROTOCOL[p].max_request for p in self.handlers
                        if OP_BY_PROTOCOL[p].frame is FrameType.REQUEST), default=0)
        self.server = DataPlaneServer(
            identity, self._serve, host=host, port=port, allow=allow, max_connections=max_connections,
            max_connections_per_ip=max_connections, max_connections_per_peer=2,
            handshakes_per_ip_per_s=handshakes_per_ip_per_s, handshake_turns=trio.Semaphore(HANDSHAKES_PER_PASS),
            # the frame limits are the largest operation of each kind: checked from the header
            max_sizes={FrameType.MESSAGE: largest, FrameType.REQUEST: smallest, FrameType.CHUNK: 0},
        )

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def addr(self) -> str:
        return self.server.addr

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await self.server.serve(task_status=task_status)

    def _refuse(self, code: str, peer: str, detail: str) -> bytes:
        self.refusals[code] += 1
        self._log.log(logging.WARNING, code, trio.current_time(), "channel: refused a request from %s: [%s] %s",
                      peer, code, detail)
        return encode_error(code, detail)

    async def _serve(self, conn: DataConnection) -> None:
        failed: list[Echo2Error] = []
        async with trio.open_nursery() as nursery:
            try:
                await self._read_requests(conn, nursery)
            except Echo2Error as exc:  # raised bare, outside the nursery: the server counts it by code
                failed.append(exc)
            nursery.cancel_scope.cancel()  # the node said BYE or is gone: what it still waits for is moot
        if failed:
            raise failed[0]

    async def _read_requests(self, conn: DataConnection, nursery: trio.Nursery) -> None:
        peer = conn.peer_id
        inflight = [0]
        while (frame := await self._next_frame(conn)) is not None:  # None: BYE; a dead peer raises
            key = unpack_key(frame.key)  # not one of ours: the connection is dropped
            if key.kind != KIND_REQUEST or frame.type is not key.op.frame:
                raise DecodeError(f"channel: a {frame.type.name} frame where a request was expected")
            op, body = key.op, frame.payload
            handler = self.handlers.get(op.protocol_id)
            reply: bytes | None = None
            charge = Charge([(self._held, peer)])
            if handler is None:
                reply = self._refuse("unsupported", peer, f"{op.protocol_id} is not served on the channel")
            elif len(body) > op.max_request:
                reply = self._refuse("too_large", peer, f"request of {len(body)} bytes exceeds {op.max_request}")
            elif not self._rates[op.protocol_id].allow(peer, trio.current_time()):
                reply = self._refuse("rate_limited", peer, f"more than {self._rates[op.protocol_id].rate_per_s:g} "
                                     f"requests/s on {op.protocol_id}")
            elif inflight[0] >= self.max_inflight:
                reply = self._refuse("too_many_streams", peer, f"more than {self.max_inflight} requests at once")
            elif not charge.take(len(body)):
                charge.release()
                reply = self._refuse("busy", peer, "too many request bytes in flight from this peer; retry later")
            if reply is not None:
                await self._reply(conn, op.code, key.rid, reply)
                continue
            assert handler is not None
            inflight[0] += 1
            nursery.start_soon(self._answer, conn, handler, key.op.code, key.rid, bytes(body), charge, inflight)

    async def _next_frame(self, conn: DataConnection) -> Frame | None:
        """The next request frame, read on one of the server's turns when it is all there already
        (a partial one is read without: the peer is waited for), or None at the peer's BYE.
        Costs no pass of the loop of its own: the header is peeked without a checkpoint, and a
        free turn is taken without one (holding it bounds the readers per pass: each read of a
        frame is a checkpoint)."""
        sock = conn.socket
        head = _peek(sock)
        if len(head) < HEADER_SIZE:
            try:
                await trio.lowlevel.wait_readable(sock.fileno())
            except (OSError, trio.ClosedResourceError):
                pass  # the receive says what is wrong
            head = _peek(sock)
        if not frame_ready(head, sock.fileno()):
            frame = await conn.receive()
        else:
            try:
                self._turns.acquire_nowait()
            except trio.WouldBlock:
                await self._turns.acquire()
            try:
                frame = await conn.receive()
            finally:
                self._turns.release()
        return None if frame.type is FrameType.BYE else frame

    async def _answer(self, conn: DataConnection, handler: Handler, op: int, rid: int, body: bytes, charge: Charge,
                      inflight: list[int]) -> None:
        peer = conn.peer_id
        try:
            with trio.move_on_after(self.handler_timeout_s) as scope:
                try:
                    reply = encode_ok(await handler(peer, body))
                except Echo2Error as exc:
                    reply = self._refuse(exc.code, peer, exc.message)
                except Exception as exc:
                    self.refusals["internal"] += 1
                    log.exception("channel handler for operation %d failed on a request from %s", op, peer)
                    reply = encode_error("internal", f"internal error ({type(exc).__name__})")
            if scope.cancelled_caught:
                reply = self._refuse("timeout", peer, f"no reply within {self.handler_timeout_s:g} s")
        finally:
            charge.release()
            inflight[0] -= 1
        self.requests_served += 1
        await self._reply(conn, op, rid, reply)

    async def _reply(self, conn: DataConnection, op: int, rid: int, reply: bytes) -> None:
        try:
            await conn.send_keyed(FrameType.MESSAGE, pack_key(KIND_REPLY, op, rid), reply)
        except Echo2Error as exc:  # the node is gone: its reader ends the connection
            log.debug("channel reply to %s not sent: %s", conn.peer_id, exc)


class _Waiter:
    __slots__ = ("done", "body", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.body: bytes | None = None
        self.error: Echo2Error | None = None


class ChannelClient:
    """A node's open channel to its hub. Run :meth:`run` in a task (it reads the replies); call
    :meth:`request` from any number of tasks. Once :attr:`up` is False it stays so."""

    def __init__(self, conn: DataConnection) -> None:
        self.conn = conn
        self.peer_id = conn.peer_id
        self.up = True
        self._ids = RequestIds()
        self._waiting: dict[int, _Waiter] = {}

    @classmethod
    async def open(cls, addr: str, identity: Identity, hub_peer: str, *, timeout_s: float = 10.0) -> ChannelClient:
        # the frame limits bound what we send as well as what we read: a result is a MESSAGE of up to
        # 64 MiB, so replies are held to MAX_REPLY by request() (the hub is the one peer trusted here)
        return cls(await connect(addr, identity, hub_peer, timeout_s=timeout_s, max_sizes={FrameType.CHUNK: 0}))

    async def run(self) -> None:
        """Read replies until the connection ends; then every waiting request fails."""
        why = "channel closed"
        try:
            async for frame in self.conn:
                key = unpack_key(frame.key)
                if key.kind != KIND_REPLY or frame.type is not FrameType.MESSAGE:
                    raise DecodeError("channel: a frame that is not a reply from the hub")
                waiter = self._waiting.get(key.rid)
                if waiter is None or not self._ids.done(key.rid):
                    continue  # a reply to a request given up on (timed out): dropped
                waiter.body = bytes(frame.payload)
                waiter.done.set()
        except Echo2Error as exc:
            why = f"channel lost: {exc}"
            log.info("channel to %s ended: %s", self.peer_id, exc)
        finally:
            self._down(why)

    def _down(self, why: str) -> None:
        self.up = False
        for waiter in self._waiting.values():
            if not waiter.done.is_set():
                waiter.error = TransportError(why)
                waiter.done.set()

    async def request(self, protocol_id: str, payload: bytes, *, max_response: int, timeout_s: float) -> bytes:
        """Like :meth:`ControlHost.request <echo2.protocol.net.reqresp.RequestResponse.request>`:
        the reply payload, or RemoteError / Timeout / TransportError / TooLarge."""
        op = OP_BY_PROTOCOL[protocol_id]
        if not self.up:
            raise TransportError("channel is down")
        rid = self._ids.take()
        waiter = _Waiter()
        self._waiting[rid] = waiter
        try:
            with trio.fail_after(timeout_s):
                # A frame cut by cancellation would leave the connection out of step for every
                # other request on it: the send is shielded (bounded by the request's own time),
                # cancellation is honoured while the reply is awaited.
                with trio.CancelScope(shield=True), trio.move_on_after(timeout_s):
                    try:
                        await self.conn.send_keyed(op.frame, pack_key(KIND_REQUEST, op.code, rid), payload)
                    except TransportError as exc:
                        self._down(f"channel lost: {exc}")
                        raise
                await trio.lowlevel.checkpoint_if_cancelled()
                await waiter.done.wait()
        except trio.TooSlowError as exc:
            raise Timeout(f"{protocol_id} on the channel timed out after {timeout_s:g} s") from exc
        finally:
            self._waiting.pop(rid, None)
            self._ids.done(rid)
            if not self.conn.usable:  # cancelled mid-frame: the byte stream is out of step
                self._down("channel lost: a request was cut mid-frame")
        if waiter.error is not None:
            raise waiter.error
        body = waiter.body or b""
        if body[:1] == bytes([STATUS_OK]) and len(body) - 1 > max_response:
            raise TooLarge(f"response of {len(body) - 1} bytes exceeds the limit of {max_response}")
        if body[:1] != bytes([STATUS_OK]) and len(body) - 1 > MAX_ERROR_PAYLOAD:
            raise TooLarge("error reply too large")
        return decode_response(body)

    async def aclose(self) -> None:
        self.up = False
        with trio.CancelScope(shield=True), trio.move_on_after(2.0):
            await self.conn.aclose()
