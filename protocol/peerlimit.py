"""Per-peer limits on incoming work (sans-IO): request rates, concurrency, log volume.

Used by the control plane (per peer ID and protocol) and the data plane (per IP and per peer).
Every structure is bounded in memory: a hostile fleet of fresh identities or addresses can only
push out the least recently seen keys, never grow the tables without limit. The clock is a
parameter (``now``, seconds on any monotonic clock), so all of it is testable with plain numbers.
"""

from __future__ import annotations

import ipaddress
import logging
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence

from .tokenbucket import TokenBucket

__all__ = ["ByteBudget", "Charge", "address_key", "ConcurrencyLimiter", "KeyedRateLimiter", "LogThrottle"]


def address_key(ip: str) -> str:
    """The key a per-IP budget uses for ``ip``: the address itself for IPv4, its /64 for IPv6.

    One IPv6 customer commonly holds a whole /64, so a per-address budget would give one
    attacker 2**64 budgets. Anything that is not an IP address (e.g. a peer ID standing in for an
    unknown address) is its own key.
    """
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


class KeyedRateLimiter:
    """One token bucket per key: ``rate_per_s`` sustained, ``burst`` at once; refuse, never wait.

    A request either takes a whole token now or is refused: a server must not queue work for a
    peer that sends faster than it may. Buckets of the least recently seen keys are dropped above
    ``max_keys``; a dropped key starts again with a full bucket, which bounds what an attacker can
    gain from it to one burst per eviction cycle of ``max_keys`` other keys.
    """

    def __init__(self, rate_per_s: float, burst: float, *, max_keys: int = 100_000) -> None:
        if burst < 1:
            raise ValueError("burst must be >= 1 (a bucket that never holds a token refuses everything)")
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        # TokenBucket validates the rate (positive, finite).
        TokenBucket(rate_per_s, burst)
        self.rate_per_s = float(rate_per_s)
        self.burst = float(burst)
        self.max_keys = int(max_keys)
        self._buckets: OrderedDict[Hashable, TokenBucket] = OrderedDict()
        self.refused = 0

    def __len__(self) -> int:
        return len(self._buckets)

    def allow(self, key: Hashable, now: float, cost: int = 1) -> bool:
        """Take ``cost`` tokens for ``key`` at time ``now``; False (nothing taken) if short."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = TokenBucket(self.rate_per_s, self.burst, now=now)
            self._buckets[key] = bucket
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        if bucket.tokens(now) < cost:
            self.refused += 1
            return False
        bucket.reserve(cost, now)
        return True

    def wait_s(self, key: Hashable, now: float, cost: int = 1) -> float:
        """Seconds until ``key`` has ``cost`` tokens (0 if it has them now or is not tracked)."""
        bucket = self._buckets.get(key)
        if bucket is None:
            return 0.0
        short = cost - bucket.tokens(now)
        return max(0.0, short / self.rate_per_s)


class ConcurrencyLimiter:
    """Counts what each key holds open (streams, connections); refuses above ``limit`` per key.

    ``acquire`` and ``release`` must pair up (use try/finally). Keys at zero are forgotten, so the
    table holds only keys with something open.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.limit = int(limit)
        self._open: Counter[Hashable] = Counter()
        self.refused = 0

    def __len__(self) -> int:
        return len(self._open)

    def count(self, key: Hashable) -> int:
        return self._open.get(key, 0)

    def acquire(self, key: Hashable) -> bool:
        if self._open.get(key, 0) >= self.limit:
            self.refused += 1
            return False
        self._open[key] += 1
        return True

    def release(self, key: Hashable) -> None:
        left = self._open.get(key, 0) - 1
        if left > 0:
            self._open[key] = left
        else:
            self._open.pop(key, None)


class ByteBudget:
    """Bytes held per key, under a cap per key and a cap over all keys; refuse, never wait.

    Charged as bytes actually arrive (:meth:`take`) and given back when the work holding them is
    done (:meth:`give`), never reserved from what a peer merely announces: an announced length
    costs the announcer nothing and so can crowd out nobody. Keys at zero are forgotten, so the
    table holds only keys with bytes in flight.
    """

    def __init__(self, per_key: int, total: int) -> None:
        if per_key < 1 or total < 1:
            raise ValueError("byte budgets must be >= 1")
        self.per_key = int(per_key)
        self.total = int(total)
        self.total_held = 0
        self._held: Counter[Hashable] = Counter()
        self.refused = 0

    def __len__(self) -> int:
        return len(self._held)

    def held(self, key: Hashable) -> int:
        return self._held.get(key, 0)

    def can_take(self, key: Hashable, nbytes: int) -> bool:
        return self._held.get(key, 0) + nbytes <= self.per_key and self.total_held + nbytes <= self.total

    def take(self, key: Hashable, nbytes: int) -> bool:
        """Charge ``nbytes`` to ``key``; False (nothing charged) if either cap would be passed."""
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        if not self.can_take(key, nbytes):
            self.refused += 1
            return False
        if nbytes:
            self._held[key] += nbytes
            self.total_held += nbytes
        return True

    def give(self, key: Hashable, nbytes: int) -> None:
        held = self._held.get(key, 0)
        nbytes = min(nbytes, held)
        left = held - nbytes
        if left > 0:
            self._held[key] = left
        else:
            self._held.pop(key, None)
        self.total_held -= nbytes


class Charge:
    """The bytes one piece of work (a request body, a frame) holds in several budgets at once,
    taken as they arrive, all or none, and given back together by :meth:`release`."""

    def __init__(self, accounts: Sequence[tuple[ByteBudget, Hashable]]) -> None:
        self.accounts = list(accounts)
        self.held = 0

    @property
    def cap(self) -> int:
        """The most this charge could ever hold (the smallest per-key cap among its budgets)."""
        return min((budget.per_key for budget, _key in self.accounts), default=0)

    def take(self, nbytes: int) -> bool:
        if not all(budget.can_take(key, nbytes) for budget, key in self.accounts):
            for budget, _key in self.accounts:
                budget.refused += 1
            return False
        for budget, key in self.accounts:
            budget.take(key, nbytes)
        self.held += nbytes
        return True

    def release(self) -> None:
        for budget, key in self.accounts:
            budget.give(key, self.held)
        self.held = 0


class LogThrottle:
    """At most ``per_s`` log lines per category per second; the rest are counted and summed up.

    A flood of hostile input must not become a flood of log lines (disk, CPU, and the honest
    lines drowned). Each refusal is still counted by the caller; only the logging is thinned.
    """

    def __init__(self, logger: logging.Logger, per_s: int = 10) -> None:
        self.logger = logger
        self.per_s = max(1, int(per_s))
        self._window: dict[str, tuple[int, int, int]] = {}  # category -> (second, logged, suppressed)

    def log(self, level: int, category: str, now: float, msg: str, *args: object) -> None:
        second = int(now)
        cur, logged, suppressed = self._window.get(category, (second, 0, 0))
        if cur != second:
            if suppressed:
                self.logger.log(level, "... %d more [%s] lines suppressed in the last second", suppressed, category)
            cur, logged, suppressed = second, 0, 0
        if logged < self.per_s:
            self.logger.log(level, msg, *args, stacklevel=3)
            logged += 1
        else:
            suppressed += 1
        self._window[category] = (cur, logged, suppressed)
        if len(self._window) > 1024:  # categories are our own codes; this only guards a bug
            self._window.clear()
