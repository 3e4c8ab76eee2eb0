"""Reports of corrupt relayed chunks: the reputation rule (pure) and the hub's handler (real
hub, real signatures, handlers called directly; the swarm test is in test_e2e_hostile.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from hubkit import small_hub_cfg
from test_hub_results import admit

from echo2.learner_hub.config import HubConfig
from echo2.learner_hub.hub import Hub
from echo2.learner_hub.planner import NodeInfo, plan_broadcast
from echo2.learner_hub.reputation import Event, ReputationBook, ReputationConfig
from echo2.protocol import envelope
from echo2.protocol.errors import MeaningError
from echo2.protocol.identity import Identity
from echo2.protocol.messages import ErrorReply, RelayReport

# --- the rule ----------------------------------------------------------------------------------


def test_a9_reports_alone_never_ban_nor_cost_the_accused() -> None:
    # any admitted node can name its parent: no number of reporters is evidence (two Sybils
    # under an honest relay would otherwise ban it)
    book = ReputationBook(ReputationConfig(ban_below=0.3))
    outs = [book.record("relay", Event.RELAY_REPORTED, "c0", reporter=f"r{i % 10}") for i in range(30)]
    assert all(o.ban is None and o.score == ReputationConfig().initial for o in outs)
    assert not book.is_banned("relay") and len(book.get("relay").relay_reporters) == 10


def test_a9_a_conviction_bans_at_once() -> None:
    book = ReputationBook()
    out = book.record("relay", Event.CORRUPT_RELAY, "served the hub a corrupt chunk 3 of v1")
    assert out.ban is not None and "relayed corrupt chunks" in out.ban and book.is_banned("relay")


def test_reporters_survive_a_restart() -> None:
    book = ReputationBook()
    book.restore("x", {"relay_reporters": ["a", "b", 7]})
    assert book.get("x").relay_reporters == {"a", "b"}


def test_report_needs_another_reporter() -> None:
    book = ReputationBook()
    with pytest.raises(ValueError):
        book.record("relay", Event.RELAY_REPORTED)
    with pytest.raises(ValueError):
        book.record("relay", Event.RELAY_REPORTED, reporter="relay")


# --- the hub -----------------------------------------------------------------------------------


@pytest.fixture()
def hub(tmp_path: Path) -> Hub:
    cfg = HubConfig(
        dir=str(tmp_path), steps=10, prompts_per_step=2, group_size=4, staleness=1, max_new_tokens=4,
        broadcast="pipelined", upload_limit_MBps=10.0, chunk_bytes=64 * 1024,
    )
    h = Hub(cfg)
    trio.run(h.publish)  # version 0: the manifest reports are checked against
    return h


def plan_with_relay(hub: Hub, relay: str, leaves: list[str]) -> int:
    """Plan version 0 with the real planner: a 1 MB/s hub, ``relay`` by far the fastest uplink
    (interior, with room for every other node in its stripe). Returns a chunk index of that
    stripe, where ``relay`` is every other node's parent."""
    infos = [NodeInfo(relay, 1e9, True)] + [NodeInfo(n, 1e6, True) for n in leaves]
    n_chunks = len(hub.publisher.recent[0].packed.manifest.chunks)
    plan = plan_broadcast(0, 1e6, infos, n_chunks, hub=hub.identity.peer_id, stripes=2)
    hub.sender._remember(plan)
    for index in range(n_chunks):
        if all(plan.parent[index % plan.stripes][n] == relay for n in leaves):
            return index
    raise AssertionError(f"the planner made {relay} nobody's parent: {plan.parent}")


def report(hub: Hub, reporter: Identity, accused: str, **kw: object) -> RelayReport:
    index = int(kw.pop("index", 0))  # type: ignore[call-overload]
    chunks = hub.publisher.recent[0].packed.manifest.chunks
    fields: dict[str, object] = dict(
        peer_id=reporter.peer_id, accused=accused, version=0, index=index,
        expected_hash=chunks[index % len(chunks)].enc_hash, got_hash=bytes(32),
    )
    fields.update(kw)
    return RelayReport(**fields)  # type: ignore[arg-type]


def send(hub: Hub, reporter: Identity, rep: RelayReport) -> str:
    reply = trio.run(hub.on_relay_report, reporter.peer_id, envelope.seal(reporter, rep))
    return envelope.open_envelope(reply, ErrorReply, replay=None).message.message


