"""Policy packing: a state dict as content-addressed, compressed chunks plus a manifest.

Layout. Tensors are laid out in sorted-name order in one flat little-endian byte buffer, each
starting at a multiple of ``ALIGN`` (64) bytes; the gaps are zero bytes. Alignment keeps every
bfloat16 value on an even offset (so the byte-plane split below separates low from high bytes),
lets ``assemble`` hand out tensors that view one buffer without another copy, and makes the layout
a pure function of (names, dtypes, shapes) that ``verify_manifest_consistency`` can recompute. Raw
bytes are taken through ``view(torch.uint8)``, never through a float conversion, so every dtype
(bfloat16 NaN payloads included) round-trips bit for bit. This module works on the flat bytes
only; the state dict <-> bytes conversion (torch) is ``echo2.models.statedict``.

Chunks. The buffer is cut into ``chunk_size`` pieces (the last one shorter); a chunk is named by
the blake3 hash of its raw bytes. Encodings: ``full`` = zstd(T(raw)), ``delta`` =
zstd(T(raw XOR parent_raw)) where the parent chunk is the same index of the parent version and T is
the byte-plane split when ``Manifest.bf16_split`` is set (all even-offset bytes, then all
odd-offset bytes, then an odd tail byte if any). zstd level 1; level 3 never paid (brief, section 3).

Byte-plane split, measured here (Llama-shaped random model, 49 M params, bf16, AdamW with fp32
master weights, 3 warm-up steps then the measured step, zstd level 1, 1-8 MiB chunks; encode
speed includes XOR, split and both blake3 hashes, one process, 2 shared cores)::

                       plain bytes           byte planes split
    full               1.283x  ~1100 MB/s    1.461x  ~450 MB/s
    delta, lr 1e-6     0.0176  ~1200 MB/s    0.0163  ~950 MB/s   (1.4 % of values changed)
    delta, lr 1e-5     0.0818  ~600 MB/s     0.0694  ~630 MB/s   (8.8 % of values changed)

(delta figures are encoded/raw bytes). ``echo2 bench pack`` at 98.7 M params (8 layers, hidden
768, 2 MiB chunks), encoded/raw bytes, split off -> on: full 0.780 -> 0.684, lr 1e-6 delta
0.0196 -> 0.0181 (1.5 % of values changed), lr 1e-5 delta 0.0909 -> 0.0774 (9.8 % changed).
The split saves 12 % of full bytes and 7-15 % of delta bytes, so ``BF16_SPLIT`` is on. It roughly
halves full-encode speed (zstd entropy-codes the compressible high-byte plane; full encodes happen
once per ``full_every`` versions) and costs ~20 % on lr-1e-6 deltas, still well above 300 MB/s.
The split itself (numpy, uint16 view) runs at ~8 GB/s.

Content addressing. A chunk whose raw hash equals its parent chunk's is still listed (the
manifest must cover every byte); it is encoded as a delta of all-zero bytes (a few hundred bytes
at most). A receiver that already holds a chunk with the listed ``raw_hash`` (from any version)
skips fetching it altogether.

Snapshots. Every ``full_every`` versions (``version % full_every == 0``), or without a usable
parent, every chunk is ``full``: a node that joins late, or lost its chain, needs at most
``full_every - 1`` deltas on top of a snapshot. A node that lacks the parent chunk of a delta gets
``encode_chunk(raw)`` (a ``full`` encoding) instead and checks it with ``decode_full_fallback``.

Hostile input. ``decode_chunk`` checks the encoded size and hash before decompressing, refuses a
zstd frame whose declared content size is not the manifest's ``raw_size`` (so a zstd bomb never
allocates more than ``raw_size``, itself bounded by ``MAX_CHUNK_SIZE``), and checks the raw hash
after. Everything it refuses raises ``ChunkMismatch`` (``ManifestError`` for a delta chunk without
a parent chunk).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import zstandard

from .errors import ChunkMismatch, ManifestError
from .hashing import digest
from .messages import MAX_CHUNKS, MAX_TENSORS, Manifest, ManifestChunk, TensorEntry

log = logging.getLogger(__name__)

MiB = 1 << 20

# Chunk size, measured with the model above (49 M params, 98 MB raw), split on, zstd level 1:
#   chunk   full ratio  lr1e-6 delta  lr1e-5 delta  delta encode MB/s (lr 1e-6 / 1e-5)
#   1 MiB   1.462x      0.0163        0.0693        970 / 650
#   2 MiB   1.461x      0.0163        0.0694        935 / 630
#   4 MiB   1.461x      0.0163        0.0695        900 / 610
#   8 MiB   1.461x      0.0162        0.0695        695 / 520
# ``echo2 bench pack`` at 98.7 M params (197 MB raw, lr 1e-6) gives delta ratio 0.0181 at 1, 2, 4
# and 8 MiB alike (full 0.6840-0.6843); its speeds (420-760 MB/s encode) were within the noise of
# the shared machine. Ratio does not depend on the size in this range and speed falls slowly with
# size (cache).
# The broadcast pipeline costs about (1 + depth/k) for k chunks, so more chunks are better there,
# while each chunk costs a manifest entry (~150 bytes), a request and a hash lookup. 2 MiB gives a
# 100 M-param bf16 model ~96 chunks (3 % pipeline overhead at depth 3) and a 7 B model ~6,700
# chunks (a ~1 MB manifest).
DEFAULT_CHUNK_SIZE = 2 * MiB
MAX_CHUNK_SIZE = 64 * MiB  # bounds the memory one decode may allocate
MAX_TOTAL_BYTES = 1 << 40
ALIGN = 64
DEFAULT_FULL_EVERY = 10
DEFAULT_LEVEL = 1
BF16_SPLIT = True
MAX_SHAPE_DIMS = 8
MAX_NAME_LEN = 256

# Bytes per element of each dtype name a manifest may list (torch's element_size of the same
# dtypes; echo2.models.statedict checks the two agree).
ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


@dataclass
class PackedVersion:
    """One packed policy version: the manifest (unsigned; the hub seals it), the raw chunks (for
    the next version's deltas and for serving ``full`` fallbacks) and the encoded chunks."""

    manifest: Manifest
    raw_chunks: list[bytes] = field(repr=False)
    encoded: list[bytes] = field(repr=False)

    @property
    def encoded_bytes(self) -> int:
        return sum(len(e) for e in self.encoded)


# ---------------------------------------------------------------------------------------------
# flat layout
# ---------------------------------------------------------------------------------------------


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _check_entries(entries: Sequence[TensorEntry], total: int) -> None:
    """The tensor index must be exactly the canonical layout of its names, dtypes and shapes."""
    if len(entries) > MAX_TENSORS:
        raise ManifestError(f"{len(entries)} tensors, at most {MAX_TENSORS}")
    off = 0
    prev: str | None = None
    for e in entries:
        if prev is not None and not e.name > prev:
            raise ManifestError(f"tensor names not strictly sorted at {e.name!r:.80}")
        prev = e.name
        size = ITEMSIZE.get(e.dtype)
        if size is None:
            raise ManifestError(f"{e.name!r:.80}: unknown dtype {e.dtype!r:.20}")
        if len(e.shape) > MAX_SHAPE_DIMS or any(not isinstance(d, int) or d < 0 for d in e.shape):
            raise ManifestError(f"{e.name!r:.80}: bad shape")
        if e.nbytes != math.prod(e.shape) * size:
            raise ManifestError(f"{e.name!r:.80}: nbytes {e.nbytes} does not match shape and dtype")
        off = align(off)
        if e.offset != off:
            # any other offset would overlap a neighbour or leave a non-canonical gap
            raise ManifestError(f"{e.name!r:.80}: offset {e.offset}, expected {off}")
        off += e.nbytes
        if off > total:
            raise ManifestError(f"{e.name!r:.80}: ends at {off}, beyond {total} bytes")
    if off != total:
        raise ManifestError(f"tensors end at {off}, total_bytes is {total}")


def check_unflatten(entries: Sequence[TensorEntry], total: int) -> None:
    """ManifestError unless every tensor's bytes lie inside ``total`` bytes and match its dtype
    and shape (what turning the flat bytes back into tensors relies on)."""
    for e in entries:
        size = ITEMSIZE.get(e.dtype)
        if size is None:
            raise ManifestError(f"{e.name!r:.80}: unknown dtype {e.dtype!r:.20}")
        if any(d < 0 for d in e.shape) or e.nbytes != math.prod(e.shape) * size:
            raise ManifestError(f"{e.name!r:.80}: nbytes {e.nbytes} does not match shape and dtype")
        if e.offset < 0 or e.offset + e.nbytes > total:
            raise ManifestError(f"{e.name!r:.80}: bytes {e.offset}..{e.offset + e.nbytes} outside {total}")


# ---------------------------------------------------------------------------------------------
# chunk encodings
# ---------------------------------------------------------------------------------------------

class _Codec:
    """zstd contexts and work arrays for one call at a time (zstd contexts are not thread-safe)."""

    def __init__(self) -> None:
        self.compressors: dict[int, zstandard.ZstdCompressor] = {}
        self.decompressor = zstandard.ZstdDecompressor()
        self.scratch: dict[str, np.ndarray] = {}

    def compressor(self, level: int) -> zstandard.ZstdCompressor:
        c = self.compressors.get(level)
        if c is None:
            c = self.compressors[level] = zstandard.ZstdCompressor(
                level=level, write_content_size=True, write_checksum=False
            )
        return c

    def work(self, slot: str, n: int) -> np.ndarray:
        # Reused work arrays: a fresh multi-MiB array per chunk costs page faults (and glibc
        # returns the pages each time), which halved the encode speed here.
        a = self.scratch.get(slot)
        if a is None or a.size < n:
            a = self.scratch[slot] = np.empty(max(n, 1 << 16), dtype=np.uint8)
        return a[:n]


# Idle codecs. Callers run in worker threads (trio.to_thread), so each call takes a codec of its
# own and puts it back: list.pop/append are atomic, which keeps this module free of threading
# while the pool grows only to the number of concurrent calls.
_idle_codecs: list[_Codec] = []


@contextlib.contextmanager
def _codec() -> Iterator[_Codec]:
    try:
        c = _idle_codecs.pop()
    except IndexError:
        c = _Codec()
    try:
        yield c
    finally:
        _idle_codecs.append(c)


def max_encoded_size(raw_size: int) -> int:
    """Upper bound on an encoded chunk (zstd's compress bound plus frame header, with margin)."""
    return raw_size + raw_size // 128 + 1024


def _u8(b: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    return b if isinstance(b, np.ndarray) else np.frombuffer(b, dtype=np.uint8)


def split_planes(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Even-offset bytes (bf16 low bytes), then odd-offset bytes (high bytes), then an odd tail."""
    n = x.size
    h = n // 2
    if out is None:
        out = np.empty(n, dtype=np.uint8)
    v = x[: 2 * h].view("<u2")
    np.copyto(out[:h], v, casting="unsafe")  # truncation keeps the low byte
    np.right_shift(v, 8, out=out[h : 2 * h], casting="unsafe")
    out[2 * h :] = x[2 * h :]
    return out


def join_planes(y: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`split_planes`."""
    n = y.size
    h = n // 2
    if out is None:
        out = np.empty(n, dtype=np.uint8)
    o = out[: 2 * h].view("<u2")
    o[...] = y[h : 2 * h]
    o <<= 8
    o |= y[:h]
    out[2 * h :] = y[2 * h :]
    return out


def _xor(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    if out is None:
        out = np.empty(a.size, dtype=np.uint8)
    n8 = a.size // 8 * 8
    np.bitwise_xor(a[:n8].view(np.uint64), b[:n8].view(np.uint64), out=out[:n8].view(np.uint64))
    np.bitwise_xor(a[n8:], b[n8:], out=out[n8:])
    return out


@functools.lru_cache(maxsize=16)
def _zero_frame(size: int, level: int) -> bytes:
    # identical to compressing the all-zero XOR; both planes of zeros are zeros
    with _codec() as c:
        return c.compressor(level).compress(bytes(size))


def encode_chunk(
    raw: bytes | bytearray | memoryview,
    parent_raw: bytes | bytearray | memoryview | None = None,
    *,
    bf16_split: bool = BF16_SPLIT,
    level: int = DEFAULT_LEVEL,
) -> bytes:
    """``full`` encoding without ``parent_raw``, else ``delta`` against it (same length)."""
    x = _u8(raw)
    with _codec() as c:
        if parent_raw is not None:
            p = _u8(parent_raw)
            if p.size != x.size:
                raise ValueError(f"parent chunk has {p.size} bytes, chunk has {x.size}")
            x = _xor(x, p, out=c.work("xor", x.size))
        if bf16_split:
            x = split_planes(x, out=c.work("planes", x.size))
        return c.compressor(level).compress(x.data)


def decode_full_fallback(
    entry: ManifestChunk, encoded: bytes | bytearray | memoryview, *, bf16_split: bool = BF16_SPLIT
) -> bytes:
    """Decode a ``full`` encoding of a chunk that the manifest lists as a delta, for a node without
    the parent chunk (the sender made it with ``encode_chunk(raw)``). Its encoded hash is not in the
    signed manifest, so only the raw size and raw hash vouch for it; both are checked."""
    substitute = dataclasses.replace(
        entry, encoding="full", enc_size=len(encoded), enc_hash=digest(encoded), parent_raw_hash=None
    )
    if substitute.enc_size > max_encoded_size(entry.raw_size):
        raise ChunkMismatch(f"chunk {entry.index}: {len(encoded)} encoded bytes for {entry.raw_size} raw bytes")
    return decode_chunk(substitute, encoded, None, bf16_split=bf16_split)


def verify_encoded(entry: ManifestChunk, encoded: bytes | bytearray | memoryview) -> None:
    """Check only the encoded size and hash (what a relay does before storing or forwarding)."""
    if len(encoded) != entry.enc_size:
        raise ChunkMismatch(f"chunk {entry.index}: {len(encoded)} encoded bytes, manifest says {entry.enc_size}")
    if digest(encoded) != entry.enc_hash:
        raise ChunkMismatch(f"chunk {entry.index}: encoded hash does not match the manifest")


def decode_chunk(
    entry: ManifestChunk,
    encoded: bytes | bytearray | memoryview,
    parent_raw: bytes | bytearray | memoryview | None,
    *,
    bf16_split: bool = BF16_SPLIT,
) -> bytes:
    """The verified raw bytes of one chunk. Pass ``bf16_split=manifest.bf16_split``.

    ChunkMismatch: size or hash of ``encoded`` wrong, undecodable, decoded size or raw hash wrong,
    parent chunk of the wrong size or hash. ManifestError: a delta chunk without ``parent_raw``.
    """
    if entry.raw_size <= 0 or entry.raw_size > MAX_CHUNK_SIZE:
        raise ManifestError(f"chunk {entry.index}: raw_size {entry.raw_size} outside 1..{MAX_CHUNK_SIZE}")
    if entry.encoding not in ("full", "delta"):
        raise ManifestError(f"chunk {entry.index}: unknown encoding {entry.encoding!r:.20}")
    verify_encoded(entry, encoded)
    p: np.ndarray | None = None
    if entry.encoding == "delta":
        if entry.parent_raw_hash is None:
            raise ManifestError(f"chunk {entry.index}: delta without parent_raw_hash")
        if parent_raw is None:
            raise ManifestError(f"chunk {entry.index}: delta chunk needs its parent chunk")
        if len(parent_raw) != entry.raw_size:
            raise ChunkMismatch(f"chunk {entry.index}: parent chunk has {len(parent_raw)} bytes, not {entry.raw_size}")
        if digest(parent_raw) != entry.parent_raw_hash:
            raise ChunkMismatch(f"chunk {entry.index}: parent chunk hash does not match the manifest")
        p = _u8(parent_raw)
    try:
        declared = zstandard.get_frame_parameters(bytes(encoded[:18])).content_size
    except zstandard.ZstdError as exc:
        raise ChunkMismatch(f"chunk {entry.index}: not a zstd frame: {exc}") from None
    if declared != entry.raw_size:
        # refuse before allocating: zstd trusts the declared size and ignores max_output_size
        raise ChunkMismatch(f"chunk {entry.index}: frame declares {declared} bytes, manifest says {entry.raw_size}")
    with _codec() as codec:
        try:
            data = codec.decompressor.decompress(encoded, max_output_size=entry.raw_size, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise ChunkMismatch(f"chunk {entry.index}: zstd: {exc}") from None
        if len(data) != entry.raw_size:
            raise ChunkMismatch(f"chunk {entry.index}: decoded {len(data)} bytes, manifest says {entry.raw_size}")
        y = _u8(data)
        if bf16_split:
            y = join_planes(y, out=codec.work("planes", y.size))
        if p is not None:
            y = _xor(y, p, out=y if bf16_split else codec.work("xor", y.size))
        raw = y.tobytes() if (bf16_split or p is not None) else data
    if digest(raw) != entry.raw_hash:
        raise ChunkMismatch(f"chunk {entry.index}: raw hash does not match the manifest")
    return raw


# ---------------------------------------------------------------------------------------------
# versions and manifests
# ---------------------------------------------------------------------------------------------


def chunk_count(total_bytes: int, chunk_size: int) -> int:
    return -(-total_bytes // chunk_size)


def pack_buffer(
    entries: list[TensorEntry],
    buf: bytes | bytearray,
    *,
    version: int,
    parent: PackedVersion | None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    model_config: str,
    artifacts: dict[str, bytes],
    full_every: int = DEFAULT_FULL_EVERY,
    level: int = DEFAULT_LEVEL,
    created: float | None = None,
    bf16_split: bool = BF16_SPLIT,
    keep_unchanged: bool = False,
) -> PackedVersion:
    """Cut and encode one version's flat bytes (``buf``, laid out as ``entries`` say). Chunks are
    deltas against ``parent`` where the parent has the same chunk (same index and size, same chunk
    size and split), except on snapshot versions (``version % full_every == 0``) where every chunk
    is full. With ``keep_unchanged`` a snapshot still lists a chunk identical to the parent's as a
    (zero) delta: a LoRA policy's frozen base never changes, and a node holding a chunk by its raw
    hash never fetches it, while one without it gets the full encoding anyway, so re-encoding the
    base in full every ``full_every`` versions would only cost the hub (echo2.models.lora).
    An unchanged chunk shares the parent's bytes object (no second copy in memory).
    ``echo2.models.statedict.pack_version`` is the state-dict front door."""
    if not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size {chunk_size} outside 1..{MAX_CHUNK_SIZE}")
    if full_every < 1:
        raise ValueError("full_every must be >= 1")
    total = len(buf)
    if total > MAX_TOTAL_BYTES:
        raise ValueError(f"{total} bytes, at most {MAX_TOTAL_BYTES}")
    base: PackedVersion | None = None
    if parent is not None:
        pm = parent.manifest
        if pm.version >= version:
            raise ValueError(f"parent version {pm.version} is not older than {version}")
        if (version % full_every != 0 or keep_unchanged) and pm.chunk_size == chunk_size and pm.bf16_split == bf16_split:
            base = parent
    snapshot = version % full_every == 0
    mv = memoryview(buf)
    raw_chunks: list[bytes] = []
    encoded: list[bytes] = []
    chunks: list[ManifestChunk] = []
    any_delta = False
    for index, off in enumerate(range(0, total, chunk_size)):
        raw = bytes(mv[off : off + chunk_size])
        raw_hash = digest(raw)
        parent_hash: bytes | None = None
        if base is not None and index < len(base.raw_chunks) and len(base.raw_chunks[index]) == len(raw):
            parent_hash = base.manifest.chunks[index].raw_hash
            if parent_hash == raw_hash:
                enc = _zero_frame(len(raw), level)
                raw = base.raw_chunks[index]
                any_delta = True
            elif snapshot:
                parent_hash = None
                enc = encode_chunk(raw, None, bf16_split=bf16_split, level=level)
            else:
                enc = encode_chunk(raw, base.raw_chunks[index], bf16_split=bf16_split, level=level)
                any_delta = True
        else:
            enc = encode_chunk(raw, None, bf16_split=bf16_split, level=level)
        raw_chunks.append(raw)
        encoded.append(enc)
        chunks.append(
            ManifestChunk(
                index=index, offset=off, raw_size=len(raw), raw_hash=raw_hash,
                encoding="delta" if parent_hash is not None else "full",
                enc_size=len(enc), enc_hash=digest(enc), parent_raw_hash=parent_hash,
            )
        )
    del mv
    log.debug(
        "packed version %d: %d bytes raw, %d encoded, %d chunks (%s)", version, total,
        sum(len(e) for e in encoded), len(chunks), "delta" if any_delta else "full",
    )
    manifest = Manifest(
        version=version,
        parent=base.manifest.version if (base is not None and any_delta) else None,
        created=time.time() if created is None else float(created),
        chunk_size=chunk_size,
        total_bytes=total,
        tensors=entries,
        chunks=chunks,
        model_config=model_config,
        artifacts=dict(artifacts),
        bf16_split=bf16_split,
    )
    return PackedVersion(manifest=manifest, raw_chunks=raw_chunks, encoded=encoded)


def verify_manifest_consistency(manifest: Manifest) -> None:
    """Meaning checks a receiver runs after the signature: ManifestError unless the chunks are
    contiguous, cover ``total_bytes`` exactly and stay within the limits, and the tensor index is
    the canonical layout (sorted, aligned, no overlaps, sizes matching dtype and shape)."""
    m = manifest
    if m.parent is not None and not 0 <= m.parent < m.version:
        raise ManifestError(f"parent {m.parent} is not older than version {m.version}")
    if not 0 < m.chunk_size <= MAX_CHUNK_SIZE:
        raise ManifestError(f"chunk_size {m.chunk_size} outside 1..{MAX_CHUNK_SIZE}")
    if not 0 <= m.total_bytes <= MAX_TOTAL_BYTES:
        raise ManifestError(f"total_bytes {m.total_bytes} outside 0..{MAX_TOTAL_BYTES}")
    n = chunk_count(m.total_bytes, m.chunk_size)
    if n > MAX_CHUNKS:
        raise ManifestError(f"{n} chunks, at most {MAX_CHUNKS}")
    if len(m.chunks) != n:
        raise ManifestError(f"{len(m.chunks)} chunks listed, {n} needed to cover {m.total_bytes} bytes")
    for i, c in enumerate(m.chunks):
        off = i * m.chunk_size
        if c.index != i or c.offset != off:
            raise ManifestError(f"chunk {i}: index {c.index} / offset {c.offset}, expected {i} / {off}")
        size = min(m.chunk_size, m.total_bytes - off)
        if c.raw_size != size:
            raise ManifestError(f"chunk {i}: raw_size {c.raw_size}, expected {size}")
        if not 0 < c.enc_size <= max_encoded_size(size):
            raise ManifestError(f"chunk {i}: enc_size {c.enc_size} outside 1..{max_encoded_size(size)}")
        if c.encoding == "delta":
            if c.parent_raw_hash is None:
                raise ManifestError(f"chunk {i}: delta without parent_raw_hash")
            if m.parent is None:
                raise ManifestError(f"chunk {i}: delta chunk in a manifest without parent version")
        elif c.encoding == "full":
            if c.parent_raw_hash is not None:
                raise ManifestError(f"chunk {i}: full chunk with a parent_raw_hash")
        else:
            raise ManifestError(f"chunk {i}: unknown encoding {c.encoding!r:.20}")
    _check_entries(m.tensors, m.total_bytes)


def assemble_buffer(manifest: Manifest, raw_chunks: Sequence[bytes], *, verify: bool = True) -> bytearray:
    """The flat bytes of a complete version from its raw chunks (checked against their raw hashes
    unless ``verify=False``, for chunks that :func:`decode_chunk` returned a moment ago)."""
    verify_manifest_consistency(manifest)
    if len(raw_chunks) != len(manifest.chunks):
        raise ManifestError(f"{len(raw_chunks)} raw chunks for {len(manifest.chunks)} manifest chunks")
    buf = bytearray(manifest.total_bytes)
    mv = memoryview(buf)
    for c, raw in zip(manifest.chunks, raw_chunks, strict=True):
        if len(raw) != c.raw_size:
            raise ChunkMismatch(f"chunk {c.index}: {len(raw)} bytes, manifest says {c.raw_size}")
        if verify and digest(raw) != c.raw_hash:
            raise ChunkMismatch(f"chunk {c.index}: raw hash does not match the manifest")
        mv[c.offset : c.offset + c.raw_size] = raw
    del mv
    return buf
