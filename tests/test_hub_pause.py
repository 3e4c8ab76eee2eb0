"""A node paused by its owner's preferences is unavailable, not failing (issue 19): the hub hands
its undelivered tasks back, activates others in its place, bills and punishes nothing meanwhile,
and takes it back when it resumes (real hub object and store; handlers called directly)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from hubkit import announce, small_hub_cfg

from echo2.learner_hub.hub import Hub
from echo2.protocol import envelope
from echo2.protocol.errors import MeaningError
from echo2.protocol.identity import Identity
from echo2.protocol.messages import AdmissionRequest, Heartbeat, NodePause


def admit(hub: Hub, node: Identity, price: float) -> None:
    req = AdmissionRequest(peer_id=node.peer_id, join_token="", announce=announce(node.peer_id, price_usd_per_hour=price))
    trio.run(hub.on_admission, node.peer_id, envelope.seal(node, req))


def pause(hub: Hub, node: Identity, paused: bool, code: str = "hours", reason: str = "outside the allowed hours") -> None:
    msg = NodePause(peer_id=node.peer_id, paused=paused, reason_code=code, reason=reason, resume_at=0.0)
    trio.run(hub.on_pause, node.peer_id, envelope.seal(node, msg))


def test_paused_node_is_unavailable_not_failed(tmp_path: Path) -> None:
    # B = 2 x 4 = 8 rollouts a step, T_train 0.5 s: R* = 1.25 x 16 = 20/s; either node covers it
    hub = Hub(small_hub_cfg(tmp_path, activation_margin=1.25))
    cheap, dear = Identity.generate(), Identity.generate()
    admit(hub, cheap, 0.10)
    admit(hub, dear, 1.00)
    for n in (cheap, dear):
        hub.dispatcher.nodes[n.peer_id].rate, hub.dispatcher.nodes[n.peer_id].claimed = 30.0, False
        hub.nodes[n.peer_id].held_version = hub.learner.version
    hub.history.append({"step": 1, "train_s": 0.5, "reward": 0.0, "t": 1.0})
    hub.activate()
    assert hub.active == {cheap.peer_id}
    hub._refill()
    hub._pump()
    queued = len(hub.nodes[cheap.peer_id].mailbox)
    assert queued > 0
    rep = hub.reputation.score(cheap.peer_id)

    pause(hub, cheap, True)
    # its undelivered tasks went back (declined: paused), the dear node replaces it, nothing punished
    assert not hub.nodes[cheap.peer_id].mailbox
    assert hub.dispatcher.stats.declined == queued
    assert hub.active == {dear.peer_id}
    assert hub.nodes[dear.peer_id].mailbox, "the replacement got the handed-back prompts"
    assert hub.reputation.score(cheap.peer_id) == rep
    row = next(n for n in hub.status()["nodes"] if n["peer_id"] == cheap.peer_id)
    assert row["state"] == "paused" and row["paused"] == "hours: outside the allowed hours"
    hub.store.flush()
    tasks = [hub.store.get_task(t) for t in hub.dispatcher._closed]
    assert [t.status for t in tasks if t is not None] == ["declined:paused"] * queued
    assert not hub.ledger.row(cheap.peer_id, 0.0).active  # not billed while paused
    # a repeated pause is its keepalive: no new activation, no tasks
    pause(hub, cheap, True)
    assert hub.active == {dear.peer_id} and not hub.nodes[cheap.peer_id].mailbox

    pause(hub, cheap, False)
    assert cheap.peer_id in (hub.active or set())
    assert not next(n for n in hub.status()["nodes"] if n["peer_id"] == cheap.peer_id)["paused"]


def test_asking_for_work_ends_a_pause_and_a_pause_names_its_sender(tmp_path: Path) -> None:
    hub = Hub(small_hub_cfg(tmp_path))
    node, other = Identity.generate(), Identity.generate()
    admit(hub, node, 0.0)
    admit(hub, other, 0.0)
    pause(hub, node, True, "cpu_busy", "other programs use 90% of the CPUs")
    assert node.peer_id not in (hub.active or set())
    # a node that restarted paused-free just asks for work: that is resuming
    hb = Heartbeat(peer_id=node.peer_id, seq=1, versions_held=[], busy_tasks=0, queue_free=1)

    async def poll() -> None:
        with trio.move_on_after(0.2):
            await hub.on_work(node.peer_id, envelope.seal(node, hb))

    trio.run(poll)
    assert not hub.nodes[node.peer_id].paused and node.peer_id in (hub.active or set())
    msg = NodePause(peer_id=other.peer_id, paused=True, reason_code="hours", reason="x", resume_at=0.0)
    with pytest.raises(MeaningError, match="another node"):
        trio.run(hub.on_pause, node.peer_id, envelope.seal(node, msg))
