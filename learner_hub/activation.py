"""Cost-aware activation (BRIEF section 6): the cheapest set of nodes whose rates cover R*.

Problem: minimise ``sum p_i x_i`` subject to ``sum r_i x_i >= R``, ``x_i`` in {0, 1} (a covering
knapsack). Prices are $/hour, rates rollouts/s (hub-timed).

Methods
-------
* ``greedy``: take nodes by price per rate until R is covered, also try "prefix + the cheapest
  single node that covers the remainder", then repair: drop redundant nodes (most expensive
  first) and apply best-improvement 1-for-1 swaps until none helps. O(n log n) per pass, numpy.
  Always returns a feasible set and a proven lower bound (the LP relaxation), hence a certified
  gap ``cost / lower_bound - 1``.
* ``exact``: Lagrangian variable fixing, then dynamic programming over *integer price units*.
  1. The LP relaxation (fractional greedy) gives a bound ``L`` and a critical ratio ``lam``;
     with reduced cost ``c_i = p_i - lam*r_i`` any node with ``L + |c_i| > UB`` (UB = cost of the
     greedy set) is fixed out (``c_i > 0``) or in (``c_i < 0``) - no solution costing <= UB can
     do otherwise (Dembo-Hammer reduction). On heterogeneous fleets this fixes most nodes.
  2. For the remaining nodes, ``w_i = floor(p_i / q)`` units with ``q`` the price quantum (default
     $0.001/h, the resolution marketplaces quote; values within 1e-6 unit of an integer are
     snapped). ``dp[c]`` = the largest total rate with sum ``w <= c``; the least ``c*`` with
     ``dp[c*] >= R'`` is found and its set rebuilt from per-node bit masks.
  *Exactness*: ``q*c*`` (plus the fixed-in cost) is a proven lower bound on the true optimum,
  since ``q*w_i <= p_i`` for every set; the returned set is feasible and costs at most
  ``LB + q*|set|``. When every price is a multiple of ``q`` the two coincide and the answer is
  optimal (``exact=True``); otherwise the gap to the bound is reported honestly. If the table
  would exceed ``max_cells`` entries, ``q`` is coarsened (same guarantees, looser bound).
* ``auto`` (production): greedy; if its certified gap is not already 0 and the reduced DP table is
  small (``auto_exact_cells`` table entries: a few tens of ms of numpy at worst), run the exact
  stage and keep the cheaper; otherwise keep the greedy set with its certified gap.

Nodes with rate <= 0 are never selected. If all nodes together fall short of R, all positive-rate
nodes are activated and the shortfall is flagged.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)

PRICE_QUANTUM = 0.001  # $/hour
_REL_TOL = 1e-9
FArr = npt.NDArray[np.float64]
BArr = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class NodeOffer:
    node_id: str
    price: float  # $/hour, as announced
    rate: float  # rollouts/s, hub-timed

    def __post_init__(self) -> None:
        if not (math.isfinite(self.price) and math.isfinite(self.rate)) or self.price < 0:
            raise ValueError(f"node {self.node_id}: price must be finite >= 0 and rate finite")


@dataclass(frozen=True)
class Activation:
    selected: tuple[str, ...]
    cost: float  # $/hour of the selected set
    rate: float  # rollouts/s of the selected set
    required_rate: float
    method: str  # "exact" | "greedy" | "all" (infeasible) | "none" (R <= 0) | "kept" (hysteresis)
    exact: bool  # proven optimal: cost <= lower_bound (within float tolerance)
    lower_bound: float | None  # proven lower bound on the optimal cost (None if infeasible)
    shortfall: float = 0.0  # R - rate when infeasible
    elapsed_ms: float = 0.0

    @property
    def feasible(self) -> bool:
        return self.shortfall <= 0

    @property
    def gap_bound(self) -> float | None:
        """Certified upper bound on cost / optimum - 1."""
        if self.lower_bound is None:
            return None
        if self.lower_bound <= 0:
            return 0.0 if self.cost <= 0 else math.inf
        return max(0.0, self.cost / self.lower_bound - 1.0)


def _tol(x: float) -> float:
    return _REL_TOL * max(1.0, abs(x))


def lp_bound(prices: FArr, rates: FArr, required: float) -> tuple[float, float]:
    """LP relaxation value and critical price-per-rate ``lam`` (fractional greedy)."""
    order = np.argsort(prices / rates, kind="stable")
    cum = np.cumsum(rates[order])
    k = int(np.searchsorted(cum, required - _tol(required)))
    k = min(k, len(order) - 1)
    before = float(cum[k - 1]) if k > 0 else 0.0
    j = order[k]
    lam = float(prices[j] / rates[j])
    value = float(prices[order[:k]].sum()) + lam * max(0.0, required - before)
    return value, lam


def _greedy(prices: FArr, rates: FArr, required: float, max_passes: int = 200) -> BArr:
    n = len(prices)
    order = np.lexsort((-rates, prices / rates))
    cum = np.cumsum(rates[order])
    k = int(np.searchsorted(cum, required - _tol(required)))
    sel = np.zeros(n, dtype=bool)
    sel[order[: k + 1]] = True
    # Alternative: prefix + the cheapest single other node covering what the prefix lacks.
    residual = required - (float(cum[k - 1]) if k > 0 else 0.0)
    rest = order[k:]
    ok = rest[rates[rest] >= residual - _tol(required)]
    if len(ok):
        j = ok[np.argmin(prices[ok])]
        if prices[j] < prices[order[k]]:
            sel[order[k]] = False
            sel[j] = True
    return _repair(prices, rates, required, sel, max_passes)


def _drop_redundant(prices: FArr, rates: FArr, required: float, sel: BArr) -> None:
    while True:
        surplus = float(rates[sel].sum()) - required
        cand = np.flatnonzero(sel & (rates <= surplus + _tol(required)))
        if len(cand) == 0:
            return
        sel[cand[np.argmax(prices[cand])]] = False


def _repair(prices: FArr, rates: FArr, required: float, sel: BArr, max_passes: int) -> BArr:
    _drop_redundant(prices, rates, required, sel)
    for _ in range(max_passes):
        surplus = float(rates[sel].sum()) - required
        ins = np.flatnonzero(sel)
        outs = np.flatnonzero(~sel)
        if len(outs) == 0 or len(ins) == 0:
            break
        # Best 1-for-1 swap: out-node j may replace in-node i iff r_j >= r_i - surplus.
        o = outs[np.argsort(rates[outs], kind="stable")]
        o_rates = rates[o]
        o_prices = prices[o]
        suf_min = np.minimum.accumulate(o_prices[::-1])[::-1]
        # Index of the cheapest node in each suffix o[idx:]: on the reversed array, the latest
        # position where the running minimum was attained.
        rev = o_prices[::-1]
        pos = np.where(rev <= np.minimum.accumulate(rev), np.arange(len(rev)), 0)
        run_arg = np.maximum.accumulate(pos)
        suf_arg = (len(rev) - 1 - run_arg)[::-1]
        idx = np.searchsorted(o_rates, rates[ins] - surplus - _tol(required), side="left")
        valid = idx < len(o)
        if not valid.any():
            break
        gains = np.full(len(ins), -np.inf)
        gains[valid] = prices[ins[valid]] - suf_min[idx[valid]]
        b = int(np.argmax(gains))
        if gains[b] <= _tol(float(prices[ins[b]])):
            break
        sel[ins[b]] = False
        sel[o[suf_arg[idx[b]]]] = True
        _drop_redundant(prices, rates, required, sel)
    return sel


def _units(prices: FArr, q: float) -> npt.NDArray[np.int64]:
    x = prices / q
    r = np.round(x)
    snapped = np.where(np.abs(x - r) < 1e-6, r, np.floor(x))
    return snapped.astype(np.int64)


@dataclass
class _ExactOut:
    sel: BArr
    lower_bound: float


def _exact(
    prices: FArr,
    rates: FArr,
    required: float,
    ub_sel: BArr,
    quantum: float,
    max_cells: int,
    cell_limit: int | None = None,
) -> _ExactOut | None:
    """Reduction + price-unit DP. Returns None if ``cell_limit`` (auto mode) would be exceeded."""
    ub = float(prices[ub_sel].sum())
    lb_lp, lam = lp_bound(prices, rates, required)
    rc = prices - lam * rates
    lagr = lam * required + float(np.minimum(rc, 0.0).sum())
    slack = _tol(ub)
    fixed1 = (rc < 0) & (lagr - rc > ub + slack)
    fixed0 = (rc > 0) & (lagr + rc > ub + slack)
    free = ~(fixed0 | fixed1)
    base_cost = float(prices[fixed1].sum())
    need = required - float(rates[fixed1].sum())
    sel = fixed1.copy()
    if need <= _tol(required):
        return _ExactOut(sel, max(lb_lp, base_cost))
    idx = np.flatnonzero(free)
    q = quantum
    while True:
        w = _units(prices[idx], q)
        cap = int(w[ub_sel[idx]].sum())
        keep = w <= cap
        cells = int(keep.sum()) * (cap + 1)
        if cell_limit is not None and cells > cell_limit:
            return None
        if cells <= max_cells:
            break
        q *= math.ceil(cells / max_cells)
    zero = idx[w == 0]  # free at this resolution: always worth taking
    sel[zero] = True
    need -= float(rates[zero].sum())
    items = idx[(w > 0) & keep]
    wi = w[(w > 0) & keep]
    if need > _tol(required):
        dp = np.zeros(cap + 1)
        masks: list[npt.NDArray[np.uint8]] = []
        for it, wt in zip(items.tolist(), wi.tolist(), strict=True):
            cand = dp[: cap + 1 - wt] + rates[it]
            better = cand > dp[wt:]
            dp[wt:] = np.where(better, cand, dp[wt:])
            masks.append(np.packbits(better))
        reach = np.flatnonzero(dp >= need - _tol(required))
        if len(reach) == 0:  # cannot happen (the greedy set fits in cap); keep the greedy set
            log.warning("exact DP found no feasible set within the greedy bound")
            return _ExactOut(ub_sel.copy(), lb_lp)
        c = int(reach[0])
        units_lb = c
        for k in range(len(items) - 1, -1, -1):
            wt = int(wi[k])
            if c >= wt:
                pos = c - wt
                if (masks[k][pos >> 3] >> (7 - (pos & 7))) & 1:
                    sel[items[k]] = True
                    c -= wt
    else:
        units_lb = 0
    # Snapping may have rounded a price up by < 1e-6 unit; subtract that to keep the bound sound.
    lb_dp = base_cost + q * units_lb - 1e-6 * q * len(idx)
    return _ExactOut(sel, max(lb_lp, lb_dp))


def _result(
    ids: Sequence[str],
    sel: BArr,
    prices: FArr,
    rates: FArr,
    required: float,
    method: str,
    lower_bound: float | None,
    t0: float,
) -> Activation:
    cost = float(prices[sel].sum())
    rate = float(rates[sel].sum())
    exact = lower_bound is not None and cost <= lower_bound + 1e-7 * max(1.0, cost)
    return Activation(
        selected=tuple(ids[i] for i in np.flatnonzero(sel).tolist()),
        cost=cost,
        rate=rate,
        required_rate=required,
        method=method,
        exact=exact,
        lower_bound=lower_bound,
        shortfall=max(0.0, required - rate) if method == "all" else 0.0,
        elapsed_ms=(time.perf_counter() - t0) * 1e3,
    )


def solve(
    nodes: Sequence[NodeOffer],
    required_rate: float,
    method: str = "auto",
    *,
    quantum: float = PRICE_QUANTUM,
    max_cells: int = 200_000_000,
    auto_exact_cells: int = 15_000_000,
) -> Activation:
    """Choose the cheapest set of ``nodes`` whose rates sum to at least ``required_rate``.

    ``method``: "auto" | "exact" | "greedy" (see module doc for guarantees)."""
    ids = [n.node_id for n in nodes]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate node ids")
    prices = np.array([n.price for n in nodes], dtype=np.float64)
    rates = np.array([n.rate for n in nodes], dtype=np.float64)
    return solve_arrays(ids, prices, rates, required_rate, method, quantum=quantum, max_cells=max_cells,
                        auto_exact_cells=auto_exact_cells)


def solve_arrays(
    ids: Sequence[str],
    prices: FArr,
    rates: FArr,
    required_rate: float,
    method: str = "auto",
    *,
    quantum: float = PRICE_QUANTUM,
    max_cells: int = 200_000_000,
    auto_exact_cells: int = 15_000_000,
) -> Activation:
    """:func:`solve` over parallel arrays (``ids`` distinct, prices finite >= 0, rates finite):
    what the fleet's decision calls, without a :class:`NodeOffer` per node (building 10,000 of
    them was ~60% of a re-solve's CPU at 10,000 nodes)."""
    t0 = time.perf_counter()
    if method not in ("auto", "exact", "greedy"):
        raise ValueError(f"unknown method {method!r}")
    usable = rates > 0
    if required_rate <= 0:
        return _result(ids, np.zeros(len(ids), bool), prices, rates, required_rate, "none", 0.0, t0)
    total = float(rates[usable].sum())
    if total < required_rate - _tol(required_rate):
        log.warning("activation infeasible: fleet rate %.4g < required %.4g", total, required_rate)
        return _result(ids, usable.copy(), prices, rates, required_rate, "all", None, t0)
    u = np.flatnonzero(usable)
    p, r = prices[u], rates[u]
    g = _greedy(p, r, required_rate)
    lb = lp_bound(p, r, required_rate)[0]
    best, used = g, "greedy"
    cost_g = float(p[g].sum())
    if method != "greedy" and cost_g > lb + 1e-7 * max(1.0, cost_g):
        limit = auto_exact_cells if method == "auto" else None
        ex = _exact(p, r, required_rate, g, quantum, max_cells, limit)
        if ex is not None:
            lb = max(lb, ex.lower_bound)
            if float(p[ex.sel].sum()) < cost_g:
                best = ex.sel
            used = "exact"
    full = np.zeros(len(ids), dtype=bool)
    full[u[best]] = True
    return _result(ids, full, prices, rates, required_rate, used, lb, t0)


