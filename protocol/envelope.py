"""Signed envelopes: every control message travels in one.

Wire form: a canonical map ``{"d": domain, "k": signer public key (32 bytes), "n": nonce (16 bytes),
"p": payload bytes, "s": signature (64 bytes), "t": created, "x": expires}``. The signature covers
``SIGN_PREFIX + canonical.encode(map without "s")``; the prefix keeps these signatures from ever
being valid for another echo2 or libp2p signing context with the same key.

:func:`open_envelope` checks in this order: size; the envelope's own fields, read in place
(canonical layout, field types and sizes, the domain; the payload stays raw bytes); signature;
signer allowed; expiry; replay; and only then decodes and schema-checks the payload. So a frame
nobody trusted signed costs its receiver a copy of its bytes, a hash and a signature check, never
a payload decode (issue 15, A2: a 4 MB frame of tiny items used to cost +560 MiB and seconds of
loop time). The signature is checked over the bytes as received (the canonical map minus its "s"
entry is a slice of them), never a re-encoding. Each refusal is its own Echo2Error subclass; what
the message *means* is the caller's to judge. Pure: no I/O, the clock is a parameter.
"""

from __future__ import annotations

import math
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

import msgpack

from . import canonical, fastdecode
from .errors import (
    DecodeError,
    Echo2Error,
    Expired,
    SchemaError,
    SignerNotAllowed,
    TooLarge,
    WrongDomain,
)
from .identity import Identity, peer_id_from_public_key, verify_signature
from .messages import MESSAGE_TYPES_BY_DOMAIN, Message
from .replay import PeerReplay, ReplayCheck, ReplayGuard

__all__ = ["PeerReplay", "ReplayCheck", "ReplayGuard", "Verified", "open_envelope", "peek_domain", "seal"]

SIGN_PREFIX = b"echo2-envelope\x00"
NONCE_SIZE = 16
PUBKEY_SIZE = 32
SIGNATURE_SIZE = 64
MAX_DOMAIN_LEN = 128
ENVELOPE_KEYS = frozenset({"d", "p", "k", "t", "x", "n", "s"})
# Room for the largest message type plus the envelope's own fields.
MAX_ENVELOPE_SIZE = max(c.MAX_SIZE for c in MESSAGE_TYPES_BY_DOMAIN.values())

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class Verified(Generic[M]):
    """A message whose envelope passed every check."""

    signer: str  # peer ID of the signing key
    message: M
    created: float
    expires: float
    nonce: bytes
    raw: bytes  # the envelope exactly as received (for relaying or archiving)


def seal(
    identity: Identity,
    msg: Message,
    *,
    ttl_s: float = 60.0,
    now: float | None = None,
    nonce: bytes | None = None,
    payload: bytes | None = None,
) -> bytes:
    """Validate ``msg``, sign it and return the envelope bytes.

    ``payload``: ``canonical.encode(msg.to_wire())`` already made by the caller for a message it
    built itself from typed values (the hub's Tasks: :func:`~.messages.task_payload`, the bytes
    their hash is taken from), signed as given: no second encoding and no ``validate`` round trip
    (together 54 us of the 108 us a Task's seal cost, measured). Never for bytes from outside.
    """
    if not isinstance(msg, Message) or not msg.TYPE:
        raise SchemaError(f"cannot seal {type(msg).__name__}: not a top-level message type")
    if not (math.isfinite(ttl_s) and ttl_s > 0):
        raise SchemaError(f"ttl_s must be a positive finite number, got {ttl_s!r}")
    if payload is None:
        # Refuse locally what a receiver would refuse, with the same message.
        payload = canonical.encode(msg.validate().to_wire())
    created = float(time.time() if now is None else now)
    n = os.urandom(NONCE_SIZE) if nonce is None else bytes(nonce)
    if len(n) != NONCE_SIZE:
        raise SchemaError(f"nonce must be {NONCE_SIZE} bytes, got {len(n)}")
    expires = created + float(ttl_s)
    if not math.isfinite(expires):
        raise SchemaError(f"non-finite float {expires!r} cannot be encoded")
    # The canonical layout written directly (keys d k n p [s] t x in order, as _read_fixed reads
    # it) instead of canonical.encode of the map twice, once without "s" to sign and once with it
    head = b"".join((b"\xa1d", msgpack.packb(msg.DOMAIN), b"\xa1k\xc4\x20", identity.public_bytes,
                     b"\xa1n\xc4\x10", n, b"\xa1p", _bin_header(len(payload))))
    tail = b"".join((b"\xa1t\xcb", struct.pack(">d", created), b"\xa1x\xcb", struct.pack(">d", expires)))
    sig = identity.sign(b"".join((SIGN_PREFIX, b"\x86", head, payload, tail)))
    data = b"".join((b"\x87", head, payload, b"\xa1s\xc4\x40", sig, tail))
    if len(data) > msg.MAX_SIZE:
        raise TooLarge(f"{msg.TYPE} envelope of {len(data)} bytes exceeds the limit of {msg.MAX_SIZE}")
    return data


