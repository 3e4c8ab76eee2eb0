"""Frames of the bulk data plane (sans-IO): header layout, frame types, their size limits.

Frame = header ``type u8 | key 32 bytes | length u64`` (big endian) + body. The receiver checks
the length against a per-type limit before any of the body is read. Types:

- ``CHUNK``: key = blake3 digest of the body as carried (for policy chunks: the encoded bytes,
  i.e. ``ManifestChunk.enc_hash``); verified on arrival.
- ``REQUEST``: small canonical payload (e.g. a ``ChunkRequest``).
- ``MESSAGE``: a signed envelope (e.g. a ``Manifest``), opened by the layer above.
- ``ERROR``: ``code`` and ``message`` as UTF-8, separated by a newline (see :func:`parse_error`).
- ``BYE``: clean end.

The connection that moves these frames is ``echo2.protocol.net.connection``.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import TransportError
from .hashing import digest

HEADER = struct.Struct(">B32sQ")
HEADER_SIZE = HEADER.size
KEY_SIZE = 32
ZERO_KEY = bytes(KEY_SIZE)

MiB = 1024 * 1024


class FrameType(enum.IntEnum):
    CHUNK = 1
    REQUEST = 2
    MESSAGE = 3
    ERROR = 4
    BYE = 5


DEFAULT_MAX_SIZES: Mapping[FrameType, int] = {
    FrameType.CHUNK: 32 * MiB,  # packing chunks are a few MiB; zstd never grows them much
    FrameType.REQUEST: 1 * MiB,  # a ChunkRequest of 100000 indices is < 600 KB
    FrameType.MESSAGE: 64 * MiB + 64 * 1024,  # Manifest.MAX_SIZE is 64 MiB
    FrameType.ERROR: 4096,
    FrameType.BYE: 0,
}


@dataclass(frozen=True, slots=True)
class Frame:
    """A received frame. ``payload`` is a bytearray (received in place, never copied)."""

    type: FrameType
    key: bytes
    payload: bytearray


def chunk_key(data: bytes | bytearray | memoryview) -> bytes:
    """The key a CHUNK frame carries: the project's content hash (blake3) of the body."""
    return digest(data)


def encode_error(code: str, message: str) -> bytes:
    """ERROR frame payload."""
    body = code.encode()[:64] + b"\n" + message.encode()
    return body[: DEFAULT_MAX_SIZES[FrameType.ERROR]]


def parse_error(payload: bytes | bytearray) -> tuple[str, str]:
    """``(code, message)`` of an ERROR frame; undecodable bytes are replaced, never raised."""
    code, _, message = bytes(payload).partition(b"\n")
    return code.decode("utf-8", "replace")[:64], message.decode("utf-8", "replace")


def parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``; ``TransportError`` if malformed."""
    host, sep, port_s = addr.rpartition(":")
    if not sep or not host or not port_s.isdigit():
        raise TransportError(f"bad data-plane address {addr[:100]!r} (want host:port)")
    port = int(port_s)
    if not 0 < port < 65536:
        raise TransportError(f"bad data-plane port in {addr[:100]!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port
