"""status.json's per-node list, kept encoded and re-encoded only where it changed (issue 20).

Sans-IO: :class:`NodeFragments` holds each node's entry and its JSON text, and decides which
entries a write must rebuild: the nodes something happened to since the last write (the fleet,
the ledger and the reputation book name them as they change), the nodes whose entry moves with
time alone (a token rate that is not zero, the cost of a node billed at a price > 0: refreshed
every ``refresh_s``, so such a figure is at most that old; each entry says when it was built, in
``as_of``), and every node when a fleet-wide input changed (a new version moves every node's
``versions_behind``; a training step their ``staleness_mean``). Everything else is copied from
the last write as text. Measured: rebuilding and encoding all 10,000 entries each second cost
the status writer's thread 200-240 ms of CPU per second, GIL held, and that was the hub's loop
lag at rest (p99 85-660 ms, /tmp profile of a 10,000-node hub, `echo2 bench intake --clients`).

Why every node stays in status.json rather than a capped list: an operator's scripts read it as
the fleet's list (tests, `echo2 hub nodes`, dashboards); assembling it from cached texts is one
``str.join`` (~1 ms at 10,000 nodes), and the file is written in the writer's thread, which
gives the GIL back while the disk writes.
"""

from __future__ import annotations

import heapq
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from .status_http import json_safe

#: the longest a time-moving figure (a token rate, a billed node's cost) in an entry may lag
REFRESH_S = 10.0
#: node entries in one part of the status body (~400 B each: a part is ~200 KB, joined in ~0.3 ms)
BODY_PART = 500

#: strict JSON (a browser's JSON.parse refuses NaN): raises ValueError on NaN or an infinity
strict_json = json.JSONEncoder(allow_nan=False, default=str).encode


def moves_with_time(entry: dict[str, Any], billed: bool) -> bool:
    """Whether ``entry`` would read differently later with nothing happening to its node: a rate
    that is unknown yet or not zero (it decays as the window moves), or a cost that grows."""
    return billed or entry.get("tokens_per_s_1m") != 0.0 or entry.get("tokens_per_s_5m") != 0.0


class NodeFragments:
    """Each node's status entry, as a dict and as JSON text; which ones a write must rebuild."""

    def __init__(self, refresh_s: float = REFRESH_S) -> None:
        self.refresh_s = refresh_s
        self.text: dict[str, bytes] = {}  # JSON, ASCII (json escapes the rest)
        self.entry: dict[str, dict[str, Any]] = {}
        self.state: dict[str, str] = {}
        self._due: list[tuple[float, str]] = []  # (refresh time, peer): entries that move with time
        self._due_at: dict[str, float] = {}  # the live heap entry of each peer (others are stale)
        self._key: Any = None  # the fleet-wide inputs of the entries at the last write
        self.rebuilt = 0  # entries built by the last update (the benches read it)
        self._body: tuple[list[str], tuple[bytes, ...]] | None = None  # the last list joined, while no entry changed

    def select(self, now: float, present: Iterable[str], changed: Iterable[str], key: Any) -> set[str]:
        """The nodes a write at ``now`` must rebuild (call on the loop, between writes).
        ``present``: the fleet's nodes (all of them, when ``key`` changed); ``changed``: the nodes
        that something happened to since the last write, joiners included (:meth:`missing`
        catches one that was not named); ``key``: the fleet-wide inputs."""
        if key != self._key:
            self._key = key
            return set(present)
        out = set(changed)  # a node that joined is among them (the fleet marks it at admission)
        while self._due and self._due[0][0] <= now:
            at, p = heapq.heappop(self._due)
            if self._due_at.get(p) == at:
                del self._due_at[p]
                out.add(p)
        return out

    def update(self, entries: Iterable[tuple[dict[str, Any], bool]], now: float) -> None:
        """New entries (with whether the node is billed at a price > 0 right now), built at ``now``."""
        n = 0
        for e, billed in entries:
            p = e["peer_id"]
            try:  # strict JSON (a browser's JSON.parse refuses NaN); rarely needed, so tried second
                t = strict_json(e).encode()
            except ValueError:
                t = strict_json(json_safe(e)).encode()
            self.text[p], self.entry[p], self.state[p] = t, e, e["state"]
            if moves_with_time(e, billed):
                at = now + self.refresh_s
                self._due_at[p] = at
                heapq.heappush(self._due, (at, p))
            else:
                self._due_at.pop(p, None)
            n += 1
        self.rebuilt = n
        if n:
            self._body = None

    def missing(self, peers: Sequence[str]) -> list[str]:
        """Those of ``peers`` without an entry yet (none, when the changes named every joiner):
        a C-level scan, ~0.1 ms at 10,000 nodes."""
        if all(map(self.text.__contains__, peers)):
            return []
        return [p for p in peers if p not in self.text]

    def body(self, peers: list[str]) -> tuple[bytes, ...]:
        """The JSON list of ``peers``' entries, in that order (each must have been built), as
        consecutive parts of BODY_PART entries at most (their concatenation is the list). The
        last one is reused while no entry changed and the list is the same (a C-level compare).
        Why parts: joining 10,000 entries (~4 MB) is one C call, the GIL held ~5 ms on this
        machine, and joining that again with the file's head as long; the loop's lag p99 at
        10,000 nodes took both (`echo2 bench intake --clients 2`: the writer's longest GIL
        stretch 10.9 ms). A part is joined in ~0.3 ms; the file and the HTTP reply are written
        part by part."""
        if self._body is not None and self._body[0] == peers:
            return self._body[1]
        text = self.text
        parts = [b",".join(map(text.__getitem__, peers[lo:lo + BODY_PART])) for lo in range(0, len(peers), BODY_PART)]
        out = tuple([b"[" + parts[0], *(b"," + x for x in parts[1:]), b"]"]) if parts else (b"[]",)
        self._body = (peers, out)
        return out

    def states(self, peers: Sequence[str]) -> dict[str, int]:
        return dict(Counter(map(self.state.__getitem__, peers)))

    def first(self, peers: Sequence[str], k: int) -> list[dict[str, Any]]:
        return [self.entry[p] for p in peers[:k]]

    def forget_absent(self, peers: Sequence[str]) -> None:
        """Drop the entries of departed nodes once they are many (an O(fleet) pass, amortised:
        at most once per as many departures as half the fleet)."""
        if len(self.text) <= len(peers) + max(64, len(peers) // 2):
            return
        keep = set(peers)
        for d in (self.text, self.entry, self.state, self._due_at):
            for p in [p for p in d if p not in keep]:
                del d[p]
        self._due = [(at, p) for at, p in self._due if self._due_at.get(p) == at]
        heapq.heapify(self._due)