def _bin_header(n: int) -> bytes:
    """msgpack's shortest bin header for ``n`` bytes (the canonical form)."""
    if n < 256:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 65536:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def _expected_types(expected: type[Message] | tuple[type[Message], ...]) -> tuple[type[Message], ...]:
    types = expected if isinstance(expected, tuple) else (expected,)
    for t in types:
        if not (isinstance(t, type) and issubclass(t, Message) and t.TYPE):
            raise TypeError(f"expected must be message types, got {t!r}")
    return types


def _kind(first: int) -> str:
    """The Python type name of the msgpack value starting with byte ``first`` (for messages)."""
    if first <= 0x7F or first >= 0xE0 or 0xCC <= first <= 0xD3:
        return "int"
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        return "dict"
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        return "list"
    if 0xA0 <= first <= 0xBF or first in (0xD9, 0xDA, 0xDB):
        return "str"
    if first in (0xC4, 0xC5, 0xC6):
        return "bytes"
    if first in (0xCA, 0xCB):
        return "float"
    if first in (0xC2, 0xC3):
        return "bool"
    return {0xC0: "NoneType", 0xC1: "invalid"}.get(first, "ext")


def _shortest_form(first: int, total: int) -> bool:
    """Whether a str or bin value of ``total`` encoded bytes starting with ``first`` uses the
    shortest length form, as the canonical encoding does."""
    if 0xA0 <= first <= 0xBF:
        return True  # fixstr: the length is in the byte itself
    header = {0xD9: 2, 0xDA: 3, 0xDB: 5, 0xC4: 2, 0xC5: 3, 0xC6: 5}[first]
    n = total - header
    if first in (0xC4, 0xC5, 0xC6):
        return first == (0xC4 if n < 256 else 0xC5 if n < 65536 else 0xC6)
    return n >= 32 and first == (0xD9 if n < 256 else 0xDA if n < 65536 else 0xDB)


@dataclass(frozen=True)
class _Fields:
    """An envelope's own fields; the payload as its place in the received bytes."""

    domain: str
    key: bytes
    nonce: bytes
    signature: bytes
    created: float
    expires: float
    payload: slice


# The fields read as values, each only when its header shows the type and size the schema wants;
# anything else is stepped over unread (msgpack's C skip), so no field can make us build objects.
_BIN_FIELDS = {"k": PUBKEY_SIZE, "n": NONCE_SIZE, "s": SIGNATURE_SIZE}
_MAX_FIELDS = 2 * len(ENVELOPE_KEYS)  # past this, no need to read on to know the envelope is wrong


def _read_envelope(mv: memoryview) -> _Fields:
    """The envelope's fields read in place: DecodeError unless ``mv`` is canonical msgpack as far as
    read, SchemaError unless the fields are exactly the envelope's. The payload is not decoded."""
    return _read_fixed(mv) or _read_any(mv)


def _entry(mv: memoryview, at: int, head: bytes, size: int) -> bytes | None:
    """The ``size`` bytes after ``head`` at ``at``, or None if ``head`` is not there."""
    end = at + len(head)
    return bytes(mv[end : end + size]) if bytes(mv[at:end]) == head and end + size <= len(mv) else None


