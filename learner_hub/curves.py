"""The run's curves for the status page and ``echo2 hub report``: bounded, built incrementally.

Sans-IO: :class:`Series` and :class:`NodeRates` only take points; :class:`HubCurves` reads the
hub's live state (on the loop, like ``hub_status``) and takes only what is new since its last
call, so building status.json stays O(points kept) whatever the run's length.

Why bounded by halving: a run of 100k steps cannot ship 100k points to a browser every 5 s, and
an operator reading a curve wants its whole shape, not only the last minutes. A series keeps
every ``stride``-th point; when it holds ``cap`` points it drops every other one and doubles the
stride, so it always covers the whole run with between cap/2 and cap points (amortised O(1) per
point). The newest point is always shown, so the curve ends where the run is.

The curves dict (``status.json`` key ``curves``; the report embeds the same shape) is columnar,
as uPlot takes it: ``{"train": {"step": [...], "wall_s": [...], "series": {name: [...]}}, ...}``,
``None`` where a point lacks a series. Names are TRL's where TRL has one (``reward``,
``rewards/<func>/mean``, ``completions/mean_length``) and ``echo2/...`` otherwise.
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
import threading
import time
from collections import deque
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .fleet import NodeInfo
    from .hub import Hub

#: points per curve (status.json carries ~4 curves of this many points: ~100 KB at most)
CURVE_POINTS = 400
#: per-node throughput: a sample every NODE_SAMPLE_S, kept for NODE_WINDOW_S
NODE_SAMPLE_S = 10.0
NODE_WINDOW_S = 600.0
#: the nodes drawn in the throughput chart (the busiest in the window)
MAX_NODE_SERIES = 16

#: the per-step figures the page draws: TRL's name, then the training room's history key that
#: carries the same figure when trainmetrics' table is absent (older hubs' stores)
TRAIN_KEYS: tuple[tuple[str, str | None], ...] = (
    ("reward", "reward"),
    ("completions/mean_length", None),
    ("echo2/learner_busy_fraction", "busy_fraction"),
    ("echo2/predicted_busy_fraction", "predicted_busy_fraction"),
    ("echo2/staleness_mean", "staleness_mean"),
    ("loss", "loss"),
)
EVAL_KEYS = ("accuracy", "mean_reward")
BROADCAST_KEYS = ("first_s", "median_s", "last_s")


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None  # JSON has no NaN or infinity, and a diverged loss is no point to draw
    return float(x)


class Series:
    """Points ``(x0, x1, {name: value})`` kept within ``cap`` by stride doubling (see module doc)."""

    def __init__(self, xnames: tuple[str, ...], cap: int = CURVE_POINTS) -> None:
        if cap < 4:
            raise ValueError("cap must be >= 4")
        self.xnames = xnames
        self.cap = cap
        self.stride = 1
        self.seen = 0  # points offered
        self.kept: list[tuple[tuple[float, ...], dict[str, float]]] = []
        self.last: tuple[tuple[float, ...], dict[str, float]] | None = None
        self.names: list[str] = []  # every series name seen, in first-seen order

    def add(self, xs: tuple[float, ...], ys: Mapping[str, Any]) -> None:
        vals = {k: v for k, raw in ys.items() if (v := _num(raw)) is not None}
        self.names += [k for k in vals if k not in self.names]
        point = (xs, vals)
        if self.seen % self.stride == 0:
            self.kept.append(point)
            self.last = None
            if len(self.kept) >= self.cap:
                self.kept = self.kept[::2]
                self.stride *= 2
                if self.kept[-1] is not point:  # thinned away: still the newest, shown
                    self.last = point
        else:
            self.last = point
        self.seen += 1

    def points(self) -> list[tuple[tuple[float, ...], dict[str, float]]]:
        return self.kept + ([self.last] if self.last is not None else [])

    def columns(self) -> dict[str, Any]:
        pts = self.points()
        out: dict[str, Any] = {x: [p[0][i] for p in pts] for i, x in enumerate(self.xnames)}
        out["series"] = {k: [p[1].get(k) for p in pts] for k in self.names}
        out["stride"] = self.stride
        return out


def series_of(rows: Iterable[Mapping[str, Any]], xnames: tuple[str, ...], keys: Iterable[str] | None = None,
              cap: int = CURVE_POINTS) -> Series:
    """A :class:`Series` of ``rows`` (dicts with the ``xnames`` and figures; ``keys``: only those)."""
    s = Series(xnames, cap)
    want = None if keys is None else set(keys)
    for r in rows:
        xs = tuple(_num(r.get(x)) for x in xnames)
        if any(x is None for x in xs):
            continue
        ys = {k: v for k, v in r.items() if k not in xnames and (want is None or k in want)}
        s.add(tuple(float(x) for x in xs if x is not None), ys)
    return s


def train_figures(row: Mapping[str, Any]) -> dict[str, Any]:
    """What the train curves keep of one step's figures (trainmetrics' names or history's keys)."""
    out: dict[str, Any] = {}
    for name, fallback in TRAIN_KEYS:
        v = row.get(name)
        if v is None and fallback is not None:
            v = row.get(fallback)
        if v is not None:
            out[name] = v
    out |= {k: v for k, v in row.items() if k.startswith("rewards/") and k.endswith("/mean")}
    return out