def reselect(
    current_active: Iterable[str],
    nodes: Sequence[NodeOffer],
    required_rate: float,
    min_gain: float = 0.05,
    method: str = "auto",
) -> Activation:
    """Hysteresis: keep the current set (restricted to nodes still present) if it still covers
    ``required_rate`` and the new optimum is less than ``min_gain`` (fraction) cheaper."""
    ids = [n.node_id for n in nodes]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate node ids")
    prices = np.array([n.price for n in nodes], dtype=np.float64)
    rates = np.array([n.rate for n in nodes], dtype=np.float64)
    return reselect_arrays(current_active, ids, prices, rates, required_rate, min_gain, method)


def reselect_arrays(
    current_active: Iterable[str],
    ids: Sequence[str],
    prices: FArr,
    rates: FArr,
    required_rate: float,
    min_gain: float = 0.05,
    method: str = "auto",
) -> Activation:
    """:func:`reselect` over parallel arrays (as :func:`solve_arrays`)."""
    new = solve_arrays(ids, prices, rates, required_rate, method)
    pos = {i: k for k, i in enumerate(ids)}
    cur = [pos[i] for i in dict.fromkeys(current_active) if i in pos]
    cur_rate = sum(float(rates[k]) for k in cur)
    cur_cost = sum(float(prices[k]) for k in cur)
    if (
        cur
        and required_rate > 0
        and cur_rate >= required_rate - _tol(required_rate)
        and new.cost >= (1.0 - min_gain) * cur_cost
    ):
        lb = new.lower_bound
        return Activation(
            selected=tuple(ids[k] for k in cur),
            cost=cur_cost,
            rate=cur_rate,
            required_rate=required_rate,
            method="kept",
            exact=lb is not None and cur_cost <= lb + 1e-7 * max(1.0, cur_cost),
            lower_bound=lb,
            elapsed_ms=new.elapsed_ms,
        )
    return new


