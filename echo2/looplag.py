"""Trio event-loop health: a ticker that measures how late the loop wakes it.

A task that asks to sleep ``interval`` and wakes ``interval + lag`` later saw ``lag`` of the
loop being busy elsewhere (a blocking call, a long pure-Python stretch). The hub and the node run
one each and report ``loop_lag_p99_ms`` and ``loop_lag_max_ms`` in their status.
"""

from __future__ import annotations

import math
from collections import deque

import trio

#: 100 ms ticks keep the ticker's own cost negligible (10 wake-ups/s) while catching any stall
#: of the order that matters here (heartbeats and results have deadlines of seconds).
DEFAULT_INTERVAL_S = 0.1
#: The window for the percentile: the last 10 minutes at the default interval.
DEFAULT_WINDOW = 6000


class LoopLag:
    """Recent scheduling lags (seconds) of the trio loop this runs in."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, window: int = DEFAULT_WINDOW) -> None:
        self.interval_s = interval_s
        self._lags: deque[float] = deque(maxlen=window)
        self.max_s = 0.0
        self.samples = 0

    def record(self, lag_s: float) -> None:
        lag_s = max(0.0, lag_s)
        self._lags.append(lag_s)
        self.max_s = max(self.max_s, lag_s)
        self.samples += 1

    def p99_s(self) -> float:
        if not self._lags:
            return 0.0
        ordered = sorted(self._lags)
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]

    def report(self) -> dict[str, float]:
        """The figures status.json, /metrics and the benches publish."""
        return {
            "loop_lag_p99_ms": round(self.p99_s() * 1e3, 2),
            "loop_lag_max_ms": round(self.max_s * 1e3, 2),
        }

    async def run(self) -> None:
        """Tick until cancelled."""
        while True:
            t0 = trio.current_time()
            await trio.sleep(self.interval_s)
            self.record(trio.current_time() - t0 - self.interval_s)