def _read_fixed(mv: memoryview) -> _Fields | None:
    """The fields of an envelope laid out exactly as :func:`seal` writes it, read without a copy of
    the frame; None for anything else, which :func:`_read_any` then reads and names the fault of."""
    if len(mv) < 4 or bytes(mv[:3]) != b"\x87\xa1d":
        return None
    first = mv[3]
    if 0xA0 <= first <= 0xBF:
        head, n = 1, first & 0x1F
    elif first in (0xD9, 0xDA) and len(mv) > 5:
        head = 2 if first == 0xD9 else 3
        n = int.from_bytes(mv[4 : 3 + head], "big")
    else:
        return None
    if not _shortest_form(first, head + n):
        return None
    try:
        domain = str(mv[3 + head : 3 + head + n], "utf-8")
    except UnicodeDecodeError:
        return None
    at = 3 + head + n
    key = _entry(mv, at, b"\xa1k\xc4\x20", PUBKEY_SIZE)
    nonce = _entry(mv, at + 4 + PUBKEY_SIZE, b"\xa1n\xc4\x10", NONCE_SIZE)
    at += 8 + PUBKEY_SIZE + NONCE_SIZE
    plen = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(mv[at + 2]) if at + 2 < len(mv) else None
    if key is None or nonce is None or plen is None or bytes(mv[at : at + 2]) != b"\xa1p":
        return None
    start = at + 3 + plen
    end = start + int.from_bytes(mv[at + 3 : start], "big")
    if not _shortest_form(mv[at + 2], end - at - 2):
        return None
    sig = _entry(mv, end, b"\xa1s\xc4\x40", SIGNATURE_SIZE)
    t = _entry(mv, end + 4 + SIGNATURE_SIZE, b"\xa1t\xcb", 8)
    x = _entry(mv, end + 15 + SIGNATURE_SIZE, b"\xa1x\xcb", 8)
    if sig is None or t is None or x is None or end + 26 + SIGNATURE_SIZE != len(mv):
        return None
    created, expires = struct.unpack(">d", t)[0], struct.unpack(">d", x)[0]
    if len(domain) > MAX_DOMAIN_LEN or not (math.isfinite(created) and math.isfinite(expires)) or expires < created:
        return None
    return _Fields(domain, key, nonce, sig, created, expires, slice(start, end))


def _read_any(mv: memoryview) -> _Fields:
    """:func:`_read_envelope` for any input: walks whatever map it is given (stepping over values
    it has no use for) to say exactly what is wrong with it."""
    size = len(mv)
    if not size:
        raise DecodeError("empty envelope")
    up = msgpack.Unpacker(raw=False, max_buffer_size=size, timestamp=0)
    up.feed(mv)
    got: dict[str, Any] = {}
    wrong: set[str] = set()
    try:
        if _kind(mv[0]) != "dict":
            up.skip()
            if up.tell() != size:
                raise DecodeError("trailing bytes after the envelope")
            raise SchemaError(f"envelope: expected map, got {_kind(mv[0])}")
        count = up.read_map_header()
        if count > _MAX_FIELDS:
            raise SchemaError(f"envelope: {count} fields, expected {len(ENVELOPE_KEYS)}")
        prev: bytes | None = None
        for _ in range(count):
            at = up.tell()
            if at >= size:
                raise DecodeError(f"envelope is truncated: {count} fields announced")
            if _kind(mv[at]) != "str":
                raise DecodeError(f"envelope: map key must be str, got {_kind(mv[at])}")
            name = up.unpack()
            raw_name = name.encode()
            if not _shortest_form(mv[at], up.tell() - at) or (prev is not None and raw_name <= prev):
                raise DecodeError("envelope is not in canonical form (key order, duplicate keys or length forms)")
            prev = raw_name
            at = up.tell()
            if at >= size:
                raise DecodeError(f"envelope is truncated after field {name[:32]!r}")
            first = mv[at]
            if name == "p" and _kind(first) == "bytes":
                up.skip()
                if not _shortest_form(first, up.tell() - at):
                    raise DecodeError("envelope.p: not in canonical form (length form)")
                got[name] = slice(at + {0xC4: 2, 0xC5: 3, 0xC6: 5}[first], up.tell())
            elif (
                (name in _BIN_FIELDS and first == 0xC4 and mv[at + 1] == _BIN_FIELDS[name])
                or (name in ("t", "x") and first == 0xCB)
                or (name == "d" and _kind(first) == "str")
            ):
                got[name] = up.unpack()
                if name == "d" and not _shortest_form(first, up.tell() - at):
                    raise DecodeError("envelope.d: not in canonical form (length form)")
            else:
                up.skip()
                wrong.add(name)
        if up.tell() != size:
            raise DecodeError("trailing bytes after the envelope")
    except Echo2Error:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise DecodeError(f"malformed msgpack: {type(exc).__name__}: {str(exc)[:120]}") from exc
    del up  # its copy of the frame goes before the signed bytes are built

    keys = set(got) | wrong
    if keys != ENVELOPE_KEYS:
        extra = sorted(str(k)[:32] for k in keys - ENVELOPE_KEYS)
        missing = sorted(ENVELOPE_KEYS - keys)
        raise SchemaError(f"envelope: unknown field(s) {extra}, missing field(s) {missing}")
    d = got.get("d")
    if d is None or len(d) > MAX_DOMAIN_LEN:
        raise SchemaError(f"envelope.d: expected str of <= {MAX_DOMAIN_LEN} chars")
    for name, n in _BIN_FIELDS.items():
        if name in wrong:
            raise SchemaError(f"envelope.{name}: expected {n} bytes")
    if "p" in wrong:
        raise SchemaError("envelope.p: expected bytes")
    for name in ("t", "x"):
        if name in wrong or not math.isfinite(got[name]):
            raise SchemaError(f"envelope.{name}: expected a finite float")
    if got["x"] < got["t"]:
        raise SchemaError("envelope: expires before it was created")
    return _Fields(d, got["k"], got["n"], got["s"], got["t"], got["x"], got["p"])


