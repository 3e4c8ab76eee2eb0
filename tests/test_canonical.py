"""Canonical msgpack and content hashing."""

from __future__ import annotations

import math
import random
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from echo2.protocol import canonical, hashing
from echo2.protocol.errors import DecodeError, SchemaError, TooLarge

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children, max_size=6)
    ),
    max_leaves=40,
)


# --- hashing -----------------------------------------------------------------------------------


def test_blake3_known_vector_and_views() -> None:
    empty = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    assert hashing.hexdigest(b"") == empty
    data = bytes(range(256)) * 1000
    d = hashing.digest(data)
    assert len(d) == hashing.DIGEST_SIZE == 32
    assert (
        hashing.digest(memoryview(data)) == d == hashing.digest(bytearray(data)) == hashing.chunk_hash(data)
    )
    assert hashing.digest(data[:-1] + b"\x00") != d


# --- encode ------------------------------------------------------------------------------------


def test_known_encodings() -> None:
    assert canonical.encode({"b": 1, "a": 2}) == b"\x82\xa1a\x02\xa1b\x01"
    assert canonical.encode(b"xy") == b"\xc4\x02xy"  # bin, not str
    assert canonical.encode(1.0) == b"\xcb" + struct.pack(">d", 1.0)  # always float64
    assert canonical.encode(1.5) == b"\xcb" + struct.pack(">d", 1.5)
    assert canonical.encode(0) == b"\x00"
    assert canonical.encode(-1) == b"\xff"
    assert canonical.encode(200) == b"\xcc\xc8"
    assert canonical.encode(2**64 - 1) == b"\xcf" + b"\xff" * 8
    assert canonical.encode(-(2**63)) == b"\xd3\x80" + b"\x00" * 7
    assert canonical.encode((1, 2)) == canonical.encode([1, 2]) == b"\x92\x01\x02"
    assert canonical.encode([None, True, False]) == b"\x93\xc0\xc3\xc2"
    assert canonical.encode("a" * 40) == b"\xd9\x28" + b"a" * 40


def test_keys_sorted_by_utf8_bytes() -> None:
    keys = ["z", "a", "é", "\U0001f600", "\uffff", "aa", "", "B", "\x7f"]
    data = canonical.encode({k: 0 for k in keys})
    decoded = list(msgpack.unpackb(data, raw=False))
    assert decoded == sorted(keys, key=lambda k: k.encode("utf-8"))


@SETTINGS
@given(st.dictionaries(st.text(max_size=8), st.integers(0, 10), max_size=12), st.randoms())
def test_insertion_order_does_not_matter(d: dict[str, int], rnd: random.Random) -> None:
    items = list(d.items())
    rnd.shuffle(items)
    assert canonical.encode(dict(items)) == canonical.encode(d)


@SETTINGS
@given(values)
def test_round_trip(v: object) -> None:
    data = canonical.encode(v)
    back = canonical.decode(data, max_size=len(data))
    assert canonical.encode(back) == data


@pytest.mark.parametrize(
    "bad",
    [
        math.nan,
        math.inf,
        -math.inf,
        [1.0, math.nan],
        {"x": math.inf},
        2**64,
        -(2**63) - 1,
        {1: 2},
        {b"k": 2},
        {1.5, 2.5},
        object(),
        "\ud800",
        {"\udfff": 1},
    ],
    ids=repr,
)
def test_encode_refuses(bad: object) -> None:
    with pytest.raises(SchemaError):
        canonical.encode(bad)


def test_depth_limit() -> None:
    ok: object = None
    for _ in range(canonical.MAX_DEPTH):
        ok = [ok]
    canonical.decode(canonical.encode(ok), max_size=1000)
    with pytest.raises(SchemaError, match="nesting"):
        canonical.encode([ok])
    with pytest.raises(DecodeError, match="nesting"):
        canonical.decode(b"\x91" * (canonical.MAX_DEPTH + 1) + b"\xc0", max_size=1000)
    with pytest.raises(DecodeError):
        canonical.decode(b"\x91" * 100_000 + b"\xc0", max_size=10**6)


# --- decode ------------------------------------------------------------------------------------


def test_too_large() -> None:
    data = canonical.encode(b"x" * 100)
    assert canonical.decode(data, max_size=len(data)) == b"x" * 100
    with pytest.raises(TooLarge):
        canonical.decode(data, max_size=len(data) - 1)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\x92\x01", id="truncated"),
        pytest.param(b"\xc0\xc0", id="trailing"),
        pytest.param(b"\xc1", id="reserved-byte"),
        pytest.param(msgpack.packb({"b": 1, "a": 2}), id="unsorted"),
        pytest.param(b"\x82\xa1a\x01\xa1a\x02", id="duplicate-key"),
        pytest.param(msgpack.packb(1.0, use_single_float=True), id="float32"),
        pytest.param(b"\xcd\x00\x01", id="non-minimal-int"),
        pytest.param(b"\xd9\x01a", id="non-minimal-str"),
        pytest.param(b"\xdc\x00\x01\x01", id="non-minimal-array"),
        pytest.param(msgpack.packb("ab", use_bin_type=False)[:1] + b"\xff\xfe", id="bad-utf8"),
        pytest.param(msgpack.packb(msgpack.ExtType(5, b"x")), id="ext"),
        pytest.param(b"\xd6\xff" + b"\x00" * 4, id="timestamp"),
        pytest.param(msgpack.packb({1: 2}), id="int-key"),
        pytest.param(msgpack.packb({b"k": 2}, use_bin_type=True), id="bytes-key"),
        pytest.param(b"\xcb" + struct.pack(">d", math.nan), id="nan"),
        pytest.param(b"\xcb" + struct.pack(">d", math.inf), id="inf"),
        pytest.param(b"\xdd\xff\xff\xff\xff", id="huge-array-header"),
        pytest.param(b"\xc6\xff\xff\xff\xff", id="huge-bin-header"),
    ],
)
def test_decode_refuses(data: bytes) -> None:
    with pytest.raises(DecodeError):
        canonical.decode(data, max_size=1000)


def test_decode_refuses_non_bytes() -> None:
    with pytest.raises(DecodeError):
        canonical.decode("text", max_size=100)  # type: ignore[arg-type]
    with pytest.raises(DecodeError):
        canonical.decode(None, max_size=100)  # type: ignore[arg-type]


def test_decode_accepts_views() -> None:
    data = canonical.encode({"a": [1, b"x"]})
    assert canonical.decode(memoryview(data), max_size=100) == {"a": [1, b"x"]}
    assert canonical.decode(bytearray(data), max_size=100) == {"a": [1, b"x"]}
