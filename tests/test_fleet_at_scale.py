"""The hub's periodic duties with a large fleet (issue 20): each second's tick, ledger save, node
and each step's rate save visit the nodes that changed, a bounded number at a time, never
every node; heartbeats are checked and answered a bounded number per pass of the loop. A real
hub object (tiny model, real SQLite store) with N nodes admitted through the fleet's own
admission (the signed request's checks are tests/test_hub_*'s business)."""

from __future__ import annotations

import dataclasses
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.abc

from echo2.learner_hub import fleet
from echo2.learner_hub.config import HubConfig
from echo2.learner_hub.hub import PUMP_SLICE, REFILL_SLICE, WORK_GATE, Hub
from echo2.protocol import envelope
from echo2.protocol.identity import Identity
from echo2.protocol.messages import Announce, Heartbeat, Task

N = 2500


def announce(peer: str) -> Announce:
    return Announce(
        peer_id=peer, software_version="0.1.0", accelerator="", accelerator_count=0, accelerator_memory_bytes=0,
        cpu_model="test", cpu_cores=1, ram_bytes=1 << 30, free_disk_bytes=1 << 30, engine="transformers",
        engine_version="", tokens_per_s=0.0, rollouts_per_s=1.0, upload_MBps=0.0, download_MBps=0.0,
        price_usd_per_hour=0.5, listen_addrs=[], data_addr="", reachable=False, versions_held=[], max_upload_MBps=0.0,
    )


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Hub, list[Identity]]]:
    d = tmp_path_factory.mktemp("hub")
    hub = Hub(HubConfig(dir=str(d), prompts_per_step=N, group_size=2, max_new_tokens=8, staleness=1,
                        task_deadline_s=3600.0, node_silence_s=3600.0))
    idents = [Identity.from_seed(i.to_bytes(32, "big")) for i in range(1, N + 1)]

    async def admit_all() -> None:
        await hub.publish()
        for ident in idents:
            ok, why = await hub.fleet.admit(ident.peer_id, "", announce(ident.peer_id), time.time())
            assert ok, why
        await hub.store.call(lambda st: None)

    trio.run(admit_all)
    yield hub, idents
    hub.store.close()


def _count_calls(monkeypatch: pytest.MonkeyPatch, obj: object, name: str) -> list[int]:
    """Counts the calls of ``obj.name`` (the real one still runs)."""
    calls = [0]
    real = getattr(obj, name)

    def counted(*a: object, **kw: object) -> object:
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(obj, name, counted)
    return calls


