"""Assembling a policy version from verified chunks (pure; no I/O).

A version is loaded only when every chunk has been verified against the hub-signed manifest.
Deltas need the parent's raw chunk at the same index; without it the node asks for (and the hub
sends) the full encoding instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from echo2.protocol import packing
from echo2.protocol.errors import ChunkMismatch, ManifestError
from echo2.protocol.messages import Manifest
from echo2.protocol.wire import ENC_FULL, ENC_MANIFEST


@dataclass
class HeldVersion:
    """A complete, verified version: its manifest and raw chunks (parents for the next delta)."""

    manifest: Manifest
    raw_chunks: list[bytes]

    @property
    def version(self) -> int:
        return self.manifest.version


@dataclass
class Assembly:
    manifest: Manifest
    parent: HeldVersion | None
    raw: dict[int, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        packing.verify_manifest_consistency(self.manifest)
        if self.parent is not None and self.parent.version != self.manifest.parent:
            self.parent = None

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def needs_full(self) -> bool:
        """True if some delta chunk cannot be decoded here (the parent is missing)."""
        return self.parent is None and any(c.encoding == "delta" for c in self.manifest.chunks)

    def missing(self) -> list[int]:
        return [c.index for c in self.manifest.chunks if c.index not in self.raw]

    def add(self, index: int, encoding: int, data: bytes | memoryview) -> bool:
        """Verify and keep one chunk; True when the version is complete. Raises ChunkMismatch."""
        chunks = self.manifest.chunks
        if not 0 <= index < len(chunks):
            raise ChunkMismatch(f"chunk index {index} outside the manifest of version {self.version}")
        entry = chunks[index]
        if index in self.raw:
            return self.complete
        if encoding == ENC_FULL:
            raw = packing.decode_full_fallback(entry, bytes(data), bf16_split=self.manifest.bf16_split)
        elif encoding == ENC_MANIFEST:
            parent_raw = None
            if entry.encoding == "delta":
                if self.parent is None or index >= len(self.parent.raw_chunks):
                    raise ManifestError(f"delta chunk {index} of version {self.version} without its parent")
                parent_raw = self.parent.raw_chunks[index]
            raw = packing.decode_chunk(entry, bytes(data), parent_raw, bf16_split=self.manifest.bf16_split)
        else:
            raise ChunkMismatch(f"unknown encoding flag {encoding}")
        self.raw[index] = raw
        return self.complete

    @property
    def complete(self) -> bool:
        return len(self.raw) == len(self.manifest.chunks)

    def finish(self) -> HeldVersion:
        if not self.complete:
            raise ManifestError(f"version {self.version} incomplete: {len(self.missing())} chunks missing")
        return HeldVersion(self.manifest, [self.raw[i] for i in range(len(self.manifest.chunks))])
