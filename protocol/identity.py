"""Persistent Ed25519 identities and libp2p-compatible peer IDs.

A party's name everywhere (wire, database, ledger, logs) is its libp2p peer ID: the base58btc
multihash of the protobuf-encoded public key. For Ed25519 the encoded key is 36 bytes, short
enough that libp2p uses the identity multihash, which is why such IDs start with ``12D3KooW``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import BadSignature, IdentityError

_KEY_FILE_MAGIC = b"echo2-ed25519-v1\n"
# libp2p crypto.proto: message PublicKey { KeyType Type = 1; bytes Data = 2; }, Ed25519 = 1
_PB_ED25519_PREFIX = bytes([0x08, 0x01, 0x12, 0x20])
_MULTIHASH_IDENTITY = bytes([0x00, 0x24])  # identity hash code, length 36


def libp2p_public_key_bytes(raw_public: bytes) -> bytes:
    """The protobuf encoding libp2p uses for an Ed25519 public key."""
    if len(raw_public) != 32:
        raise IdentityError(f"Ed25519 public key must be 32 bytes, got {len(raw_public)}")
    return _PB_ED25519_PREFIX + raw_public


@functools.lru_cache(maxsize=16384)
def peer_id_from_public_key(raw_public: bytes) -> str:
    """The libp2p peer ID (``12D3KooW...``) of a raw 32-byte Ed25519 public key.

    Cached (pure; a wrong-size key raises and is not cached): every envelope opened names its
    signer, and the base58 encode cost 15 us a call (the hub's heartbeat and result path,
    issue 20); 16,384 entries cover a fleet of 10,000 nodes."""
    return base58.b58encode(_MULTIHASH_IDENTITY + libp2p_public_key_bytes(raw_public)).decode()


@functools.lru_cache(maxsize=4096)
def public_key_from_peer_id(peer_id: str) -> bytes:
    """Recover the raw Ed25519 public key embedded in an identity-multihash peer ID.

    Cached (pure; failures are not cached): every ChunkHave a relay receives names its sender,
    ~10 a second per link during a broadcast, and the base58 decode cost 0.3 ms each (cProfile
    of 8 relays: 1464 calls, 0.47 s)."""
    try:
        raw = base58.b58decode(peer_id.encode())
    except Exception as exc:  # base58 raises ValueError on bad alphabet
        raise IdentityError(f"not a base58 peer ID: {peer_id[:60]!r}") from exc
    prefix = _MULTIHASH_IDENTITY + _PB_ED25519_PREFIX
    if len(raw) != len(prefix) + 32 or not raw.startswith(prefix):
        raise IdentityError("peer ID does not embed an Ed25519 public key")
    return raw[len(prefix) :]


#: Up to this size data is verified by libsodium (PyNaCl, a dependency of libp2p): 72-77 us a
#: check here against OpenSSL's 130-145 us (cryptography), and the hub checks two signatures per
#: small result (the result's and the heartbeat's that fetched its task; issue 20). libsodium's
#: API in PyNaCl has no detached check, so it copies signature + data once: larger data stays with
#: OpenSSL, which is faster there (36 MB: 0.08 s against libsodium's 0.19 s).
_SODIUM_MAX = 64 * 1024

#: Up to this size data is signed by libsodium (see Identity.sign)
_SODIUM_SIGN_MAX = 4 * 1024

try:
    from nacl.bindings import crypto_sign as _sodium_sign
    from nacl.bindings import crypto_sign_open as _sodium_open
    from nacl.bindings import crypto_sign_seed_keypair as _sodium_keypair
    from nacl.exceptions import CryptoError as _SodiumError
except ImportError:  # pragma: no cover - PyNaCl comes with libp2p
    _sodium_open = None  # type: ignore[assignment]
    _sodium_sign = None  # type: ignore[assignment]


def verify_signature(raw_public: bytes, signature: bytes, data: bytes) -> None:
    """Raise :class:`BadSignature` unless ``signature`` is valid for ``data``.

    Both libraries check the RFC 8032 signature equation with S < L; libsodium is the stricter
    (it also refuses small-order and non-canonical keys and R values, which no honest signer
    produces), so a signature it accepts OpenSSL accepts too."""
    if len(raw_public) != 32 or len(signature) != 64:
        raise BadSignature("signature does not verify")
    if _sodium_open is not None and len(data) <= _SODIUM_MAX:
        try:
            _sodium_open(bytes(signature) + bytes(data), bytes(raw_public))
        except (_SodiumError, ValueError, TypeError) as exc:
            raise BadSignature("signature does not verify") from exc
        return
    try:
        Ed25519PublicKey.from_public_bytes(raw_public).verify(signature, data)
    except (InvalidSignature, ValueError) as exc:
        raise BadSignature("signature does not verify") from exc


@dataclass(frozen=True)
class Identity:
    """An Ed25519 key pair with its libp2p peer ID."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        if len(seed) != 32:
            raise IdentityError("Ed25519 seed must be 32 bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @property
    def seed(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    @functools.cached_property
    def public_bytes(self) -> bytes:
        # computed once: every seal reads it (3-6 us a derivation and serialisation here)
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @functools.cached_property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self.public_bytes)

    @functools.cached_property
    def _sodium_secret(self) -> bytes:
        # libsodium's 64-byte signing key (seed + public key), derived once
        return _sodium_keypair(self.seed)[1]

    def sign(self, data: bytes) -> bytes:
        # Ed25519 signatures are deterministic: both libraries give the same bytes. libsodium signs
        # the small messages (tasks, receipts, acks, replies) in 17 us against OpenSSL's 29 (300
        # bytes, here); from a few KiB on OpenSSL's hashing is the faster (6 KB: 40 vs 44 us,
        # 60 KB: 242 vs 185), and PyNaCl's API copies the data into its reply
        if _sodium_sign is not None and len(data) <= _SODIUM_SIGN_MAX:
            return _sodium_sign(bytes(data), self._sodium_secret)[:64]
        return self.private_key.sign(data)

    def __repr__(self) -> str:  # never print key material
        return f"Identity({self.peer_id})"

    # --- key-file contents (reading and writing the file is echo2.keyfile) -------------------
    def key_file_bytes(self) -> bytes:
        """The contents of this identity's key file (a magic line, then the hex seed)."""
        return _KEY_FILE_MAGIC + self.seed.hex().encode() + b"\n"

    @classmethod
    def from_key_file_bytes(cls, data: bytes, where: str) -> Identity:
        """The identity in key-file contents; IdentityError (naming ``where``) if they are not one."""
        if not data.startswith(_KEY_FILE_MAGIC):
            raise IdentityError(f"{where} is not an echo2 key file")
        try:
            seed = bytes.fromhex(data[len(_KEY_FILE_MAGIC) :].decode().strip())
        except ValueError as exc:
            raise IdentityError(f"{where} is corrupt") from exc
        return cls.from_seed(seed)
