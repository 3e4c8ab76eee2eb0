"""Group commit in the store worker: accepted batches queued together share one transaction, and
each caller still hears its own outcome (a real HubStore in its thread, a real trio loop)."""

from __future__ import annotations

import threading
from pathlib import Path

import trio

from echo2.learner_hub.store import Accepted, HubStore
from echo2.learner_hub.storeworker import StoreWorker


def _batch(lo: int, n: int, tokens: int = 64) -> list[Accepted]:
    return [Accepted(f"t{i}", "node-a", 0, tokens, 8, 100.0 + i, b"rows%d" % i, 1000) for i in range(lo, lo + n)]


def _run_grouped(tmp_path: Path, batches: list[list[Accepted]]) -> tuple[StoreWorker, list[object]]:
    gate = threading.Event()
    worker = StoreWorker(tmp_path)
    outcomes: list[object] = [None] * len(batches)

    async def main() -> None:
        # the store thread is held inside a job until every batch is queued behind it
        worker.submit(lambda _st: gate.wait(10))
        replies = [worker.request(HubStore.record_accepted_many, b) for b in batches]
        gate.set()
        with trio.fail_after(20):
            for i, r in enumerate(replies):
                try:
                    outcomes[i] = await r.wait()
                except Exception as exc:
                    outcomes[i] = exc

    trio.run(main)
    return worker, outcomes


def test_batches_queued_together_share_one_transaction_and_all_are_stored(tmp_path: Path) -> None:
    worker, outcomes = _run_grouped(tmp_path, [_batch(0, 8), _batch(8, 8), _batch(16, 8)])
    try:
        assert outcomes == [None, None, None]
        assert worker.grouped == 3
        assert worker.call_sync(HubStore.accepted_task_ids) == {f"t{i}" for i in range(24)}
        entries = worker.call_sync(HubStore.ledger_entries, "node-a")
        assert len(entries) == 24 and sum(e[3] for e in entries) == 24 * 64
    finally:
        worker.close()


def test_a_bad_batch_in_a_group_fails_only_its_own_caller(tmp_path: Path) -> None:
    worker, outcomes = _run_grouped(tmp_path, [_batch(0, 4), _batch(4, 4, tokens=-1), _batch(8, 4)])
    try:
        assert outcomes[0] is None and outcomes[2] is None
        assert isinstance(outcomes[1], ValueError)
        assert worker.grouped == 0  # the group was rolled back whole and written batch by batch
        assert worker.call_sync(HubStore.accepted_task_ids) == {f"t{i}" for i in (*range(4), *range(8, 12))}
    finally:
        worker.close()


def test_a_job_between_grouped_batches_keeps_its_place(tmp_path: Path) -> None:
    """FIFO order holds across a group: a job queued between two batches runs between them."""
    gate = threading.Event()
    worker = StoreWorker(tmp_path)
    seen: list[set[str]] = []

    async def main() -> None:
        worker.submit(lambda _st: gate.wait(10))
        first = worker.request(HubStore.record_accepted_many, _batch(0, 2))
        between = worker.request(HubStore.accepted_task_ids)
        last = worker.request(HubStore.record_accepted_many, _batch(2, 2))
        gate.set()
        with trio.fail_after(20):
            await first.wait()
            seen.append(await between.wait())
            await last.wait()

    try:
        trio.run(main)
        assert seen == [{"t0", "t1"}]
        assert worker.call_sync(HubStore.accepted_task_ids) == {"t0", "t1", "t2", "t3"}
    finally:
        worker.close()
