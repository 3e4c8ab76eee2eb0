"""Length-prefixed frames and the one-byte-status response format of the control plane (sans-IO).

Frame = 4-byte big-endian unsigned length + body. A fixed 4-byte prefix rather than an unsigned
varint: the header is always read with one exact read, there is no over-long/non-minimal varint
form to reject, and the size check happens on a plain integer before a single body byte is read
or any buffer is allocated. The length is limited per protocol by the receiver (``max_size``).

Response body = 1 status byte + payload. Status 0: payload is the handler's reply. Status 1:
payload is ``canonical.encode({"code": str, "message": str})`` (the shape of
``messages.ErrorReply``), which the requester turns into :class:`RemoteError`.
"""

from __future__ import annotations

import struct
from typing import Any

from . import canonical
from .errors import DecodeError, ProtocolError, TooLarge

HEADER_SIZE = 4
MAX_FRAME_LIMIT = 2**32 - 1
STATUS_OK = 0
STATUS_ERROR = 1
# An error reply is tiny; a bigger one is hostile, so it is refused before decoding.
MAX_ERROR_PAYLOAD = 2048
MAX_CODE_LEN = 64
MAX_MESSAGE_LEN = 1024

_HEADER = struct.Struct(">I")


class RemoteError(ProtocolError):
    """The remote peer refused the request with an error reply."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(message or code)
        # Per instance: the code is the remote's, so metrics and callers can branch on it.
        self.code = code


def encode_header(length: int, *, max_size: int) -> bytes:
    if length < 0 or length > MAX_FRAME_LIMIT:
        raise TooLarge(f"frame length {length} cannot be encoded")
    if length > max_size:
        raise TooLarge(f"frame of {length} bytes exceeds the limit of {max_size}")
    return _HEADER.pack(length)


def encode_frame(body: bytes, *, max_size: int = MAX_FRAME_LIMIT) -> bytes:
    return encode_header(len(body), max_size=max_size) + body


def decode_header(header: bytes, *, max_size: int) -> int:
    """The body length announced by a 4-byte header; TooLarge if it exceeds ``max_size``."""
    if len(header) != HEADER_SIZE:
        raise DecodeError(f"frame header must be {HEADER_SIZE} bytes, got {len(header)}")
    (length,) = _HEADER.unpack(header)
    if length > max_size:
        raise TooLarge(f"frame of {length} bytes exceeds the limit of {max_size}")
    return int(length)


class FrameDecoder:
    """Incremental decoder: feed arbitrary byte slices, get whole frame bodies out.

    The size check fires as soon as the 4 header bytes are in, so an oversized frame is refused
    without buffering its body.
    """

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._buf = bytearray()
        self._need: int | None = None

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out: list[bytes] = []
        while True:
            if self._need is None:
                if len(self._buf) < HEADER_SIZE:
                    return out
                self._need = decode_header(bytes(self._buf[:HEADER_SIZE]), max_size=self.max_size)
                del self._buf[:HEADER_SIZE]
            if len(self._buf) < self._need:
                return out
            out.append(bytes(self._buf[: self._need]))
            del self._buf[: self._need]
            self._need = None

    @property
    def pending(self) -> int:
        """Bytes held for an incomplete frame (non-zero at EOF means a truncated frame)."""
        return len(self._buf) + (HEADER_SIZE if self._need is not None else 0)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def encode_ok(payload: bytes) -> bytes:
    return bytes([STATUS_OK]) + payload


def encode_error(code: str, message: str) -> bytes:
    body = {"code": _clip(code, MAX_CODE_LEN), "message": _clip(message, MAX_MESSAGE_LEN)}
    return bytes([STATUS_ERROR]) + canonical.encode(body)


def decode_response(body: bytes) -> bytes:
    """The payload of an ok response; raises RemoteError for an error reply, DecodeError if malformed."""
    if not body:
        raise DecodeError("empty response frame")
    status = body[0]
    if status == STATUS_OK:
        return body[1:]
    if status != STATUS_ERROR:
        raise DecodeError(f"unknown response status {status}")
    if len(body) - 1 > MAX_ERROR_PAYLOAD:
        raise TooLarge(f"error reply of {len(body) - 1} bytes exceeds {MAX_ERROR_PAYLOAD}")
    decoded: Any = canonical.decode(body[1:], max_size=MAX_ERROR_PAYLOAD)
    if (
        not isinstance(decoded, dict)
        or set(decoded) != {"code", "message"}
        or not isinstance(decoded["code"], str)
        or not isinstance(decoded["message"], str)
        or len(decoded["code"]) > MAX_CODE_LEN
        or len(decoded["message"]) > MAX_MESSAGE_LEN
    ):
        raise DecodeError("malformed error reply")
    raise RemoteError(decoded["code"], decoded["message"])
