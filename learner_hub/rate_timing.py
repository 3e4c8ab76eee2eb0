"""A node's rate from the hub's own timings of its results (the dispatcher's rate EWMA).

Pure: the last timing in, the next one out. A node works its tasks serially, so results that come
back together (a node's ResultBatch) extend the last timing as one span of their rollouts instead
of reading as done in no time, which inflated the node's rate (tasks grew 2.25x with a 2 s linger).
"""

from __future__ import annotations

#: results of one node this close together were delivered together (a batch), not made in that time
BURST_S = 0.05

#: the last timing: (rollouts, seconds, the rate before it, its weight)
Timing = tuple[float, float, float, float]


def timed(last: Timing | None, rollouts: int, elapsed: float, rate: float, claimed: bool, alpha: float) -> Timing | None:
    """The timing this result makes (None: it says nothing); its rate is :func:`rate_of`."""
    if elapsed < BURST_S and last is not None:
        n, span, before, a = last  # serial work: back-to-back timings are one span together
        return n + rollouts, span + max(0.0, elapsed), before, a
    if elapsed > 0:
        # the first timing replaces a claim outright: a claim never enters the average
        return rollouts, elapsed, rate, 1.0 if claimed else alpha
    return None


def rate_of(t: Timing, min_rate: float) -> float:
    n, span, before, a = t
    return max(min_rate, a * n / span + (1 - a) * before)
