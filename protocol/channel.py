"""The node's long-lived channel to its hub (issue 20, item 2), sans-IO: what rides on it and how
a request and its reply are named.

Why the data plane's authenticated TCP and not a persistent libp2p stream. Measured on 127.0.0.1
(2 shared cores, hub in its own process, CPU from /proc, 2 clients x 500 request/reply pairs of
300 bytes, connection set-up included; ``python -m echo2.bench.channel_cost``): a fresh py-libp2p stream per
request cost the hub 4.4-5.5 ms of CPU a message, one persistent libp2p stream with our framing
1.0-1.2 ms (Noise, Yamux and trio's stream layers remain on every message), the data plane's
connection 0.26-0.31 ms (4 runs, contended machine). Only the last comes near the 0.3 ms a
heartbeat target, whose handler alone costs the hub ~0.3 ms more (bench intake, in-process). Nothing on the
channel needs the transport's encryption for integrity: every payload is a signed envelope whose
signature is checked over its raw bytes, and the connection itself is authenticated both ways
with the peers' libp2p keys (:mod:`echo2.protocol.handshake`), so the peer ID a request is
served under is proven, as on a libp2p stream. Identity, admission, announcements and gossip stay
on the standard libp2p control plane; the channel is an optimisation the node falls back from.

Frames are data-plane frames (:mod:`.dataframe`): the 32-byte key of the header names the frame
(:func:`pack_key`), so the receiver knows the operation, and with it the size limit, before a
byte of the body is read. A request for a control operation (heartbeat long poll, holds, decline,
pause) travels as a REQUEST frame (1 MiB limit); a result or a batch of results as a MESSAGE
frame (64 MiB); replies always as MESSAGE frames, their body the control plane's response format
(:func:`echo2.protocol.framing.encode_ok` / ``encode_error``), so a reply on the channel reads
exactly like the same reply on a libp2p stream.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from .dataframe import KEY_SIZE, FrameType
from .errors import DecodeError
from .wire import DECLINE, HOLDS, MAX_CONTROL_REQUEST, MAX_RESULT, PAUSE, RESULT, RESULTS, WORK

#: first byte of every channel key: a frame of another protocol on the connection is refused
MAGIC = 0xEC
VERSION = 1
KIND_REQUEST = 1
KIND_REPLY = 2

_KEY = struct.Struct(">BBBBI")
_PAD = bytes(KEY_SIZE - _KEY.size)


@dataclass(frozen=True)
class Op:
    code: int
    protocol_id: str
    frame: FrameType  # what a request for it travels as
    max_request: int


OPS: tuple[Op, ...] = (
    Op(1, WORK, FrameType.REQUEST, 64 * 1024),
    Op(2, RESULT, FrameType.MESSAGE, MAX_RESULT),
    Op(3, RESULTS, FrameType.MESSAGE, MAX_RESULT),
    Op(4, HOLDS, FrameType.REQUEST, 64 * 1024),
    Op(5, DECLINE, FrameType.REQUEST, 64 * 1024),
    Op(6, PAUSE, FrameType.REQUEST, 64 * 1024),
)
OP_BY_CODE = {op.code: op for op in OPS}
OP_BY_PROTOCOL = {op.protocol_id: op for op in OPS}
assert all(op.max_request <= MAX_CONTROL_REQUEST or op.frame is FrameType.MESSAGE for op in OPS)

#: request ids wrap at 2**32; a node never has anywhere near that many outstanding
RID_MODULUS = 1 << 32


def pack_key(kind: int, op: int, rid: int) -> bytes:
    return _KEY.pack(MAGIC, VERSION, kind, op, rid % RID_MODULUS) + _PAD


@dataclass(frozen=True)
class Key:
    kind: int
    op: Op
    rid: int


def unpack_key(key: bytes) -> Key:
    """The frame a key names; DecodeError for a key that is not one of ours (the connection is
    then out of step with its peer's protocol and is dropped)."""
    if len(key) != KEY_SIZE:
        raise DecodeError(f"channel key must be {KEY_SIZE} bytes, got {len(key)}")
    magic, version, kind, code, rid = _KEY.unpack_from(key)
    if magic != MAGIC or version != VERSION or key[_KEY.size :] != _PAD:
        raise DecodeError("not a channel frame (bad magic, version or padding)")
    if kind not in (KIND_REQUEST, KIND_REPLY):
        raise DecodeError(f"unknown channel frame kind {kind}")
    op = OP_BY_CODE.get(code)
    if op is None:
        raise DecodeError(f"unknown channel operation {code}")
    return Key(kind, op, rid)


class RequestIds:
    """Request ids of one side's outstanding requests: unique among those still waiting."""

    def __init__(self) -> None:
        self._next = 1
        self.pending: set[int] = set()

    def take(self) -> int:
        while self._next in self.pending:
            self._next = (self._next + 1) % RID_MODULUS
        rid = self._next
        self._next = (self._next + 1) % RID_MODULUS
        self.pending.add(rid)
        return rid

    def done(self, rid: int) -> bool:
        """Forget ``rid``; False if it was not waiting (a reply nobody asked for)."""
        if rid in self.pending:
            self.pending.discard(rid)
            return True
        return False


def batch_prefix(sizes: Sequence[int], *, max_count: int, max_bytes: int) -> int:
    """How many of the leading items (by envelope size) go in one batch: at least one (a single
    item is sent alone whatever its size), then as many as fit both bounds."""
    if not sizes:
        return 0
    n, total = 1, sizes[0]
    while n < len(sizes) and n < max_count and total + sizes[n] <= max_bytes:
        total += sizes[n]
        n += 1
    return n
