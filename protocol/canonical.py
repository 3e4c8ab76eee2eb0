"""Canonical msgpack: exactly one byte sequence per value, so a signature verifies anywhere.

Rules: maps have ``str`` keys sorted by their UTF-8 bytes, ``bytes`` use the bin type, floats are
always float64, ints take their smallest form, tuples encode as lists. Only None, bool, int
(-2**63 .. 2**64-1), finite float, str, bytes, list and dict[str, ...] are allowed, nested at most
:data:`MAX_DEPTH` containers deep.

:func:`decode` accepts only input that is already canonical: it decodes, re-encodes and compares,
which rejects duplicate keys, unsorted maps, float32, over-long int or length forms, ext types and
trailing bytes with one rule instead of a list of special cases.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

from .errors import DecodeError, SchemaError, TooLarge

MAX_DEPTH = 32
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1
_INTS: set[type] = {int}
_FLOATS: set[type] = {float}


def _normalize(obj: Any, depth: int) -> Any:
    """A copy of ``obj`` with sorted maps and lists for tuples; raises SchemaError on bad values."""
    # Order of checks matters: bool is a subclass of int, and it must stay a bool on the wire.
    if obj is None or obj is True or obj is False:
        return obj
    t = type(obj)
    if t is str:
        return obj
    if t is bytes:
        return obj
    if t is int:
        if obj < INT_MIN or obj > INT_MAX:
            raise SchemaError(f"integer out of the 64-bit range: {obj}")
        return obj
    if t is float:
        if not math.isfinite(obj):
            raise SchemaError(f"non-finite float {obj!r} cannot be encoded")
        return obj
    if t is dict:
        if depth >= MAX_DEPTH:
            raise SchemaError(f"nesting deeper than {MAX_DEPTH}")
        for k in obj:
            if type(k) is not str:
                raise SchemaError(f"map key must be str, got {type(k).__name__}")
        # Code-point order equals UTF-8 byte order for every encodable string.
        return {k: _normalize(obj[k], depth + 1) for k in sorted(obj)}
    if t is list or t is tuple:
        if depth >= MAX_DEPTH:
            raise SchemaError(f"nesting deeper than {MAX_DEPTH}")
        # Token ids and log-probs: a list of plain ints (or floats) is checked with C-level loops
        # (map, min, max) instead of one recursive call per element: a Task's 320 prompt ids
        # took 110 us to encode that way, most of sealing a task and hashing it. Same rules.
        kinds = set(map(type, obj))
        if kinds == _INTS:
            if min(obj) < INT_MIN or max(obj) > INT_MAX:
                bad = next(v for v in obj if v < INT_MIN or v > INT_MAX)
                raise SchemaError(f"integer out of the 64-bit range: {bad}")
            return list(obj)
        if kinds == _FLOATS:
            if not all(map(math.isfinite, obj)):
                bad = next(v for v in obj if not math.isfinite(v))
                raise SchemaError(f"non-finite float {bad!r} cannot be encoded")
            return list(obj)
        return [_normalize(v, depth + 1) for v in obj]
    # Subclasses and other byte-likes: accepted where unambiguous, stored as their base type.
    if isinstance(obj, bool):
        return bool(obj)
    if isinstance(obj, int):
        return _normalize(int(obj), depth)
    if isinstance(obj, float):
        return _normalize(float(obj), depth)
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return bytes(obj)
    if isinstance(obj, dict):
        return _normalize(dict(obj), depth)
    raise SchemaError(f"type {type(obj).__name__} cannot be encoded")


def encode(obj: Any) -> bytes:
    """The canonical msgpack bytes of ``obj`` (SchemaError if ``obj`` is not encodable)."""
    norm = _normalize(obj, 0)
    try:
        return msgpack.packb(norm, use_bin_type=True, use_single_float=False, strict_types=False)
    except UnicodeEncodeError as exc:  # lone surrogates have no UTF-8 form
        raise SchemaError("string is not valid Unicode (lone surrogate)") from exc
    except (ValueError, OverflowError, TypeError) as exc:
        raise SchemaError(f"cannot encode: {exc}") from exc


def decode(data: bytes | bytearray | memoryview, *, max_size: int) -> Any:
    """Decode canonical msgpack ``data``; TooLarge or DecodeError, never another exception."""
    try:
        n = len(data)
    except Exception as exc:
        raise DecodeError(f"input is not bytes ({type(data).__name__})") from exc
    if n > max_size:
        raise TooLarge(f"input of {n} bytes exceeds the limit of {max_size} bytes")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"input is not bytes ({type(data).__name__})")
    raw = bytes(data)
    try:
        obj = msgpack.unpackb(
            raw,
            raw=False,
            use_list=True,
            strict_map_key=True,
            # Timestamps would come back as objects; as plain ext they fail the re-encode check.
            timestamp=0,
        )
    except Exception as exc:  # msgpack raises ValueError/TypeError/UnicodeDecodeError/StackError...
        raise DecodeError(f"malformed msgpack: {type(exc).__name__}: {str(exc)[:120]}") from exc
    try:
        again = encode(obj)
    except SchemaError as exc:
        raise DecodeError(f"not a canonical value: {exc.message}") from exc
    except RecursionError as exc:
        raise DecodeError("nesting too deep") from exc
    if again != raw:
        raise DecodeError("input is not in canonical form (key order, duplicate keys or number forms)")
    return obj