# In canonical key order the signature entry is the fifth of seven (d k n p s t x) and only the two
# float64 entries follow it, so its place in a canonical envelope is fixed from the end.
_TAIL = 2 * (2 + 9)  # "t" and "x": fixstr key + float64
_SIG_ENTRY = 2 + 2 + SIGNATURE_SIZE  # "s": fixstr key + bin8 header + 64 bytes


def _signed_bytes(data: bytes | bytearray | memoryview) -> bytes:
    """``SIGN_PREFIX + canonical.encode(envelope without "s")``, cut from the canonical ``data``.

    Only for ``data`` that decoded as canonical and passed the envelope schema.
    """
    mv = memoryview(data)
    sig_at = len(mv) - _TAIL - _SIG_ENTRY
    if mv[0] != 0x80 | len(ENVELOPE_KEYS) or bytes(mv[sig_at : sig_at + 4]) != b"\xa1s\xc4\x40":
        raise DecodeError("envelope layout is not canonical")  # unreachable after canonical.decode
    return b"".join(
        (SIGN_PREFIX, bytes([0x80 | (len(ENVELOPE_KEYS) - 1)]), mv[1:sig_at], mv[len(mv) - _TAIL :])
    )


@overload
def open_envelope(
    data: bytes | bytearray | memoryview,
    expected: type[M],
    *,
    now: float | None = None,
    replay: ReplayCheck | None,
    allowed: Callable[[str, type], bool] | None = None,
    max_size: int | None = None,
    clock_skew_s: float = 30.0,
    covered: bool = False,
) -> Verified[M]: ...


@overload
def open_envelope(
    data: bytes | bytearray | memoryview,
    expected: tuple[type[Message], ...],
    *,
    now: float | None = None,
    replay: ReplayCheck | None,
    allowed: Callable[[str, type], bool] | None = None,
    max_size: int | None = None,
    clock_skew_s: float = 30.0,
    covered: bool = False,
) -> Verified[Any]: ...


