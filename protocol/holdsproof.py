"""Proof that a node holds a version (issue 15, A5): dispatch only on what is proven.

A node reports ``HoldsVersion``; the hub answers with a :class:`HoldsChallenge` naming a random
byte range of one raw chunk of that version and a fresh nonce, and counts the node as holding the
version (so gives it work on it) only when the node answers with ``blake3(nonce || those bytes)``.
Only a node with the chunk's bytes can answer, and a nonce is never reused, so an answer seen
elsewhere is worth nothing. Both sides hash at most :data:`CHALLENGE_BYTES`: microseconds.

Pure: the caller passes the randomness (the hub's ``secrets``) and the bytes.
"""

from __future__ import annotations

import random

from .errors import MeaningError
from .hashing import new_hasher
from .messages import HoldsChallenge, Manifest

#: bytes hashed per proof: enough that the range can't be guessed, little enough to be free
CHALLENGE_BYTES = 64 * 1024


def choose(manifest: Manifest, rng: random.Random) -> tuple[int, int, int]:
    """(chunk index, offset, length) of a range of ``manifest``'s raw bytes, uniformly placed."""
    chunks = [c for c in manifest.chunks if c.raw_size > 0]
    if not chunks:
        raise MeaningError(f"version {manifest.version} has no bytes to prove")
    c = chunks[rng.randrange(len(chunks))]
    length = min(CHALLENGE_BYTES, c.raw_size)
    return c.index, rng.randrange(c.raw_size - length + 1), length


def check(ch: HoldsChallenge, manifest: Manifest) -> None:
    """A challenge a node can answer from ``manifest``'s chunks (the hub may be hostile too: a
    range outside the chunk or over the bound is refused, not read)."""
    if ch.version != manifest.version:
        raise MeaningError(f"challenge for version {ch.version}, but version {manifest.version} is held")
    if not 0 <= ch.index < len(manifest.chunks):
        raise MeaningError(f"challenge names chunk {ch.index} of {len(manifest.chunks)}")
    size = manifest.chunks[ch.index].raw_size
    if ch.length > CHALLENGE_BYTES or ch.offset + ch.length > size:
        raise MeaningError(f"challenge range {ch.offset}+{ch.length} exceeds chunk {ch.index} ({size} bytes)")


def answer(nonce: bytes, raw_chunk: bytes | memoryview, offset: int, length: int) -> bytes:
    """``blake3(nonce || raw_chunk[offset:offset + length])``: what both sides compute."""
    h = new_hasher()
    h.update(nonce)
    h.update(memoryview(raw_chunk)[offset : offset + length])
    return h.digest()
