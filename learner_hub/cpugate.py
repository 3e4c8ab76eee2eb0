"""Intake's CPU work on the trio loop, one task at a time, in slices (issue 20: loop lag).

Why: trio runs every runnable task for one step per pass of its loop. When the batches of many
nodes arrive together, each handler examined and judged its whole batch in one step (8 small
results: ~2-3 ms), so a pass ran them all back to back and the loop's ticker, and every
heartbeat, waited for the lot: `echo2 bench intake --nodes 100 --batch 8 --workers 0` measured a
loop lag p99 of 114 ms with 32 working nodes. A checkpoint between items alone does not bound
that (the pass still runs one step of every handler); a gate does: one task at a time does
intake's CPU work, and between items it gives the gate to the next waiter (trio's Lock is FIFO)
and lets the loop run once its slice (``slice_s``) is used up.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

#: how long one task may run intake work before it lets the loop run (a small result is ~0.3 ms
#: to examine, ~0.1 ms to judge: a slice holds a few; the loop's lag stays near one slice)
SLICE_S = 0.001


class CpuGate:
    """``async with gate.held() as g: for x in xs: work(x); await g.tick()``."""

    def __init__(self, slice_s: float = SLICE_S) -> None:
        self.slice_s = slice_s
        self._lock: trio.Lock | None = None  # made in the loop that uses it (the hub's)
        self._since = 0.0
        self.yields = 0  # slices handed on (status, tests)

    async def _acquire(self) -> None:
        self._lock = self._lock or trio.Lock()
        try:  # uncontended: no trip through the scheduler (each costs the loop ~30 us)
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()
        self._since = time.perf_counter()

    def _release(self) -> None:
        if self._lock is not None and self._lock.statistics().owner is trio.lowlevel.current_task():
            self._lock.release()

    @asynccontextmanager
    async def held(self) -> AsyncIterator[CpuGate]:
        await self._acquire()
        try:
            yield self
        finally:
            self._release()  # not held if cancelled while waiting to take it back in tick()

    async def tick(self) -> None:
        """Between two items: past the slice, the next task in line (and the loop) goes first."""
        if time.perf_counter() - self._since < self.slice_s:
            return
        self.yields += 1
        self._release()
        await trio.lowlevel.checkpoint()
        await self._acquire()
