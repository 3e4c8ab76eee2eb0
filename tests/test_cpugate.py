"""cpugate.CpuGate (issue 20, loop lag): intake's CPU work runs one task at a time, and a task
past its slice lets the loop (and the next task in line) run between two items."""

from __future__ import annotations

import time

import trio

from echo2.learner_hub.cpugate import CpuGate, PassClock
from echo2.learner_hub.intake_check import Limits
from echo2.learner_hub.intake_pool import IntakePool
from echo2.learner_hub.intake_worker import CheckContext, WorkerSpec


def _busy(seconds: float) -> None:
    end = trio.current_time() + seconds  # the loop's clock advances with real time here
    while trio.current_time() < end:
        pass


def test_tasks_take_turns_and_the_loop_runs_between_slices() -> None:
    order: list[str] = []

    async def main() -> None:
        gate = CpuGate(slice_s=0.002)

        async def work(name: str) -> None:
            async with gate.held() as g:
                for i in range(4):
                    _busy(0.003)  # each item is past the slice
                    order.append(f"{name}{i}")
                    await g.tick()

        async def ticker() -> None:
            for _ in range(50):
                order.append("tick")
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(work, "a")
            nursery.start_soon(work, "b")
            nursery.start_soon(ticker)

    trio.run(main)
    items = [x for x in order if x != "tick"]
    # the two batches interleave (not one whole batch, then the other): a task whose slice is
    # used up goes behind the other (trio's Lock is FIFO); at most two items in a row each
    names = "".join(x[0] for x in items)
    assert sorted(names) == list("aaaabbbb")
    assert "aaa" not in names and "bbb" not in names
    # the loop's other tasks ran between items
    first, last = order.index(items[0]), order.index(items[-1])
    assert "tick" in order[first:last]


def test_a_pass_of_the_loop_runs_at_most_its_budget_of_gated_work() -> None:
    """Tasks that each take the gate once, all runnable in the same pass: the free lock let every
    one of them run in that pass (the pass was their sum); past the pass budget they wait for the
    next pass, so each pass runs at most one item that is over the budget on its own."""
    passes: list[int] = []

    async def main() -> int:
        clock = PassClock()
        trio.lowlevel.add_instrument(clock)
        gate = CpuGate(slice_s=1.0, pass_budget_s=0.002)

        async def work() -> None:
            async with gate.held():
                _busy(0.003)  # one item, past the pass budget on its own
                passes.append(clock.passes)

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(work)
        return gate.deferred

    deferred = trio.run(main)
    assert len(passes) == 8
    assert len(set(passes)) == 8, passes  # one item per pass: the budget was spent by the first
    assert deferred >= 7


def test_within_the_slice_a_task_keeps_the_gate() -> None:
    async def main() -> int:
        gate = CpuGate(slice_s=10.0)
        async with gate.held() as g:
            for _ in range(100):
                await g.tick()
        return gate.yields

    assert trio.run(main) == 0


def test_cancelled_while_waiting_to_take_the_gate_back_leaves_it_free() -> None:
    async def main() -> None:
        gate = CpuGate(slice_s=0.0)
        with trio.move_on_after(0.05):
            async with gate.held() as g:
                async with trio.open_nursery() as nursery:
                    async def other() -> None:
                        async with gate.held():
                            await trio.sleep(1)  # holds it past our deadline
                    nursery.start_soon(other)
                    await trio.sleep(0.01)
                    await g.tick()  # hands it over, and is cancelled waiting for it
        with trio.fail_after(2):
            async with gate.held():  # not left locked
                pass

    trio.run(main)


def test_the_in_process_pool_examines_a_batch_in_slices() -> None:
    """With workers 0, check_many lets the loop run between items (it ran a whole batch in one
    step: the loop's lag with many nodes' batches at once)."""
    seen: list[int] = []

    async def main() -> None:
        pool = IntakePool(0, WorkerSpec(artifacts={}, limits=Limits(100, 8, frozenset({0}))), lambda seqs: [""] * len(seqs))
        pool.gate.slice_s = 0.0
        done = trio.Event()

        async def ticker() -> None:
            while not done.is_set():
                seen.append(pool.checked)
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.lowlevel.checkpoint()
            out = await pool.check_many([b"junk"] * 20, CheckContext("peer", {}, 0, 1))
            done.set()
        assert len(out) == 20 and all(isinstance(x, Exception) for x in out)

    trio.run(main)
    # the ticker ran while the batch was part done (it ran before and after it, on the old code)
    assert any(0 < n < 20 for n in seen)


def test_a_gate_used_by_several_trio_runs_starts_afresh_in_each() -> None:
    """A hub object driven by several ``trio.run`` calls (as tests drive one): each run's work
    used to add up against the pass budget of the first run's loop, whose clock never counted
    another pass, until a task waited forever for the next pass."""
    gate = CpuGate(slice_s=10.0, pass_budget_s=0.002)

    async def work() -> None:
        with trio.fail_after(10):
            async with gate.held():
                t = time.perf_counter()
                while time.perf_counter() - t < 0.003:  # more than a pass's budget
                    pass

    for _ in range(3):
        trio.run(work)
