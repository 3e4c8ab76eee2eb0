"""The schema library: field specs and records with a strict wire form.

Every message field has a :class:`Spec` that checks one wire value (type, range, length, nested
records) and converts a Python value to its wire form. ``from_wire`` is the only way network
input becomes a record, and it refuses anything unexpected with a :class:`SchemaError` naming the
field path (``Result.completions[3].logprobs[7]: ...``), so callers can log and reply precisely.

``to_wire`` does not validate (the hot path for trusted local data); :meth:`Record.validate`
runs the same checks and :func:`echo2.protocol.envelope.seal` calls it before signing.
The message catalogue built from these is :mod:`echo2.protocol.messages`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Self

from .errors import Echo2Error, SchemaError
from .identity import public_key_from_peer_id

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
PEER_ID_MAX_LEN = 64

# --------------------------------------------------------------------------------------------
# Field specs
# --------------------------------------------------------------------------------------------


def _fail(path: str, what: str) -> SchemaError:
    return SchemaError(f"{path}: {what}")


def _tname(v: Any) -> str:
    return type(v).__name__


class Spec:
    """Checks one wire value and converts one Python value to wire form."""

    def check(self, v: Any, path: str) -> Any:
        """The Python value for wire value ``v``; SchemaError naming ``path`` if invalid."""
        raise NotImplementedError

    def wire(self, v: Any) -> Any:
        """The wire form of Python value ``v`` (no validation)."""
        return v


class Int(Spec):
    def __init__(self, lo: int = 0, hi: int = INT64_MAX) -> None:
        self.lo, self.hi = lo, hi

    def check(self, v: Any, path: str) -> int:
        if type(v) is not int:  # bool is an int subclass and is refused on purpose
            raise _fail(path, f"expected int, got {_tname(v)}")
        if v < self.lo or v > self.hi:
            raise _fail(path, f"{v} out of range [{self.lo}, {self.hi}]")
        return v

    def all_ok(self, vs: list[Any]) -> bool:
        lo, hi = self.lo, self.hi
        return all(type(x) is int and lo <= x <= hi for x in vs)


class Float(Spec):
    """A finite float64 in [lo, hi] (or (lo, hi] with ``lo_open``)."""

    def __init__(self, lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False) -> None:
        self.lo, self.hi, self.lo_open = lo, hi, lo_open

    def check(self, v: Any, path: str) -> float:
        # Ints are refused: the canonical form of a float field is float64, and accepting both
        # would give one message two encodings (and two task hashes).
        if type(v) is not float:
            raise _fail(path, f"expected float, got {_tname(v)}")
        if not math.isfinite(v):
            raise _fail(path, f"non-finite float {v!r}")
        if v < self.lo or v > self.hi or (self.lo_open and v == self.lo):
            lb = "(" if self.lo_open else "["
            raise _fail(path, f"{v!r} out of range {lb}{self.lo}, {self.hi}]")
        return v

    def wire(self, v: Any) -> Any:
        return float(v) if type(v) is int else v

    def all_ok(self, vs: list[Any]) -> bool:
        lo, hi, lo_open = self.lo, self.hi, self.lo_open
        return all(
            type(x) is float and math.isfinite(x) and lo <= x <= hi and not (lo_open and x == lo) for x in vs
        )


class Bool(Spec):
    def check(self, v: Any, path: str) -> bool:
        if type(v) is not bool:
            raise _fail(path, f"expected bool, got {_tname(v)}")
        return v


class Str(Spec):
    def __init__(self, max_len: int = 256, *, choices: Iterable[str] | None = None) -> None:
        self.max_len = max_len
        self.choices = frozenset(choices) if choices is not None else None

    def check(self, v: Any, path: str) -> str:
        if type(v) is not str:
            raise _fail(path, f"expected str, got {_tname(v)}")
        if len(v) > self.max_len:
            raise _fail(path, f"string of {len(v)} chars exceeds {self.max_len}")
        if self.choices is not None and v not in self.choices:
            raise _fail(path, f"{v[:40]!r} is not one of {sorted(self.choices)}")
        return v


class PeerId(Spec):
    """A libp2p peer ID of an Ed25519 key (base58, <= 64 chars, embeds the public key)."""

    def check(self, v: Any, path: str) -> str:
        if type(v) is not str:
            raise _fail(path, f"expected peer ID str, got {_tname(v)}")
        if len(v) > PEER_ID_MAX_LEN:
            raise _fail(path, f"peer ID of {len(v)} chars exceeds {PEER_ID_MAX_LEN}")
        try:
            public_key_from_peer_id(v)
        except Echo2Error as exc:
            raise _fail(path, f"invalid peer ID {v[:64]!r}: {exc.message}") from exc
        except Exception as exc:  # a base58 oddity must still surface as a schema refusal
            raise _fail(path, f"invalid peer ID {v[:64]!r}") from exc
        return v


class Bytes(Spec):
    def __init__(self, *, size: int | None = None, max_len: int | None = None) -> None:
        self.size, self.max_len = size, max_len

    def check(self, v: Any, path: str) -> bytes:
        if type(v) is not bytes:
            raise _fail(path, f"expected bytes, got {_tname(v)}")
        if self.size is not None and len(v) != self.size:
            raise _fail(path, f"expected exactly {self.size} bytes, got {len(v)}")
        if self.max_len is not None and len(v) > self.max_len:
            raise _fail(path, f"{len(v)} bytes exceeds {self.max_len}")
        return v

    def wire(self, v: Any) -> Any:
        return bytes(v) if isinstance(v, (bytearray, memoryview)) else v


class Nullable(Spec):
    def __init__(self, inner: Spec) -> None:
        self.inner = inner

    def check(self, v: Any, path: str) -> Any:
        return None if v is None else self.inner.check(v, path)

    def wire(self, v: Any) -> Any:
        return None if v is None else self.inner.wire(v)


class List(Spec):
    def __init__(self, item: Spec, max_len: int, *, min_len: int = 0) -> None:
        self.item, self.max_len, self.min_len = item, max_len, min_len

    def check(self, v: Any, path: str) -> list[Any]:
        if type(v) is not list:
            raise _fail(path, f"expected list, got {_tname(v)}")
        if len(v) > self.max_len:
            raise _fail(path, f"list of {len(v)} items exceeds {self.max_len}")
        if len(v) < self.min_len:
            raise _fail(path, f"list of {len(v)} items is shorter than {self.min_len}")
        item = self.item
        # Fast path for long scalar lists (token ids, logprobs): one generator, no per-item calls.
        all_ok: Callable[[list[Any]], bool] | None = getattr(item, "all_ok", None)
        if all_ok is not None and all_ok(v):
            return list(v)
        return [item.check(x, f"{path}[{i}]") for i, x in enumerate(v)]

    def wire(self, v: Any) -> Any:
        item = self.item
        if type(item) in (Int, Str, Bool, PeerId):
            return list(v)
        return [item.wire(x) for x in v]


class Dict(Spec):
    def __init__(self, key: Spec, value: Spec, max_len: int) -> None:
        self.key, self.value, self.max_len = key, value, max_len

    def check(self, v: Any, path: str) -> dict[Any, Any]:
        if type(v) is not dict:
            raise _fail(path, f"expected map, got {_tname(v)}")
        if len(v) > self.max_len:
            raise _fail(path, f"map of {len(v)} entries exceeds {self.max_len}")
        out: dict[Any, Any] = {}
        for k, x in v.items():
            kk = self.key.check(k, f"{path} key")
            out[kk] = self.value.check(x, f"{path}[{str(k)[:64]!r}]")
        return out

    def wire(self, v: Any) -> Any:
        return {self.key.wire(k): self.value.wire(x) for k, x in v.items()}


class Nested(Spec):
    def __init__(self, cls: type[Record]) -> None:
        self.cls = cls

    def check(self, v: Any, path: str) -> Record:
        return self.cls._from_wire_at(v, path)

    def wire(self, v: Any) -> Any:
        if isinstance(v, dict):  # already in wire form
            return v
        return v.to_wire()


# --------------------------------------------------------------------------------------------
# Records and messages
# --------------------------------------------------------------------------------------------


class Record:
    """A schema-checked frozen dataclass. Subclasses define ``SPEC`` (field name -> Spec)."""

    SPEC: ClassVar[dict[str, Spec]] = {}

    def to_wire(self) -> dict[str, Any]:
        return {name: spec.wire(getattr(self, name)) for name, spec in self.SPEC.items()}

    @classmethod
    def from_wire(cls, d: Any) -> Self:
        """Strictly build from wire form; SchemaError on anything unexpected."""
        return cls._from_wire_at(d, cls.__name__)

    @classmethod
    def _from_wire_at(cls, d: Any, path: str) -> Self:
        if type(d) is not dict:
            raise _fail(path, f"expected map, got {_tname(d)}")
        spec = cls.SPEC
        if len(d) != len(spec) or any(k not in spec for k in d):
            unknown = sorted(str(k)[:64] for k in d if k not in spec)
            if unknown:
                raise _fail(path, f"unknown field(s) {unknown}")
            missing = sorted(k for k in spec if k not in d)
            raise _fail(path, f"missing field(s) {missing}")
        kwargs = {name: s.check(d[name], f"{path}.{name}") for name, s in spec.items()}
        obj = cls(**kwargs)
        obj._check_fields(path)
        return obj

    def _check_fields(self, path: str) -> None:
        """Cross-field rules; override where one field constrains another."""

    def validate(self) -> Self:
        """Check this instance as a receiver would; returns the normalized copy."""
        return type(self).from_wire(self.to_wire())


class Message(Record):
    """A top-level message that travels in a signed envelope."""

    TYPE: ClassVar[str] = ""
    DOMAIN: ClassVar[str] = ""
    MAX_SIZE: ClassVar[int] = 0
    VERSION: ClassVar[str] = "1.0.0"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # The stream a message travels on is named once, in :mod:`echo2.protocol.wire`; the domain
        # names the message itself (what an envelope's signature is bound to).
        super().__init_subclass__(**kwargs)
        if cls.TYPE:
            cls.DOMAIN = f"echo2/{cls.TYPE}/{cls.VERSION}"
