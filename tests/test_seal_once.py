"""A Task is encoded once (issue 20): the hub hashes and signs the same canonical bytes, and seal's
directly written envelope layout is exactly the canonical encoding of the envelope map."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import trio
from hubkit import announce, small_hub_cfg
from test_messages import IDENTITIES, make_task

from echo2.learner_hub.hub import Hub
from echo2.protocol import canonical, envelope
from echo2.protocol.errors import SchemaError
from echo2.protocol.identity import Identity
from echo2.protocol.messages import (
    MAX_PROMPT_TOKENS,
    AdmissionRequest,
    ErrorReply,
    Task,
    task_hash,
    task_payload,
)
from echo2.protocol.taskencode import task_map

HUB = IDENTITIES[0]
NOW, NONCE = 1_700_000_000.0, bytes(range(16))


@pytest.mark.parametrize("size", [0, 1, 200, 255, 256, 300, 65535, 65536, 70000])
def test_written_layout_is_the_canonical_encoding(size: int) -> None:
    # every bin length form of the payload, around each boundary
    msg: ErrorReply | Task = ErrorReply(code="c", message="m" * size) if size < 300 else make_task(
        prompts=[[1] * 4000] * (size // 4000) + [[1] * (size % 4000)])
    data = envelope.seal(HUB, msg, now=NOW, nonce=NONCE, ttl_s=300)
    body = canonical.decode(data, max_size=1 << 20)  # decode refuses anything not canonical
    assert canonical.encode(body) == data and body["p"] == canonical.encode(msg.to_wire())
    unsigned = {k: v for k, v in body.items() if k != "s"}
    assert body["s"] == HUB.sign(envelope.SIGN_PREFIX + canonical.encode(unsigned))
    assert envelope.open_envelope(data, type(msg), replay=None, now=NOW).message == msg


def test_sealing_the_payload_signs_the_same_bytes_as_sealing_the_task() -> None:
    task = make_task(temperature=1)  # an int given for a float: both paths put the float on the wire
    payload = task_payload(task)
    assert canonical.encode(task.validate().to_wire()) == payload
    assert envelope.seal(HUB, task, now=NOW, nonce=NONCE, payload=payload) == envelope.seal(HUB, task, now=NOW, nonce=NONCE)
    opened = envelope.open_envelope(envelope.seal(HUB, task, payload=payload), Task, replay=None).message
    assert task_hash(opened) == task_hash(task)


def test_task_payload_checks_the_prompts_drawn_from_data() -> None:
    with pytest.raises(SchemaError, match="Task.prompts"):
        task_payload(make_task(prompts=[[1] * (MAX_PROMPT_TOKENS + 1)]))
    with pytest.raises(SchemaError, match="ttl_s"):
        envelope.seal(HUB, make_task(), ttl_s=math.inf, payload=task_payload(make_task()))


def test_hub_signs_the_bytes_it_hashed(tmp_path: Path) -> None:
    hub = Hub(small_hub_cfg(tmp_path))
    node = Identity.generate()
    req = AdmissionRequest(peer_id=node.peer_id, join_token="", announce=announce(node.peer_id))
    trio.run(hub.on_admission, node.peer_id, envelope.seal(node, req))
    hub.nodes[node.peer_id].held_version = hub.learner.version
    hub._refill()
    hub._pump()
    task = hub.nodes[node.peer_id].mailbox.popleft()
    entry = hub.intake.book.get(task.task_id)
    # issued, not yet encoded: a learner step's pump issues hundreds at once (intake.TaskEntry)
    assert entry is not None and entry.payload is None and entry.task is task
    assert entry.task_hash == task_hash(task) and entry.payload is not None and entry.task is None
    data = hub.outbox.seal(task)
    assert entry.payload is None  # taken: the book does not keep a task's bytes once it is out
    opened = envelope.open_envelope(data, Task, replay=None).message
    assert opened == task.validate() and task_hash(opened) == entry.task_hash
    # sealed again (no payload left): the validating path gives the same task
    assert envelope.open_envelope(hub.outbox.seal(task), Task, replay=None).message == opened
    hub.store.close()


def _generic(task: Task) -> bytes:
    return canonical.encode(task.to_wire())


@pytest.mark.parametrize("odd", [
    {},  # the plain task: the fast path
    {"prompts": [[]]}, {"prompts": [[0, 2**63 - 1], [5]]}, {"prompts": [(1, 2, 3)]},
    {"prompts": [[2**63]]}, {"prompts": [[-1, 7]]},  # beyond int64 / below zero: the generic encoder
    {"prompts": [[True, 2]]}, {"temperature": 1}, {"top_p": True}, {"group_size": True},
    {"deadline": 1e300}, {"seed": 2**64 - 1}, {"task_id": "\u00e9t\u00e9"},
])
def test_task_payload_is_exactly_the_generic_canonical_encoding(odd: dict[str, object]) -> None:
    task = make_task(**odd)
    assert task_payload(task) == _generic(task)
    if not odd or "temperature" in odd or "prompts" in odd and odd["prompts"] != [[2**63]]:
        assert task_map(task) is not None  # these took the fast path, not the fallback


@pytest.mark.parametrize("bad", [
    {"prompts": [[1.5]]}, {"prompts": [[float("nan")]]}, {"prompts": [[2**64]]}, {"deadline": float("inf")},
    {"temperature": float("nan")}, {"task_id": "\ud800"}, {"prompts": [["a"]]},
])
def test_task_payload_refuses_what_the_generic_encoder_refuses_or_encodes_it_alike(bad: dict[str, object]) -> None:
    task = make_task(**bad)
    try:
        expected = _generic(task)
    except SchemaError:
        with pytest.raises(SchemaError):
            task_payload(task)
    else:  # a float id the schema would refuse on the node still encodes alike
        assert task_payload(task) == expected
