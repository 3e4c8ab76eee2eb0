"""Batched result intake and the node's channel to its hub (issue 20, item 2).

:class:`ResultBatch` carries several finished results in one signed message: each item is a
result's own signed envelope (``PackedResult`` or ``Result``) exactly as the node would send it
alone, so the hub judges each one through the same per-result intake (signature, replay, task
binding) and the node's proof of each result stays the envelope it signed. The batch's own
signature binds the set to its sender and gives it one replay nonce. :class:`BatchAck` answers
item by item, in order: accepted (with the hub's signed receipt) or refused with its code.

:class:`ChannelOffer` is the hub's answer to a node asking for a channel: the address of the
hub's channel listener (the data plane's authenticated TCP, :mod:`echo2.protocol.channel`) and
the batch limits the hub takes. Registered in :mod:`.messages`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import msgpack

from . import canonical
from .errors import SchemaError
from .schema import Bool, Bytes, Int, List, Message, Nested, PeerId, Record, Spec, Str

KiB = 1024
MiB = 1024 * KiB

#: the most results one batch may carry (a node batches what is finished, never waits to fill it)
MAX_BATCH_RESULTS = 32
#: the most bytes of result envelopes one batch may carry: a single result may be this large too
MAX_BATCH_BYTES = 64 * MiB - 64 * KiB
#: a sealed Receipt envelope (Receipt.MAX_SIZE is 4 KiB) with room to spare
MAX_RECEIPT_ENVELOPE = 8 * KiB


@dataclass(frozen=True)
class ResultBatch(Message):
    """Several signed result envelopes from one node, in one signed message."""

    TYPE: ClassVar[str] = "result_batch"
    MAX_SIZE: ClassVar[int] = 64 * MiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "node_id": PeerId(),
        "results": List(Bytes(max_len=MAX_BATCH_BYTES), MAX_BATCH_RESULTS, min_len=1),
    }
    node_id: str
    results: list[bytes]


@dataclass(frozen=True)
class BatchVerdict(Record):
    """The hub's verdict on one item of a batch: ``code`` is "ok" when accepted (``receipt`` is
    then the hub's sealed Receipt), else the refusal's error code (the same as a lone result's)."""

    SPEC: ClassVar[dict[str, Spec]] = {
        "accepted": Bool(),
        "code": Str(64),
        "message": Str(1024),
        "receipt": Bytes(max_len=MAX_RECEIPT_ENVELOPE),
    }
    accepted: bool
    code: str
    message: str
    receipt: bytes


@dataclass(frozen=True)
class BatchAck(Message):
    """One verdict per item of a ResultBatch, in the batch's order."""

    TYPE: ClassVar[str] = "batch_ack"
    MAX_SIZE: ClassVar[int] = MAX_BATCH_RESULTS * (MAX_RECEIPT_ENVELOPE + 2 * KiB) + 4 * KiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "node_id": PeerId(),
        "verdicts": List(Nested(BatchVerdict), MAX_BATCH_RESULTS, min_len=1),
    }
    node_id: str
    verdicts: list[BatchVerdict]


@dataclass(frozen=True)
class ChannelOffer(Message):
    """Where a node opens its long-lived channel to the hub, and what batches the hub takes."""

    TYPE: ClassVar[str] = "channel_offer"
    MAX_SIZE: ClassVar[int] = 4 * KiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "hub_id": PeerId(),
        "node_id": PeerId(),
        "addr": Str(256),
        "max_batch": Int(1, MAX_BATCH_RESULTS),
        "max_batch_bytes": Int(0, MAX_BATCH_BYTES),
    }
    hub_id: str
    node_id: str
    addr: str
    max_batch: int
    max_batch_bytes: int


def batch_ack_payload(ack: BatchAck) -> bytes:
    """``canonical.encode(ack.validate().to_wire())``, written directly for the BatchAck the hub
    builds: its map in canonical key order, each value checked against the SPEC here, packed in
    one call. The generic route (validate's round trip, then to_wire and canonical's sort of every
    map) was 53 of the 103 us of a batch of 8's seal, once per batch (`echo2 bench intake
    --batch 8`). Anything the fast path does not take goes the generic way, which raises the
    SchemaError a receiver would, so the bytes and the refusals are the same either way."""
    fast = _ack_map(ack)
    if fast is not None:
        try:
            return msgpack.packb(fast, use_bin_type=True)
        except (TypeError, ValueError, OverflowError, UnicodeEncodeError):
            pass  # a str without a UTF-8 form: the generic encoder says so
    return canonical.encode(ack.validate().to_wire())


def _ack_map(ack: BatchAck) -> dict[str, object] | None:
    vs = ack.verdicts
    if type(vs) is not list or not 1 <= len(vs) <= MAX_BATCH_RESULTS:
        return None
    try:
        _NODE_ID.check(ack.node_id, "node_id")
    except SchemaError:
        return None
    out = []
    for v in vs:
        if (type(v) is not BatchVerdict or type(v.accepted) is not bool or type(v.code) is not str
                or type(v.message) is not str or type(v.receipt) is not bytes or len(v.code) > _CODE_MAX
                or len(v.message) > _MESSAGE_MAX or len(v.receipt) > MAX_RECEIPT_ENVELOPE):
            return None
        # keys in canonical (UTF-8 byte) order, as canonical.encode sorts them
        out.append({"accepted": v.accepted, "code": v.code, "message": v.message, "receipt": v.receipt})
    return {"node_id": ack.node_id, "verdicts": out}


_NODE_ID = BatchAck.SPEC["node_id"]
_CODE_MAX = BatchVerdict.SPEC["code"].max_len  # type: ignore[attr-defined]
_MESSAGE_MAX = BatchVerdict.SPEC["message"].max_len  # type: ignore[attr-defined]
if tuple(BatchVerdict.SPEC) != ("accepted", "code", "message", "receipt") or tuple(BatchAck.SPEC) != ("node_id", "verdicts"):
    raise RuntimeError("batch_ack_payload writes BatchAck's fields by name: update it with the SPEC")