def test_a9_two_reporters_do_not_ban_a_relay_only_its_conviction_does(hub: Hub) -> None:
    relay, a, b = Identity.generate(), Identity.generate(), Identity.generate()
    for n in (relay, a, b):
        assert admit(hub, n).admitted
    score = hub.reputation.score(relay.peer_id)
    i = plan_with_relay(hub, relay.peer_id, [a.peer_id, b.peer_id])
    assert send(hub, a, report(hub, a, relay.peer_id, index=i)) == "noted"
    # An accusation, not evidence (A9): a suspect, asked to serve the hub a chunk once it is
    # connected; distrusted only if that chunk is corrupt (tests/test_relay_security.py).
    assert relay.peer_id in hub.sender.suspects and relay.peer_id not in hub.sender.distrusted
    again = send(hub, a, report(hub, a, relay.peer_id, index=i, got_hash=b"\x01" * 32))
    assert "already reported" in again
    assert send(hub, b, report(hub, b, relay.peer_id, index=i)) == "noted"
    # two distinct reporters (two Sybils would do): recorded, still no ban and no cost
    assert hub.store.ban_reason(relay.peer_id) is None and relay.peer_id in hub.nodes
    assert hub.reputation.score(relay.peer_id) == score
    assert hub.reputation.get(relay.peer_id).relay_reporters == {a.peer_id, b.peer_id}
    rows = hub.store.relay_reports(relay.peer_id)
    assert {(r[1], r[2], r[3]) for r in rows} == {(a.peer_id, 0, i), (b.peer_id, 0, i)}
    assert hub.relay_reports_received == 3
    # the challenge convicts it (it served the hub a corrupt chunk): that, and only that, bans
    hub.sender.on_convicted(relay.peer_id, f"served the hub a corrupt chunk {i} of v0")
    reason = hub.store.ban_reason(relay.peer_id)
    assert reason is not None and "relayed corrupt chunks" in reason
    assert relay.peer_id not in hub.nodes


def test_a_node_can_only_accuse_its_own_parent(hub: Hub) -> None:
    relay, a, b = Identity.generate(), Identity.generate(), Identity.generate()
    for n in (relay, a, b):
        admit(hub, n)
    i = plan_with_relay(hub, relay.peer_id, [a.peer_id, b.peer_id])
    # b was never a's parent: a liar cannot pick its victim
    assert "not its parent" in send(hub, a, report(hub, a, b.peer_id, index=i))
    assert hub.store.relay_reports() == [] and b.peer_id not in hub.sender.distrusted
    assert b.peer_id not in hub.sender.suspects


def test_reports_survive_a_restart_and_a_pardon_clears_them(hub: Hub, tmp_path: Path) -> None:
    relay, a = Identity.generate(), Identity.generate()
    for n in (relay, a):
        admit(hub, n)
    i = plan_with_relay(hub, relay.peer_id, [a.peer_id])
    send(hub, a, report(hub, a, relay.peer_id, index=i))
    again = Hub(hub.cfg)  # same directory: the restarted hub
    assert again.reputation.get(relay.peer_id).relay_reporters == {a.peer_id}
    assert relay.peer_id in again.sender.suspects
    again.reputation.unban(relay.peer_id)
    assert again.reputation.get(relay.peer_id).relay_reporters == set()


def test_reports_that_do_not_check_out_are_refused(hub: Hub) -> None:
    relay, a = Identity.generate(), Identity.generate()
    for n in (relay, a):
        admit(hub, n)
    i = plan_with_relay(hub, relay.peer_id, [a.peer_id])
    good = report(hub, a, relay.peer_id, index=i)
    with pytest.raises(MeaningError, match="expected hash"):
        send(hub, a, report(hub, a, relay.peer_id, index=i, expected_hash=b"\x02" * 32))
    with pytest.raises(MeaningError, match="expected hash"):
        send(hub, a, report(hub, a, relay.peer_id, index=10_000))
    with pytest.raises(MeaningError, match="matches the manifest"):
        send(hub, a, report(hub, a, relay.peer_id, index=i, got_hash=good.expected_hash))
    with pytest.raises(MeaningError, match="itself"):
        send(hub, a, report(hub, a, a.peer_id, index=i))
    with pytest.raises(MeaningError, match="another reporter"):
        send(hub, a, report(hub, a, Identity.generate().peer_id, index=i, peer_id=relay.peer_id))
    # not a node of this hub, or a version it no longer knows: ignored, held against no one
    assert "ignored" in send(hub, a, report(hub, a, Identity.generate().peer_id, index=i))
    assert "ignored" in send(hub, a, report(hub, a, relay.peer_id, index=i, version=99))
    assert hub.store.relay_reports() == []
    assert hub.reputation.get(relay.peer_id).relay_reporters == set()


def test_star_broadcast_has_no_relays_to_accuse(tmp_path: Path) -> None:
    cfg = small_hub_cfg(tmp_path)
    h = Hub(cfg)
    trio.run(h.publish)
    relay, a = Identity.generate(), Identity.generate()
    for n in (relay, a):
        admit(h, n)
    assert "not its parent" in send(h, a, report(h, a, relay.peer_id))
    assert h.store.relay_reports() == []
