"""The token bucket of upload rate limiting (sans-IO; the trio edge is ``net/ratelimit.py``).

Units: rates are given in MB/s with **1 MB = 10**6 bytes** (what ``ip``/``tc`` and link vendors
mean by megabytes, and what the benches print); the bucket itself works in bytes per second.

The bucket uses the *debt* form: :meth:`TokenBucket.reserve` always takes the bytes, possibly
driving the balance negative, and returns how long the caller must wait before sending them.
That makes it safe to share one bucket between concurrent senders (each reservation is
accounted for at once, in call order) and keeps the core free of any clock or sleep, so it can
be tested with plain numbers.
"""

from __future__ import annotations

import math

MB = 1_000_000
#: The burst is small, so that a short transfer cannot beat the asked rate by much, but not
#: tiny: whenever the sender is late by more than burst/rate (a busy event loop, a sleep that
#: overshoots on a loaded machine) the bucket caps and the lost time is never made up. 25 ms
#: worth of tokens, at least 64 KiB, kept the measured rate within a few % of the asked one.
MIN_BURST_BYTES = 64 * 1024
BURST_SECONDS = 0.025


class TokenBucket:
    """Token bucket of ``rate_Bps`` bytes/s holding at most ``burst_bytes`` tokens (sans-IO)."""

    __slots__ = ("rate_Bps", "burst_bytes", "_tokens", "_last")

    def __init__(self, rate_Bps: float, burst_bytes: float, *, now: float | None = None) -> None:
        if not (math.isfinite(rate_Bps) and rate_Bps > 0):
            raise ValueError(f"rate must be a positive finite number of bytes/s, got {rate_Bps!r}")
        if not (math.isfinite(burst_bytes) and burst_bytes >= 0):
            raise ValueError(f"burst must be >= 0 bytes, got {burst_bytes!r}")
        self.rate_Bps = float(rate_Bps)
        self.burst_bytes = float(burst_bytes)
        self._tokens = float(burst_bytes)
        # None until the first reserve: a bucket created long before its first use is full.
        self._last: float | None = now

    def _refill(self, now: float) -> None:
        if self._last is None:
            self._last = now
            return
        # A clock that steps backwards must not mint tokens or stall the refill for long.
        elapsed = max(0.0, now - self._last)
        self._last = max(self._last, now)
        self._tokens = min(self.burst_bytes, self._tokens + elapsed * self.rate_Bps)

    def tokens(self, now: float) -> float:
        """Current balance (negative while in debt)."""
        self._refill(now)
        return self._tokens

    def reserve(self, nbytes: int, now: float) -> float:
        """Take ``nbytes`` now and return the seconds to wait before sending them (>= 0)."""
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        self._refill(now)
        self._tokens -= nbytes
        if self._tokens >= 0:
            return 0.0
        return -self._tokens / self.rate_Bps


def bucket_for_MBps(rate_MBps: float, burst_bytes: int | None = None) -> TokenBucket:
    """A bucket for ``rate_MBps`` (10**6 bytes/s) with a small default burst."""
    if burst_bytes is None:
        burst_bytes = default_burst_bytes(rate_MBps * MB)
    return TokenBucket(rate_MBps * MB, burst_bytes)


def default_burst_bytes(rate_Bps: float) -> int:
    return max(MIN_BURST_BYTES, int(rate_Bps * BURST_SECONDS))