class NodeRates:
    """Each node's cumulative accepted tokens sampled over time: its tokens/s over the last minutes.

    Incremental (issue 20): a sample every ``sample_s`` records only the nodes whose count changed
    since the last one (a node's count at any sample is its last recorded value at or before it);
    copying every node's count per sample cost the loop O(fleet) per status write, 10,000 dict
    entries at 10,000 nodes. ``_order`` lists recorded entries oldest first, so pruning the window
    touches only entries that left it; a present node's lone baseline entry is re-queued (one
    look per node per window), a departed node's is forgotten.
    """

    def __init__(self, sample_s: float = NODE_SAMPLE_S, window_s: float = NODE_WINDOW_S) -> None:
        self.sample_s = sample_s
        self.window_s = window_s
        self.times: deque[float] = deque()  # the samples' times, oldest first
        # the same as a tuple, replaced (never changed) at each sample: the status writer's thread
        # reads it while the loop may be taking a sample
        self.times_now: tuple[float, ...] = ()
        self.per_peer: dict[str, deque[tuple[float, int]]] = {}  # (sample time, tokens) when it changed
        self._order: deque[tuple[float, str]] = deque()
        # peers by the time of their last recorded change, oldest first: those changed inside the
        # window are the only ones whose chart gain can be > 0 (columns() ranks only them: ranking
        # every node cost the status writer ~40 ms of GIL every sample at 10,000 nodes)
        self._recent: dict[str, float] = {}  # peer -> its last change's sample time
        self._recent_order: deque[tuple[float, str]] = deque()  # the same in time order (stale ones skipped)
        self.version = 0  # bumped when a sample is taken: the curves' encoding is then stale

    def due(self, now: float) -> bool:
        return not self.times or now - self.times[-1] >= self.sample_s

    def add(self, now: float, changed: Mapping[str, int], present: Container[str] | None = None) -> bool:
        """A sample at ``now`` of the nodes in ``changed`` (their counts); others kept theirs.
        ``present``: the nodes still in the fleet (None: every node recorded so far)."""
        if not self.due(now):
            return False
        self.times.append(now)
        for p, tok in changed.items():
            dq = self.per_peer.get(p)
            if dq is None:
                dq = self.per_peer[p] = deque()
                moved = tok != 0  # a baseline of 0 (a node as it joins) gains nothing
            elif dq[-1][1] == tok:
                continue
            else:
                moved = True
            dq.append((now, int(tok)))
            self._order.append((now, p))
            if moved:
                self._recent[p] = now
                self._recent_order.append((now, p))
        while now - self.times[0] > self.window_s:
            self.times.popleft()
        start = self.times[0]
        while self._recent_order and self._recent_order[0][0] <= start:
            at, p = self._recent_order.popleft()
            if self._recent.get(p) == at:
                del self._recent[p]
        requeue = []
        while self._order and self._order[0][0] < start:
            _, p = self._order.popleft()
            dq = self.per_peer.get(p)
            if dq is None:
                continue
            while len(dq) >= 2 and dq[1][0] <= start:  # keep one baseline at or before the window
                dq.popleft()
            if len(dq) == 1 and dq[0][0] < start:
                if present is not None and p not in present:
                    del self.per_peer[p]
                else:
                    requeue.append((now, p))
        self._order.extend(requeue)
        self.times_now = tuple(self.times)
        self.version += 1
        return True

    @staticmethod
    def _value_at(entries: Sequence[tuple[float, int]], t: float) -> int | None:
        """A node's count at sample time ``t``: its last entry at or before ``t``."""
        i = bisect.bisect_right(entries, t, key=lambda e: e[0])
        return entries[i - 1][1] if i else None

    def rate(self, peer: str, now: float, tokens_now: int, over_s: float) -> float | None:
        """Tokens/s over (about) the last ``over_s``: from the oldest sample inside that span at
        which the node was known."""
        dq = self.per_peer.get(peer)
        if not dq:
            return None
        times = self.times_now
        i = bisect.bisect_left(times, now - over_s)
        if i >= len(times) or times[i] >= now:
            return None
        t = times[i]
        entries = list(dq)
        v = self._value_at(entries, t)
        if v is None:  # first known after t: from the first sample it was in
            t, v = entries[0]
            if t >= now:
                return None
        return (tokens_now - v) / (now - t)

    def columns(self, most: int = MAX_NODE_SERIES, present: Container[str] | None = None) -> dict[str, Any]:
        """tokens/s between consecutive samples, at the later sample's time, of the ``most`` nodes
        with the most tokens in the window: a chart of a 10,000-node fleet's every line would be
        unreadable. Reads snapshots of the structures (one C call each under the GIL), so the
        status writer's thread may call it while the loop adds samples."""
        times = list(self.times_now)
        if not times:
            return {"wall_s": [], "series": {}}
        first, last = times[0], times[-1]
        per_peer = self.per_peer
        moved = [p for p in list(self._recent) if present is None or p in present]
        peers = [(p, list(dq)) for p in moved if (dq := per_peer.get(p))]
        if len(peers) < most:  # the chart still shows ``most`` lines: nodes that gained nothing
            seen = set(moved)
            for p, dq in list(per_peer.items()):
                if len(peers) >= most:
                    break
                if p not in seen and (present is None or p in present) and dq and dq[0][0] <= last:
                    peers.append((p, list(dq)))

        def gain(item: tuple[str, list[tuple[float, int]]]) -> int:
            es = item[1]
            if not es or es[0][0] > last:
                return -1
            return (self._value_at(es, last) or 0) - (self._value_at(es, first) or 0)

        top = heapq.nlargest(most, peers, key=gain)
        series = {}
        for p, es in top:
            vals = [self._value_at(es, t) for t in times]
            series[p] = [((b - a) / (tb - ta)) if a is not None and b is not None and tb > ta else None
                         for a, b, ta, tb in zip(vals, vals[1:], times, times[1:], strict=False)]
        return {"wall_s": times[1:], "series": series}


