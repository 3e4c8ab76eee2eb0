"""Port mapping, the pure parts: the NAT-PMP codec (RFC 6886, protocol/natpmp.py) against the
RFC's byte layouts, hostile replies refused, the route-table parser and when a node asks at all
(node/portmap.py)."""

from __future__ import annotations

import struct

import pytest

from echo2.node.portmap import parse_route_table, skip_reason
from echo2.protocol import natpmp
from echo2.protocol.errors import DecodeError


def test_requests_have_the_rfc_layout() -> None:
    assert natpmp.external_request() == b"\x00\x00"
    # version 0, opcode 2 (TCP), reserved 0, internal 7000, suggested external 7000, lifetime 3600
    assert natpmp.map_request(7000, 7000, 3600) == bytes.fromhex("0002 0000 1b58 1b58 00000e10")
    assert natpmp.map_request(7000, 0, 0) == bytes.fromhex("0002 0000 1b58 0000 00000000")  # delete
    assert natpmp.map_request(53, 53, 60, tcp=False)[1] == 1
    for bad in ((0, 1, 1), (70000, 1, 1), (1, -1, 1), (1, 1, -1), (1, 1, 2**32)):
        with pytest.raises(ValueError):
            natpmp.map_request(*bad)


def test_replies_are_decoded() -> None:
    ext = natpmp.parse_external(bytes.fromhex("0080 0000 00001234") + bytes([11, 213, 0, 2]))
    assert ext == natpmp.ExternalAddress(0x1234, "11.213.0.2")
    m = natpmp.parse_map(struct.pack("!BBHIHHI", 0, 130, 0, 99, 7000, 7001, 1800), 7000)
    assert m == natpmp.PortMapping(99, 7000, 7001, 1800)
    gone = natpmp.parse_map(struct.pack("!BBHIHHI", 0, 130, 0, 99, 7000, 0, 0), 7000)
    assert gone.lifetime_s == 0 and gone.external_port == 0


def test_hostile_or_refusing_replies_raise() -> None:
    good = struct.pack("!BBHIHHI", 0, 130, 0, 1, 7000, 7000, 60)
    for data in (b"", good[:3], good[:15], good + b"x", b"\x01" + good[1:], good[:1] + b"\x81" + good[2:]):
        with pytest.raises(DecodeError):
            natpmp.parse_map(data, 7000)
    with pytest.raises(DecodeError, match="internal port"):  # answers another request
        natpmp.parse_map(good, 7001)
    with pytest.raises(DecodeError, match="external port"):
        natpmp.parse_map(struct.pack("!BBHIHHI", 0, 130, 0, 1, 7000, 0, 60), 7000)
    with pytest.raises(natpmp.NatPmpRefused, match="not authorized") as err:
        natpmp.parse_map(struct.pack("!BBHIHHI", 0, 130, 2, 1, 7000, 7000, 60), 7000)
    assert err.value.result == 2
    with pytest.raises(natpmp.NatPmpRefused, match="result 3"):  # a refusal may be short: 8 bytes
        natpmp.parse_external(bytes.fromhex("0080 0003 00000001"))
    with pytest.raises(DecodeError):
        natpmp.parse_external(bytes.fromhex("0080 0000 00000001 0b"))


def test_retry_schedule_is_short() -> None:
    assert natpmp.retry_timeouts() == [0.25, 0.5, 1.0]  # 1.75 s, not the RFC's 64 s


ROUTES = """Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t0001A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
eth0\t00000000\t0101A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
"""


def test_default_gateway_from_the_route_table() -> None:
    assert parse_route_table(ROUTES) == "192.168.1.1"
    assert parse_route_table(ROUTES.splitlines()[0] + "\n" + ROUTES.splitlines()[1]) is None
    assert parse_route_table("") is None


def test_a_node_asks_only_where_a_mapping_can_help() -> None:
    assert skip_reason("auto", "192.168.1.2") is None
    assert skip_reason("auto", "100.64.3.4") is None  # carrier NAT space: the home router may still map
    assert skip_reason("auto", "10.0.0.5") is None
    assert "loopback" in (skip_reason("auto", "127.0.0.1") or "")  # tests and a hub on this machine
    assert "public" in (skip_reason("auto", "11.213.0.5") or "")
    assert skip_reason("upnp", "11.213.0.5") is None  # asked for by name: tried
    assert "off" in (skip_reason("off", "192.168.1.2") or "")
    assert skip_reason("auto", None) is not None
    assert "listening on 127.0.0.1" in (skip_reason("auto", "192.168.1.2", "127.0.0.1") or "")  # the node's default
    assert skip_reason("auto", "192.168.1.2", "0.0.0.0") is None
    assert "IPv6" in (skip_reason("auto", "fd00::2") or "")


def test_random_and_mutated_replies_raise_only_protocol_errors() -> None:
    """Whatever a LAN host sends to our NAT-PMP socket: a decoded reply or an Echo2Error, never
    another exception (seeded, 20,000 inputs)."""
    import random

    from echo2.protocol.errors import Echo2Error

    rng = random.Random(18)
    seeds = [struct.pack("!BBHIHHI", 0, 130, 0, 1, 7000, 7000, 60), bytes.fromhex("0080 0000 00000001 0b0d0002")]
    ok = 0
    for _ in range(20_000):
        if rng.random() < 0.5:
            data = bytearray(rng.choice(seeds))
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = data[: rng.randint(0, len(data) + 2)]
        else:
            data = bytearray(rng.randbytes(rng.randint(0, 24)))
        for parse in (natpmp.parse_external, lambda d: natpmp.parse_map(d, 7000)):
            try:
                parse(bytes(data))
                ok += 1
            except Echo2Error:
                pass
    assert ok > 0  # some mutations stay valid replies (the fuzz reached the decoders' end)
