"""Signed envelopes: every control message travels in one.

Wire form: a canonical map ``{"d": domain, "k": signer public key (32 bytes), "n": nonce (16 bytes),
"p": payload bytes, "s": signature (64 bytes), "t": created, "x": expires}``. The signature covers
``SIGN_PREFIX + canonical.encode(map without "s")``; the prefix keeps these signatures from ever
being valid for another echo2 or libp2p signing context with the same key.

:func:`open_envelope` checks in the order of the design brief: size, decoding, schema (incl. the
domain), signature, signer allowed, expiry, replay. The signature is checked over the bytes
as received (the canonical map minus its "s" entry is a slice of them), never a re-encoding. Each refusal is its own Echo2Error subclass;
what the message *means* is the caller's to judge. Pure: no I/O, the clock is a parameter.
"""

from __future__ import annotations

import heapq
import math
import os
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
    Replay,
    SchemaError,
    SignerNotAllowed,
    TooLarge,
    WrongDomain,
)
from .identity import Identity, peer_id_from_public_key, verify_signature
from .messages import MESSAGE_TYPES_BY_DOMAIN, Message

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
) -> bytes:
    """Validate ``msg``, sign it and return the envelope bytes."""
    if not isinstance(msg, Message) or not msg.TYPE:
        raise SchemaError(f"cannot seal {type(msg).__name__}: not a top-level message type")
    if not (math.isfinite(ttl_s) and ttl_s > 0):
        raise SchemaError(f"ttl_s must be a positive finite number, got {ttl_s!r}")
    # Refuse locally what a receiver would refuse, with the same message.
    wire = msg.validate().to_wire()
    created = float(time.time() if now is None else now)
    n = os.urandom(NONCE_SIZE) if nonce is None else bytes(nonce)
    if len(n) != NONCE_SIZE:
        raise SchemaError(f"nonce must be {NONCE_SIZE} bytes, got {len(n)}")
    body: dict[str, Any] = {
        "d": msg.DOMAIN,
        "p": canonical.encode(wire),
        "k": identity.public_bytes,
        "t": created,
        "x": created + float(ttl_s),
        "n": n,
    }
    body["s"] = identity.sign(SIGN_PREFIX + canonical.encode(body))
    data = canonical.encode(body)
    if len(data) > msg.MAX_SIZE:
        raise TooLarge(f"{msg.TYPE} envelope of {len(data)} bytes exceeds the limit of {msg.MAX_SIZE}")
    return data


class ReplayGuard:
    """Remembers (signer, nonce) until the envelope expires; bounded in time and memory.

    Envelopes living longer than ``window_s`` are refused by :func:`open_envelope` (Expired), so
    an entry is never forgotten while its envelope could still be accepted. When full, new
    envelopes are refused rather than old entries evicted: eviction would reopen a replay.
    """

    def __init__(self, window_s: float = 600.0, max_entries: int = 1_000_000) -> None:
        self.window_s = float(window_s)
        self.max_entries = int(max_entries)
        self._seen: dict[tuple[Any, bytes], float] = {}
        self._heap: list[tuple[float, tuple[Any, bytes]]] = []

    def __len__(self) -> int:
        return len(self._seen)

    def _purge(self, now: float) -> None:
        heap, seen = self._heap, self._seen
        while heap and heap[0][0] < now:
            _, key = heapq.heappop(heap)
            seen.pop(key, None)

    def check_and_add(self, signer: Any, nonce: bytes, expires: float, now: float) -> None:
        """Record the nonce; raise Replay if it was already seen (or cannot be tracked)."""
        self._purge(now)
        key = (signer, bytes(nonce))
        if key in self._seen:
            raise Replay(f"nonce {bytes(nonce).hex()} from {signer} was already seen")
        if expires > now + self.window_s:
            raise Replay(
                f"envelope expires {expires - now:.0f}s from now, beyond the {self.window_s:.0f}s replay window"
            )
        if len(self._seen) >= self.max_entries:
            raise Replay(f"replay cache full ({self.max_entries} live nonces); retry later")
        self._seen[key] = expires
        heapq.heappush(self._heap, (expires, key))


def _expected_types(expected: type[Message] | tuple[type[Message], ...]) -> tuple[type[Message], ...]:
    types = expected if isinstance(expected, tuple) else (expected,)
    for t in types:
        if not (isinstance(t, type) and issubclass(t, Message) and t.TYPE):
            raise TypeError(f"expected must be message types, got {t!r}")
    return types


