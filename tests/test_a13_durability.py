"""A13 (durability): an accepted result and its ledger entry are written in one durable
(synchronous=FULL) transaction before the hub answers "accepted", so a SIGKILL at any moment loses
neither; a restarted hub reads them back."""

from __future__ import annotations

import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from echo2.learner_hub.ledger import Ledger
from echo2.learner_hub.store import HubStore


def accept(st: HubStore, tid: str, price_micro: int = 10_000) -> None:
    st.record_accepted(tid, "node-a", 3, tokens=10, rollouts=2, received_at=100.0, payload=b"rows", price_micro=price_micro)


def test_a13_durability_accept_is_one_durable_transaction(tmp_path: Path) -> None:
    with HubStore.in_dir(tmp_path) as st:
        st.record_task("t1", "node-a", 90.0, 130.0, 2)
        trace: list[str] = []
        st._db.set_trace_callback(trace.append)
        accept(st, "t1")
        st._db.set_trace_callback(None)
        order = [" ".join(s.split()[:2]) for s in trace]
        assert order[0] == "PRAGMA synchronous=FULL" and order[1] == "BEGIN IMMEDIATE"
        assert order.index("COMMIT") > max(i for i, s in enumerate(order) if s.startswith(("INSERT", "UPDATE")))
        assert order[-1] == "PRAGMA synchronous=NORMAL" and st.synchronous() == 1
        assert st.get_task("t1").status == "done"  # type: ignore[union-attr]
        assert st.ledger_entries() == [("t1", "node-a", 2, 10, 10_000, 100.0)]
        (row,) = st.load_ledger()
        assert (row.accepted_results, row.accepted_rollouts, row.accepted_tokens) == (1, 2, 10)
        assert [p.task_id for p in st.pending_results()] == ["t1"]
        # the same task twice (a retried answer) is one ledger entry
        accept(st, "t1")
        assert len(st.ledger_entries()) == 1 and st.load_ledger()[0].accepted_results == 1
        # all or nothing: a failing ledger entry takes the result with it
        st._db.execute(
            "CREATE TEMP TRIGGER fail BEFORE INSERT ON ledger_entries BEGIN SELECT RAISE(ABORT, 'disk full'); END"
        )
        with pytest.raises(sqlite3.DatabaseError):
            accept(st, "t2")
        assert "t2" not in st.accepted_task_ids() and st.synchronous() == 1
        # a snapshot of the in-memory ledger taken before a result was committed (the hub takes
        # it on the loop, and the store writes it later) never moves the counts backwards
        stale = Ledger.restore(st.load_ledger()).snapshot(200.0)
        st._db.execute("DROP TRIGGER fail")
        accept(st, "t3")
        st.save_ledger(stale, 200.0)
        assert st.load_ledger()[0].accepted_results == 2 == len(st.ledger_entries())


_CHILD = textwrap.dedent(
    """
    import sys, time
    from echo2.learner_hub.store import HubStore
    st = HubStore.in_dir(sys.argv[1])
    i = 0
    while True:
        st.record_accepted(f"t{i}", "node-a", 0, tokens=10, rollouts=2, received_at=time.time(), payload=b"x" * 200,
                           price_micro=10_000)
        print(f"t{i}", flush=True)  # "accepted": only after the transaction returned
        i += 1
    """
)


def test_a13_durability_sigkill_loses_no_acknowledged_result(tmp_path: Path) -> None:
    """A real process accepting results as fast as it can, SIGKILLed at a random moment."""
    rng = random.Random()
    for k in range(3):
        d = tmp_path / f"round{k}"
        with HubStore.in_dir(d):
            pass  # create and migrate the file first, so the kill can only land in the accept path
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(d)], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        acked: list[str] = []
        stop_after = rng.randint(5, 60)
        try:
            while len(acked) < stop_after:
                line = child.stdout.readline()
                assert line, "the child process ended early"
                acked.append(line.strip())
            child.send_signal(signal.SIGKILL)
            acked += [x.strip() for x in child.stdout.read().splitlines() if x.strip()]
        finally:
            child.kill()
            child.wait(timeout=10)
        # a fresh process restarting on the same file
        with HubStore.in_dir(d) as st:
            found = st.accepted_task_ids()
            entries = {e[0] for e in st.ledger_entries()}
            counters = sum(r.accepted_results for r in st.load_ledger())
        assert set(acked) <= found and set(acked) <= entries
        assert counters == len(entries) >= len(acked)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a13_durability_hub_sigkill_while_a_node_sends_results(tmp_path: Path) -> None:
    """A real hub process SIGKILLed while a real node sends it results, restarted: every result
    the node was told was accepted is found, with its ledger entry and in the ledger's counts."""
    from echo2.bench.crash import run_crash

    rep = run_crash(tmp_path, 1, n_nodes=1, min_s=0.5, max_s=3.0, seed=7, say=lambda _m: None)
    assert rep["acknowledged_results"] > 0, rep
    assert rep["lost_results"] == 0 and rep["lost_ledger_entries"] == 0, rep
    assert rep["ledger_accepted_results"] >= rep["acknowledged_results"], rep
