"""Replay guards: which (signer, nonce) pairs were seen, so a signed envelope is accepted once.

An entry lives until its envelope expires; :func:`echo2.protocol.envelope.open_envelope` refuses
envelopes living longer than the guard's ``window_s``, so every entry is gone after ``window_s``.
What must never happen is that one party fills a guard that others depend on (issue 15, A3): so
state is kept per signer, and strangers get a small pool of their own.

- :class:`ReplayGuard`: one bounded pool. Full, it refuses new nonces (``evict=False``: sound, for
  a pool only one party fills) or forgets the entries that expire soonest (``evict=True``: for a
  pool strangers share, where refusing would let one stranger lock out all the others).
- :class:`PeerReplay`: one small :class:`ReplayGuard` per signer, for peers that passed admission;
  a signer's guard, full, forgets that signer's own soonest-expiring entries (see the class for
  why that is sound), and the number of signers tracked is bounded.

Pure: no I/O, the clock is a parameter.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Protocol

from .errors import Replay


class ReplayCheck(Protocol):
    """What :func:`~echo2.protocol.envelope.open_envelope` needs of a replay guard."""

    @property
    def window_s(self) -> float: ...

    def check_and_add(self, signer: str, nonce: bytes, expires: float, now: float) -> None: ...


class ReplayGuard:
    """Remembers (signer, nonce) until the envelope expires; at most ``max_entries`` at once.

    ``evict=False``: when full, new envelopes are refused (eviction would reopen a replay).
    ``evict=True``: when full, the entries that expire soonest are forgotten to make room; their
    envelopes could be replayed until they expire, which is acceptable only where a replay is
    harmless and a refusal of everyone is not (e.g. admission requests from unadmitted keys).
    """

    def __init__(self, window_s: float = 600.0, max_entries: int = 1_000_000, *, evict: bool = False) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self._window_s = float(window_s)
        self.max_entries = int(max_entries)
        self.evict = evict
        self.evicted = 0  # entries forgotten before they expired (evict=True only)
        self._seen: dict[tuple[str, bytes], float] = {}
        self._heap: list[tuple[float, tuple[str, bytes]]] = []

    @property
    def window_s(self) -> float:
        return self._window_s

    def __len__(self) -> int:
        return len(self._seen)

    def purge(self, now: float) -> None:
        """Forget every entry whose envelope has expired."""
        heap, seen = self._heap, self._seen
        while heap and heap[0][0] < now:
            _, key = heapq.heappop(heap)
            seen.pop(key, None)

    def latest_expiry(self) -> float:
        """When the last remembered envelope expires (-inf when empty)."""
        return max(self._seen.values(), default=float("-inf"))

    def check_and_add(self, signer: str, nonce: bytes, expires: float, now: float) -> None:
        """Record the nonce; raise Replay if it was already seen (or cannot be tracked)."""
        self.purge(now)
        key = (signer, bytes(nonce))
        if key in self._seen:
            raise Replay(f"nonce {bytes(nonce).hex()} from {signer} was already seen")
        if expires > now + self._window_s:
            raise Replay(
                f"envelope expires {expires - now:.0f}s from now, beyond the {self._window_s:.0f}s replay window"
            )
        if len(self._seen) >= self.max_entries:
            if not self.evict:
                raise Replay(f"replay cache full ({self.max_entries} live nonces); retry later")
            # Every heap item is live here (purge ran and entries are never removed otherwise),
            # so the heap's head is the entry that expires soonest.
            _, old = heapq.heappop(self._heap)
            del self._seen[old]
            self.evicted += 1
        self._seen[key] = expires
        heapq.heappush(self._heap, (expires, key))


class PeerReplay:
    """A :class:`ReplayGuard` of ``per_peer`` entries for each signer, at most ``max_peers`` signers.

    Only for envelopes whose signer already passed the caller's ``allowed`` check (an admitted
    peer): ``open_envelope`` checks the signer before the nonce, so a stranger never gets a guard
    here. A signer past its own cap forgets its own entries that expire soonest (``evict=True``
    on its guard): the hub's handlers accept an envelope only on a stream (or channel) from the
    peer that signed it, so only the signer could replay one, and a signer gains nothing by
    replaying what it could sign afresh. Refusing instead cost honest nodes their work: a fast
    node in ``echo2 bench attack`` (a version every ~0.2 s, two holds messages per version, a work
    request and a result per task) passed 2048 live nonces in a minute and had its work requests,
    holds reports and results refused as "replay cache full" (A5's window read 0.73, 74 refusals
    in one node's log). Other signers are never touched. When ``max_peers`` signers are tracked, a
    new one takes the place of the one idle longest. If that one still had live envelopes they
    become replayable, which matters little: ``max_peers`` is sized above the fleet, so only a
    flood of admitted identities gets there, and the hub's handlers accept an envelope only on a
    stream from the peer that signed it. Memory: at most ``max_peers * per_peer`` entries, about
    200 bytes each (the defaults: 1M entries, ~200 MiB, the bound of the single guard this replaces).
    Not grown with the fleet: at 10,000 nodes (``echo2 bench intake --nodes 10000``, 1,000
    identities heartbeating) 94% of messages replace a guard, yet a pool fitted to the fleet
    (tried: a guard per admitted signer) cost the hub process ~8% more per result in paired runs
    (0.686 / 0.682 ms against 0.637 / 0.623, workers 2), for replays only their own signer could
    make.
    A nonce lives as long as its envelope (60 s for most node messages, 300 s for a Result).
    """

    def __init__(self, window_s: float = 600.0, per_peer: int = 2048, max_peers: int = 512) -> None:
        if per_peer < 1 or max_peers < 1:
            raise ValueError("per_peer and max_peers must be >= 1")
        self._window_s = float(window_s)
        self.per_peer = int(per_peer)
        self.max_peers = int(max_peers)
        self.dropped_peers = 0  # guards forgotten while they still held live entries
        self._guards: OrderedDict[str, ReplayGuard] = OrderedDict()  # least recently used first

    @property
    def window_s(self) -> float:
        return self._window_s

    def __len__(self) -> int:
        return sum(len(g) for g in self._guards.values())

    def peers(self) -> int:
        return len(self._guards)

    def evicted(self) -> int:
        """Entries the tracked signers' guards forgot before they expired (their own, when full)."""
        return sum(g.evicted for g in self._guards.values())

    def _make_room(self, now: float) -> None:
        while len(self._guards) >= self.max_peers:
            _, g = self._guards.popitem(last=False)
            g.purge(now)
            if len(g):
                self.dropped_peers += 1

    def check_and_add(self, signer: str, nonce: bytes, expires: float, now: float) -> None:
        """Record the nonce in ``signer``'s own guard; raise Replay if seen or over its cap."""
        g = self._guards.get(signer)
        if g is None:
            if len(self._guards) >= self.max_peers:
                self._make_room(now)
            g = self._guards[signer] = ReplayGuard(self._window_s, self.per_peer, evict=True)
        else:
            self._guards.move_to_end(signer)
        g.check_and_add(signer, nonce, expires, now)