def _check_envelope_schema(env: Any) -> None:
    if type(env) is not dict:
        raise SchemaError(f"envelope: expected map, got {type(env).__name__}")
    keys = set(env)
    if keys != ENVELOPE_KEYS:
        extra = sorted(str(k)[:32] for k in keys - ENVELOPE_KEYS)
        missing = sorted(ENVELOPE_KEYS - keys)
        raise SchemaError(f"envelope: unknown field(s) {extra}, missing field(s) {missing}")
    d = env["d"]
    if type(d) is not str or len(d) > MAX_DOMAIN_LEN:
        raise SchemaError(f"envelope.d: expected str of <= {MAX_DOMAIN_LEN} chars")
    for name, size in (("k", PUBKEY_SIZE), ("n", NONCE_SIZE), ("s", SIGNATURE_SIZE)):
        v = env[name]
        if type(v) is not bytes or len(v) != size:
            raise SchemaError(f"envelope.{name}: expected {size} bytes")
    if type(env["p"]) is not bytes:
        raise SchemaError("envelope.p: expected bytes")
    for name in ("t", "x"):
        v = env[name]
        if type(v) is not float or not math.isfinite(v):
            raise SchemaError(f"envelope.{name}: expected a finite float")
    if env["x"] < env["t"]:
        raise SchemaError("envelope: expires before it was created")


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
    replay: ReplayGuard | None,
    allowed: Callable[[str, type], bool] | None = None,
    max_size: int | None = None,
    clock_skew_s: float = 30.0,
) -> Verified[M]: ...


@overload
def open_envelope(
    data: bytes | bytearray | memoryview,
    expected: tuple[type[Message], ...],
    *,
    now: float | None = None,
    replay: ReplayGuard | None,
    allowed: Callable[[str, type], bool] | None = None,
    max_size: int | None = None,
    clock_skew_s: float = 30.0,
) -> Verified[Any]: ...


def open_envelope(
    data: bytes | bytearray | memoryview,
    expected: type[Message] | tuple[type[Message], ...],
    *,
    now: float | None = None,
    replay: ReplayGuard | None,
    allowed: Callable[[str, type], bool] | None = None,
    max_size: int | None = None,
    clock_skew_s: float = 30.0,
) -> Verified[Any]:
    """Verify an envelope carrying one of the ``expected`` message types and return it.

    ``allowed(signer_peer_id, message_class)`` decides who may send what; ``replay=None`` skips
    the nonce check (only for messages whose replay is harmless, e.g. idempotent queries).
    """
    types = _expected_types(expected)
    limit = max(t.MAX_SIZE for t in types) if max_size is None else max_size

    # 1. size
    try:
        size = len(data)
    except TypeError as exc:
        raise DecodeError(f"envelope is not bytes ({type(data).__name__})") from exc
    if size > limit:
        raise TooLarge(f"envelope of {size} bytes exceeds the limit of {limit} bytes")

    # 2. decoding (envelope, then the payload it carries). A payload of an expected type is
    # decoded and schema-checked in one go (fastdecode); its refusal is raised in step 3.
    env = canonical.decode(data, max_size=limit)
    by_domain = {t.DOMAIN: t for t in types}
    payload_obj: Any = None
    message: Message | None = None
    schema_error: SchemaError | None = None
    if type(env) is dict and type(env.get("p")) is bytes:
        guess = by_domain.get(env["d"]) if type(env.get("d")) is str else None
        if guess is None:
            payload_obj = canonical.decode(env["p"], max_size=limit)
        else:
            try:
                message = fastdecode.decode_payload(guess, env["p"], max_size=limit)
            except SchemaError as exc:
                schema_error = exc

    # 3. schema: envelope fields, domain, payload
    _check_envelope_schema(env)
    domain = env["d"]
    cls = by_domain.get(domain)
    if cls is None:
        known = MESSAGE_TYPES_BY_DOMAIN.get(domain)
        what = f"a {known.TYPE} message" if known is not None else f"unknown domain {domain[:64]!r}"
        raise WrongDomain(f"expected {sorted(by_domain)}, got {what}")
    if max_size is None and size > cls.MAX_SIZE:  # a small type must not ride under a large one's limit
        raise TooLarge(f"{cls.TYPE} envelope of {size} bytes exceeds the limit of {cls.MAX_SIZE} bytes")
    if schema_error is not None:
        raise schema_error
    if message is None:
        message = cls.from_wire(payload_obj)

    # 4. signature, over the bytes as received (no re-encoding of a payload of up to 64 MiB)
    signer_key: bytes = env["k"]
    verify_signature(signer_key, env["s"], _signed_bytes(data))
    signer = peer_id_from_public_key(signer_key)

    # 5. signer allowed for this message type
    if allowed is not None and not allowed(signer, cls):
        raise SignerNotAllowed(f"{signer} may not send {cls.TYPE} messages")

    # 6. expiry, including created too far in the future
    t_now = time.time() if now is None else float(now)
    created: float = env["t"]
    expires: float = env["x"]
    if t_now > expires:
        raise Expired(f"{cls.TYPE} from {signer} expired {t_now - expires:.1f}s ago")
    if created > t_now + clock_skew_s:
        raise Expired(
            f"{cls.TYPE} from {signer} is dated {created - t_now:.1f}s in the future "
            f"(allowed clock skew {clock_skew_s:.0f}s)"
        )
    if replay is not None and expires > t_now + replay.window_s:
        raise Expired(
            f"{cls.TYPE} from {signer} expires {expires - t_now:.0f}s from now, "
            f"beyond the {replay.window_s:.0f}s replay window"
        )

    # 7. replay
    if replay is not None:
        replay.check_and_add(signer, env["n"], expires, t_now)

    return Verified(
        signer=signer,
        message=message,
        created=created,
        expires=expires,
        nonce=env["n"],
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
