"""batchmessages.batch_ack_payload: the BatchAck the hub seals, written directly, is byte for byte
the generic canonical encoding, and whatever the direct writer does not take is refused alike."""

from __future__ import annotations

from unittest import mock

import pytest

from echo2.protocol import batchmessages, canonical, envelope
from echo2.protocol.batchmessages import (
    MAX_BATCH_RESULTS,
    MAX_RECEIPT_ENVELOPE,
    BatchAck,
    BatchVerdict,
    batch_ack_payload,
)
from echo2.protocol.errors import SchemaError
from echo2.protocol.identity import Identity

HUB = Identity.from_seed(b"h" * 32)
NODE = Identity.from_seed(b"n" * 32)


def _generic(ack: BatchAck) -> bytes:
    return canonical.encode(ack.validate().to_wire())


@pytest.mark.parametrize("verdicts", [
    [BatchVerdict(accepted=True, code="ok", message="", receipt=b"r" * 700)] * 8,
    [BatchVerdict(accepted=False, code="busy", message="retry later", receipt=b""),
     BatchVerdict(accepted=True, code="ok", message="", receipt=b"\x00" * MAX_RECEIPT_ENVELOPE)],
    [BatchVerdict(accepted=False, code="x" * 64, message="é ü 雪 " * 100, receipt=b"")] * MAX_BATCH_RESULTS,
])
def test_the_direct_bytes_are_the_canonical_bytes(verdicts: list[BatchVerdict]) -> None:
    ack = BatchAck(node_id=NODE.peer_id, verdicts=verdicts)
    with mock.patch.object(batchmessages.canonical, "encode", side_effect=AssertionError("generic path taken")):
        fast = batch_ack_payload(ack)  # the direct writer really took it
    assert fast == _generic(ack)
    opened = envelope.open_envelope(envelope.seal(HUB, ack, payload=fast), BatchAck, replay=None)
    assert opened.message == ack


@pytest.mark.parametrize("ack", [
    BatchAck(node_id="not-a-peer-id", verdicts=[BatchVerdict(accepted=True, code="ok", message="", receipt=b"")]),
    BatchAck(node_id=NODE.peer_id, verdicts=[]),
    BatchAck(node_id=NODE.peer_id, verdicts=[BatchVerdict(accepted=True, code="ok", message="", receipt=b"")] * 33),
    BatchAck(node_id=NODE.peer_id, verdicts=[BatchVerdict(accepted=True, code="x" * 65, message="", receipt=b"")]),
    BatchAck(node_id=NODE.peer_id, verdicts=[BatchVerdict(accepted=True, code="ok", message="m" * 1025, receipt=b"")]),
    BatchAck(node_id=NODE.peer_id, verdicts=[BatchVerdict(accepted=1, code="ok", message="", receipt=b"")]),  # type: ignore[arg-type]
    BatchAck(node_id=NODE.peer_id, verdicts=[BatchVerdict(accepted=True, code="ok", message="",
                                                          receipt=b"r" * (MAX_RECEIPT_ENVELOPE + 1))]),
    BatchAck(node_id=NODE.peer_id, verdicts=[BatchVerdict(accepted=True, code="\ud800", message="", receipt=b"")]),
])
def test_what_the_direct_writer_does_not_take_is_refused_as_the_generic_route_refuses_it(ack: BatchAck) -> None:
    with pytest.raises(SchemaError) as generic:
        _generic(ack)
    with pytest.raises(SchemaError) as fast:
        batch_ack_payload(ack)
    assert str(fast.value) == str(generic.value)


def test_odd_but_valid_values_go_the_generic_way_to_the_same_bytes() -> None:
    class Code(str):
        pass

    ack = BatchAck(node_id=NODE.peer_id, verdicts=[BatchVerdict(accepted=True, code=Code("ok"), message="",
                                                                receipt=bytearray(b"r"))])  # type: ignore[arg-type]
    try:
        want = _generic(ack)
    except SchemaError:
        with pytest.raises(SchemaError):
            batch_ack_payload(ack)
        return
    assert batch_ack_payload(ack) == want
