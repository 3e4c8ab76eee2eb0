"""Token bucket (pure) and its trio edge (on trio's mock clock, so exact and fast)."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from echo2.protocol.net.ratelimit import UploadLimiter, acquire_all
from echo2.protocol.tokenbucket import MB, MIN_BURST_BYTES, TokenBucket, bucket_for_MBps


def test_burst_is_free_then_debt_costs_time() -> None:
    b = TokenBucket(1000.0, 500.0, now=0.0)
    assert b.reserve(500, 0.0) == 0.0
    assert b.reserve(250, 0.0) == pytest.approx(0.25)
    # A second caller queues behind the first: its wait includes the first one's debt.
    assert b.reserve(250, 0.0) == pytest.approx(0.5)
    assert b.tokens(0.5) == pytest.approx(0.0)


def test_refill_caps_at_burst() -> None:
    b = TokenBucket(1000.0, 100.0, now=0.0)
    assert b.reserve(100, 0.0) == 0.0
    # An hour idle refills only the burst, not an hour of tokens.
    assert b.tokens(3600.0) == pytest.approx(100.0)
    assert b.reserve(300, 3600.0) == pytest.approx(0.2)


def test_first_use_starts_full_without_now() -> None:
    b = TokenBucket(10.0, 50.0)
    assert b.reserve(50, 1e9) == 0.0
    assert b.reserve(10, 1e9) == pytest.approx(1.0)


def test_clock_going_backwards_mints_nothing() -> None:
    b = TokenBucket(100.0, 100.0, now=10.0)
    b.reserve(100, 10.0)
    assert b.tokens(5.0) == pytest.approx(0.0)  # stepped back: no refill, no crash
    assert b.tokens(10.5) == pytest.approx(50.0)


@pytest.mark.parametrize(
    "rate,burst", [(0.0, 1.0), (-1.0, 1.0), (float("nan"), 1.0), (float("inf"), 1.0), (1.0, -1.0)]
)
def test_rejects_bad_parameters(rate: float, burst: float) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate, burst)


def test_negative_reservation_rejected() -> None:
    with pytest.raises(ValueError):
        TokenBucket(1.0, 1.0).reserve(-1, 0.0)


def test_long_run_rate_despite_late_wakeups() -> None:
    """A sender that sleeps what it is told plus some lateness (each sleep overshoots a little,
    and now and then the loop stalls for up to burst/rate) still achieves the asked rate:
    lateness is made up by the tokens that accrue meanwhile."""
    rate = 20 * MB
    b = bucket_for_MBps(20)
    rng = random.Random(1)
    now = 0.0
    total = 0
    slice_ = 64 * 1024
    while total < 100 * MB:
        now += b.reserve(slice_, now)
        now += rng.uniform(0, 0.5 * slice_ / rate)  # every sleep overshoots
        if rng.random() < 0.02:
            now += 0.9 * b.burst_bytes / rate  # a stall of the event loop
        total += slice_
    expected = (total - b.burst_bytes) / rate
    assert now == pytest.approx(expected, rel=0.01)


def test_stalls_beyond_the_burst_lose_time() -> None:
    """The cap is real: a sender idle for long cannot then exceed the rate by more than the burst."""
    b = TokenBucket(1000.0, 100.0, now=0.0)
    assert b.reserve(1000, 10.0) == pytest.approx(0.9)


def test_default_burst_scales_with_rate() -> None:
    assert bucket_for_MBps(1).burst_bytes == MIN_BURST_BYTES
    assert bucket_for_MBps(100).burst_bytes == pytest.approx(100 * MB * 0.025)
    assert bucket_for_MBps(100, burst_bytes=1).burst_bytes == 1


def test_upload_limiter_on_trio_clock() -> None:
    async def main() -> float:
        lim = UploadLimiter(10.0, burst_bytes=0)  # 10 MB/s
        t0 = trio.current_time()
        for _ in range(100):
            await lim.acquire(10_000)  # 1 MB in total
        assert lim.bytes_granted == 1_000_000
        return trio.current_time() - t0

    elapsed = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert elapsed == pytest.approx(0.1, rel=1e-6)


def test_acquire_all_waits_for_the_slowest_not_the_sum() -> None:
    async def main() -> float:
        per_conn = UploadLimiter(10.0, burst_bytes=0)
        process = UploadLimiter(5.0, burst_bytes=0)
        t0 = trio.current_time()
        for _ in range(10):
            await acquire_all((per_conn, None, process), 100_000)
        return trio.current_time() - t0

    elapsed = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert elapsed == pytest.approx(1_000_000 / (5 * MB), rel=1e-6)


def test_shared_limiter_splits_between_concurrent_senders() -> None:
    async def main() -> float:
        shared = UploadLimiter(4.0, burst_bytes=0)
        t0 = trio.current_time()

        async def sender() -> None:
            for _ in range(20):
                await shared.acquire(50_000)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            nursery.start_soon(sender)
        return trio.current_time() - t0

    elapsed = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    # Two senders of 1 MB each through one 4 MB/s bucket: 0.5 s, not 0.25 s.
    assert elapsed == pytest.approx(0.5, rel=0.01)
