"""Protocol IDs of the control plane and the framing of policy chunks on the data plane.

Control requests travel over libp2p streams (the stream's Noise-authenticated peer ID names the
sender; the payload is still a signed envelope so it can be logged, stored and re-verified).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .errors import SchemaError

ADMISSION = "/echo2/admission/1.0.0"  # AdmissionRequest -> AdmissionDecision
WORK = "/echo2/work/1.0.0"  # Heartbeat (long poll) -> Task | ErrorReply(no_work)
RESULT = "/echo2/result/1.0.0"  # Result -> ErrorReply(ok) | error
DECLINE = "/echo2/decline/1.0.0"  # TaskDecline -> ack
HOLDS = "/echo2/holds/1.0.0"  # HoldsVersion -> ack
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
