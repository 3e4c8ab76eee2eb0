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

import dataclasses
import sys
from collections.abc import Callable
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


Builder = Callable[[Any], Any]


def _peer(spec: PeerId) -> Builder:
    def build(v: Any) -> Any:
        try:
            return spec.check(v, "")
        except Exception as exc:
            raise _NotFast from exc
    return build


def _builder(spec: Spec) -> Builder | None:
    """What turns a decoded value of ``spec`` into the record's value: None where the value is
    taken as decoded. Compiled once per record type: walking the specs for every value (the
    per-value ``_needs_build`` recursion) was ~45 us of a small PackedResult's 120 us decode."""
    if not _needs_build(spec):
        return None
    if isinstance(spec, PeerId):
        return _peer(spec)
    if isinstance(spec, Nested):
        cls = spec.cls
        return lambda v: _record(cls, v)
    if isinstance(spec, Nullable):
        inner = _builder(spec.inner)
        assert inner is not None
        return lambda v: None if v is None else inner(v)
    if isinstance(spec, List):
        if isinstance(spec.item, Nested) and getattr(spec.item.cls, "fast_check_all", None) is not None:
            many = spec.item.cls
            return lambda v: _records_checked_together(many, v)
        item = _builder(spec.item)
        assert item is not None
        return lambda v: [item(x) for x in v]
    if isinstance(spec, Dict):
        kb, vb = _builder(spec.key), _builder(spec.value)
        k = kb or (lambda x: x)
        x = vb or (lambda y: y)
        return lambda v: {k(a): x(b) for a, b in v.items()}
    raise TypeError(f"cannot build {spec!r}")


class _Plan:
    """How one record type is built from its decoded Struct: the fields' builders, and whether
    the dataclass takes them positionally in the Struct's order (it does for every record
    today: one ``cls(*values)`` call instead of a dict of keyword arguments)."""

    __slots__ = ("builders", "names", "plain", "positional")

    def __init__(self, cls: type[Record]) -> None:
        self.names = tuple(cls.SPEC)
        self.builders = tuple(_builder(spec) for spec in cls.SPEC.values())
        try:
            order = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
        except TypeError:
            order = ()
        self.positional = order == self.names
        self.plain = self.positional and all(b is None for b in self.builders)

    def values(self, st: Any) -> list[Any]:
        vals = list(msgspec.structs.astuple(st))
        for i, b in enumerate(self.builders):
            if b is not None:
                vals[i] = b(vals[i])
        return vals

    def make(self, cls: type[R], st: Any) -> R:
        if self.plain:  # every value as decoded (a PackedCompletion): ~2 -> ~1.2 us a record
            return cls(*msgspec.structs.astuple(st))
        vals = self.values(st)
        return cls(*vals) if self.positional else cls(**dict(zip(self.names, vals, strict=True)))


_PLANS: dict[type[Record], _Plan] = {}


def _plan(cls: type[Record]) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _Plan(cls)
    return plan


def _record(cls: type[R], st: Any) -> R:
    obj = _plan(cls).make(cls, st)
    try:
        obj._check_fields("")
    except Exception as exc:
        raise _NotFast from exc
    return obj


def _records_checked_together(cls: type[R], sts: list[Any]) -> list[R]:
    """A list of ``cls`` records whose cross-field rules ``cls.fast_check_all(records)`` vouches
    for all at once (whole-array checks: a PackedResult's completions, whose per-completion numpy
    checks were ~67 us of a small result's 120 us decode). It only ever vouches: False sends the
    payload to the reference path, which names the first fault exactly as before."""
    plan = _plan(cls)
    objs = [plan.make(cls, st) for st in sts]
    try:
        ok = cls.fast_check_all(objs)  # type: ignore[attr-defined]
    except Exception as exc:
        raise _NotFast from exc
    if not ok:
        raise _NotFast
    return objs


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
