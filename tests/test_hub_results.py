"""The hub refuses forged, foreign and stale results and accepts honest ones (real model, real
signatures, no network: the hub's handlers are called directly)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio
from hubkit import announce, small_hub_cfg

from echo2.learner_hub.hub import Hub
from echo2.models.engine import TransformersEngine
from echo2.protocol import envelope
from echo2.protocol.errors import BadSignature, MeaningError, SignerNotAllowed
from echo2.protocol.identity import Identity
from echo2.protocol.messages import AdmissionDecision, AdmissionRequest, Result, Task, task_hash


@pytest.fixture()
def hub(tmp_path: Path) -> Hub:
    cfg = small_hub_cfg(tmp_path)
    return Hub(cfg)


def admit(hub: Hub, node: Identity) -> AdmissionDecision:
    req = AdmissionRequest(peer_id=node.peer_id, join_token="", announce=announce(node.peer_id))
    reply = trio.run(hub.on_admission, node.peer_id, envelope.seal(node, req))
    return envelope.open_envelope(reply, AdmissionDecision, replay=None).message


def take_task(hub: Hub, node: Identity) -> Task:
    hub.nodes[node.peer_id].held_version = hub.learner.version
    hub._refill()
    hub._pump()
    data = hub.outbox.seal(hub.nodes[node.peer_id].mailbox.popleft())  # as on_work hands it over
    return envelope.open_envelope(data, Task, replay=None).message


def run_task(hub: Hub, node: Identity, task: Task, version: int = 0) -> Result:
    eng = TransformersEngine(device="cpu")
    eng.load_version(version, hub.model_config, hub.artifacts, hub.learner.state_dict_for_publish())
    comps = eng.generate(task.prompts, task.group_size, task.max_new_tokens, task.temperature, task.top_p, task.seed)
    return Result(task_id=task.task_id, task_hash=task_hash(task), node_id=node.peer_id, version=version,
                  completions=comps, started_at=time.time(), gen_seconds=0.1, tokens=sum(len(c.token_ids) for c in comps))


def test_honest_result_accepted_and_duplicate_refused(hub: Hub) -> None:
    node = Identity.generate()
    assert admit(hub, node).admitted
    task = take_task(hub, node)
    result = run_task(hub, node, task)
    trio.run(hub.on_result, node.peer_id, envelope.seal(node, result))
    assert hub.dispatcher.stats.accepted == 1 and len(hub.buffer) == len(task.prompts)
    with pytest.raises(MeaningError, match="duplicate"):
        trio.run(hub.on_result, node.peer_id, envelope.seal(node, result))
    assert hub.dispatcher.stats.accepted == 1


def test_bad_signature_refused(hub: Hub) -> None:
    from echo2.protocol import canonical

    node = Identity.generate()
    admit(hub, node)
    result = run_task(hub, node, take_task(hub, node))
    data = bytearray(envelope.seal(node, result))
    sig = canonical.decode(bytes(data), max_size=1 << 24)["s"]
    data[bytes(data).index(sig) + 3] ^= 0x40
    with pytest.raises(BadSignature):
        trio.run(hub.on_result, node.peer_id, bytes(data))
    assert hub.dispatcher.stats.accepted == 0


def test_result_from_unknown_node_refused(hub: Hub) -> None:
    node, stranger = Identity.generate(), Identity.generate()
    admit(hub, node)
    task = take_task(hub, node)
    forged = run_task(hub, stranger, task)
    with pytest.raises(SignerNotAllowed):
        trio.run(hub.on_result, stranger.peer_id, envelope.seal(stranger, forged))
    # an admitted node cannot claim another's task either
    other = Identity.generate()
    admit(hub, other)
    with pytest.raises(MeaningError):
        trio.run(hub.on_result, other.peer_id, envelope.seal(other, run_task(hub, other, task)))
    assert hub.dispatcher.stats.accepted == 0


def test_result_bound_to_other_task_refused(hub: Hub) -> None:
    node = Identity.generate()
    admit(hub, node)
    task = take_task(hub, node)
    result = run_task(hub, node, task)
    bad = Result(**{**result.__dict__, "task_hash": bytes(32)})
    with pytest.raises(MeaningError, match="task hash"):
        trio.run(hub.on_result, node.peer_id, envelope.seal(node, bad))


def test_stale_result_dropped_and_counted(hub: Hub) -> None:
    node = Identity.generate()
    admit(hub, node)
    task = take_task(hub, node)
    result = run_task(hub, node, task, version=0)
    hub.learner.version = 2  # S = 1: at step 2 only versions >= 1 are admissible
    with pytest.raises(MeaningError, match="stale"):
        trio.run(hub.on_result, node.peer_id, envelope.seal(node, result))
    assert hub.dispatcher.stats.stale_dropped == 1
    assert hub.status()["stale_dropped"] == 1
