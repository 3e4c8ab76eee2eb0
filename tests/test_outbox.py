"""The node's outbox of finished results (issue 20): the batching decision (sans-IO) and the file
of one waiting result."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from echo2.node.outbox import Entry, WorkerState, decode_entry, encode_entry, plan
from echo2.protocol.identity import Identity
from echo2.protocol.packedresult import PackedCompletion, PackedResult, pack_ids, pack_logprobs

NODE = Identity.generate().peer_id


def result(task_id: str, version: int = 3) -> PackedResult:
    c = PackedCompletion(0, pack_ids([5, 6, 7]), pack_logprobs([-0.5, -0.25, -1.0]), "length")
    return PackedResult(task_id=task_id, task_hash=b"\xab" * 32, node_id=NODE, version=version, completions=[c],
                        started_at=1000.0, gen_seconds=0.5, tokens=3)


def entry(i: int, *, ready_at: float = 100.0, deadline: float = 1000.0, size: int = 10, version: int = 3,
          not_before: float = 0.0) -> Entry:
    return Entry(task_id=f"t-{i}", deadline=deadline, version=version, ready_at=ready_at, size=size,
                 result=result(f"t-{i}", version), not_before=not_before)


def ids(es: list[Entry]) -> list[str]:
    return [e.task_id for e in es]


def test_ready_results_go_at_once_up_to_the_batch_limits() -> None:
    es = [entry(i) for i in range(5)]
    p = plan(es, 100.0, max_count=4, max_bytes=1000, linger_s=0.0, next_at=None, held_version=3)
    assert ids(p.send) == ["t-0", "t-1", "t-2", "t-3"] and not p.expired and p.wake_at is None
    # the bytes bound cuts the batch; one result goes alone whatever its size
    p = plan(es, 100.0, max_count=32, max_bytes=25, linger_s=0.0, next_at=None, held_version=3)
    assert ids(p.send) == ["t-0", "t-1"]
    p = plan([entry(0, size=10**9)], 100.0, max_count=32, max_bytes=25, linger_s=0.0, next_at=None, held_version=3)
    assert ids(p.send) == ["t-0"]
    # no channel: one result per request
    assert ids(plan(es, 100.0, max_count=1, max_bytes=0, linger_s=1.0, next_at=100.1, held_version=3).send) == ["t-0"]
    # nothing waiting: wait for a put
    assert plan([], 100.0, max_count=4, max_bytes=1000, linger_s=1.0, next_at=None, held_version=3) == \
        plan([], 100.0, max_count=4, max_bytes=1000, linger_s=0.0, next_at=None, held_version=None)


def test_linger_waits_only_for_a_result_expected_in_time() -> None:
    es = [entry(0, ready_at=100.0)]
    kw = {"max_count": 32, "max_bytes": 10**6, "held_version": 3}
    # the next result is due in 0.2 s, within a 0.5 s linger: wait (until the linger's end at most)
    p = plan(es, 100.0, linger_s=0.5, next_at=100.2, **kw)  # type: ignore[arg-type]
    assert not p.send and p.wake_at == pytest.approx(100.5)
    # ... and at the linger's end it goes, the next one or not
    assert ids(plan(es, 100.5, linger_s=0.5, next_at=100.2, **kw).send) == ["t-0"]  # type: ignore[arg-type]
    # not expected in time, nothing being made, or linger off: at once
    assert ids(plan(es, 100.0, linger_s=0.5, next_at=101.0, **kw).send) == ["t-0"]  # type: ignore[arg-type]
    assert ids(plan(es, 100.0, linger_s=0.5, next_at=None, **kw).send) == ["t-0"]  # type: ignore[arg-type]
    assert ids(plan(es, 100.0, linger_s=0.0, next_at=100.01, **kw).send) == ["t-0"]  # type: ignore[arg-type]
    # a full batch does not wait
    full = [entry(i) for i in range(32)]
    assert len(plan(full, 100.0, linger_s=0.5, next_at=100.2, **kw).send) == 32  # type: ignore[arg-type]


def test_linger_never_crosses_a_deadline_or_a_newer_version() -> None:
    kw = {"max_count": 32, "max_bytes": 10**6, "linger_s": 0.5, "next_at": 100.2}
    # deadline in 5.3 s with a 5 s margin: the linger ends at 100.3, not 100.5
    p = plan([entry(0, deadline=105.3)], 100.0, held_version=3, **kw)  # type: ignore[arg-type]
    assert not p.send and p.wake_at == pytest.approx(100.3)
    # deadline within the margin: no linger at all
    assert ids(plan([entry(0, deadline=104.0)], 100.0, held_version=3, **kw).send) == ["t-0"]  # type: ignore[arg-type]
    # the node already holds a newer version than the result was made with: no delay
    assert ids(plan([entry(0, version=3)], 100.0, held_version=4, **kw).send) == ["t-0"]  # type: ignore[arg-type]


def test_expired_and_backed_off_results() -> None:
    kw = {"max_count": 32, "max_bytes": 10**6, "linger_s": 0.0, "next_at": None, "held_version": 3}
    es = [entry(0, deadline=99.0), entry(1, not_before=102.0), entry(2)]
    # past its deadline a result is still tried once (the hub's verdict is the node's record) ...
    assert ids(plan(es, 100.0, **kw).send) == ["t-0", "t-2"] and not plan(es, 100.0, **kw).expired  # type: ignore[arg-type]
    # ... and without lingering
    assert ids(plan([entry(0, deadline=99.0)], 100.0, max_count=32, max_bytes=10**6, linger_s=5.0, next_at=100.1,
                    held_version=3).send) == ["t-0"]
    es[0].failures = 1  # tried, failed, and past its deadline: dropped
    p = plan(es, 100.0, **kw)  # type: ignore[arg-type]
    assert ids(p.expired) == ["t-0"] and ids(p.send) == ["t-2"]  # t-1 waits for its retry time
    p = plan(es[:2], 100.0, **kw)  # type: ignore[arg-type]
    assert ids(p.expired) == ["t-0"] and not p.send and p.wake_at == 102.0
    assert ids(plan(es[1:2], 102.0, **kw).send) == ["t-1"]  # type: ignore[arg-type]


def test_worker_state_predicts_the_next_result() -> None:
    w = WorkerState(weight=0.5)
    assert w.predict(0.0) == (None, None)  # nothing measured: no prediction, no linger
    w.polling(0.0)
    w.generating(0.004)  # the hub had a task: answered in 4 ms
    assert w.predict(0.5) == (None, None)  # generation time not yet known
    w.generated(2.004)
    assert w.gen_s == pytest.approx(2.0) and w.predict(2.1) == (None, None)  # idle: nothing coming
    w.polling(3.0)
    # asking for work: a task may come within the grace (2 x 4 ms, at least 10 ms), then 2 s of work;
    # past the grace, the hub is holding the request (it lets the node hold no more tasks)
    nxt, recheck = w.predict(3.001)
    assert recheck == pytest.approx(3.01) and nxt == pytest.approx(5.01)
    assert w.predict(3.02) == (None, None)
    w.generating(3.005)
    assert w.predict(3.5) == (pytest.approx(5.005), None)
    # a long poll that waited is not an answer time; a failed task is not a generation time
    w.generated(4.0)
    w.polling(10.0)
    w.generating(15.0)
    w.idle(15.1)
    assert w.answer_s == pytest.approx(0.0045) and w.gen_s == pytest.approx(1.4975)


def test_linger_with_a_worker_asking_for_work_rechecks_after_the_grace() -> None:
    es = [entry(0, ready_at=100.0)]
    p = plan(es, 100.0, max_count=32, max_bytes=10**6, linger_s=3.0, next_at=102.05, recheck_at=100.05,
             held_version=3)
    assert not p.send and p.wake_at == pytest.approx(100.05)


def test_entry_file_round_trips_and_refuses_junk() -> None:
    e = entry(7, ready_at=time.time(), deadline=time.time() + 60)
    data = encode_entry(e)
    back = decode_entry(data)
    assert (back.task_id, back.deadline, back.version, back.ready_at, back.result) == \
        (e.task_id, e.deadline, e.version, e.ready_at, e.result)
    assert back.name == e.name and back.name.endswith(".result") and "t-7" not in back.name
    for junk in (b"", b"\x00\x01", data[:-3]):
        with pytest.raises(Exception):  # noqa: B017 - any decoding error refuses it
            decode_entry(junk)


def test_a_restarted_node_finds_its_outbox(tmp_path: Path) -> None:
    """What one run kept (durably, before its task loop moved on) the next run takes up, oldest
    first; a file that is not an outbox entry is moved aside, never sent."""
    import trio

    from echo2.node.taskloop_delivery import ResultDelivery

    def delivery() -> ResultDelivery:
        async def nothing(*_: object) -> None:
            return None

        def no_link() -> Any:
            raise AssertionError("nothing is sent here")

        return ResultDelivery(tmp_path / "outbox", Identity.generate(), "hub", to_hub=no_link, on_accepted=nothing,
                              on_refused=nothing, held_version=lambda: None)

    first = delivery()
    now = time.time()
    trio.run(first.put, entry(2, ready_at=now + 1, deadline=now + 60))
    trio.run(first.put, entry(1, ready_at=now, deadline=now + 60))
    (tmp_path / "outbox" / ("0" * 40 + ".result")).write_bytes(b"\x00 not an entry")
    second = delivery()
    assert trio.run(second.load) == 2
    assert ids(second.entries) == ["t-1", "t-2"] and second.entries[0].result == first.entries[1].result
    assert (tmp_path / "outbox" / ("0" * 40 + ".result.bad")).exists()
