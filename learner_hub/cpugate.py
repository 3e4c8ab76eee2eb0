"""Intake's CPU work on the trio loop, one task at a time, in slices (issue 20: loop lag).

Why: trio runs every runnable task for one step per pass of its loop. When the batches of many
nodes arrive together, each handler examined and judged its whole batch in one step (8 small
results: ~2-3 ms), so a pass ran them all back to back and the loop's ticker, and every
heartbeat, waited for the lot: `echo2 bench intake --nodes 100 --batch 8 --workers 0` measured a
loop lag p99 of 114 ms with 32 working nodes. A checkpoint between items alone does not bound
that (the pass still runs one step of every handler); a gate does: one task at a time does
intake's CPU work, and between items it gives the gate to the next waiter (trio's Lock is FIFO)
and lets the loop run once its slice (``slice_s``) is used up.

A slice per holder does not bound a pass, though: the lock is free between two holders, so every
task that became runnable in a pass (32 nodes' batches, each read in the same pass) took it in
turn within that pass, and the pass ran them all: loop lag p99 23-33 ms with 32 working nodes,
`echo2 bench intake --nodes 100 --batch 8`, where no single step was over 10 ms (trio instrument).
So the gate also keeps a budget per pass of the loop (``pass_budget_s``, counted by a trio
instrument on the loop's I/O wait, which runs once a pass): once the pass has had it, a task that
wants the gate waits for the next pass.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

#: how long one task may run intake work before it lets the loop run (a small result is ~0.3 ms
#: to examine, ~0.1 ms to judge: a slice holds a few; the loop's lag stays near one slice)
SLICE_S = 0.001
#: the gated work one pass of the loop runs at most (a holder may overrun it by one item): what
#: the loop's other tasks wait for, at most
PASS_BUDGET_S = 0.004


class PassClock(trio.abc.Instrument):
    """Counts the passes of the trio loop it is added to: trio calls ``after_io_wait`` once per
    pass (and only the hooks an instrument defines, so this costs one call a pass)."""

    def __init__(self) -> None:
        self.passes = 0

    def after_io_wait(self, timeout: float) -> None:
        self.passes += 1


class CpuGate:
    """``async with gate.held() as g: for x in xs: work(x); await g.tick()``."""

    def __init__(self, slice_s: float = SLICE_S, pass_budget_s: float = PASS_BUDGET_S) -> None:
        self.slice_s = slice_s
        self.pass_budget_s = pass_budget_s
        self._lock: trio.Lock | None = None  # made in the loop that uses it (the hub's)
        self._clock: PassClock | None = None  # added to that loop with the lock
        self._token: trio.lowlevel.TrioToken | None = None  # that loop's
        self._since = 0.0
        self._pass = -1  # the pass _spent counts for
        self._spent = 0.0
        self.yields = 0  # slices handed on (status, tests)
        self.deferred = 0  # times a task waited for the next pass: this one's budget was spent

    def _spent_now(self) -> float:
        return self._spent if self._clock is not None and self._pass == self._clock.passes else 0.0

    async def _acquire(self) -> None:
        token = trio.lowlevel.current_trio_token()
        if self._lock is None or self._token is not token:
            # the first use in this loop (a hub object driven by several trio.run calls, as tests
            # do: a clock left on a finished loop never counts a pass, and the spent budget of
            # every earlier run would add up until a task waited forever for the next pass)
            self._lock, self._clock, self._token = trio.Lock(), PassClock(), token
            self._pass, self._spent = -1, 0.0
            trio.lowlevel.add_instrument(self._clock)
        while self._spent_now() >= self.pass_budget_s:
            self.deferred += 1
            await trio.lowlevel.checkpoint()  # runs again in the next pass
        try:  # uncontended: no trip through the scheduler (each costs the loop ~30 us)
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()
        self._since = time.perf_counter()

    def _release(self) -> None:
        if self._lock is not None and self._lock.statistics().owner is trio.lowlevel.current_task():
            assert self._clock is not None
            if self._pass != self._clock.passes:
                self._pass, self._spent = self._clock.passes, 0.0
            self._spent += time.perf_counter() - self._since
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
