"""A state dict as the flat bytes that ``echo2.protocol.packing`` chunks, and back.

The layout rule (sorted names, ``ALIGN``-byte offsets, zero gaps) and everything done on the bytes
live in the sans-IO core; this module is the torch half: tensors are read through
``view(torch.uint8)``, never through a float conversion, so every dtype (bfloat16 NaN payloads
included) round-trips bit for bit, and ``assemble`` hands out tensors that view one buffer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from echo2.protocol import packing
from echo2.protocol.messages import Manifest, TensorEntry
from echo2.protocol.packing import MAX_NAME_LEN, MAX_SHAPE_DIMS, PackedVersion

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
# The core's byte sizes are written out by hand (it may not import torch); they must be torch's.
assert set(DTYPES) == set(packing.ITEMSIZE) and all(
    torch.empty(0, dtype=v).element_size() == packing.ITEMSIZE[k] for k, v in DTYPES.items()
)


def _flatten_into_buffer(state_dict: Mapping[str, torch.Tensor]) -> tuple[list[TensorEntry], bytearray]:
    entries: list[TensorEntry] = []
    sources: list[tuple[int, torch.Tensor]] = []
    off = 0
    for name in sorted(state_dict):
        t = state_dict[name]
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN:
            raise ValueError(f"tensor name must be a str of 1..{MAX_NAME_LEN} chars: {name!r:.80}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        dname = _DTYPE_NAMES.get(t.dtype)
        if dname is None:
            raise TypeError(f"{name}: unsupported dtype {t.dtype}")
        if t.dim() > MAX_SHAPE_DIMS:
            raise ValueError(f"{name}: {t.dim()} dims, at most {MAX_SHAPE_DIMS}")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        off = packing.align(off)
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(name=name, dtype=dname, shape=list(t.shape), offset=off, nbytes=nbytes))
        sources.append((off, t))
        off += nbytes
    buf = bytearray(off)  # zero-filled: the alignment gaps are zero bytes
    dst = np.frombuffer(buf, dtype=np.uint8)
    for start, t in sources:
        if t.numel():
            src = t.contiguous().reshape(-1).view(torch.uint8).numpy()
            dst[start : start + src.size] = src
    return entries, buf


def flatten(state_dict: Mapping[str, torch.Tensor]) -> tuple[list[TensorEntry], bytes]:
    """Tensor index (sorted names, 64-byte aligned offsets) and the flat raw bytes."""
    entries, buf = _flatten_into_buffer(state_dict)
    return entries, bytes(buf)


def _tensors_from_buffer(entries: Sequence[TensorEntry], buf: bytearray) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        dtype = DTYPES[e.dtype]
        if e.nbytes == 0:
            out[e.name] = torch.empty(e.shape, dtype=dtype)
            continue
        if e.offset % packing.ALIGN == 0:
            flat = torch.frombuffer(buf, dtype=torch.uint8, count=e.nbytes, offset=e.offset)
        else:  # never for the canonical layout; a copy gives the typed view an aligned start
            flat = torch.frombuffer(bytearray(buf[e.offset : e.offset + e.nbytes]), dtype=torch.uint8)
        out[e.name] = flat.view(dtype).reshape(e.shape)
    return out


def unflatten(entries: Sequence[TensorEntry], raw: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Tensors back from the flat bytes, bit-identical. They share one private copy of ``raw``."""
    packing.check_unflatten(entries, len(raw))
    return _tensors_from_buffer(entries, bytearray(raw))


def pack_version(
    state_dict: Mapping[str, torch.Tensor],
    *,
    version: int,
    parent: PackedVersion | None,
    chunk_size: int = packing.DEFAULT_CHUNK_SIZE,
    model_config: str,
    artifacts: dict[str, bytes],
    full_every: int = packing.DEFAULT_FULL_EVERY,
    level: int = packing.DEFAULT_LEVEL,
    created: float | None = None,
    bf16_split: bool = packing.BF16_SPLIT,
    keep_unchanged: bool = False,
) -> PackedVersion:
    """Flatten, cut and encode one version (see :func:`echo2.protocol.packing.pack_buffer`)."""
    # Argument checks first, as before the split: a bad chunk_size must not cost a flatten.
    if not 0 < chunk_size <= packing.MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size {chunk_size} outside 1..{packing.MAX_CHUNK_SIZE}")
    if full_every < 1:
        raise ValueError("full_every must be >= 1")
    entries, buf = _flatten_into_buffer(state_dict)
    return packing.pack_buffer(
        entries, buf, version=version, parent=parent, chunk_size=chunk_size, model_config=model_config,
        artifacts=artifacts, full_every=full_every, level=level, created=created, bf16_split=bf16_split,
        keep_unchanged=keep_unchanged,
    )


def assemble(manifest: Manifest, raw_chunks: Sequence[bytes], *, verify: bool = True) -> dict[str, torch.Tensor]:
    """The state dict of a complete version from its raw chunks (checked against their raw hashes
    unless ``verify=False``, for chunks that ``decode_chunk`` returned a moment ago)."""
    buf = packing.assemble_buffer(manifest, raw_chunks, verify=verify)
    return _tensors_from_buffer(manifest.tensors, buf)
