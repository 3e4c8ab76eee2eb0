"""Replay guards (pure): the evicting pool for strangers and the per-signer guards (issue 15, A3)."""

from __future__ import annotations

import pytest

from echo2.protocol.errors import Replay
from echo2.protocol.replay import PeerReplay, ReplayGuard

NOW = 1_700_000_000.0


def nonce(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_evicting_pool_forgets_the_soonest_expiring_instead_of_refusing() -> None:
    g = ReplayGuard(window_s=600.0, max_entries=4, evict=True)
    for i in range(4):
        g.check_and_add(f"s{i}", nonce(i), NOW + 100 + i, NOW)
    g.check_and_add("late", nonce(9), NOW + 50, NOW)  # full: s0 (expires first) makes room
    assert len(g) == 4 and g.evicted == 1
    g.check_and_add("s0", nonce(0), NOW + 100, NOW)  # forgotten, so accepted again
    with pytest.raises(Replay, match="already seen"):
        g.check_and_add("s3", nonce(3), NOW + 103, NOW)  # still remembered
    with pytest.raises(Replay, match="replay window"):
        g.check_and_add("far", nonce(1), NOW + 601, NOW)


def test_a3_a_flood_of_strangers_never_fills_the_evicting_pool() -> None:
    g = ReplayGuard(max_entries=100, evict=True)
    for i in range(10_000):
        g.check_and_add(f"throwaway{i}", nonce(i), NOW + 60, NOW + i * 0.001)
    assert len(g) == 100
    g.check_and_add("honest", nonce(0), NOW + 60, NOW + 10)  # never "cache full"


def test_peer_replay_keeps_each_signer_apart() -> None:
    p = PeerReplay(window_s=600.0, per_peer=3, max_peers=10)
    for i in range(3):
        p.check_and_add("greedy", nonce(i), NOW + 60, NOW)
    p.check_and_add("honest", nonce(3), NOW + 59, NOW)
    # over its own cap: the signer's own soonest-expiring entry is forgotten, nobody is refused
    p.check_and_add("greedy", nonce(3), NOW + 70, NOW)
    assert p.evicted() == 1 and len(p) == 4
    with pytest.raises(Replay, match="already seen"):
        p.check_and_add("greedy", nonce(3), NOW + 70, NOW + 1)
    with pytest.raises(Replay, match="already seen"):
        p.check_and_add("honest", nonce(3), NOW + 59, NOW + 1)  # another signer's entry is untouched
    for i in range(4, 1000):  # a signer sending fast for long never locks itself out
        p.check_and_add("greedy", nonce(i), NOW + 60 + i / 100, NOW + i / 100)
    assert len(p) == 4 and p.peers() == 2 and p.window_s == 600.0


def test_a3_peer_replay_is_bounded_and_sheds_the_idlest_signer() -> None:
    p = PeerReplay(window_s=600.0, per_peer=200, max_peers=4)
    p.check_and_add("honest", nonce(0), NOW + 60, NOW)
    for i in range(100):  # a flood of admitted throw-away identities
        p.check_and_add(f"sybil{i}", nonce(i), NOW + 60, NOW)
        p.check_and_add("honest", nonce(1000 + i), NOW + 60, NOW)  # stays the most recently used
    assert p.peers() == 4 and len(p) == 101 + 3
    assert p.dropped_peers == 97
    with pytest.raises(Replay, match="already seen"):
        p.check_and_add("honest", nonce(1050), NOW + 60, NOW)
    # a signer whose entries all expired leaves without counting as dropped
    q = PeerReplay(window_s=600.0, per_peer=8, max_peers=1)
    q.check_and_add("a", nonce(0), NOW + 10, NOW)
    q.check_and_add("b", nonce(0), NOW + 60, NOW + 20)
    assert q.dropped_peers == 0 and q.peers() == 1


def test_bad_sizes_refused() -> None:
    with pytest.raises(ValueError):
        ReplayGuard(max_entries=0)
    with pytest.raises(ValueError):
        PeerReplay(per_peer=0)
