"""Protocol IDs of the control plane and the framing of policy chunks on the data plane.

Control requests travel over libp2p streams (the stream's Noise-authenticated peer ID names the
sender; the payload is still a signed envelope so it can be logged, stored and re-verified).

The stream protocol IDs below are the only definition of each: a message class has a domain
(``Message.DOMAIN``, what its signature is bound to) but no protocol ID of its own, since one
stream carries a request and its reply (and WORK carries a Heartbeat one way, a Task the other).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from . import canonical
from .errors import SchemaError
from .messages import ChunkHave, ChunkRequest

ADMISSION = "/echo2/admission/1.0.0"  # AdmissionRequest -> AdmissionDecision
WORK = "/echo2/work/1.0.0"  # Heartbeat (long poll) -> Task | ErrorReply(no_work)
RESULT = "/echo2/result/1.0.0"  # Result -> ErrorReply(ok) | error
DECLINE = "/echo2/decline/1.0.0"  # TaskDecline -> ack
HOLDS = "/echo2/holds/1.0.0"  # HoldsVersion -> ack
REPORT = "/echo2/relay_report/1.0.0"  # RelayReport (a peer relayed a corrupt chunk) -> ack
PAUSE = "/echo2/pause/1.0.0"  # NodePause (computing paused or resumed by preferences) -> ack
RESULTS = "/echo2/results/1.0.0"  # ResultBatch (several signed results) -> BatchAck (one verdict each)
CHANNEL = "/echo2/channel/1.0.0"  # empty -> ChannelOffer: where the node opens its channel (protocol/channel.py)
PROBE = "/echo2/probe/1.0.0"  # Announce (before admission) -> ProbeReply: dial-back, clock, bandwidth

MAX_CONTROL_REQUEST = 4 * 1024 * 1024
MAX_RESULT = 64 * 1024 * 1024
MAX_TASK = 8 * 1024 * 1024
WORK_POLL_S = 5.0

# A chunk frame's payload: header + encoded bytes. The header says which chunk of which
# version and whether the bytes are the manifest's encoding or a full (zstd) fallback for a
# receiver that lacks the delta's parent.
_CHUNK_HEADER = struct.Struct(">QIB")
ENC_MANIFEST = 0
ENC_FULL = 1


@dataclass(frozen=True)
class ChunkFrame:
    version: int
    index: int
    encoding: int
    data: memoryview


#: Bytes before the chunk's data in a CHUNK frame payload (version, index, encoding flag).
CHUNK_HEADER_SIZE = _CHUNK_HEADER.size


def pack_chunk_frame(version: int, index: int, encoding: int, data: bytes) -> bytes:
    return _CHUNK_HEADER.pack(version, index, encoding) + data


def unpack_chunk_frame(payload: bytes | bytearray | memoryview) -> ChunkFrame:
    mv = memoryview(payload)
    if len(mv) < _CHUNK_HEADER.size:
        raise SchemaError("chunk frame shorter than its header")
    version, index, encoding = _CHUNK_HEADER.unpack_from(mv)
    if encoding not in (ENC_MANIFEST, ENC_FULL):
        raise SchemaError(f"unknown chunk encoding flag {encoding}")
    return ChunkFrame(version, index, encoding, mv[_CHUNK_HEADER.size :])


# --- REQUEST frame payloads on the data plane (relays and the hub's senders) ------------------
MAX_REQUEST_PAYLOAD = 1024 * 1024
REQ_HELLO = "hello"  # a node says its data address and upload rate
REQ_HAVE = "have"  # ChunkHave
REQ_GET = "get"  # ChunkRequest: chunks in the manifest's encoding
REQ_FULL = "full"  # ChunkRequest: full (non-delta) encodings, for a node without the parent
REQ_STATS = "stats"  # a node's byte counters for a version
REQ_PUNCH = "punch"  # a node tells the hub how the hole punch to a plan peer went (node.punch)


def encode_request(kind: str, **fields: Any) -> bytes:
    return canonical.encode({"k": kind, **fields})


def decode_request(payload: bytes | bytearray) -> tuple[str, dict[str, Any]]:
    """``(kind, map)`` of a REQUEST payload; SchemaError/DecodeError for anything malformed."""
    d = canonical.decode(bytes(payload), max_size=MAX_REQUEST_PAYLOAD)
    if not isinstance(d, dict) or not isinstance(d.get("k"), str):
        raise SchemaError("request payload must be a map with a str 'k'")
    kind = d["k"]
    if kind == REQ_HAVE:
        d["m"] = ChunkHave.from_wire(d.get("m"))
    elif kind in (REQ_GET, REQ_FULL):
        d["m"] = ChunkRequest.from_wire(d.get("m"))
    elif kind == REQ_HELLO:
        addr, up = d.get("addr"), d.get("up")
        if not isinstance(addr, str) or len(addr) > 256 or not isinstance(up, (int, float)) or not 0 <= up < 1e12:
            raise SchemaError("hello needs addr (str <= 256) and up (MB/s >= 0)")
        lport = d.get("lport", 0)  # the local port the node's hub link is bound to (0: none)
        if not isinstance(lport, int) or isinstance(lport, bool) or not 0 <= lport < 65536:
            raise SchemaError("hello lport must be a port number (0: none)")
    elif kind == REQ_PUNCH:
        v, peer, ok, sec = d.get("v"), d.get("peer"), d.get("ok"), d.get("s")
        if (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**63 or not isinstance(peer, str)
                or not 0 < len(peer) <= 128 or not isinstance(ok, bool) or not isinstance(sec, (int, float))
                or isinstance(sec, bool) or not 0 <= sec < 1e6):
            raise SchemaError("punch needs v (int >= 0), peer (str <= 128), ok (bool) and s (seconds)")
    elif kind == REQ_STATS:
        for k in ("v", "sent", "recv"):
            if not isinstance(d.get(k), int) or not 0 <= d[k] < 2**63:
                raise SchemaError(f"stats field {k} must be an int >= 0")
    else:
        raise SchemaError(f"unknown request kind {kind[:32]!r}")
    return kind, d
