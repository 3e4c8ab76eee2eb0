"""What a node says about itself, bounded: its claimed rate and its asked price. Pure: no clock,
no I/O; every call takes ``now``.

A node's Announce carries two figures the hub must not simply believe:

* ``rollouts_per_s``, its own benchmark. It is refused above ``max_rate`` (a finite, sane bound)
  and otherwise only seeds a probation: the dispatcher gives the node small tasks until it has
  timed one, and activation and the capacity model plan with measured rates. A node whose
  measured rate falls far below its claim is punished (``Event.OVERCLAIM``).
* ``price_usd_per_hour``, what it asks. The operator bounds it (``max_price`` in hub.toml: a node
  asking more is not admitted, a later Announce asking more is ignored), and a change moves the
  price in force at a bounded rate (an increase at most once per ``change_every_s``, by at most
  ``max_step`` times the current price; a decrease at once) and only for tasks issued after it: :class:`PriceBook`
  records the price each task was issued at, and the ledger bills the node's time at a new price
  only once no task issued at an older price is still in flight.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

PRICE_FLOOR = 0.01  # $/h: the base an increase from a (near) free price is measured against


@dataclass(frozen=True)
class ClaimLimits:
    max_price: float = 100.0  # $/hour
    max_rate: float = 1e4  # rollouts/s
    change_every_s: float = 600.0
    max_step: float = 2.0  # an increase at most multiplies the price in force by this
    overclaim_ratio: float = 10.0  # claimed / measured above this is an overclaim ...
    overclaim_after_tasks: int = 3  # ... once the hub has timed this many tasks

    def __post_init__(self) -> None:
        for v in (self.max_price, self.max_rate, self.change_every_s, self.max_step, self.overclaim_ratio):
            if not math.isfinite(v) or v < 0:
                raise ValueError("claim limits must be finite and >= 0")
        if self.max_step < 1 or self.overclaim_ratio < 1 or self.overclaim_after_tasks < 1:
            raise ValueError("max_step and overclaim_ratio must be >= 1, overclaim_after_tasks >= 1")


def claim_problem(rate: float, price: float, lim: ClaimLimits) -> str | None:
    """Why a claimed rate or asked price is refused (None: within bounds)."""
    if not math.isfinite(rate) or rate < 0 or rate > lim.max_rate:
        return f"claimed rate {rate:.3g} rollouts/s is outside [0, {lim.max_rate:g}]"
    if not math.isfinite(price) or price < 0 or price > lim.max_price:
        return f"price {price:.6g} $/h is above this hub's max_price {lim.max_price:g} $/h"
    return None


def overclaims(claimed: float, measured: float | None, timed_tasks: int, lim: ClaimLimits) -> bool:
    """Has the hub timed enough of the node's tasks to say its claim is far above the truth?"""
    if measured is None or timed_tasks < lim.overclaim_after_tasks:
        return False
    return claimed > lim.overclaim_ratio * max(measured, 1e-9)


def stepped_price(current: float, asked: float, lim: ClaimLimits) -> float:
    """The price in force after one allowed change towards ``asked`` (decreases are immediate)."""
    if asked <= current:
        return asked
    return min(asked, max(current, PRICE_FLOOR) * lim.max_step)


@dataclass
class _Price:
    offered: float  # the price tasks issued now are billed at
    asked: float  # what the node's latest Announce asks
    changed_at: float
    billed: float  # what the ledger bills its time at (catches up with ``offered``)


@dataclass
class PriceBook:
    limits: ClaimLimits = field(default_factory=ClaimLimits)
    _peers: dict[str, _Price] = field(default_factory=dict)
    _tasks: dict[str, tuple[str, float]] = field(default_factory=dict)  # task id -> (peer, price at issue)
    # peers whose price is still moving (ask, offer and bill differ): the only ones step() can
    # change, so the fleet's tick visits these, not every node
    moving: set[str] = field(default_factory=set)

    def _track(self, peer: str, p: _Price) -> None:
        if p.asked != p.offered or p.billed != p.offered:
            self.moving.add(peer)
        else:
            self.moving.discard(peer)

    def admit(self, peer: str, asked: float, now: float, known: float | None = None) -> float:
        """A node admitted asking ``asked``; ``known`` is the price it was billed at before (the
        restored ledger). A node seen before keeps its price in force; the new ask moves it at
        the bounded rate like any change. Returns the price in force."""
        p = self._peers.get(peer)
        if p is None:
            # a price from before a restart is held to today's operator bound too
            start = min(asked if known is None else known, self.limits.max_price)
            p = self._peers[peer] = _Price(start, asked, now, start)
        self.ask(peer, asked)
        self._track(peer, p)
        return p.offered

    def ask(self, peer: str, asked: float) -> None:
        """The node's Announce asks ``asked``: a decrease is offered at once (for tasks issued from
        now), an increase waits for :meth:`step`."""
        p = self._peers.get(peer)
        if p is not None:
            p.asked = asked
            if asked < p.offered:
                p.offered = asked
            self._track(peer, p)

    def offered(self, peer: str) -> float:
        p = self._peers.get(peer)
        return p.offered if p is not None else 0.0

    def issued(self, task_id: str, peer: str) -> None:
        self._tasks[task_id] = (peer, self.offered(peer))

    def task_price(self, task_id: str, peer: str) -> float:
        """The price in force when ``task_id`` was issued (forgotten once asked for)."""
        rec = self._tasks.pop(task_id, None)
        return rec[1] if rec is not None and rec[0] == peer else self.offered(peer)

    def step(self, peer: str, now: float, in_flight: Iterable[str]) -> float | None:
        """Move the offered price towards the ask when the rate bound allows; returns the price
        the ledger must bill from now on when that changed (every task still in flight was
        issued at the offered price), else None."""
        p = self._peers.get(peer)
        if p is None:
            return None
        if p.asked != p.offered and now - p.changed_at >= self.limits.change_every_s:
            p.offered, p.changed_at = stepped_price(p.offered, p.asked, self.limits), now
        if p.billed != p.offered and all(self._tasks.get(t, (peer, p.offered))[1] == p.offered for t in in_flight):
            p.billed = p.offered
            self._track(peer, p)
            return p.billed
        self._track(peer, p)
        return None

    def forget_tasks(self, keep: Iterable[str]) -> None:
        """Drop the issue prices of tasks that closed without an accepted result, once they are
        many (at least 1,024 and a quarter of those kept): the fleet's tick calls this every
        second, and a pass over every task in flight each time cost ~1 ms a second at 10,000
        nodes (py-spy of the hub at rest); amortised, it is O(1) per closed task."""
        live = keep if isinstance(keep, (set, dict)) else set(keep)
        if len(self._tasks) - len(live) < max(1024, len(live) // 4):
            return
        for t in [t for t in self._tasks if t not in live]:
            del self._tasks[t]
