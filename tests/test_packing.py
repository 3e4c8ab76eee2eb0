"""Policy packing: bit-identical round trips, deltas, tamper detection, bombs, manifest checks."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from echo2.models import statedict
from echo2.protocol import canonical, packing
from echo2.protocol.errors import ChunkMismatch, ManifestError
from echo2.protocol.hashing import digest
from echo2.protocol.messages import Manifest

DTYPE_NAMES = sorted(statedict.DTYPES)
KW: dict = {"model_config": '{"arch": "test"}', "artifacts": {"tokenizer.json": b"{}"}}


def _tensor_from_bytes(dtype_name: str, shape: list[int], data: bytes) -> torch.Tensor:
    dtype = statedict.DTYPES[dtype_name]
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


@st.composite
def state_dicts(draw: st.DrawFn, max_numel: int = 40) -> dict[str, torch.Tensor]:
    names = draw(st.lists(st.text("abc.xyz_0189", min_size=1, max_size=12), max_size=6, unique=True))
    out: dict[str, torch.Tensor] = {}
    for name in names:
        dtype = draw(st.sampled_from(DTYPE_NAMES))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        numel = math.prod(shape)
        if numel > max_numel:
            shape, numel = [numel % max_numel], numel % max_numel
        n = numel * packing.ITEMSIZE[dtype]
        if dtype == "bool":
            data = bytes(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)))
        else:  # arbitrary bytes: NaN payloads, subnormals, -0.0 must all survive
            data = draw(st.binary(min_size=n, max_size=n))
        out[name] = _tensor_from_bytes(dtype, shape, data)
    return out


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert tuple(a[k].shape) == tuple(b[k].shape), k
        assert _bits(a[k]) == _bits(b[k]), k


def decode_all(pv: packing.PackedVersion, parent: packing.PackedVersion | None) -> list[bytes]:
    m = pv.manifest
    out = []
    for c, enc in zip(m.chunks, pv.encoded, strict=True):
        parent_raw = parent.raw_chunks[c.index] if (c.encoding == "delta" and parent is not None) else None
        out.append(packing.decode_chunk(c, enc, parent_raw, bf16_split=m.bf16_split))
    return out


def model_like(n: int = 20_000, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.weight": (torch.randn(n, generator=g) * 0.02).reshape(-1, 100),
        "layers.0.norm": torch.ones(100),
        "layers.1.weight": (torch.randn(n, generator=g) * 0.02).reshape(100, -1),
        "step": torch.tensor(7, dtype=torch.int64),
        "z.frozen": (torch.randn(n // 2, generator=g) * 0.02),  # never trained: chunks stay the same
    }


def step(sd: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (v - lr * torch.randn(v.shape, generator=g).sign()) if v.is_floating_point() and "frozen" not in k else v
            for k, v in sd.items()}


def bf16(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}


# ---------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sd=state_dicts(), chunk_size=st.integers(1, 300), split=st.booleans())
def test_full_round_trip_bit_identical(sd: dict[str, torch.Tensor], chunk_size: int, split: bool) -> None:
    entries, raw = statedict.flatten(sd)
    assert [e.name for e in entries] == sorted(sd)
    assert_identical(statedict.unflatten(entries, raw), sd)
    pv = statedict.pack_version(sd, version=3, parent=None, chunk_size=chunk_size, bf16_split=split, **KW)
    m = pv.manifest
    packing.verify_manifest_consistency(m)
    assert m.parent is None and all(c.encoding == "full" for c in m.chunks)
    assert b"".join(pv.raw_chunks) == raw
    assert Manifest.from_wire(canonical.decode(canonical.encode(m.to_wire()), max_size=1 << 24)) == m
    assert_identical(statedict.assemble(m, decode_all(pv, None)), sd)


@settings(max_examples=40, deadline=None)
@given(sd=state_dicts(max_numel=200), chunk_size=st.integers(1, 500), split=st.booleans(), data=st.data())
def test_delta_round_trip(sd: dict[str, torch.Tensor], chunk_size: int, split: bool, data: st.DataObject) -> None:
    v1 = statedict.pack_version(sd, version=1, parent=None, chunk_size=chunk_size, bf16_split=split, **KW)
    entries, raw = statedict.flatten(sd)
    buf = bytearray(raw)
    for e in entries:  # flip a few bytes of non-bool tensors
        if e.nbytes and e.dtype != "bool" and data.draw(st.booleans()):
            pos = e.offset + data.draw(st.integers(0, e.nbytes - 1))
            buf[pos] ^= data.draw(st.integers(1, 255))
    sd2 = statedict.unflatten(entries, buf)
    v2 = statedict.pack_version(sd2, version=2, parent=v1, chunk_size=chunk_size, bf16_split=split, **KW)
    packing.verify_manifest_consistency(v2.manifest)
    assert all(c.encoding == "delta" for c in v2.manifest.chunks)
    assert v2.manifest.parent == (1 if v2.manifest.chunks else None)
    assert_identical(statedict.assemble(v2.manifest, decode_all(v2, v1)), sd2)


def test_realistic_delta_is_small_and_unchanged_chunks_are_tiny() -> None:
    sd1 = model_like()
    v1 = statedict.pack_version(bf16(sd1), version=1, parent=None, chunk_size=4096, **KW)
    sd2 = bf16(step(sd1, 1e-6, seed=1))
    v2 = statedict.pack_version(sd2, version=2, parent=v1, chunk_size=4096, **KW)
    m = v2.manifest
    assert v2.encoded_bytes < 0.2 * m.total_bytes
    unchanged = [c for c in m.chunks if c.raw_hash == c.parent_raw_hash]
    assert unchanged, "the frozen tensor never changes"
    for c in unchanged:
        assert c.encoding == "delta" and c.enc_size < 100
    assert_identical(statedict.assemble(m, decode_all(v2, v1)), sd2)


def test_flipped_encoded_byte_detected() -> None:
    sd1 = bf16(model_like(5000))
    v1 = statedict.pack_version(sd1, version=1, parent=None, chunk_size=2048, **KW)
    v2 = statedict.pack_version(bf16(step(model_like(5000), 1e-3, 2)), version=2, parent=v1, chunk_size=2048, **KW)
    rng = random.Random(0)
    for pv, parent in ((v1, None), (v2, v1)):
        for c, enc in zip(pv.manifest.chunks, pv.encoded, strict=True):
            parent_raw = parent.raw_chunks[c.index] if parent else None
            positions = {0, len(enc) - 1, *(rng.randrange(len(enc)) for _ in range(6))}
            for pos in positions:
                bad = bytearray(enc)
                bad[pos] ^= 1 << rng.randrange(8)
                with pytest.raises(ChunkMismatch):
                    packing.verify_encoded(c, bytes(bad))
                with pytest.raises(ChunkMismatch):
                    packing.decode_chunk(c, bytes(bad), parent_raw)
            with pytest.raises(ChunkMismatch):  # truncated / extended
                packing.decode_chunk(c, enc[:-1], parent_raw)
            with pytest.raises(ChunkMismatch):
                packing.decode_chunk(c, enc + b"\0", parent_raw)


def test_flipped_raw_byte_detected() -> None:
    sd = bf16(model_like(5000))
    pv = statedict.pack_version(sd, version=1, parent=None, chunk_size=3000, **KW)
    m = pv.manifest
    rng = random.Random(1)
    for i in range(len(pv.raw_chunks)):
        raws = list(pv.raw_chunks)
        bad = bytearray(raws[i])
        bad[rng.randrange(len(bad))] ^= 0x80
        raws[i] = bytes(bad)
        with pytest.raises(ChunkMismatch):
            statedict.assemble(m, raws)
        # an encoder that lies: encoded hash fits, raw bytes are not the manifest's
        enc = packing.encode_chunk(raws[i])
        entry = dataclasses.replace(m.chunks[i], enc_size=len(enc), enc_hash=digest(enc))
        with pytest.raises(ChunkMismatch):
            packing.decode_chunk(entry, enc, None)
    # the wrong split flag decodes to other bytes, caught by the raw hash
    with pytest.raises(ChunkMismatch):
        packing.decode_chunk(m.chunks[0], pv.encoded[0], None, bf16_split=not m.bf16_split)
    with pytest.raises(ManifestError):
        statedict.assemble(m, pv.raw_chunks[:-1])


def test_wrong_or_missing_parent() -> None:
    base = model_like(5000)
    v1 = statedict.pack_version(bf16(base), version=1, parent=None, chunk_size=2048, **KW)
    other = statedict.pack_version(bf16(step(base, 1e-2, 9)), version=1, parent=None, chunk_size=2048, **KW)
    v2 = statedict.pack_version(bf16(step(base, 1e-3, 3)), version=2, parent=v1, chunk_size=2048, **KW)
    c, enc = v2.manifest.chunks[0], v2.encoded[0]
    assert c.encoding == "delta"
    with pytest.raises(ManifestError):
        packing.decode_chunk(c, enc, None)
    with pytest.raises(ChunkMismatch):
        packing.decode_chunk(c, enc, other.raw_chunks[0])
    with pytest.raises(ChunkMismatch):
        packing.decode_chunk(c, enc, v1.raw_chunks[0][:-1])
    assert packing.decode_chunk(c, enc, v1.raw_chunks[0]) == v2.raw_chunks[0]
    # a node without the parent gets a full encoding of the chunk instead
    full = packing.encode_chunk(v2.raw_chunks[0])
    assert packing.decode_full_fallback(c, full) == v2.raw_chunks[0]
    with pytest.raises(ChunkMismatch):
        packing.decode_full_fallback(c, packing.encode_chunk(other.raw_chunks[0]))


def test_zstd_bomb_refused() -> None:
    raw = bytes(range(256)) * 4
    entry = statedict.pack_version(
        {"w": torch.frombuffer(bytearray(raw), dtype=torch.uint8)}, version=0, parent=None, **KW
    ).manifest.chunks[0]
    big = 256 << 20
    bombs = [
        zstandard.ZstdCompressor(level=1).compress(bytes(big)),  # declares 256 MiB
        zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(big)),  # declares nothing
        zstandard.ZstdCompressor(level=1).compress(raw) * 2,  # two frames
        b"not zstd at all",
    ]
    for bomb in bombs:
        e = dataclasses.replace(entry, enc_size=len(bomb), enc_hash=digest(bomb))
        with pytest.raises(ChunkMismatch):
            packing.decode_chunk(e, bomb, None, bf16_split=False)
        with pytest.raises(ChunkMismatch):
            packing.decode_full_fallback(entry, bomb)
    e = dataclasses.replace(entry, raw_size=packing.MAX_CHUNK_SIZE + 1)
    with pytest.raises(ManifestError):
        packing.decode_chunk(e, bombs[0], None)


def test_manifest_consistency_refusals() -> None:
    sd1 = bf16(model_like(3000))
    v1 = statedict.pack_version(sd1, version=4, parent=None, chunk_size=1000, **KW)
    v2 = statedict.pack_version(bf16(step(model_like(3000), 1e-3, 5)), version=5, parent=v1, chunk_size=1000, **KW)
    m = v2.manifest
    packing.verify_manifest_consistency(m)
    assert m.parent == 4
    rep = dataclasses.replace
    ch, te = m.chunks, m.tensors
    bad: list[Manifest] = [
        rep(m, chunks=ch[:-1]),
        rep(m, chunks=[*ch, rep(ch[-1], index=len(ch))]),
        rep(m, chunks=[ch[1], ch[0], *ch[2:]]),
        rep(m, chunks=[rep(ch[0], offset=1), *ch[1:]]),
        rep(m, chunks=[rep(ch[0], raw_size=999), *ch[1:]]),
        rep(m, chunks=[*ch[:-1], rep(ch[-1], raw_size=ch[-1].raw_size + 1)]),
        rep(m, chunks=[rep(ch[0], enc_size=10**9), *ch[1:]]),
        rep(m, chunks=[rep(ch[0], parent_raw_hash=None), *ch[1:]]),
        rep(m, chunks=[rep(ch[0], encoding="full"), *ch[1:]]),  # full with a parent hash
        rep(m, chunks=[rep(ch[0], encoding="gzip"), *ch[1:]]),
        rep(m, parent=None),  # deltas without a parent version
        rep(m, parent=5),
        rep(m, total_bytes=m.total_bytes + 1),
        rep(m, chunk_size=0),
        rep(m, chunk_size=packing.MAX_CHUNK_SIZE + 1),
        rep(m, tensors=[te[1], te[0], *te[2:]]),  # unsorted
        rep(m, tensors=[te[0], te[0], *te[1:]]),  # duplicate
        rep(m, tensors=[te[0], rep(te[1], offset=te[1].offset - 64), *te[2:]]),  # overlap
        rep(m, tensors=[te[0], rep(te[1], offset=te[1].offset + 64), *te[2:]]),  # gap / past the end
        rep(m, tensors=[rep(te[0], nbytes=te[0].nbytes - 2), *te[1:]]),
        rep(m, tensors=[rep(te[0], shape=[7, 7]), *te[1:]]),
        rep(m, tensors=[rep(te[0], dtype="complex64"), *te[1:]]),
        rep(m, tensors=te[:-1]),  # does not reach total_bytes
    ]
    for i, b in enumerate(bad):
        with pytest.raises(ManifestError):
            packing.verify_manifest_consistency(b)
            pytest.fail(f"case {i} accepted")
        with pytest.raises(ManifestError):
            statedict.assemble(b, v2.raw_chunks)
    with pytest.raises(ManifestError):
        statedict.unflatten([rep(te[0], offset=10**9)], b"\0" * 100)


def test_full_snapshot_cadence() -> None:
    sd = model_like(2000)
    prev: packing.PackedVersion | None = None
    for version in range(1, 13):
        sd = step(sd, 1e-3, version)
        pv = statedict.pack_version(bf16(sd), version=version, parent=prev, chunk_size=1024, full_every=5, **KW)
        m = pv.manifest
        packing.verify_manifest_consistency(m)
        encodings = {c.encoding for c in m.chunks}
        if version % 5 == 0 or prev is None:
            assert encodings == {"full"} and m.parent is None, version
        else:
            assert encodings == {"delta"} and m.parent == version - 1, version
        assert_identical(statedict.assemble(m, decode_all(pv, prev)), bf16(sd))
        prev = pv
    # a parent cut differently is not usable for deltas
    other = statedict.pack_version(bf16(sd), version=13, parent=prev, chunk_size=2048, **KW)
    assert {c.encoding for c in other.manifest.chunks} == {"full"}
    with pytest.raises(ValueError):
        statedict.pack_version(bf16(sd), version=12, parent=prev, **KW)


def test_flatten_refuses_unsupported() -> None:
    with pytest.raises(TypeError):
        statedict.flatten({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TypeError):
        statedict.flatten({"x": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        statedict.flatten({"x": torch.zeros([1] * 9)})
    entries, raw = statedict.flatten({})
    assert entries == [] and raw == b""
    pv = statedict.pack_version({}, version=0, parent=None, **KW)
    assert pv.manifest.chunks == [] and statedict.assemble(pv.manifest, []) == {}


def test_non_contiguous_and_shared_tensors() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd = {"t": base.t(), "slice": base[:, 1:3], "tied_a": base, "tied_b": base}
    entries, raw = statedict.flatten(sd)
    assert all(e.offset % packing.ALIGN == 0 for e in entries)
    out = statedict.unflatten(entries, raw)
    for k, v in sd.items():
        assert torch.equal(out[k], v)


@pytest.mark.slow
def test_bf16_model_delta_ratio_and_speed_slow() -> None:
    sd1 = model_like(2_000_000)
    v1 = statedict.pack_version(bf16(sd1), version=1, parent=None, **KW)
    sd2 = bf16(step(sd1, 1e-6, 1))
    v2 = statedict.pack_version(sd2, version=2, parent=v1, **KW)
    assert v2.encoded_bytes < 0.05 * v2.manifest.total_bytes
    assert_identical(statedict.assemble(v2.manifest, decode_all(v2, v1)), sd2)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sd=state_dicts(max_numel=300), chunk_size=st.integers(1, 2000), split=st.booleans())
def test_full_round_trip_many_slow(sd: dict[str, torch.Tensor], chunk_size: int, split: bool) -> None:
    pv = statedict.pack_version(sd, version=1, parent=None, chunk_size=chunk_size, bf16_split=split, **KW)
    assert_identical(statedict.assemble(pv.manifest, decode_all(pv, None)), sd)
