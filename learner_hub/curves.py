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

import heapq
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping
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
    """Each node's cumulative accepted tokens sampled over time: its tokens/s over the last minutes."""

    def __init__(self, sample_s: float = NODE_SAMPLE_S, window_s: float = NODE_WINDOW_S) -> None:
        self.sample_s = sample_s
        self.window_s = window_s
        self.samples: deque[tuple[float, dict[str, int]]] = deque()

    def add(self, now: float, tokens: Mapping[str, int]) -> None:
        if self.samples and now - self.samples[-1][0] < self.sample_s:
            return
        self.samples.append((now, dict(tokens)))
        while self.samples and now - self.samples[0][0] > self.window_s:
            self.samples.popleft()

    def rate(self, peer: str, now: float, tokens_now: int, over_s: float) -> float | None:
        """Tokens/s over (about) the last ``over_s``: from the oldest sample inside that span."""
        for t, toks in self.samples:
            if now - t <= over_s and t < now:
                if peer not in toks:
                    continue
                return (tokens_now - toks[peer]) / (now - t)
        return None

    def columns(self, most: int = MAX_NODE_SERIES) -> dict[str, Any]:
        """tokens/s between consecutive samples, at the later sample's time, of the ``most`` nodes
        with the most tokens in the window: a chart of a 10,000-node fleet's every line would be
        unreadable, and building it cost O(nodes x samples) of the loop per status write."""
        pts = list(self.samples)
        if not pts:
            return {"wall_s": [], "series": {}}
        first, last = pts[0][1], pts[-1][1]
        peers = heapq.nlargest(most, last, key=lambda p: last[p] - first.get(p, 0))
        t = [b[0] for b in pts[1:]]
        series = {
            p: [((b[1][p] - a[1][p]) / (b[0] - a[0])) if p in a[1] and p in b[1] and b[0] > a[0] else None
                for a, b in zip(pts, pts[1:], strict=False)]
            for p in peers
        }
        return {"wall_s": t, "series": series}


class HubCurves:
    """The live hub's curves; ``update(hub)`` on the loop before each status snapshot."""

    def __init__(self, cap: int = CURVE_POINTS) -> None:
        self.train = Series(("step", "wall_s"), cap)
        self.eval = Series(("step", "wall_s"), cap)
        self.broadcast = Series(("version",), cap)
        self.rates = NodeRates()
        self._step = -1
        self._eval_step = -1
        self._version = -1
        self._started: float | None = None

    def update(self, hub: Hub, now: float | None = None) -> None:
        now = time.time() if now is None else now
        tr = hub.trainer
        self._started = hub.started
        # trainmetrics' figures of the last steps (TRL's names; the training room keeps the last 100), by step
        extra = {int(r["step"]): r for r in tr.train_metrics}
        for h in tr.history:  # steps are appended in order; only the new ones are read
            step = int(h.get("step", -1))
            if step <= self._step:
                continue
            self._step = step
            self.train.add((float(step), float(h.get("t", 0.0))), train_figures({**h, **extra.get(step, {})}))
        for e in hub.evaluator.history:
            if e["step"] > self._eval_step:
                self._eval_step = int(e["step"])
                self.eval.add((float(e["step"]), float(e.get("wall_s") or 0.0)), {k: e.get(k) for k in EVAL_KEYS})
        for v in hub.publisher.history:
            if v["version"] > self._version:
                self._version = int(v["version"])
                self.broadcast.add((float(v["version"]),), {k: v.get(k) for k in BROADCAST_KEYS})
        self.rates.add(now - hub.started, {n.peer_id: n.tokens for n in hub.fleet.nodes.values()})

    def node_rate(self, hub: Hub, n: NodeInfo, now: float) -> dict[str, float | None]:
        """One node's tokens/s over the last 1 and 5 minutes (reads only: the status writer's
        thread calls it for each node, off the loop)."""
        t = now - hub.started
        return {"tokens_per_s_1m": self.rates.rate(n.peer_id, t, n.tokens, 60.0),
                "tokens_per_s_5m": self.rates.rate(n.peer_id, t, n.tokens, 300.0)}

    def as_dict(self) -> dict[str, Any]:
        return {
            "train": self.train.columns(),
            "eval": self.eval.columns(),
            "broadcast": self.broadcast.columns(),
            "nodes": self.rates.columns(),
        }