class HubCurves:
    """The live hub's curves; ``update(hub)`` on the loop before each status snapshot.

    Per status write the loop only takes what is new (steps, evaluations, versions, and the nodes
    whose token count changed); the columns are built and JSON-encoded by :meth:`encoded`, in the
    status writer's thread, and only when a point was added since the last encoding: building and
    encoding them on the loop at every write cost ~8 ms at 10,000 nodes (`echo2 bench intake`).
    """

    def __init__(self, cap: int = CURVE_POINTS) -> None:
        self.train = Series(("step", "wall_s"), cap)
        self.eval = Series(("step", "wall_s"), cap)
        self.broadcast = Series(("version",), cap)
        self.rates = NodeRates()
        self._step = -1
        self._eval_step = -1
        self._version = -1
        self._started: float | None = None
        self._points = 0  # points added to the three series (with rates.version: what is drawn)
        self._cache: tuple[tuple[int, int], dict[str, Any], str] | None = None
        self._present: Mapping[str, NodeInfo] | None = None
        # node samples taken on the loop (their time and who changed), recorded by catch_up in
        # the status writer's thread: reading 10,000 counts and recording them held the loop
        # 44 ms once a sample after a burst of admissions (cProfile of `echo2 bench intake`'s
        # idle phase at 10,000 nodes: its loop lag p99 25-59 ms), and the window's requeue of
        # every quiet node is O(fleet) once per window
        self._pending: deque[tuple[float, set[str]]] = deque()
        self._last_sample: float | None = None
        self._catching_up = threading.Lock()

    def update(self, hub: Hub, now: float | None = None) -> None:
        now = time.time() if now is None else now
        tr = hub.trainer
        self._started = hub.started
        if tr.history and int(tr.history[-1].get("step", -1)) > self._step:
            # trainmetrics' figures of the last steps (TRL's names; the training room keeps the last 100), by step
            extra = {int(r["step"]): r for r in tr.train_metrics}
            for h in tr.history:  # steps are appended in order; only the new ones are read
                step = int(h.get("step", -1))
                if step <= self._step:
                    continue
                self._step = step
                self.train.add((float(step), float(h.get("t", 0.0))), train_figures({**h, **extra.get(step, {})}))
                self._points += 1
        for e in hub.evaluator.history:
            if e["step"] > self._eval_step:
                self._eval_step = int(e["step"])
                self.eval.add((float(e["step"]), float(e.get("wall_s") or 0.0)), {k: e.get(k) for k in EVAL_KEYS})
                self._points += 1
        for v in hub.publisher.history:
            if v["version"] > self._version:
                self._version = int(v["version"])
                self.broadcast.add((float(v["version"]),), {k: v.get(k) for k in BROADCAST_KEYS})
                self._points += 1
        t = now - hub.started
        if self._last_sample is None or t - self._last_sample >= self.rates.sample_s:
            changed = hub.fleet.tokens_changed
            self._pending.append((t, set(changed)))  # one C call; the set itself stays the fleet's
            changed.clear()  # in place: each NodeInfo holds this set
            self._last_sample = t
        self._present = hub.fleet.nodes

    def catch_up(self) -> None:
        """Record the node samples :meth:`update` took (the status writer's thread calls it
        before it reads the rates; any reader may). A node's count is read here, a moment after
        its sample's time: a change in between is in the next sample's set as well."""
        nodes = self._present
        if nodes is None:
            return
        with self._catching_up:
            while self._pending:
                t, peers = self._pending.popleft()
                counts = {p: n.tokens for p in peers if (n := nodes.get(p)) is not None}
                self.rates.add(t, counts, present=nodes)

    def node_rate(self, hub: Hub, n: NodeInfo, now: float) -> dict[str, float | None]:
        """One node's tokens/s over the last 1 and 5 minutes (reads only: the status writer's
        thread calls it for each node, off the loop)."""
        if self._pending:  # a reader on the loop (hub_status with its nodes): the writer's thread has caught up first
            self.catch_up()
        t = now - hub.started
        return {"tokens_per_s_1m": self.rates.rate(n.peer_id, t, n.tokens, 60.0),
                "tokens_per_s_5m": self.rates.rate(n.peer_id, t, n.tokens, 300.0)}

    def as_dict(self) -> dict[str, Any]:
        self.catch_up()
        return {
            "train": self.train.columns(),
            "eval": self.eval.columns(),
            "broadcast": self.broadcast.columns(),
            "nodes": self.rates.columns(present=self._present),
        }

    def encoded(self) -> tuple[dict[str, Any], str]:
        """The curves dict and its JSON, rebuilt only when a point was added since the last call
        (the status writer's thread calls it; one writer at a time, the hub's status lock)."""
        self.catch_up()
        key = (self._points, self.rates.version)
        if self._cache is None or self._cache[0] != key:
            d = self.as_dict()
            self._cache = (key, d, json.dumps(d))
        return self._cache[1], self._cache[2]