def open_envelope(
    data: bytes | bytearray | memoryview,
    expected: type[Message] | tuple[type[Message], ...],
    *,
    now: float | None = None,
    replay: ReplayCheck | None,
    allowed: Callable[[str, type], bool] | None = None,
    max_size: int | None = None,
    clock_skew_s: float = 30.0,
    covered: bool = False,
) -> Verified[Any]:
    """Verify an envelope carrying one of the ``expected`` message types and return it.

    ``allowed(signer_peer_id, message_class)`` decides who may send what; ``replay=None`` skips
    the nonce check (only for messages whose replay is harmless, e.g. idempotent queries).
    ``covered=True``: ``data`` came whole inside an envelope whose signature the caller has
    verified (an item of a ResultBatch), so its bytes are already authenticated: the Ed25519 check
    of its own signature is skipped, every other step is not (the signer is still read from its
    key, and ``allowed`` must then demand the outer envelope's signer).
    """
    types = _expected_types(expected)
    limit = max(t.MAX_SIZE for t in types) if max_size is None else max_size

    # 1. size
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"envelope is not bytes ({type(data).__name__})")
    try:
        mv = memoryview(data).cast("B")
    except TypeError as exc:
        raise DecodeError("envelope is not a contiguous byte buffer") from exc
    size = len(mv)
    if size > limit:
        raise TooLarge(f"envelope of {size} bytes exceeds the limit of {limit} bytes")

    # 2. the envelope's own fields (a fixed canonical layout), the domain among them; the payload
    # stays raw bytes: decoding what nobody trusted signed is what made a bad frame expensive
    env = _read_envelope(mv)
    by_domain = {t.DOMAIN: t for t in types}
    cls = by_domain.get(env.domain)
    if cls is None:
        known = MESSAGE_TYPES_BY_DOMAIN.get(env.domain)
        what = f"a {known.TYPE} message" if known is not None else f"unknown domain {env.domain[:64]!r}"
        raise WrongDomain(f"expected {sorted(by_domain)}, got {what}")
    if max_size is None and size > cls.MAX_SIZE:  # a small type must not ride under a large one's limit
        raise TooLarge(f"{cls.TYPE} envelope of {size} bytes exceeds the limit of {cls.MAX_SIZE} bytes")

    # 3. signature, over the bytes as received (no re-encoding of a payload of up to 64 MiB)
    if not covered:
        verify_signature(env.key, env.signature, _signed_bytes(mv))
    signer = peer_id_from_public_key(env.key)

    # 4. signer allowed for this message type
    if allowed is not None and not allowed(signer, cls):
        raise SignerNotAllowed(f"{signer} may not send {cls.TYPE} messages")

    # 5. expiry, including created too far in the future
    t_now = time.time() if now is None else float(now)
    if t_now > env.expires:
        raise Expired(f"{cls.TYPE} from {signer} expired {t_now - env.expires:.1f}s ago")
    if env.created > t_now + clock_skew_s:
        raise Expired(
            f"{cls.TYPE} from {signer} is dated {env.created - t_now:.1f}s in the future "
            f"(allowed clock skew {clock_skew_s:.0f}s)"
        )
    if replay is not None and env.expires > t_now + replay.window_s:
        raise Expired(
            f"{cls.TYPE} from {signer} expires {env.expires - t_now:.0f}s from now, "
            f"beyond the {replay.window_s:.0f}s replay window"
        )

    # 6. replay
    if replay is not None:
        replay.check_and_add(signer, env.nonce, env.expires, t_now)

    # 7. the payload, decoded and schema-checked in one go (fastdecode), now that a known signer
    # vouches for it; its size is already within the type's limit
    message = fastdecode.decode_payload(cls, bytes(mv[env.payload]), max_size=limit)

    return Verified(
        signer=signer,
        message=message,
        created=env.created,
        expires=env.expires,
        nonce=env.nonce,
        raw=bytes(data),
    )


def peek_domain(data: bytes | bytearray | memoryview) -> str:
    """The domain of an envelope, without verifying anything (for dispatch by type only).

    Reads only the first map entry: in canonical key order "d" always comes first.
    """
    try:
        size = len(data)
    except TypeError as exc:
        raise DecodeError(f"envelope is not bytes ({type(data).__name__})") from exc
    if size > MAX_ENVELOPE_SIZE:
        raise TooLarge(f"envelope of {size} bytes exceeds the limit of {MAX_ENVELOPE_SIZE} bytes")
    try:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=max(size, 1))
        unpacker.feed(bytes(data))
        n = unpacker.read_map_header()
        key = unpacker.unpack() if n else None
        domain = unpacker.unpack() if key == "d" else None
    except Echo2Error:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise DecodeError(f"not an envelope: {type(exc).__name__}") from exc
    if n != len(ENVELOPE_KEYS) or key != "d":
        raise DecodeError("not an envelope: first field is not the domain")
    if type(domain) is not str or len(domain) > MAX_DOMAIN_LEN:
        raise SchemaError(f"envelope.d: expected str of <= {MAX_DOMAIN_LEN} chars")
    return domain


def signed_at(data: bytes | bytearray | memoryview) -> float:
    """When the envelope says it was signed, read without verifying anything: for checking a
    kept envelope (a receipt) long after it expired, as ``open_envelope(..., now=signed_at(data))``."""
    size = len(data)
    if size > MAX_ENVELOPE_SIZE:
        raise TooLarge(f"envelope of {size} bytes exceeds the limit of {MAX_ENVELOPE_SIZE} bytes")
    return _read_envelope(memoryview(data).cast("B")).created
