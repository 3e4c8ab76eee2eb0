"""The data plane's mutual handshake, its bytes and rules (sans-IO; the exchange itself is in
``echo2.protocol.net.dataplane``).

Both sides send at once, so it costs two round trips:

1. each side sends ``HELLO`` = magic ``b"echo2dp\\x00"`` | version u16 | Ed25519 public key (32)
   | fresh random nonce (32);
2. each side sends its signature over ``b"echo2-dataplane-v1" | dialer nonce | listener nonce |
   dialer key | listener key | role`` where role is ``b"D"`` (dialer) or ``b"L"`` (listener): both
   nonces make the proof fresh, both keys bind it to this pair, the role byte makes a reflected
   signature useless;
3. the listener answers one byte: accepted (1) or refused (0), so a dialer that is not allowed
   learns it from ``connect`` rather than from its first read.
"""

from __future__ import annotations

import struct

from .errors import HandshakeError

PROTOCOL_VERSION = 1
HELLO_MAGIC = b"echo2dp\x00"
SIG_DOMAIN = b"echo2-dataplane-v1"
HELLO = struct.Struct(">8sH32s32s")
SIG_SIZE = 64
ACCEPTED = b"\x01"
REFUSED = b"\x00"
ROLE_DIALER = b"D"
ROLE_LISTENER = b"L"


class HandshakeRefused(HandshakeError):
    """Peer failed to prove its identity or was not allowed."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        #: short machine-readable reason, counted in ``refusals`` as ``"handshake.<reason>"``
        self.reason = reason


def encode_hello(public_key: bytes, nonce: bytes) -> bytes:
    return HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, public_key, nonce)


def parse_hello(data: bytes) -> tuple[bytes, bytes]:
    """``(public key, nonce)`` of a peer's hello; HandshakeRefused if it is not ours."""
    magic, version, key, nonce = HELLO.unpack(data)
    if magic != HELLO_MAGIC:
        raise HandshakeRefused("bad_hello", "peer does not speak the echo2 data plane")
    if version != PROTOCOL_VERSION:
        raise HandshakeRefused(
            "version", f"peer speaks data-plane version {version}, we speak {PROTOCOL_VERSION}"
        )
    return key, nonce


def transcript(dialer_nonce: bytes, listener_nonce: bytes, dialer_key: bytes, listener_key: bytes) -> bytes:
    """What both sides sign (each followed by its own role byte)."""
    return SIG_DOMAIN + dialer_nonce + listener_nonce + dialer_key + listener_key
