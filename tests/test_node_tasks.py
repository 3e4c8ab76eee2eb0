"""The node refuses forged, expired, misaddressed and too-new tasks with clear errors."""

from __future__ import annotations

import time

import pytest

from echo2.node.tasks import TaskRefused, open_task
from echo2.protocol import envelope
from echo2.protocol.errors import BadSignature, Expired, Replay, SignerNotAllowed
from echo2.protocol.identity import Identity
from echo2.protocol.messages import ErrorReply, Task

HUB = Identity.generate()
NODE = Identity.generate()


def make_task(**kw: object) -> Task:
    base: dict[str, object] = dict(
        task_id="t-1", node_id=NODE.peer_id, prompts=[[1, 4, 5]], group_size=4, max_new_tokens=4,
        temperature=1.0, top_p=1.0, seed=7, min_version=3, max_version_lag=1, deadline=time.time() + 60,
    )
    base.update(kw)
    return Task(**base)  # type: ignore[arg-type]


def open_(data: bytes, held: int | None = 3, guard: envelope.ReplayGuard | None = None) -> Task | None:
    return open_task(data, hub_peer=HUB.peer_id, me=NODE.peer_id, held_version=held,
                     replay=guard if guard is not None else envelope.ReplayGuard()).task


def test_authentic_task_accepted() -> None:
    task = make_task()
    assert open_(envelope.seal(HUB, task)) == task


def test_no_work_reply() -> None:
    acc = open_task(envelope.seal(HUB, ErrorReply(code="no_work", message="idle")), hub_peer=HUB.peer_id,
                    me=NODE.peer_id, held_version=0, replay=None)
    assert acc.task is None and acc.reply is not None and acc.reply.code == "no_work"


def test_forged_task_signed_by_someone_else() -> None:
    with pytest.raises(SignerNotAllowed):
        open_(envelope.seal(Identity.generate(), make_task()))


def test_tampered_task_bad_signature() -> None:
    from echo2.protocol import canonical

    data = bytearray(envelope.seal(HUB, make_task()))
    sig = canonical.decode(bytes(data), max_size=1 << 20)["s"]
    data[bytes(data).index(sig) + 5] ^= 0x01  # inside the signature
    with pytest.raises(BadSignature):
        open_(bytes(data))


def test_expired_envelope() -> None:
    data = envelope.seal(HUB, make_task(), ttl_s=1.0, now=time.time() - 100)
    with pytest.raises(Expired):
        open_(data)


def test_task_deadline_passed_is_declinable() -> None:
    with pytest.raises(TaskRefused) as ei:
        open_(envelope.seal(HUB, make_task(deadline=time.time() - 5)))
    assert ei.value.code == "expired" and ei.value.task.task_id == "t-1"


def test_version_not_held() -> None:
    with pytest.raises(TaskRefused) as ei:
        open_(envelope.seal(HUB, make_task(min_version=5)), held=4)
    assert ei.value.code == "version_not_held"
    assert "needs policy version >= 5" in ei.value.message
    with pytest.raises(TaskRefused):
        open_(envelope.seal(HUB, make_task(min_version=0)), held=None)


def test_task_for_another_node() -> None:
    with pytest.raises(TaskRefused) as ei:
        open_(envelope.seal(HUB, make_task(node_id=Identity.generate().peer_id)))
    assert ei.value.code == "not_mine"


def test_replayed_task_refused() -> None:
    guard = envelope.ReplayGuard()
    data = envelope.seal(HUB, make_task())
    open_(data, guard=guard)
    with pytest.raises(Replay):
        open_(data, guard=guard)
