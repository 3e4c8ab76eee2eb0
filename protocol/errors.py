"""One error type per refusal reason.

Every input from the network that is refused raises a subclass of :class:`Echo2Error`, carrying a
stable machine-readable ``code`` (sent back in Error replies, counted in metrics) and a
human-readable message. Decoders must never let another exception type escape.
"""

from __future__ import annotations


class Echo2Error(Exception):
    """Base of every error echo2 raises on purpose."""

    code: str = "error"

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__doc__ or self.code)
        self.message = message or (self.__class__.__doc__ or self.code).strip()

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class ProtocolError(Echo2Error):
    """Base of refusals of network input."""

    code = "protocol"


class TooLarge(ProtocolError):
    """Input exceeds the size limit."""

    code = "too_large"


class DecodeError(ProtocolError):
    """Input is not a valid canonical encoding."""

    code = "decode"


class SchemaError(ProtocolError):
    """Input does not match the message schema."""

    code = "schema"


class BadSignature(ProtocolError):
    """Signature does not verify."""

    code = "bad_signature"


class SignerNotAllowed(ProtocolError):
    """Signer is not allowed to send this message type."""

    code = "signer_not_allowed"


class Expired(ProtocolError):
    """Message is expired or not yet valid."""

    code = "expired"


class Replay(ProtocolError):
    """Message nonce was already seen."""

    code = "replay"


class WrongDomain(ProtocolError):
    """Message type or protocol version is not the expected one."""

    code = "wrong_domain"


class MeaningError(ProtocolError):
    """Message is well-formed and authentic but refused on its meaning."""

    code = "meaning"


class RateLimited(ProtocolError):
    """Request refused for rate; retry after ``retry_after_s``.

    Raised by a request handler whose own bucket refused the request: the transport answers with
    ``rate_limited`` and reads nothing more from the requester's connection for ``retry_after_s``
    (see :mod:`echo2.protocol.net.yamux_guard`), so a peer that ignores the refusal and asks again
    at once costs the server nothing until then.
    """

    code = "rate_limited"

    def __init__(self, message: str = "", retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after_s = max(0.0, float(retry_after_s))


class ChunkMismatch(ProtocolError):
    """Chunk bytes do not match the manifest."""

    code = "chunk_mismatch"


class ManifestError(ProtocolError):
    """Manifest is inconsistent."""

    code = "manifest"


class TransportError(Echo2Error):
    """Network transport failed (dead peer, timeout, truncated stream)."""

    code = "transport"


class HandshakeError(TransportError):
    """Peer failed to prove its identity."""

    code = "handshake"


class Timeout(TransportError):
    """Operation timed out."""

    code = "timeout"


class IdentityError(Echo2Error):
    """Key file is missing, malformed or has unsafe permissions."""

    code = "identity"


class NotAdmitted(SignerNotAllowed):
    """Peer is not admitted (or no longer: the hub restarted or banned it); request admission."""

    code = "not_admitted"
