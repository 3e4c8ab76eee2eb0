"""Upload rate limiting on trio's clock: the edge that sleeps for the pure token bucket.

The bucket and its units (1 MB = 10**6 bytes) are in :mod:`echo2.protocol.tokenbucket`.
"""

from __future__ import annotations

from collections.abc import Iterable

import trio

from ..tokenbucket import bucket_for_MBps

#: Senders are cut into slices of this size when limited, so the rate is smooth at the scale of
#: milliseconds rather than a whole chunk at once.
DEFAULT_SLICE_BYTES = 64 * 1024


class UploadLimiter:
    """A token bucket on trio's clock, meant to be shared: one per connection and/or one per
    process (pass the same instance to the data-plane server and to every ``connect``).

    ``rate_MBps`` uses 1 MB = 10**6 bytes.
    """

    def __init__(self, rate_MBps: float, *, burst_bytes: int | None = None) -> None:
        self.rate_MBps = float(rate_MBps)
        self.bucket = bucket_for_MBps(rate_MBps, burst_bytes)
        self.bytes_granted = 0

    def reserve(self, nbytes: int) -> float:
        self.bytes_granted += nbytes
        return self.bucket.reserve(nbytes, trio.current_time())

    async def acquire(self, nbytes: int) -> None:
        await acquire_all((self,), nbytes)

    def __repr__(self) -> str:
        return f"UploadLimiter({self.rate_MBps:g} MB/s)"


async def acquire_all(limiters: Iterable[UploadLimiter | None], nbytes: int) -> None:
    """Debit ``nbytes`` from every limiter and sleep for the longest wait among them.

    All buckets are debited at the same instant, so a slow process-wide bucket and a faster
    per-connection one compose to the slower of the two, not their sum.
    """
    delay = 0.0
    for lim in limiters:
        if lim is not None:
            delay = max(delay, lim.reserve(nbytes))
    if delay > 0:
        await trio.sleep(delay)
