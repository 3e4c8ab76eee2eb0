"""The node's chunk store: content addressing, resume, verification on load, crash safety, GC."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from echo2.models import statedict
from echo2.node.chunkstore import TMP_PREFIX, ChunkStore
from echo2.protocol import packing
from echo2.protocol.errors import ChunkMismatch, ManifestError
from echo2.protocol.hashing import digest
from echo2.protocol.messages import Manifest, ManifestChunk


def _manifest(version: int, chunks: list[bytes]) -> Manifest:
    entries = []
    off = 0
    for i, c in enumerate(chunks):
        h = digest(c)
        entries.append(ManifestChunk(index=i, offset=off, raw_size=len(c), raw_hash=h, encoding="full",
                                     enc_size=len(c), enc_hash=h, parent_raw_hash=None))
        off += len(c)
    return Manifest(version=version, parent=None, created=0.0, chunk_size=max(len(c) for c in chunks),
                    total_bytes=off, tensors=[], chunks=entries, model_config="{}", artifacts={}, bf16_split=False)


def _chunks(seed: int, n: int = 3, size: int = 4096) -> list[bytes]:
    return [bytes([(seed * 31 + i * 7 + j) % 251 for j in range(size)]) for i in range(n)]


def test_put_get_has_and_refuses_wrong_hash(tmp_path: Path) -> None:
    s = ChunkStore(tmp_path)
    data = b"x" * 1000
    h = digest(data)
    assert not s.has(h)
    assert s.put(h, data) is True
    assert s.put(h, data) is False  # content addressed: never written twice
    assert s.has(h) and s.get(h) == data
    with pytest.raises(ChunkMismatch):
        s.put(digest(b"other"), data)
    with pytest.raises(KeyError):
        s.get(digest(b"absent"))


def test_missing_resume_and_load(tmp_path: Path) -> None:
    chunks = _chunks(1)
    m = _manifest(1, chunks)
    s = ChunkStore(tmp_path)
    s.save_version(m, b"envelope-bytes")
    assert s.missing(m) == [0, 1, 2]
    s.put(m.chunks[0].raw_hash, chunks[0])
    with pytest.raises(ManifestError):
        s.load_raw_chunks(m)  # incomplete: never loadable
    # "restart": a new store object on the same directory resumes where the last one stopped
    s2 = ChunkStore(tmp_path)
    assert s2.versions() == [1]
    assert s2.manifest_envelope(1) == b"envelope-bytes"
    assert s2.missing(m) == [1, 2]
    for i in (1, 2):
        s2.put(m.chunks[i].raw_hash, chunks[i])
    assert s2.is_complete(m)
    assert s2.load_raw_chunks(m) == chunks


def test_truncated_tmp_file_is_ignored_and_removed(tmp_path: Path) -> None:
    chunks = _chunks(2)
    m = _manifest(1, chunks)
    s = ChunkStore(tmp_path)
    s.save_version(m, b"env")
    # simulated crash mid-write: a half-written temporary next to the final name
    tmp = s.chunk_dir / f"{TMP_PREFIX}{m.chunks[0].raw_hash.hex()}.999"
    tmp.write_bytes(chunks[0][:100])
    assert not s.has(m.chunks[0].raw_hash)
    assert s.missing(m) == [0, 1, 2]
    s2 = ChunkStore(tmp_path)
    assert s2.removed_tmp == 1 and not tmp.exists()
    assert s2.missing(m) == [0, 1, 2]


def test_corrupted_chunk_detected_at_load_and_refetched(tmp_path: Path) -> None:
    chunks = _chunks(3)
    m = _manifest(1, chunks)
    s = ChunkStore(tmp_path)
    s.save_version(m, b"env")
    for c, raw in zip(m.chunks, chunks, strict=True):
        s.put(c.raw_hash, raw)
    path = s.chunk_dir / m.chunks[1].raw_hash.hex()
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01
    path.write_bytes(bytes(data))  # bit rot after a clean write
    assert s.has(m.chunks[1].raw_hash)
    with pytest.raises(ChunkMismatch):
        s.load_raw_chunks(m)
    assert s.missing(m) == [1]  # removed, so the caller fetches it again
    s.put(m.chunks[1].raw_hash, chunks[1])
    assert s.load_raw_chunks(m) == chunks


def test_gc_keeps_last_k_versions_and_shared_chunks(tmp_path: Path) -> None:
    s = ChunkStore(tmp_path, keep=2)
    shared = b"s" * 512
    ms = []
    for v in (1, 2, 3):
        chunks = [shared, bytes([v]) * 512]
        m = _manifest(v, chunks)
        s.save_version(m, b"env%d" % v)
        for c, raw in zip(m.chunks, chunks, strict=True):
            s.put(c.raw_hash, raw)
        ms.append(m)
    s.gc()
    assert s.versions() == [2, 3]
    assert s.has(digest(shared))  # unchanged chunk: one file, still referenced
    assert not s.has(digest(bytes([1]) * 512))
    assert s.has(digest(bytes([2]) * 512)) and s.has(digest(bytes([3]) * 512))
    assert sorted(os.listdir(s.chunk_dir)) == sorted(h.hex() for h in {digest(shared), digest(b"\x02" * 512), digest(b"\x03" * 512)})


def test_real_packed_version_roundtrip(tmp_path: Path) -> None:
    import torch

    sd = {"a": torch.arange(5000, dtype=torch.float32), "b": torch.ones(300, dtype=torch.bfloat16)}
    pv = statedict.pack_version(sd, version=0, parent=None, chunk_size=4096, model_config="{}", artifacts={})
    s = ChunkStore(tmp_path)
    s.save_version(pv.manifest, b"env")
    for c, enc in zip(pv.manifest.chunks, pv.encoded, strict=True):
        s.put(c.raw_hash, packing.decode_chunk(c, enc, None, bf16_split=pv.manifest.bf16_split))
    out = statedict.assemble(pv.manifest, s.load_raw_chunks(pv.manifest))
    assert torch.equal(out["a"], sd["a"]) and torch.equal(out["b"], sd["b"])