def test_a_tick_visits_only_changed_nodes_a_batch_at_a_time(big: tuple[Hub, list[Identity]],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    hub, _ = big
    f = hub.fleet
    steps = _count_calls(monkeypatch, f.prices, "step")
    f.tick(time.time())  # what admission left: nothing of a new node's claim to check
    assert steps[0] <= fleet.TICK_BATCH, "a tick visited the whole admitted fleet"
    while f._tick_pending:
        f.tick(time.time())
    for st in hub.dispatcher.nodes.values():  # every node timed at once: each one's timing changed
        st.claimed, st.rate, st.completed_tasks = False, 1.0, 1  # as claimed: no overclaim
    visits = []
    for _ in range(N // fleet.TICK_BATCH + 2):
        steps[0] = 0
        f.tick(time.time())
        visits.append(steps[0])
    assert max(visits) <= fleet.TICK_BATCH and sum(visits) == N and visits[-1] == 0, visits
    steps[0] = 0
    f.tick(time.time())
    assert steps[0] == 0  # at rest: nothing


def test_the_ledger_save_is_the_changed_accounts_a_batch_at_a_time(big: tuple[Hub, list[Identity]]) -> None:
    hub, idents = big
    led = hub.ledger
    for ident in idents:  # e.g. a fleet re-priced at once: every account changed
        led.set_price(ident.peer_id, 0.75, time.time())
    sizes = []
    while led.changed:
        sizes.append(len(led.take_changed(fleet.LEDGER_SAVE_BATCH)))
    assert sizes and max(sizes) == fleet.LEDGER_SAVE_BATCH and sum(sizes) == N
    hub.fleet.tick(time.time())
    hub.store.flush()
    db = sqlite3.connect(Path(hub.cfg.dir) / "hub.sqlite")
    before = db.execute("SELECT MAX(saved_at) FROM ledger").fetchone()[0]
    # at rest with N billed accounts: a second's save writes no account, only the alive mark
    hub.fleet.tick(time.time() + 1)
    hub.store.flush()
    assert db.execute("SELECT COUNT(*) FROM ledger WHERE saved_at > ?", (before,)).fetchone()[0] == 0
    alive = db.execute("SELECT value FROM meta WHERE key = 'ledger_alive_ms'").fetchone()[0]
    assert int(alive) >= int(before * 1000)


def test_a_step_saves_the_rates_that_moved(big: tuple[Hub, list[Identity]]) -> None:
    hub, idents = big
    f, d = hub.fleet, hub.dispatcher
    hub.store.call_sync(f.persist_job(1))  # whatever was pending
    db = sqlite3.connect(Path(hub.cfg.dir) / "hub.sqlite", isolation_level=None)
    db.execute("UPDATE nodes SET measured_rate = NULL")
    for ident in idents[:3]:
        d.nodes[ident.peer_id].rate = 0.9
    f.tick(time.time())
    hub.store.call_sync(f.persist_job(2))
    saved = db.execute("SELECT peer_id, measured_rate FROM nodes WHERE measured_rate IS NOT NULL").fetchall()
    assert sorted(saved) == sorted((i.peer_id, 0.9) for i in idents[:3])


def test_a_learner_step_rechecks_only_the_nodes_that_fall_behind(big: tuple[Hub, list[Identity]],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """When the oldest admissible version moves up (each learner step), the nodes whose
    eligibility for tasks it changes are those holding a version it passed: 3 of N here, where a
    full pass visited every node; and the dispatcher's flags are what the full pass sets."""
    hub, idents = big
    out, d = hub.outbox, hub.dispatcher
    nodes = hub.fleet.nodes
    for n in nodes.values():
        n.held_version = 5
    for ident in idents[:3]:
        nodes[ident.peer_id].held_version = 4
    monkeypatch.setattr(hub.fleet, "active", None)
    out._apply_eligibility(4, None, nodes)
    per_node = _count_calls(monkeypatch, d, "set_node_active")
    whole = _count_calls(monkeypatch, d, "set_active")
    out._apply_eligibility(5, None, nodes)  # the learner stepped: version 4 is too old now
    assert whole[0] == 0 and per_node[0] == 3
    assert {p for p, st in d.nodes.items() if not st.active} == {i.peer_id for i in idents[:3]}
    nodes[idents[0].peer_id].held_version = 6  # it loads the newest version: eligible again
    out._apply_eligibility(6, None, nodes)
    assert {p for p, st in d.nodes.items() if st.active} == {idents[0].peer_id}


def test_the_capacity_model_runs_once_a_step_not_at_each_change(big: tuple[Hub, list[Identity]],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Once training runs, the capacity model (every node walked) is recomputed after a step or
    every 10 s for the status and the step's figures, and logged at most once a minute, whatever
    the churn: 10 seconds of a join or leave every second walked the fleet 21 times before."""
    hub, _ = big
    f = hub.fleet
    walks = _count_calls(monkeypatch, f, "capacity")
    hub.history.append({"step": 1, "train_s": 5.0, "reward": 0.0, "t": 1.0})
    try:
        t0 = time.time()
        for k in range(10):  # a node joins or leaves every second
            f.changed = True
            f.tick(t0 + k)
            f.predicted_busy_fraction_recent(t0 + k)  # the status write
        assert walks[0] == 3, walks  # the log once (its report and its stored entries), the status once
        hub.history.append({"step": 2, "train_s": 5.0, "reward": 0.0, "t": 2.0})
        walks[0] = 0
        f.predicted_busy_fraction(), f.predicted_busy_fraction()  # the step's figures
        assert walks[0] == 1
    finally:
        del hub.history[-2:]


class _SealsPerPass(trio.abc.Instrument):
    """The most tasks sealed in one pass of the loop (between two waits for I/O)."""

    def __init__(self) -> None:
        self.now = self.most = 0

    def before_io_wait(self, timeout: float) -> None:
        self.most, self.now = max(self.most, self.now), 0


def test_heartbeats_are_answered_a_few_per_pass_of_the_loop(big: tuple[Hub, list[Identity]],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """64 nodes wait for work (the long poll); one pump gives each a task: the loop wakes them all
    at once, and without a bound one pass sealed all 64."""
    hub, idents = big
    waiting = idents[-64:]
    for ident in waiting:
        hub.nodes[ident.peer_id].mailbox.clear()
    seals = _SealsPerPass()
    real_seal = hub.outbox.seal

    def seal(task: Task) -> bytes:
        seals.now += 1
        return real_seal(task)

    monkeypatch.setattr(hub.outbox, "seal", seal)
    got: list[bytes] = []

    async def main() -> None:
        trio.lowlevel.add_instrument(seals)
        async with trio.open_nursery() as nursery:
            for k, ident in enumerate(waiting):
                hb = Heartbeat(peer_id=ident.peer_id, seq=k + 1, versions_held=[0], busy_tasks=0, queue_free=1)
                data = envelope.seal(ident, hb)

                async def ask(peer: str = ident.peer_id, data: bytes = data) -> None:
                    got.append(await hub.on_work(peer, data))

                nursery.start_soon(ask)
            await trio.sleep(0.5)  # all of them waiting for work
            t = Task(task_id="t", node_id="", prompts=[[1, 2]], group_size=2, max_new_tokens=8, temperature=1.0,
                     top_p=1.0, seed=1, min_version=0, max_version_lag=1, deadline=time.time() + 600)
            for ident in waiting:  # what a pump does for each node it issues a task to
                node = hub.nodes[ident.peer_id]
                node.mailbox.append(dataclasses.replace(t, node_id=ident.peer_id))
                node.wakeup.set()
        trio.lowlevel.remove_instrument(seals)
        seals.before_io_wait(0.0)  # the last pass

    trio.run(main)
    assert len(got) == 64 and seals.most <= WORK_GATE, seals.most
    assert all(isinstance(envelope.open_envelope(g, Task, replay=None).message, Task) for g in got)


def test_a_pump_issues_a_slice_of_tasks_per_pass_of_the_loop(big: tuple[Hub, list[Identity]],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A pump with thousands of groups queued and nodes free issued them all in one step of the
    loop (~240 ms at 10,000 nodes); while the housekeeping runs (Hub.issue_slices) a pump issues
    PUMP_SLICE at most and the rest follows a slice per pass, until every queued group is out."""
    hub, idents = big
    monkeypatch.setattr(hub.fleet, "active", None)
    for ident in idents:
        hub.nodes[ident.peer_id].mailbox.clear()
        hub.nodes[ident.peer_id].held_version = max(hub.nodes[ident.peer_id].held_version, 0)
    hub.outbox.refill()
    queued = len(hub.dispatcher.queue)
    assert queued > 4 * PUMP_SLICE
    issued = _count_calls(monkeypatch, hub.fleet, "task_issued")

    class IssuedPerPass(_SealsPerPass):
        total = 0

        def before_io_wait(self, timeout: float) -> None:
            self.now, issued[0] = issued[0], 0
            self.total += self.now
            super().before_io_wait(timeout)

    per_pass = IssuedPerPass()

    async def main() -> None:
        trio.lowlevel.add_instrument(per_pass)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.issue_slices)
            await trio.sleep(0.01)
            hub._pump()
            with trio.fail_after(60):
                while hub.dispatcher.queue:
                    await trio.sleep(0)
            nursery.cancel_scope.cancel()
        trio.lowlevel.remove_instrument(per_pass)
        per_pass.before_io_wait(0.0)  # the last pass

    trio.run(main)
    assert hub.outbox.pump_slice is None  # unbounded again once the slices' task is gone
    assert not hub.dispatcher.queue and 0 < per_pass.most <= PUMP_SLICE, per_pass.most
    assert per_pass.total >= queued // 8 and per_pass.total > 4 * PUMP_SLICE  # one group or more a task


def test_closed_tasks_issue_prices_are_dropped_in_bulk() -> None:
    """The tick hands the tasks in flight to the price book every second: it drops the prices of
    closed tasks once they are many (amortised O(1) a task), not in a pass over every task each
    second, and never one still in flight."""
    from echo2.learner_hub.claims import PriceBook

    book = PriceBook()
    book.admit("p", 1.0, 0.0)
    for i in range(5000):
        book.issued(f"t{i}", "p")
    in_flight = {f"t{i}": None for i in range(5000)}
    for i in range(1000):  # closed without an accepted result: fewer than the bulk size
        del in_flight[f"t{i}"]
    book.forget_tasks(in_flight)
    assert len(book._tasks) == 5000
    for i in range(1000, 2300):
        del in_flight[f"t{i}"]
    book.forget_tasks(in_flight)
    assert set(book._tasks) == set(in_flight) and len(in_flight) == 2700
    assert book.task_price("t4999", "p") == 1.0


def test_a_refill_draws_a_slice_of_prompts_per_pass_of_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refill after a learner step draws a whole batch of prompt groups (~10-15 us each); while
    the housekeeping runs (Hub.issue_slices) it draws REFILL_SLICE at most in one pass of the loop
    and the rest follows a slice per pass, until the pipeline holds what an unbounded refill
    would have queued."""
    want = 6 * REFILL_SLICE + 5
    hub = Hub(HubConfig(dir=str(tmp_path), prompts_per_step=want, group_size=2, max_new_tokens=8, staleness=1))
    drawn: list[int] = []
    real = hub.outbox.source.draw

    def draw(n: int) -> list[object]:
        drawn.append(n)
        return real(n)  # type: ignore[return-value]

    monkeypatch.setattr(hub.outbox.source, "draw", draw)

    async def main() -> None:
        await hub.publish()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.issue_slices)
            await trio.sleep(0.01)
            hub.outbox.feed()
            assert drawn == [REFILL_SLICE]  # this pass: one slice, the rest on the next passes
            with trio.fail_after(30):
                while len(hub.dispatcher.queue) < want:
                    await trio.sleep(0)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        hub.store.close()
    assert len(hub.dispatcher.queue) == want == sum(drawn)
    assert max(drawn) <= REFILL_SLICE and len(drawn) == 7, drawn
    assert hub.outbox.refill_slice is None  # unbounded again once the slices' task is gone
    hub.outbox.refill()
    assert sum(drawn) == want  # nothing more is due