# --- the fleet's active set, kept incrementally (issue 20) ----------------------------------------
#: a node's offer: price ($/hour, as offered) and hub-measured rate (None: not timed yet, probation)
Offer = tuple[float, float | None]
#: what :func:`choose_active` decides: (active, chosen paid, the paid cover or None)
ActiveDecision = tuple[set[str], set[str], "Activation | None"]


def choose_active(offers: Mapping[str, Offer], cost_aware: bool, need: float, prev_paid: Iterable[str],
                  min_gain: float = 0.05) -> ActiveDecision:
    """The full decision over the available nodes' ``offers``: (active, chosen paid, the paid
    cover's :class:`Activation` or None). Not cost-aware (``activation = "all"``, or nothing
    trained yet to size R* by): every available node. Otherwise every free and every untimed
    node, plus the cheapest cover (with hysteresis, :func:`reselect`) of what the free ones'
    measured rates leave of ``need`` among the paid ones."""
    if not cost_aware or not offers:
        return set(offers), set(), None
    probation = {p for p, (_, r) in offers.items() if r is None}
    ids = [p for p, (_, r) in offers.items() if r is not None]
    vals = [o for o in offers.values() if o[1] is not None]
    prices = np.fromiter((o[0] for o in vals), np.float64, len(vals))
    rates = np.fromiter((o[1] for o in vals), np.float64, len(vals))  # type: ignore[misc]
    bad = ~(np.isfinite(prices) & np.isfinite(rates) & (prices >= 0))
    if bad.any():
        NodeOffer(ids[int(np.argmax(bad))], *vals[int(np.argmax(bad))])  # type: ignore[arg-type]  # raises its error
    is_free = prices == 0
    free = {ids[k] for k in np.flatnonzero(is_free).tolist()}
    rest = need - sum(rates[is_free].tolist())
    paid = np.flatnonzero(prices > 0)
    chosen: set[str] = set()
    act = None
    if rest > 0 and len(paid):
        act = reselect_arrays(prev_paid, [ids[k] for k in paid.tolist()], prices[paid], rates[paid], rest,
                              min_gain=min_gain)
        chosen = set(act.selected)
    return free | chosen | probation, chosen, act


