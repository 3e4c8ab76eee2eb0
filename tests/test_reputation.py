"""Reputation scores and ban rules."""

from __future__ import annotations

import pytest

from echo2.learner_hub.reputation import Event, ReputationBook, ReputationConfig


def test_accepted_raises_score_slowly() -> None:
    book = ReputationBook()
    s0 = book.score("a")
    assert s0 == 0.5
    out = book.record("a", Event.ACCEPTED)
    assert out.ban is None and out.score == pytest.approx(0.5 + 0.02 * 0.5)
    for _ in range(500):
        book.record("a", Event.ACCEPTED)
    assert 0.99 < book.score("a") <= 1.0


def test_mismatch_ban_needs_three_in_window() -> None:
    book = ReputationBook(ReputationConfig(window=20, max_mismatches=3))
    for _ in range(50):
        book.record("a", Event.ACCEPTED)
    bans = []
    # two mismatches, then 18 good checks push the first one out of the window
    for ev in [Event.MISMATCH, Event.MISMATCH] + [Event.CHECK_OK] * 18 + [Event.MISMATCH]:
        bans.append(book.record("a", ev).ban)
    assert bans[:2] == [None, None] and bans[-1] is None  # the first mismatch left the window (21 checks)
    assert book.get("a").mismatches == 3 and not book.is_banned("a")
    assert book.record("a", Event.MISMATCH).ban is None  # the second left too: still 2 in the window
    out = book.record("a", Event.MISMATCH, "max diff 0.7")
    assert out.ban is not None and "3 log-prob mismatches in the last 20" in out.ban and "0.7" in out.ban
    assert book.is_banned("a")
    # already banned: no second ban outcome to persist
    assert book.record("a", Event.MISMATCH).ban is None


def test_mismatch_lowers_score() -> None:
    book = ReputationBook()
    before = book.score("a")
    after = book.record("a", Event.MISMATCH).score
    assert after == pytest.approx(before * 0.7)
    assert book.record("c", Event.TIMEOUT).score == pytest.approx(0.475)


def test_forged_bans_at_once() -> None:
    book = ReputationBook()
    for _ in range(100):
        book.record("a", Event.ACCEPTED)
    out = book.record("a", Event.FORGED, "task hash mismatch")
    assert out.score == 0.0 and out.ban == "forged or invalid result: task hash mismatch"


def test_snapshot_restore_and_unban() -> None:
    book = ReputationBook()
    book.record("a", Event.MISMATCH)
    book.record("a", Event.CHECK_OK)
    snap = book.snapshot("a")
    book2 = ReputationBook()
    book2.restore("a", snap)
    assert book2.get("a").to_json() == snap
    # the restored window still counts toward the ban
    book2.record("a", Event.MISMATCH)
    assert book2.record("a", Event.MISMATCH).ban is not None
    book2.unban("a")
    assert not book2.is_banned("a") and book2.score("a") == 0.5
    book2.restore("z", {"score": "x", "checks": "nope", "accepted": -3, "banned": 5})  # malformed: defaults
    assert book2.get("z").to_json() == ReputationBook().snapshot("z")


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        ReputationConfig(max_mismatches=30, window=20)
    with pytest.raises(ValueError):
        ReputationConfig(gain=0.0)
