"""Payload decoding at C speed: the field specs compiled to msgspec types, with the specs as referee.

:mod:`echo2.protocol.schema` is the one definition of every message's schema and of its refusal
messages (``Result.completions[3].logprobs[7]: 0.25 out of range ...``). Walking it in Python costs
about 4 s for a 64 MiB Result, most of it in the canonical-form check and the per-item checks of
token and logprob lists (measured: tokens and logprobs are ~9.5 million scalars). So each record
type is also compiled, from the same specs, to a msgspec Struct with ``Meta`` constraints: msgspec
decodes the msgpack straight into it and checks types, ranges, lengths and choices in C, and
re-encoding it with sorted keys must give the received bytes back (the canonical-form check).

The fast path only ever accepts: anything it does not accept (a refusal, a peer ID it cannot vouch
for, a cross-field rule, an encoding it would write differently) goes to the reference path,
``from_wire(canonical.decode(...))``, which accepts or refuses with the usual message. So the
accepted set and every error message are exactly the reference's; msgspec only makes the common
case fast. msgspec is not the referee because it coerces (an int into a float field, where the
canonical form is float64) and words its errors differently from what callers and logs expect.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from . import canonical
from .schema import (
    Bool,
    Bytes,
    Dict,
    Float,
    Int,
    List,
    Nested,
    Nullable,
    PeerId,
    Record,
    Spec,
    Str,
)

R = TypeVar("R", bound=Record)

_FMAX = sys.float_info.max  # ge/le of +-max refuse inf and nan (msgspec has no "finite" flag)
_ENCODER = msgspec.msgpack.Encoder(order="sorted")
_STRUCTS: dict[type[Record], type[msgspec.Struct]] = {}
_DECODERS: dict[type[Record], msgspec.msgpack.Decoder[Any]] = {}


class _NotFast(Exception):
    """The fast path does not vouch for this input; the reference path decides."""


def _type_of(spec: Spec) -> Any:
    """The msgspec type that accepts at most what ``spec`` accepts."""
    if isinstance(spec, Int):
        return Annotated[int, msgspec.Meta(ge=spec.lo, le=spec.hi)]
    if isinstance(spec, Float):
        lo = max(spec.lo, -_FMAX)
        hi = min(spec.hi, _FMAX)
        low = msgspec.Meta(gt=lo, le=hi) if spec.lo_open else msgspec.Meta(ge=lo, le=hi)
        return Annotated[float, low]
    if isinstance(spec, Bool):
        return bool
    if isinstance(spec, Str):
        if spec.choices is not None:
            return Literal[tuple(sorted(spec.choices))]
        return Annotated[str, msgspec.Meta(max_length=spec.max_len)]
    if isinstance(spec, PeerId):
        return Annotated[str, msgspec.Meta(max_length=64)]  # the key check runs after decoding
    if isinstance(spec, Bytes):
        if spec.size is not None:
            return Annotated[bytes, msgspec.Meta(min_length=spec.size, max_length=spec.size)]
        if spec.max_len is not None:
            return Annotated[bytes, msgspec.Meta(max_length=spec.max_len)]
        return bytes
    if isinstance(spec, Nullable):
        return _type_of(spec.inner) | None
    if isinstance(spec, List):
        item = _type_of(spec.item)
        return Annotated[list[item], msgspec.Meta(min_length=spec.min_len, max_length=spec.max_len)]  # type: ignore[valid-type]
    if isinstance(spec, Dict):
        return Annotated[
            dict[_type_of(spec.key), _type_of(spec.value)],  # type: ignore[misc]
            msgspec.Meta(max_length=spec.max_len),
        ]
    if isinstance(spec, Nested):
        return struct_for(spec.cls)
    raise TypeError(f"no msgspec type for {spec!r}")


def struct_for(cls: type[Record]) -> type[msgspec.Struct]:
    """The msgspec Struct mirroring ``cls.SPEC`` (built once per record type)."""
    st = _STRUCTS.get(cls)
    if st is None:
        fields = [(name, _type_of(spec)) for name, spec in cls.SPEC.items()]
        st = msgspec.defstruct(f"_{cls.__name__}Wire", fields, frozen=True, forbid_unknown_fields=True)
        _STRUCTS[cls] = st
    return st


def _needs_build(spec: Spec) -> bool:
    """Whether values of ``spec`` need a per-item pass (records to build, peer IDs to check)."""
    if isinstance(spec, (Nested, PeerId)):
        return True
    if isinstance(spec, Nullable):
        return _needs_build(spec.inner)
    if isinstance(spec, List):
        return _needs_build(spec.item)
    if isinstance(spec, Dict):
        return _needs_build(spec.key) or _needs_build(spec.value)
    return False


def _build(spec: Spec, v: Any) -> Any:
    if not _needs_build(spec):
        return v
    if isinstance(spec, PeerId):
        try:
            return spec.check(v, "")
        except Exception as exc:
            raise _NotFast from exc
    if isinstance(spec, Nested):
        return _record(spec.cls, v)
    if isinstance(spec, Nullable):
        return None if v is None else _build(spec.inner, v)
    if isinstance(spec, List):
        return [_build(spec.item, x) for x in v]
    if isinstance(spec, Dict):
        return {_build(spec.key, k): _build(spec.value, x) for k, x in v.items()}
    raise TypeError(f"cannot build {spec!r}")


def _record(cls: type[R], st: Any) -> R:
    obj = cls(**{name: _build(spec, getattr(st, name)) for name, spec in cls.SPEC.items()})
    try:
        obj._check_fields("")
    except Exception as exc:
        raise _NotFast from exc
    return obj


def _fast(cls: type[R], raw: bytes) -> R:
    dec = _DECODERS.get(cls)
    if dec is None:
        dec = _DECODERS[cls] = msgspec.msgpack.Decoder(struct_for(cls))
    try:
        st = dec.decode(raw)
        # Canonical iff it re-encodes to itself: this refuses ints in float fields (msgspec
        # coerced them), unsorted or duplicate keys and over-long number or length forms.
        if _ENCODER.encode(st) != raw:
            raise _NotFast
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _NotFast from exc
    return _record(cls, st)


def decode_payload(cls: type[R], data: bytes, *, max_size: int) -> R:
    """The ``cls`` record carried in canonical msgpack ``data``; exactly what
    ``cls.from_wire(canonical.decode(data, max_size=max_size))`` returns or raises, only faster."""
    if len(data) <= max_size:
        try:
            return _fast(cls, data)
        except _NotFast:
            pass
        except RecursionError:
            pass
    return cls.from_wire(canonical.decode(data, max_size=max_size))