class ActiveSet:
    """:func:`choose_active` kept by events instead of recomputed per event.

    :meth:`solve` is the full decision (the hub runs it every few seconds, when rates and R* have
    moved). Between solves a node that joins or leaves the available set (admitted, resumed,
    paused, dropped, banned) changes the set in O(1) when its offer cannot change the paid cover:
    when activation is not cost-aware, or the node is untimed (on probation it is active whatever
    the cover). A timed node's join or leave changes what the free nodes cover or the paid
    candidates, so it re-solves, as the full form would. Equal to re-running :func:`choose_active`
    after every event (tests/test_activation_incremental.py); running it over every node at each
    admission cost the loop 2-4 ms at 10,000 nodes (`echo2 bench intake`).
    """

    def __init__(self, min_gain: float = 0.05) -> None:
        self.min_gain = min_gain
        self.offers: dict[str, Offer] = {}  # the available nodes
        self.active: set[str] = set()
        self.paid: set[str] = set()
        self.cost_aware = False
        self.need = 0.0
        self.last: Activation | None = None  # the paid cover of the last solve that made one
        self.last_need = 0.0  # R* when it was made
        self.solves = 0
        self._seq = 0  # joins and leaves so far
        self._touched: dict[str, int] = {}  # node -> the number of its last join or leave, since the last decision

    def solve(self, offers: Mapping[str, Offer], cost_aware: bool, need: float) -> tuple[set[str], set[str]]:
        """The full decision; returns (activated, deactivated)."""
        self.offers, self.cost_aware, self.need = dict(offers), cost_aware, need
        return self._resolve()

    def _resolve(self) -> tuple[set[str], set[str]]:
        return self._take(choose_active(self.offers, self.cost_aware, self.need, self.paid, self.min_gain))

    def mark(self) -> tuple[int, int]:
        """Where the events stand: take it with the inputs of a decision made away (:meth:`adopt`)."""
        return self.solves, self._seq

    def adopt(self, offers: Mapping[str, Offer], cost_aware: bool, need: float, decided: ActiveDecision,
              mark: tuple[int, int]) -> tuple[set[str], set[str]] | None:
        """A full decision ``decided`` = :func:`choose_active` (``offers``, ``cost_aware``, ``need``,
        the paid set then), made away from the loop while events went on: ``mark`` is
        :meth:`mark` when its inputs were read. None if a solve ran meanwhile (an event that
        could change the cover re-solved on the loop: the set is fresher than ``decided``).
        Otherwise every event since was one of :meth:`join` and :meth:`leave`'s O(1) cases (a
        node on probation, or not cost-aware): the nodes that left are dropped from the decision,
        those that joined keep what their event decided; returns (activated, deactivated)."""
        if mark[0] != self.solves:
            return None
        new, paid, act = decided
        now, touched = self.offers, {p for p, k in self._touched.items() if k > mark[1]}
        self.offers = {p: o if p in touched else offers.get(p, o) for p, o in now.items()}
        self.cost_aware, self.need = cost_aware, need
        kept = {p for p in touched if p in self.active}  # as their own events decided
        return self._take(({p for p in new if p in now and p not in touched} | kept,
                           {p for p in paid if p in now and p not in touched}, act))

    def _take(self, decided: ActiveDecision) -> tuple[set[str], set[str]]:
        new, self.paid, act = decided
        self._touched = {}
        if act is not None:
            self.last, self.last_need = act, self.need
        self.solves += 1
        added, removed = new - self.active, self.active - new
        self.active -= removed
        self.active |= added
        return added, removed

    def join(self, peer: str, offer: Offer) -> tuple[set[str], set[str]]:
        """``peer`` is available with ``offer`` (new, resumed, or its offer renewed)."""
        old = self.offers.get(peer)
        self.offers[peer] = offer
        self._seq += 1
        self._touched[peer] = self._seq
        if self.cost_aware and (offer[1] is not None or (old is not None and old[1] is not None)):
            return self._resolve()
        if peer in self.active:
            return set(), set()
        self.active.add(peer)
        return {peer}, set()

    def leave(self, peer: str) -> tuple[set[str], set[str]]:
        """``peer`` is no longer available (paused, dropped, banned)."""
        old = self.offers.pop(peer, None)
        if old is None:
            return set(), set()
        self._seq += 1
        self._touched[peer] = self._seq
        if self.cost_aware and old[1] is not None:
            return self._resolve()
        self.paid.discard(peer)
        if peer not in self.active:
            return set(), set()
        self.active.discard(peer)
        return set(), {peer}
