"""Content hashes: blake3, 32 bytes, used everywhere for content addressing.

blake3 was chosen after measuring about 3.8 GB/s on one core here (sha256 about 0.95 GB/s); it
releases the GIL on large buffers, so hashing a chunk can overlap with receiving the next one.
"""

from __future__ import annotations

import blake3

DIGEST_SIZE = 32


def digest(data: bytes | bytearray | memoryview) -> bytes:
    """The 32-byte blake3 hash of ``data``."""
    # max_threads=1: the fleet already overlaps hashing with I/O; extra threads only steal cores.
    return blake3.blake3(data, max_threads=1).digest()


#: An incremental hasher (``update(data)``, ``digest()``).
Hasher = blake3.blake3


def new_hasher() -> Hasher:
    """An incremental hasher whose ``digest()`` equals :func:`digest` of everything fed to
    ``update()`` (for hashing a body piece by piece as it arrives)."""
    return blake3.blake3(max_threads=1)


def hexdigest(data: bytes | bytearray | memoryview) -> str:
    """The blake3 hash of ``data`` as 64 lowercase hex characters (for logs and file names)."""
    return digest(data).hex()


def chunk_hash(data: bytes | bytearray | memoryview) -> bytes:
    """Alias of :func:`digest`, the name the packing contract uses."""
    return digest(data)
