"""A node's chunk store: content-addressed raw chunks on disk plus the manifests of kept versions.

Layout under ``root``::

    chunks/<raw hash hex>          raw bytes of one chunk (named by blake3 of those bytes)
    versions/<v>.hashes            the raw hashes of version v's chunks, 32 bytes each, in order
    versions/<v>.manifest          the hub-signed manifest envelope of version v, as received

Why raw chunks (not the encoded ones): content addressing is by raw hash, so a chunk unchanged
between versions is one file, and a delta of the next version decodes against it directly.

Crash safety: every file is written to a temporary name in its own directory and renamed over its
final name (``os.replace``). Version files are fsynced first, so a final name only ever holds a
whole file. Chunk files are not: a chunk is named by the hash of its bytes and checked against it
on every read, so one a crash left empty or torn is caught like a damaged one, and an fsync per
chunk cost 3.7-6.6 ms of a store thread's time here (a 16 GB version in 384 KiB chunks is ~43,000
of them; on a volunteer's spinning disk, tens of ms each). Stray temporaries (a crash mid-write)
are removed when the store is opened. A chunk file that was damaged after the fact (a crash, the
disk, a careless user) is caught by the hash check on every read, removed, and shows up again in
:meth:`ChunkStore.missing`, so the caller fetches it again.

A version's ``.hashes`` is written before its ``.manifest``: a version is listed only when both
exist, and garbage collection never removes a chunk that a listed version references.

Sync file I/O on purpose (pure-ish): the trio caller runs big reads/writes via
``trio.to_thread.run_sync``. One store per data directory; the methods are not meant to be called
from several threads at once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from echo2.fsutil import TMP_PREFIX, atomic_write
from echo2.protocol import packing
from echo2.protocol.errors import ChunkMismatch, ManifestError
from echo2.protocol.hashing import digest
from echo2.protocol.messages import Manifest
from echo2.protocol.wire import ENC_FULL, ENC_MANIFEST

log = logging.getLogger(__name__)

DEFAULT_KEEP = 3
HASH_SIZE = 32


class ChunkStore:
    """Chunks by raw hash, and the last ``keep`` versions' manifests (see the module doc)."""

    def __init__(self, root: str | os.PathLike[str], *, keep: int = DEFAULT_KEEP, fsync: bool = True) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.root = Path(root)
        self.keep = keep
        self.fsync = fsync
        self.chunk_dir = self.root / "chunks"
        self.version_dir = self.root / "versions"
        self.chunk_dir.mkdir(parents=True, exist_ok=True)
        self.version_dir.mkdir(parents=True, exist_ok=True)
        self.removed_tmp = self._remove_stray_tmp()

    # --- housekeeping ---------------------------------------------------------------------------
    def _remove_stray_tmp(self) -> int:
        n = 0
        for d in (self.chunk_dir, self.version_dir):
            for p in d.iterdir():
                if p.name.startswith(TMP_PREFIX):
                    try:
                        p.unlink()
                        n += 1
                    except OSError as exc:
                        log.warning("cannot remove stray temporary %s: %s", p, exc)
        if n:
            log.info("chunk store %s: removed %d half-written files from an earlier run", self.root, n)
        return n

    def _write(self, path: Path, data: bytes | bytearray | memoryview) -> None:
        atomic_write(path, data, durable=self.fsync)

    # --- chunks ---------------------------------------------------------------------------------
    def _chunk_path(self, raw_hash: bytes) -> Path:
        if len(raw_hash) != HASH_SIZE:
            raise ValueError("raw hash must be 32 bytes")
        return self.chunk_dir / raw_hash.hex()

    def has(self, raw_hash: bytes) -> bool:
        """Whether a chunk with this raw hash is stored (its bytes are re-checked on read)."""
        return self._chunk_path(raw_hash).is_file()

    def put(self, raw_hash: bytes, raw: bytes | bytearray | memoryview, *, _verified: bool = False) -> bool:
        """Store a raw chunk after checking that it hashes to ``raw_hash`` (ChunkMismatch if not).
        Returns False if it was already stored (never written twice). ``_verified``: the caller
        (:meth:`decode_and_put`) has just checked the hash itself."""
        path = self._chunk_path(raw_hash)
        if not _verified and digest(raw) != raw_hash:
            raise ChunkMismatch(f"chunk does not hash to {raw_hash.hex()[:16]}; not stored")
        if path.is_file():
            return False
        atomic_write(path, raw, durable=False)  # checked against its name on every read: module doc
        return True

    def get(self, raw_hash: bytes) -> bytes:
        """The raw chunk, re-verified. A damaged file is removed and ChunkMismatch raised;
        a missing one raises KeyError."""
        path = self._chunk_path(raw_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise KeyError(raw_hash.hex()) from None
        if digest(data) != raw_hash:
            log.warning("chunk file %s is damaged; removing it so it is fetched again", path.name[:16])
            try:
                path.unlink()
            except OSError:
                pass
            raise ChunkMismatch(f"stored chunk {raw_hash.hex()[:16]} is damaged (removed)")
        return data

    def get_or_none(self, raw_hash: bytes) -> bytes | None:
        try:
            return self.get(raw_hash)
        except (KeyError, ChunkMismatch):
            return None

    # --- versions -------------------------------------------------------------------------------
    def save_version(self, manifest: Manifest, manifest_envelope: bytes) -> None:
        """Remember version ``manifest.version`` (before its chunks arrive, so that a restart can
        resume it), then drop versions beyond the last ``keep``."""
        v = manifest.version
        hashes = b"".join(c.raw_hash for c in manifest.chunks)
        self._write(self.version_dir / f"{v}.hashes", hashes)
        self._write(self.version_dir / f"{v}.manifest", manifest_envelope)
        self.gc()

    def versions(self) -> list[int]:
        """Versions with a manifest on disk (complete or not), oldest first."""
        out: list[int] = []
        for p in self.version_dir.glob("*.manifest"):
            stem = p.name[: -len(".manifest")]
            if stem.isdigit() and (self.version_dir / f"{stem}.hashes").is_file():
                out.append(int(stem))
        return sorted(out)

    def manifest_envelope(self, version: int) -> bytes | None:
        """The signed manifest envelope as received (the caller verifies it again)."""
        try:
            return (self.version_dir / f"{version}.manifest").read_bytes()
        except FileNotFoundError:
            return None

    def _hashes(self, version: int) -> list[bytes]:
        data = (self.version_dir / f"{version}.hashes").read_bytes()
        if len(data) % HASH_SIZE:
            raise ManifestError(f"hash list of version {version} is damaged")
        return [data[i : i + HASH_SIZE] for i in range(0, len(data), HASH_SIZE)]

    def missing(self, manifest: Manifest) -> list[int]:
        """Indices of the manifest's chunks not stored yet (what is left to fetch)."""
        return [c.index for c in manifest.chunks if not self.has(c.raw_hash)]

    def is_complete(self, manifest: Manifest) -> bool:
        return not self.missing(manifest)

    def load_raw_chunks(self, manifest: Manifest) -> list[bytes]:
        """Every raw chunk of a complete version, each re-verified against the manifest.

        ManifestError if chunks are missing; ChunkMismatch if a stored chunk turned out damaged
        (it is removed, so :meth:`missing` lists it and the caller fetches it again)."""
        out: list[bytes] = []
        bad: list[int] = []
        for c in manifest.chunks:
            try:
                raw = self.get(c.raw_hash)
            except KeyError:
                raise ManifestError(f"version {manifest.version} incomplete: chunk {c.index} missing") from None
            except ChunkMismatch:
                bad.append(c.index)
                continue
            if len(raw) != c.raw_size:  # same hash, other size cannot happen; defensive only
                bad.append(c.index)
                continue
            out.append(raw)
        if bad:
            raise ChunkMismatch(f"version {manifest.version}: damaged chunks {bad[:8]} removed; fetch them again")
        return out

    def gc(self, protect: Iterable[int] = (), keep: int | None = None) -> int:
        """Keep the newest ``keep`` versions (default: the store's) and ``protect``; remove other
        manifests and every chunk no kept version references. Returns the chunk files removed."""
        versions = self.versions()
        kept = set(versions[-(keep or self.keep) :]) | set(protect)
        for v in versions:
            if v not in kept:
                for suffix in (".manifest", ".hashes"):
                    try:
                        (self.version_dir / f"{v}{suffix}").unlink()
                    except FileNotFoundError:
                        pass
        referenced: set[str] = set()
        for v in kept:
            try:
                referenced.update(h.hex() for h in self._hashes(v))
            except (FileNotFoundError, ManifestError):
                continue
        removed = 0
        for p in self.chunk_dir.iterdir():
            if p.name.startswith(TMP_PREFIX) or p.name in referenced:
                continue
            try:
                p.unlink()
                removed += 1
            except OSError as exc:
                log.warning("gc cannot remove %s: %s", p, exc)
        if removed:
            log.debug("chunk store gc: removed %d chunks, kept versions %s", removed, sorted(kept))
        return removed

    def stored_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.chunk_dir.iterdir() if not p.name.startswith(TMP_PREFIX))

    # --- a version's chunks as they travel (the relay's chunk source; worker threads) -----------
    def encoded_for(self, m: Manifest, i: int) -> tuple[int, bytes]:
        """``(flag, bytes)`` to send for chunk ``i`` of ``m``: the manifest's encoding, re-made
        from the stored raw chunk (a chunk we hold but never received encoded: resumed, or
        unchanged since an earlier version), else the full encoding. KeyError if not stored."""
        entry = m.chunks[i]
        raw = self.get(entry.raw_hash)
        if entry.encoding == "full":
            enc = packing.encode_chunk(raw, None, bf16_split=m.bf16_split)
        else:
            assert entry.parent_raw_hash is not None
            parent = self.get_or_none(entry.parent_raw_hash)
            enc = packing.encode_chunk(raw, parent, bf16_split=m.bf16_split) if parent is not None else b""
        if len(enc) == entry.enc_size and digest(enc) == entry.enc_hash:
            return ENC_MANIFEST, enc
        return ENC_FULL, packing.encode_chunk(raw, None, bf16_split=m.bf16_split)

    def decode_and_put(self, m: Manifest, i: int, flag: int, data: bytes | bytearray | memoryview) -> str:
        """Decode chunk ``i`` of ``m`` as received (``flag``: the manifest's encoding or full),
        check its raw hash and store it: ``"stored"``, or ``"need_full"`` for a delta whose
        parent chunk is not here. ChunkMismatch/ManifestError if it does not decode to the
        manifest's raw chunk."""
        entry = m.chunks[i]
        if self.has(entry.raw_hash):
            return "stored"
        if flag == ENC_FULL:
            raw = packing.decode_full_fallback(entry, data, bf16_split=m.bf16_split)
        else:
            parent_raw = None
            if entry.encoding == "delta":
                assert entry.parent_raw_hash is not None
                parent_raw = self.get_or_none(entry.parent_raw_hash)
                if parent_raw is None:
                    return "need_full"
            raw = packing.decode_chunk(entry, data, parent_raw, bf16_split=m.bf16_split)
        # both decoders check the raw hash against the manifest before they return
        self.put(entry.raw_hash, raw, _verified=True)
        return "stored"
