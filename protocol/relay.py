"""Node-side relay rules for one policy version, as a pure state machine (events in, actions out).

The caller (the node's data plane, or the simulator) feeds events -- a chunk verified, a chunk
that failed verification, a peer's ChunkHave bitmap, a child's acknowledgement, a request from a
peer, a clock tick -- and carries out the returned actions: :class:`Send` a chunk to a peer,
:class:`Request` chunks from a peer (or the hub), :class:`Report` evidence of a corrupt chunk to the
hub, :class:`Complete` (this node now holds every chunk verified; emitted once).

Rules:
- cut-through: chunk ``i`` is queued for each child of stripe ``i % S`` the moment it is verified
  (never before: a relay forwards only verified bytes), in verification order; at most ``window``
  chunks are outstanding per child so that a slow child does not pile data into the transport;
- siblings share the upload evenly (``lead``): a child is given its next chunk only while no busy
  sibling (one we still owe chunks) has more than ``lead`` more outstanding than it, per stripe it
  takes from us. Why: on a link shaped by a FIFO queue (tbf) two TCP flows from one relay split its
  upload unevenly (bench --netns N = 8: one child 0.5 s behind its sibling at the end), and a
  child relay fed below its stripe rate leaves its own upload idle, a loss its subtree never makes
  up (every upload of the plan is in use). A sibling that acknowledged nothing for
  ``sibling_stall_s``, that is more than ``hold_max`` chunks behind (slower than its stripe: its
  own stall pull is its remedy), or that a repaired plan gave us with a backlog (until it caught
  up), holds nobody;
- a child that advertised a chunk (ChunkHave) or acknowledged it is never pushed it (again); an
  explicit request for a chunk it has not advertised is served even so (the push was lost);
- a stripe whose parent has made no progress for ``stall_timeout_s`` while chunks of that stripe
  are missing is pulled: each missing chunk is requested from a peer that advertised it (the one
  advertising most of them, to keep requests few), else from the hub; a request that is not
  answered within ``request_timeout_s`` is retried from another source;
- a corrupt chunk from a peer: the chunk is dropped (the caller never stores it), evidence
  ``{peer, index, expected hash, got hash}`` is reported, the peer is never asked again, and if
  it is a parent, its stripes are pulled from other sources right away (route around it).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)


class PlanView(Protocol):
    """What the relay needs from a broadcast plan (``echo2.learner_hub.planner.Plan`` fits)."""

    hub: str
    stripes: int
    parent: list[dict[str, str]]
    children: list[dict[str, list[str]]]


@dataclass(frozen=True, slots=True)
class Send:
    peer: str
    index: int


@dataclass(frozen=True, slots=True)
class Request:
    peer: str
    indices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Evidence:
    peer: str
    index: int
    expected_hash: bytes
    got_hash: bytes


@dataclass(frozen=True, slots=True)
class Report:
    evidence: Evidence


@dataclass(frozen=True, slots=True)
class Complete:
    pass


Action = Send | Request | Report | Complete


def bitmap_from_indices(indices: Iterable[int], n_chunks: int) -> bytes:
    """ChunkHave bitmap: bit ``i`` is bit ``7 - i % 8`` of byte ``i // 8`` (as in BitTorrent)."""
    buf = bytearray((n_chunks + 7) // 8)
    for i in indices:
        if 0 <= i < n_chunks:
            buf[i >> 3] |= 0x80 >> (i & 7)
    return bytes(buf)


def indices_from_bitmap(bitmap: bytes, n_chunks: int) -> set[int]:
    """Inverse of :func:`bitmap_from_indices`; bits past ``n_chunks`` (hostile input) are ignored."""
    out: set[int] = set()
    for byte_i, byte in enumerate(bitmap[: (n_chunks + 7) // 8]):
        if not byte:
            continue
        for bit in range(8):
            if byte & (0x80 >> bit):
                i = byte_i * 8 + bit
                if i < n_chunks:
                    out.add(i)
    return out


class SendQueue:
    """Chunks waiting for a peer's window, in order, each at most once (A4: a peer repeating its
    requests must not grow it; it never holds more than the version's chunks)."""

    def __init__(self) -> None:
        self._q: deque[int] = deque()
        self._in: set[int] = set()

    def append(self, i: int) -> None:
        if i not in self._in:
            self._in.add(i)
            self._q.append(i)

    def popleft(self) -> int:
        i = self._q.popleft()
        self._in.discard(i)
        return i

    def clear(self) -> None:
        self._q.clear()
        self._in.clear()

    def __contains__(self, i: object) -> bool:
        return i in self._in

    def __iter__(self) -> Iterator[int]:
        return iter(self._q)

    def __len__(self) -> int:
        return len(self._q)


class Relay:
    """Relay state of node ``me`` for one version with ``len(chunk_hashes)`` chunks.

    ``chunk_hashes`` are the manifest's hashes of what travels (encoded hashes); they only go into
    evidence reports. ``have`` are chunks already held verified (resume, or the hub itself).
    """

    def __init__(
        self,
        me: str,
        plan: PlanView,
        chunk_hashes: Sequence[bytes],
        *,
        have: Iterable[int] = (),
        now: float = 0.0,
        stall_timeout_s: float = 5.0,
        request_timeout_s: float = 10.0,
        window: int = 2,
        lead: int = 1,
        hold_max: int = 8,
        sibling_stall_s: float = 1.0,
    ) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        if not 0 <= lead <= hold_max:
            raise ValueError("need 0 <= lead <= hold_max")
        self.me = me
        self.n = len(chunk_hashes)
        self.hashes = list(chunk_hashes)
        self.stall_timeout_s = stall_timeout_s
        self.request_timeout_s = request_timeout_s
        self.window = window
        self.lead, self.hold_max, self.sibling_stall_s = lead, hold_max, sibling_stall_s
        self._last_ack: dict[str, float] = {}  # child -> when it last acknowledged (or became busy)
        # children a repaired plan gave us with a backlog: behind by arrival, not by the link's
        # split; they hold nobody until they caught up once (wan_sim, 10% churn: 1.058 -> 1.119 x
        # the fluid bound when they did)
        self._catching_up: set[str] = set()
        self.have: set[int] = {i for i in have if 0 <= i < self.n}
        self.complete_sent = False
        self.bad_peers: set[str] = set()
        self.peer_have: dict[str, set[int]] = {}
        self._queue: dict[str, SendQueue] = {}
        self._inflight: dict[str, set[int]] = {}
        self._done: dict[str, set[int]] = {}  # per child: acknowledged or advertised
        self._requested: dict[int, tuple[str, float]] = {}  # chunk -> (source, deadline)
        self._tried: dict[int, set[str]] = {}
        self._pending_serve: dict[int, list[str]] = {}  # chunk -> peers that asked before we had it
        self._now = now
        self._set_plan(plan, now)

    # -- plan ---------------------------------------------------------------------------------
    def _set_plan(self, plan: PlanView, now: float) -> None:
        self.hub = plan.hub
        self.stripes = plan.stripes
        self.parents: list[str | None] = [p.get(self.me) for p in plan.parent]
        self.child_stripes: dict[str, set[int]] = {}
        for s, ch in enumerate(plan.children):
            for c in ch.get(self.me, ()):
                self.child_stripes.setdefault(c, set()).add(s)
        self._stripe_children: list[list[str]] = [list(ch.get(self.me, ())) for ch in plan.children]
        self.last_progress: list[float] = [now] * self.stripes
        for c in self.child_stripes:
            self._queue.setdefault(c, SendQueue())
            self._inflight.setdefault(c, set())
            self._done.setdefault(c, set(self.peer_have.get(c, ())))

    def on_plan(self, plan: PlanView, *, now: float) -> list[Action]:
        """A repaired plan: new children get every held chunk of their stripes, in order."""
        old = set(self.child_stripes)
        self._now = now
        self._set_plan(plan, now)
        actions: list[Action] = []
        for c, stripes in self.child_stripes.items():
            q = self._queue[c]
            queued = set(q) | self._inflight[c] | self._done[c]
            for i in sorted(self.have):
                if i % self.stripes in stripes and i not in queued:
                    q.append(i)
            if c not in old and q:
                self._catching_up.add(c)
            if c not in old or q:
                self._pump(c, actions)
        for c in old - set(self.child_stripes):
            self._queue[c].clear()  # no longer ours to feed
        return actions

    # -- helpers ------------------------------------------------------------------------------
    def _pump(self, peer: str, actions: list[Action]) -> None:
        q, inflight, done = self._queue[peer], self._inflight[peer], self._done[peer]
        if not inflight:
            self._last_ack[peer] = self._now  # busy from now on: its stall clock starts here
        while q and len(inflight) < self.window:
            if self._held(peer):
                break
            i = q.popleft()
            if i in done or i in inflight:
                continue
            inflight.add(i)
            actions.append(Send(peer, i))

    def _owed(self, c: str) -> float:
        """Chunks not yet acknowledged by child ``c`` (queued or in flight), per stripe it takes from us."""
        return (len(self._queue[c]) + len(self._inflight[c])) / max(1, len(self.child_stripes.get(c, ())))

    def _held(self, c: str) -> bool:
        """Whether child ``c`` waits for a sibling that is behind it (see the module doc)."""
        if c not in self.child_stripes or len(self.child_stripes) < 2:
            return False  # a peer pulling from us, or an only child: nobody to share with
        mine = self._owed(c)
        for sib in self.child_stripes:
            if sib == c or not self._inflight[sib] or sib in self._catching_up:
                continue  # idle: it holds what we have of its stripes (or waits for its link to free)
            if self._now - self._last_ack.get(sib, self._now) >= self.sibling_stall_s:
                continue  # stalled: it must not hold the others
            behind = self._owed(sib) - mine
            if self.lead < behind <= self.hold_max:
                return True
        return False

    def _pump_children(self, actions: list[Action], but: str | None = None) -> None:
        for c in self.child_stripes:
            if c != but and self._queue[c] and len(self._inflight[c]) < self.window:
                self._pump(c, actions)

    def _serve(self, peer: str, i: int, actions: list[Action]) -> None:
        if peer not in self._queue:
            self._queue[peer] = SendQueue()
            self._inflight[peer] = set()
            self._done[peer] = set(self.peer_have.get(peer, ()))
        if i not in self._done[peer] and i not in self._inflight[peer]:
            self._queue[peer].append(i)
            self._pump(peer, actions)

    def missing(self) -> list[int]:
        return [i for i in range(self.n) if i not in self.have]

    # -- events -------------------------------------------------------------------------------
    def start(self, *, now: float | None = None) -> list[Action]:
        """Initial actions: forward what is already held; Complete if nothing is missing."""
        if now is not None:
            self._now = now
        actions: list[Action] = []
        for c, stripes in self.child_stripes.items():
            for i in sorted(self.have):
                if i % self.stripes in stripes:
                    self._queue[c].append(i)
            self._pump(c, actions)
        self._check_complete(actions)
        return actions

    def _check_complete(self, actions: list[Action]) -> None:
        if not self.complete_sent and len(self.have) == self.n:
            self.complete_sent = True
            actions.append(Complete())

    def on_chunk_verified(self, i: int, *, now: float | None = None) -> list[Action]:
        """Chunk ``i`` arrived and matched the manifest: store is the caller's; forward it now."""
        if now is not None:
            self._now = now
        if not 0 <= i < self.n or i in self.have:
            return []
        self.have.add(i)
        s = i % self.stripes
        self.last_progress[s] = self._now
        self._requested.pop(i, None)
        self._tried.pop(i, None)
        actions: list[Action] = []
        for c in self._stripe_children[s]:
            if i not in self._done[c]:
                self._queue[c].append(i)
                self._pump(c, actions)
        for peer in self._pending_serve.pop(i, ()):
            self._serve(peer, i, actions)
        self._check_complete(actions)
        return actions

    def on_child_ack(self, child: str, i: int, *, now: float | None = None) -> list[Action]:
        """``child`` holds chunk ``i`` (or the transfer ended): free its window slot."""
        if now is not None:
            self._now = now
        if child not in self._inflight:
            return []
        self._inflight[child].discard(i)
        self._done[child].add(i)
        self._last_ack[child] = self._now
        if not self._queue[child] and not self._inflight[child]:
            self._catching_up.discard(child)
        actions: list[Action] = []
        self._pump(child, actions)
        self._pump_children(actions, but=child)  # a sibling it held may go on
        return actions

    def on_send_failed(self, child: str, i: int, *, now: float | None = None) -> list[Action]:
        """The transfer of ``i`` to ``child`` broke off: free the slot; the child will pull."""
        if now is not None:
            self._now = now
        if child in self._inflight:
            self._inflight[child].discard(i)
            actions: list[Action] = []
            self._pump(child, actions)
            self._pump_children(actions, but=child)
            return actions
        return []

    def on_have(self, peer: str, bitmap: bytes, *, now: float | None = None) -> list[Action]:
        """A peer's ChunkHave: remember who can serve what; never send a child what it holds."""
        if now is not None:
            self._now = now
        got = indices_from_bitmap(bitmap, self.n)
        self.peer_have[peer] = got
        if peer in self._done:
            self._done[peer] |= got
        return []

    def on_request(self, peer: str, indices: Iterable[int], *, now: float | None = None) -> list[Action]:
        """A peer pulls chunks from us: send those we hold, the others once we hold them."""
        if now is not None:
            self._now = now
        actions: list[Action] = []
        done = self._done.get(peer)
        for i in indices:
            if not 0 <= i < self.n:
                continue
            if done is not None and i not in self.peer_have.get(peer, ()):
                # Asking for it says it lacks it: a push we counted as delivered was lost (the
                # connection broke after the write, or it came before the peer knew the version).
                done.discard(i)
            if i in self.have:
                self._serve(peer, i, actions)
            else:
                waiting = self._pending_serve.setdefault(i, [])
                if peer not in waiting and len(waiting) < 64:
                    waiting.append(peer)
        return actions

    def on_chunk_corrupt(
        self, i: int, from_peer: str, got_hash: bytes, *, now: float | None = None
    ) -> list[Action]:
        """Chunk ``i`` from ``from_peer`` did not match the manifest: report and route around."""
        if now is not None:
            self._now = now
        if not 0 <= i < self.n:
            return []
        actions: list[Action] = [Report(Evidence(from_peer, i, self.hashes[i], got_hash))]
        log.warning("corrupt chunk %d from %s: reporting and routing around", i, from_peer)
        if from_peer != self.hub:
            self.bad_peers.add(from_peer)
        self._tried.setdefault(i, set()).add(from_peer)
        self._requested.pop(i, None)
        if i in self.have:
            return actions
        self._pull(self._stalled_stripes(force={i % self.stripes}), actions)
        return actions

    def on_tick(self, now: float) -> list[Action]:
        """Time passes: detect stalled parents and expired requests; pull around them."""
        self._now = now
        actions: list[Action] = []
        self._pump_children(actions)  # a sibling that holds others may have stalled since
        if len(self.have) < self.n:
            expired: list[int] = []
            for i, (src, deadline) in list(self._requested.items()):
                if now >= deadline:
                    del self._requested[i]
                    self._tried.setdefault(i, set()).add(src)
                    expired.append(i)
            # An unanswered pull is retried at once elsewhere; it was already late.
            self._pull(self._stalled_stripes(), actions, extra=expired)
        return actions

    # -- pulling ------------------------------------------------------------------------------
    def _stalled_stripes(self, force: set[int] | None = None) -> set[int]:
        out = set(force or ())
        for s in range(self.stripes):
            p = self.parents[s] if s < len(self.parents) else None
            if p is None or p in self.bad_peers or self._now - self.last_progress[s] >= self.stall_timeout_s:
                out.add(s)
        return out

    def _pull(self, stripes: set[int], actions: list[Action], extra: Iterable[int] = ()) -> None:
        want = sorted({
            i for i in range(self.n)
            if i not in self.have and i not in self._requested and i % self.stripes in stripes
        } | {i for i in extra if i not in self.have and i not in self._requested})
        if not want:
            return
        stalled_parents = {self.parents[s] for s in stripes if s < len(self.parents)}
        candidates = {
            p: h for p, h in self.peer_have.items()
            if p != self.me and p not in self.bad_peers and p not in stalled_parents
        }
        by_peer: dict[str, list[int]] = {}
        coverage = {p: sum(1 for i in want if i in h) for p, h in candidates.items()}
        for i in want:
            tried = self._tried.get(i, set())
            best: tuple[int, str] | None = None
            for p, h in candidates.items():
                if i in h and p not in tried:
                    key = (-coverage[p], p)
                    if best is None or key < best:
                        best = key
            src = self.hub if best is None else best[1]
            by_peer.setdefault(src, []).append(i)
            self._requested[i] = (src, self._now + self.request_timeout_s)
        for peer in sorted(by_peer):
            actions.append(Request(peer, tuple(by_peer[peer])))
        # A stripe we just pulled is no longer considered stalled until the next timeout.
        for s in stripes:
            self.last_progress[s] = self._now
