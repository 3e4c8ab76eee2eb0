"""NAT-PMP (RFC 6886), sans-IO: the requests a node sends its home router and the checks its
replies must pass. The socket side (UDP to the default gateway, port 5351) is
:mod:`echo2.node.portmap`.

Only what a node needs: the router's external IPv4 address (opcode 0) and a TCP mapping of one
port with a lifetime (opcode 2; lifetime 0 deletes it). Every reply is hostile input: its size,
version, opcode and (for a mapping) the internal port it names are checked before it is believed,
and a non-zero result code is an error with the RFC's meaning.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

from .errors import DecodeError, MeaningError

PORT = 5351  # the gateway's NAT-PMP port (RFC 6886 section 3.1)
VERSION = 0
OP_EXTERNAL = 0
OP_MAP_UDP = 1
OP_MAP_TCP = 2
REPLY = 128  # a reply's opcode is the request's plus 128
#: RFC 6886 section 3.1: first retry after 250 ms, doubling. The node stops after 3 tries
#: (1.75 s), not the RFC's 9 (64 s): a home router answers within milliseconds, and start-up
#: must not wait a minute for one that does not speak NAT-PMP.
FIRST_TIMEOUT_S = 0.25
RESULTS = {
    0: "success",
    1: "unsupported version",
    2: "not authorized or refused (the router's owner turned NAT-PMP off?)",
    3: "network failure (the router has no external address yet)",
    4: "out of resources (no mapping left)",
    5: "unsupported opcode",
}
MAX_LIFETIME_S = 0xFFFFFFFF


class NatPmpRefused(MeaningError):
    """The gateway answered with a non-zero result code."""

    code = "natpmp_refused"

    def __init__(self, result: int) -> None:
        super().__init__(f"NAT-PMP result {result}: {RESULTS.get(result, 'unknown result code')}")
        self.result = result


@dataclass(frozen=True)
class ExternalAddress:
    epoch_s: int  # seconds since the gateway's mapping table was (re)initialised
    ip: str


@dataclass(frozen=True)
class PortMapping:
    epoch_s: int
    internal_port: int
    external_port: int  # 0 in the reply to a deletion
    lifetime_s: int  # what the gateway granted (may be less than asked); 0: deleted


def external_request() -> bytes:
    return struct.pack("!BB", VERSION, OP_EXTERNAL)


def map_request(internal_port: int, external_port: int, lifetime_s: int, *, tcp: bool = True) -> bytes:
    """Ask for ``external_port`` (a suggestion: the gateway may grant another) to reach
    ``internal_port`` on the asking host for ``lifetime_s``; lifetime 0 (and external 0) deletes."""
    if not 0 < internal_port < 65536 or not 0 <= external_port < 65536:
        raise ValueError("ports in 1..65535 (external 0: any)")
    if not 0 <= lifetime_s <= MAX_LIFETIME_S:
        raise ValueError("lifetime in 0..2**32-1 seconds")
    return struct.pack("!BBHHHI", VERSION, OP_MAP_TCP if tcp else OP_MAP_UDP, 0, internal_port, external_port, lifetime_s)


def _header(data: bytes, op: int, size: int) -> int:
    """Check version, opcode and size; return the epoch after raising on a refusal."""
    if len(data) < 4:
        raise DecodeError(f"NAT-PMP reply of {len(data)} bytes")
    version, opcode, result = struct.unpack_from("!BBH", data)
    if version != VERSION:
        raise DecodeError(f"NAT-PMP reply of version {version}")
    if opcode != REPLY + op:
        raise DecodeError(f"NAT-PMP reply opcode {opcode}, expected {REPLY + op}")
    if result != 0:
        raise NatPmpRefused(result)
    if len(data) != size:
        raise DecodeError(f"NAT-PMP reply of {len(data)} bytes, expected {size}")
    return int(struct.unpack_from("!I", data, 4)[0])


def parse_external(data: bytes) -> ExternalAddress:
    epoch = _header(data, OP_EXTERNAL, 12)
    return ExternalAddress(epoch, str(ipaddress.IPv4Address(data[8:12])))


def parse_map(data: bytes, internal_port: int, *, tcp: bool = True) -> PortMapping:
    """The reply to :func:`map_request` for ``internal_port`` (a reply naming another port
    answers another request: an error)."""
    epoch = _header(data, OP_MAP_TCP if tcp else OP_MAP_UDP, 16)
    internal, external, lifetime = struct.unpack_from("!HHI", data, 8)
    if internal != internal_port:
        raise DecodeError(f"NAT-PMP reply for internal port {internal}, asked for {internal_port}")
    if lifetime and not 0 < external < 65536:
        raise DecodeError(f"NAT-PMP granted external port {external}")
    return PortMapping(epoch, internal, external, lifetime)


def retry_timeouts(tries: int = 3) -> list[float]:
    """Seconds to wait for a reply after each try (RFC 6886: 250 ms, doubling)."""
    return [FIRST_TIMEOUT_S * 2**i for i in range(tries)]
