"""A10: an admitted node that takes a task on its own word and never answers must not hold a
training step. Measured before the fix in ``echo2 bench attack --only A10``: the hub counted the
liar's probation task as groups on their way, generated no replacement, and the honest nodes
idled until its deadline (honest rate 0.31 of the baseline)."""

from __future__ import annotations

from pathlib import Path

import trio
from hubkit import announce, small_hub_cfg

from echo2.learner_hub.dispatch import DispatchConfig, Dispatcher, PromptGroup
from echo2.learner_hub.hub import Hub
from echo2.protocol import envelope
from echo2.protocol.identity import Identity
from echo2.protocol.messages import AdmissionDecision, AdmissionRequest


def _groups(n: int, size: int = 4) -> list[PromptGroup]:
    return [PromptGroup(f"p{i}", (1, i + 3), size) for i in range(n)]


def test_a10_untimed_tasks_are_not_counted_as_supply() -> None:
    d = Dispatcher(DispatchConfig(staleness=1, min_deadline_s=10.0), task_id_prefix="t")
    d.add_node("timed", 4.0)  # the operator's figure, not a claim: counted on
    d.add_node("liar", 1.0, claimed=True)  # its own word only: on probation
    d.submit(_groups(10))
    tasks = d.next_tasks(now=100.0, learner_version=0)
    held = {n: sum(len(t.groups) for t in tasks if t.node_id == n) for n in ("timed", "liar")}
    assert held["liar"] == 1 and held["timed"] >= 1
    assert d.groups_to_count_on(100.0) == held["timed"]
    # a timed node's task long past its expected time is probably lost: no longer counted
    late = 100.0 + 2 * max(t.expected_s for t in tasks if t.node_id == "timed") + 1.5
    assert d.groups_to_count_on(late) == 0


def _admit(hub: Hub, node: Identity) -> AdmissionDecision:
    req = AdmissionRequest(peer_id=node.peer_id, join_token="", announce=announce(node.peer_id, rollouts_per_s=1.0))
    reply = trio.run(hub.on_admission, node.peer_id, envelope.seal(node, req))
    return envelope.open_envelope(reply, AdmissionDecision, replay=None).message


def test_a10_silent_new_node_leaves_a_full_step_to_the_others(tmp_path: Path) -> None:
    hub = Hub(small_hub_cfg(tmp_path, prompts_per_step=2, staleness=1))
    liar = Identity.generate()
    assert _admit(hub, liar).admitted
    hub.nodes[liar.peer_id].held_version = hub.learner.version  # HoldsVersion: believed for dispatch
    hub.outbox.feed()
    assert len(hub.nodes[liar.peer_id].mailbox) == 1  # a probation task: one group, never answered
    hub.outbox.feed()  # any later refill (a result, an expiry, the learner loop)
    # what the rest of the fleet can still roll out, with what is already buffered, makes a step
    assert len(hub.dispatcher.queue) + len(hub.buffer) >= hub.cfg.prompts_per_step
