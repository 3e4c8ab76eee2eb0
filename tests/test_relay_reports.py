"""Reports of corrupt relayed chunks: the reputation rule (pure) and the hub's handler (real
hub, real signatures, handlers called directly; the swarm test is in test_e2e_hostile.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from test_hub_results import admit

from echo2.learner_hub.config import HubConfig
from echo2.learner_hub.hub import Hub
from echo2.learner_hub.reputation import Event, ReputationBook, ReputationConfig
from echo2.protocol import envelope
from echo2.protocol.errors import MeaningError
from echo2.protocol.identity import Identity
from echo2.protocol.messages import ErrorReply, RelayReport

# --- the rule ----------------------------------------------------------------------------------


def test_one_reporter_never_bans_and_counts_once() -> None:
    book = ReputationBook(ReputationConfig(relay_report_quorum=2))
    first = book.record("relay", Event.CORRUPT_RELAY, "c0", reporter="a")
    again = book.record("relay", Event.CORRUPT_RELAY, "c1", reporter="a")
    assert first.ban is None and again.ban is None
    assert again.score == first.score < ReputationConfig().initial  # a repeat costs nothing more
    out = book.record("relay", Event.CORRUPT_RELAY, "c0", reporter="b")
    assert out.ban is not None and "reported by 2 peers" in out.ban
    assert book.is_banned("relay")


def test_quorum_one_bans_at_once_and_reporters_survive_a_restart() -> None:
    book = ReputationBook(ReputationConfig(relay_report_quorum=1))
    assert book.record("relay", Event.CORRUPT_RELAY, reporter="a").ban
    book2 = ReputationBook(ReputationConfig(relay_report_quorum=3))
    book2.restore("x", {"relay_reporters": ["a", "b", 7]})
    assert book2.get("x").relay_reporters == {"a", "b"}
    assert book2.record("x", Event.CORRUPT_RELAY, reporter="c").ban


def test_report_needs_another_reporter() -> None:
    book = ReputationBook()
    with pytest.raises(ValueError):
        book.record("relay", Event.CORRUPT_RELAY)
    with pytest.raises(ValueError):
        book.record("relay", Event.CORRUPT_RELAY, reporter="relay")


# --- the hub -----------------------------------------------------------------------------------


@pytest.fixture()
def hub(tmp_path: Path) -> Hub:
    cfg = HubConfig(dir=str(tmp_path), steps=10, prompts_per_step=2, group_size=4, staleness=1, max_new_tokens=4)
    h = Hub(cfg)
    trio.run(h.publish)  # version 0: the manifest reports are checked against
    return h


def report(hub: Hub, reporter: Identity, accused: str, **kw: object) -> RelayReport:
    chunk = hub.publisher.recent[0].packed.manifest.chunks[0]
    fields: dict[str, object] = dict(
        peer_id=reporter.peer_id, accused=accused, version=0, index=0,
        expected_hash=chunk.enc_hash, got_hash=bytes(32),
    )
    fields.update(kw)
    return RelayReport(**fields)  # type: ignore[arg-type]


def send(hub: Hub, reporter: Identity, rep: RelayReport) -> str:
    reply = trio.run(hub.on_relay_report, reporter.peer_id, envelope.seal(reporter, rep))
    return envelope.open_envelope(reply, ErrorReply, replay=None).message.message


def test_two_reporters_ban_the_relay_and_everything_is_recorded(hub: Hub) -> None:
    relay, a, b = Identity.generate(), Identity.generate(), Identity.generate()
    for n in (relay, a, b):
        assert admit(hub, n).admitted
    assert send(hub, a, report(hub, a, relay.peer_id)) == "noted"
    assert relay.peer_id in hub.nodes and hub.store.ban_reason(relay.peer_id) is None
    assert send(hub, a, report(hub, a, relay.peer_id, index=0, got_hash=b"\x01" * 32)) == "noted"
    assert hub.store.ban_reason(relay.peer_id) is None  # the same reporter again: still one
    assert send(hub, b, report(hub, b, relay.peer_id)) == "noted"
    reason = hub.store.ban_reason(relay.peer_id)
    assert reason is not None and "relayed corrupt chunks (reported by 2 peers)" in reason
    assert relay.peer_id not in hub.nodes
    rows = hub.store.relay_reports(relay.peer_id)
    assert {(r[1], r[2], r[3]) for r in rows} == {(a.peer_id, 0, 0), (b.peer_id, 0, 0)}
    assert hub.relay_reports_received == 3


def test_reports_that_do_not_check_out_are_refused(hub: Hub) -> None:
    relay, a = Identity.generate(), Identity.generate()
    for n in (relay, a):
        admit(hub, n)
    good = report(hub, a, relay.peer_id)
    with pytest.raises(MeaningError, match="expected hash"):
        send(hub, a, report(hub, a, relay.peer_id, expected_hash=b"\x02" * 32))
    with pytest.raises(MeaningError, match="expected hash"):
        send(hub, a, report(hub, a, relay.peer_id, index=10_000))
    with pytest.raises(MeaningError, match="matches the manifest"):
        send(hub, a, report(hub, a, relay.peer_id, got_hash=good.expected_hash))
    with pytest.raises(MeaningError, match="itself"):
        send(hub, a, report(hub, a, a.peer_id))
    with pytest.raises(MeaningError, match="another reporter"):
        send(hub, a, report(hub, a, Identity.generate().peer_id, peer_id=relay.peer_id))
    # not a node of this hub, or a version it no longer knows: ignored, held against no one
    assert "ignored" in send(hub, a, report(hub, a, Identity.generate().peer_id))
    assert "ignored" in send(hub, a, report(hub, a, relay.peer_id, version=99))
    assert hub.store.relay_reports() == []
    assert hub.reputation.get(relay.peer_id).relay_reporters == set()
