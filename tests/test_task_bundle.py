"""Several tasks in one WORK reply (issue 20): a node asking for k (Heartbeat.queue_free) gets up to
k of its waiting tasks in one signed TaskBundle; a node asking for 1 (every node before) gets a
plain Task; the node checks each bundled task on its own (real hub, real signatures, no network)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import trio
from hubkit import announce, small_hub_cfg

from echo2.learner_hub.hub import Hub
from echo2.node.tasks import open_task
from echo2.protocol import envelope
from echo2.protocol.identity import Identity
from echo2.protocol.messages import AdmissionRequest, Heartbeat, Task, TaskBundle, task_hash

HUB = Identity.generate()
NODE = Identity.generate()


def ready_hub(tmp_path: Path, per_node: int) -> tuple[Hub, Identity]:
    hub = Hub(small_hub_cfg(tmp_path, prompts_per_step=8, tasks_per_node=per_node))
    hub.dispatcher.config = dataclasses.replace(hub.dispatcher.config, max_prompts_per_task=1)  # a task per prompt
    node = Identity.generate()
    req = AdmissionRequest(peer_id=node.peer_id, join_token="", announce=announce(node.peer_id))
    trio.run(hub.on_admission, node.peer_id, envelope.seal(node, req))
    st = hub.dispatcher.nodes[node.peer_id]
    st.claimed = False  # past its first (probation) task, as a node that answered one
    hub.nodes[node.peer_id].held_version = hub.learner.version
    hub._refill()
    hub._pump()
    return hub, node


def ask(hub: Hub, node: Identity, seq: int, queue_free: int) -> bytes:
    hb = Heartbeat(peer_id=node.peer_id, seq=seq, versions_held=[0], busy_tasks=0, queue_free=queue_free)
    return trio.run(hub.on_work, node.peer_id, envelope.seal(node, hb))


def test_hub_config_sets_tasks_per_node_and_bundles_what_a_node_asks_for(tmp_path: Path) -> None:
    hub, node = ready_hub(tmp_path, per_node=3)
    assert hub.dispatcher.config.max_in_flight_per_node == 3
    box = hub.nodes[node.peer_id].mailbox
    waiting = list(box)
    assert len(waiting) == 3
    # an old node (queue_free=1) gets one plain Task
    one = envelope.open_envelope(ask(hub, node, 1, 1), (Task, TaskBundle), replay=None).message
    assert isinstance(one, Task) and one.task_id == waiting[0].task_id and len(box) == 2
    # asking for 5 takes the 2 left, in one signature; each hashes as the hub's book expects
    got = envelope.open_envelope(ask(hub, node, 2, 5), (Task, TaskBundle), replay=None).message
    assert isinstance(got, TaskBundle) and [t.task_id for t in got.tasks] == [t.task_id for t in waiting[1:]]
    assert not box
    for t in got.tasks:
        entry = hub.intake.book.get(t.task_id)
        assert entry is not None and entry.task_hash == task_hash(t) and entry.payload is None
    hub.store.close()


def test_default_is_two_tasks_per_node(tmp_path: Path) -> None:
    hub, node = ready_hub(tmp_path, per_node=2)
    assert len(hub.nodes[node.peer_id].mailbox) == 2
    got = envelope.open_envelope(ask(hub, node, 1, 4), (Task, TaskBundle), replay=None).message
    assert isinstance(got, TaskBundle) and len(got.tasks) == 2
    hub.store.close()


def make_task(task_id: str, **kw: object) -> Task:
    base: dict[str, object] = dict(
        task_id=task_id, node_id=NODE.peer_id, prompts=[[1, 4, 5]], group_size=4, max_new_tokens=4,
        temperature=1.0, top_p=1.0, seed=7, min_version=3, max_version_lag=1, deadline=time.time() + 60,
    )
    return Task(**(base | kw))  # type: ignore[arg-type]


def test_node_checks_each_bundled_task() -> None:
    ok1, ok2 = make_task("a"), make_task("b")
    mine_not = make_task("c", node_id=HUB.peer_id)
    too_new = make_task("d", min_version=9)
    data = envelope.seal(HUB, TaskBundle([ok1, mine_not, ok2, too_new]))
    acc = open_task(data, hub_peer=HUB.peer_id, me=NODE.peer_id, held_version=3, replay=envelope.ReplayGuard())
    assert acc.task == ok1 and acc.more == (ok2,)
    assert [(r.task.task_id, r.code) for r in acc.refused] == [("c", "not_mine"), ("d", "version_not_held")]
    # none runnable: no task, each refused to decline
    acc = open_task(envelope.seal(HUB, TaskBundle([too_new])), hub_peer=HUB.peer_id, me=NODE.peer_id, held_version=3,
                    replay=None)
    assert acc.task is None and acc.reply is None and len(acc.refused) == 1


def test_bundle_from_someone_else_is_refused() -> None:
    from echo2.protocol.errors import SignerNotAllowed

    with pytest.raises(SignerNotAllowed):
        open_task(envelope.seal(NODE, TaskBundle([make_task("a")])), hub_peer=HUB.peer_id, me=NODE.peer_id,
                  held_version=3, replay=None)
