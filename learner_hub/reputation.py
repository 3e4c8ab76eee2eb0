"""Node reputation and automatic bans (BRIEF section 7): pure, no clock, no I/O.

The learner recomputes the log-probabilities of every completion; a node whose reported
behaviour log-probs disagree with the recompute either runs a different policy than it claims or
invents numbers. Reputation is a score in [0, 1] per node:

* an accepted result moves it up a little (``score += gain * (1 - score)``), so trust is earned
  slowly and is worth more the longer a node behaves;
* a log-prob mismatch multiplies it by ``mismatch_factor``; a rate claim far above what the hub
  measured (``OVERCLAIM``, once per claimed figure) or a timed-out task by milder factors;
* forged or invalid data (wrong task hash, another node's name, ids outside the vocabulary,
  non-finite numbers) sets it to 0 and bans at once: honest software never produces it.

Ban rules: ``max_mismatches`` mismatches within the last ``window`` checked results, any forged
result, or the score falling below ``ban_below``. One mismatch alone never bans, because
numerics across hardware (bf16 kernels, vLLM vs transformers) can exceed a tolerance once.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

MAX_REPORTERS = 1000  # reporters remembered per accused node (each must be an admitted node)


class Event(StrEnum):
    ACCEPTED = "accepted"  # a result passed every check and entered the buffer
    CHECK_OK = "check_ok"  # log-probs recomputed and matched
    MISMATCH = "mismatch"  # log-probs recomputed and did not match
    FORGED = "forged"  # provably false data
    OVERCLAIM = "overclaim"  # claimed rate far above the hub-measured one
    TIMEOUT = "timeout"  # an assigned task expired unanswered
    # a peer reports it relayed a chunk off the signed manifest: an accusation (the relayed bytes
    # carry no signature of the relay), recorded, never held against the accused (A9)
    RELAY_REPORTED = "relay_reported"
    # challenged on an accusation, it served the hub itself a chunk off the signed manifest: proof
    CORRUPT_RELAY = "corrupt_relay"


@dataclass(frozen=True)
class ReputationConfig:
    initial: float = 0.5
    gain: float = 0.02
    mismatch_factor: float = 0.7
    overclaim_factor: float = 0.8
    timeout_factor: float = 0.95
    window: int = 20
    max_mismatches: int = 3
    ban_below: float = 0.02

    def __post_init__(self) -> None:
        if not 0.0 <= self.initial <= 1.0 or not 0.0 < self.gain < 1.0:
            raise ValueError("need 0 <= initial <= 1 and 0 < gain < 1")
        for f in (self.mismatch_factor, self.overclaim_factor, self.timeout_factor):
            if not 0.0 <= f <= 1.0:
                raise ValueError("penalty factors must be in [0, 1]")
        if self.window < 1 or not 1 <= self.max_mismatches <= self.window:
            raise ValueError("need window >= 1 and 1 <= max_mismatches <= window")


@dataclass
class NodeReputation:
    score: float
    checks: deque[bool] = field(default_factory=deque)  # recent checks, True = matched
    accepted: int = 0
    mismatches: int = 0
    forged: int = 0
    overclaims: int = 0
    banned: str | None = None
    relay_reporters: set[str] = field(default_factory=set)  # who reported it relaying corrupt chunks

    def to_json(self) -> dict[str, Any]:
        return {
            "score": self.score,
            "checks": [int(c) for c in self.checks],
            "accepted": self.accepted,
            "mismatches": self.mismatches,
            "forged": self.forged,
            "overclaims": self.overclaims,
            "banned": self.banned,
            "relay_reporters": sorted(self.relay_reporters),
        }


@dataclass(frozen=True)
class Outcome:
    score: float
    ban: str | None  # set when this event (newly) bans the node: the reason to persist


class ReputationBook:
    """Reputation of every node the hub has seen."""

    def __init__(self, config: ReputationConfig | None = None) -> None:
        self.config = config or ReputationConfig()
        self._nodes: dict[str, NodeReputation] = {}
        self.changed: set[str] = set()  # peers with an event since the status last read them

    def get(self, peer_id: str) -> NodeReputation:
        r = self._nodes.get(peer_id)
        if r is None:
            r = self._nodes[peer_id] = NodeReputation(self.config.initial, deque(maxlen=self.config.window))
        return r

    def score(self, peer_id: str) -> float:
        r = self._nodes.get(peer_id)
        return r.score if r is not None else self.config.initial

    def is_banned(self, peer_id: str) -> bool:
        r = self._nodes.get(peer_id)
        return r is not None and r.banned is not None

    def record(self, peer_id: str, event: Event, detail: str = "", *, reporter: str | None = None) -> Outcome:
        """Apply ``event``; ``Outcome.ban`` is the reason when the node must now be banned.
        ``RELAY_REPORTED`` needs ``reporter``; it only records who accused the node (a reporter
        counts once, however often it reports): any admitted node can name its parent, so a
        report moves no score and bans nothing, whatever the number of reporters (two Sybils
        would do). ``CORRUPT_RELAY`` is the hub's own evidence and bans at once."""
        c = self.config
        r = self.get(peer_id)
        self.changed.add(peer_id)
        ban: str | None = None
        if event is Event.ACCEPTED:
            r.accepted += 1
            r.score += c.gain * (1.0 - r.score)
        elif event is Event.CHECK_OK:
            r.checks.append(True)
        elif event is Event.MISMATCH:
            r.checks.append(False)
            r.mismatches += 1
            r.score *= c.mismatch_factor
            recent = sum(1 for ok in r.checks if not ok)
            if recent >= c.max_mismatches:
                ban = (
                    f"{recent} log-prob mismatches in the last {len(r.checks)} checked results"
                    + (f" ({detail})" if detail else "")
                )
        elif event is Event.FORGED:
            r.forged += 1
            r.score = 0.0
            ban = "forged or invalid result" + (f": {detail}" if detail else "")
        elif event is Event.OVERCLAIM:
            r.overclaims += 1
            r.score *= c.overclaim_factor
        elif event is Event.TIMEOUT:
            r.score *= c.timeout_factor
        elif event is Event.RELAY_REPORTED:
            if not reporter or reporter == peer_id:
                raise ValueError("a relay report needs a reporter other than the accused")
            if len(r.relay_reporters) < MAX_REPORTERS:
                r.relay_reporters.add(reporter)
        elif event is Event.CORRUPT_RELAY:
            # honest software verifies every chunk against the signed manifest before it stores,
            # forwards or serves it, as for a forged result
            r.score = 0.0
            ban = "relayed corrupt chunks" + (f": {detail}" if detail else "")
        else:  # pragma: no cover - exhaustive over Event
            raise ValueError(f"unknown event {event!r}")
        r.score = min(1.0, max(0.0, r.score))
        if ban is None and r.score < c.ban_below and event not in (Event.ACCEPTED, Event.RELAY_REPORTED):
            ban = f"reputation {r.score:.3f} fell below {c.ban_below}"
        if ban is not None and r.banned is None:
            r.banned = ban
            return Outcome(r.score, ban)
        return Outcome(r.score, None)

    def unban(self, peer_id: str) -> None:
        """Operator pardon: clears the ban and the window, the score restarts at ``initial``."""
        r = self.get(peer_id)
        r.banned = None
        r.checks.clear()
        r.relay_reporters.clear()
        r.score = self.config.initial

    def snapshot(self, peer_id: str) -> dict[str, Any]:
        return self.get(peer_id).to_json()

    def restore(self, peer_id: str, state: dict[str, Any]) -> None:
        """Load a :meth:`snapshot` (from the store); malformed fields fall back to defaults."""
        c = self.config
        r = NodeReputation(c.initial, deque(maxlen=c.window))
        score = state.get("score")
        if isinstance(score, (int, float)) and math.isfinite(score):
            r.score = min(1.0, max(0.0, float(score)))
        checks = state.get("checks")
        if isinstance(checks, list):
            r.checks.extend(bool(x) for x in checks[-c.window :])
        for k in ("accepted", "mismatches", "forged", "overclaims"):
            v = state.get(k)
            if isinstance(v, int) and v >= 0:
                setattr(r, k, v)
        b = state.get("banned")
        r.banned = b if isinstance(b, str) else None
        reporters = state.get("relay_reporters")
        if isinstance(reporters, list):
            r.relay_reporters = {x for x in reporters[:MAX_REPORTERS] if isinstance(x, str)}
        self._nodes[peer_id] = r
