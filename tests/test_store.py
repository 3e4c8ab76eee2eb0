"""HubStore: a real SQLite file in tmp_path; migrations, round trips, resume, checkpoints."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch

from echo2.learner_hub.ledger import Ledger
from echo2.learner_hub.store import MIGRATIONS, HubStore, StoreError


def open_store(tmp_path: Path, **kw: object) -> HubStore:
    return HubStore.in_dir(tmp_path, **kw)  # type: ignore[arg-type]


def test_migrations_applied_once_and_idempotent_on_reopen(tmp_path: Path) -> None:
    s = open_store(tmp_path)
    assert s.schema_version() == len(MIGRATIONS)
    s.upsert_node("peerA", 1.0, announce={"cpu_cores": 4}, price=0.5)
    s.close()
    s2 = open_store(tmp_path)  # reopening must not re-run migrations (ALTER TABLE would fail)
    assert s2.schema_version() == len(MIGRATIONS)
    assert s2.get_node("peerA") is not None
    s2.close()
    db = sqlite3.connect(tmp_path / "hub.sqlite")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert [r[0] for r in db.execute("SELECT version FROM schema_version ORDER BY version")] == list(
        range(1, len(MIGRATIONS) + 1)
    )
    db.close()


def test_upgrade_from_older_schema(tmp_path: Path) -> None:
    # A file created by a release that knew only migration 1 is brought up to date on open.
    db = sqlite3.connect(tmp_path / "hub.sqlite")
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    db.executescript(MIGRATIONS[0])
    db.execute("INSERT INTO schema_version VALUES (1)")
    db.execute("INSERT INTO nodes (peer_id, first_seen, last_seen) VALUES ('old', 1, 1)")
    db.commit()
    db.close()
    with open_store(tmp_path) as s:
        assert s.schema_version() == len(MIGRATIONS)
        n = s.get_node("old")
        assert n is not None and n.rep_state == {}


def test_newer_schema_refused(tmp_path: Path) -> None:
    open_store(tmp_path).close()
    db = sqlite3.connect(tmp_path / "hub.sqlite")
    db.execute("INSERT INTO schema_version VALUES (?)", (len(MIGRATIONS) + 5,))
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="newer"):
        open_store(tmp_path)


def test_nodes_bans_allowlist_admissions_round_trip(tmp_path: Path) -> None:
    with open_store(tmp_path) as s:
        s.upsert_node("p1", 10.0, announce={"accelerator": "H200", "accelerator_count": 1}, price=2.5, state="active")
        s.upsert_node("p1", 20.0)  # a later sighting keeps first_seen, the announce and the price
        s.set_measured_rate("p1", 3.25)
        s.set_reputation("p1", 0.8, {"checks": [1, 0]})
        s.allow("p2", 5.0, note="lab box")
        s.log_admission("p1", 10.0, True, "open", "admitted (open admission)")
        s.log_admission("p3", 11.0, False, "not_allowlisted", "nope")
        s.ban("p3", "forged result", 12.0)  # never admitted, still banned
        s.allow("p3", 13.0)
    with open_store(tmp_path) as s:
        n = s.get_node("p1")
        assert n is not None
        assert (n.first_seen, n.last_seen, n.price, n.measured_rate, n.reputation, n.state) == (10.0, 20.0, 2.5, 3.25, 0.8, "active")
        assert n.announce == {"accelerator": "H200", "accelerator_count": 1}
        assert n.rep_state == {"checks": [1, 0]}
        assert s.allowlist() == {"p2", "p3"}
        assert s.is_allowed("p2") and not s.is_allowed("p1")
        assert s.ban_reason("p3") == "forged result"
        assert s.ban_reason("p1") is None
        assert s.banned() == {"p3": "forged result"}
        adm = s.admissions()
        assert [a.peer_id for a in adm] == ["p3", "p1"] and not adm[0].admitted and adm[0].code == "not_allowlisted"
        assert s.unban("p3") and s.ban_reason("p3") is None and not s.unban("p3")
        assert s.disallow("p2") and not s.disallow("p2")
        assert "H200" in s.nodes_report()


def test_tasks_results_versions_meta(tmp_path: Path) -> None:
    with open_store(tmp_path) as s:
        s.record_task("t1", "p1", 1.0, 31.0, 64)
        s.close_task("t1", "done", 5.0)
        s.record_result("t1", "p1", 3, accepted=True, reason="ok", tokens=100, rollouts=64, received_at=5.0, payload=b"x")
        s.record_result("t1", "p1", 3, accepted=False, reason="duplicate", tokens=100, rollouts=64, received_at=6.0)
        s.record_result("t9", "p2", 1, accepted=False, reason="stale", tokens=1, rollouts=1, received_at=7.0)
        with pytest.raises(ValueError):
            s.record_result("t2", "p1", 3, accepted=True, reason="ok", tokens=1, rollouts=1, received_at=1.0)
        s.record_version(0, 100.0, 1000, 400)
        s.set_version_times(0, 0.1, 0.2, 0.3, 4)
        s.set_meta("prompt_seq", 17)
    with open_store(tmp_path) as s:
        t = s.get_task("t1")
        assert t is not None and (t.status, t.closed_at, t.n_rollouts) == ("done", 5.0, 64)
        assert s.task_counts() == {"done": 1}
        assert s.result_counts() == {"accepted": 1, "duplicate": 1, "stale": 1}
        (v,) = s.versions()
        assert (v.version, v.total_bytes, v.encoded_bytes, v.first_s, v.median_s, v.last_s, v.nodes) == (0, 1000, 400, 0.1, 0.2, 0.3, 4)
        assert s.get_meta("prompt_seq") == 17 and s.get_meta("missing", 3) == 3


def test_pending_results_survive_reopen_and_exactly_once(tmp_path: Path) -> None:
    with open_store(tmp_path) as s:
        for i in range(4):
            s.record_result(f"t{i}", "p1", 0, accepted=True, reason="ok", tokens=10, rollouts=2, received_at=float(i), payload=bytes([i]) * 3)
        s.mark_trained(["t0", "t1"], step=1)  # step 1 trained t0, t1 and was checkpointed
        s.mark_trained(["t2"], step=2)  # step 2 trained t2 but the hub crashed before its checkpoint
    with open_store(tmp_path) as s:
        # Resume from checkpoint 1: t2 (its training was lost) and t3 (never trained) come back.
        pend = s.pending_results(after_step=1)
        assert [(p.task_id, p.payload, p.tokens, p.rollouts) for p in pend] == [("t2", b"\x02" * 3, 10, 2), ("t3", b"\x03" * 3, 10, 2)]
        assert [p.task_id for p in s.pending_results()] == ["t3"]
        assert s.prune_payloads(upto_step=1) == 2
        assert [p.task_id for p in s.pending_results(after_step=0)] == ["t2", "t3"]  # pruned ones are gone
        assert s.drop_pending(["t3"], "stale_on_resume") == 1
        assert [p.task_id for p in s.pending_results(after_step=1)] == ["t2"]


def test_payloads_live_apart_and_leave_with_their_result(tmp_path: Path) -> None:
    """An accepted result's payload is in the payload log, its place a row of payload_refs
    (results.payload stays NULL, so marking it trained rewrites a small row); pruning and
    dropping delete that row; a batch's ledger counts match those of its results one by one."""
    from echo2.learner_hub.store import Accepted

    with open_store(tmp_path) as s:
        s.record_accepted_many([Accepted(f"t{i}", "p1" if i < 3 else "p2", 0, 10 + i, 2, float(i), bytes([i]) * 5, 7)
                                for i in range(5)])
        s.record_accepted_many([Accepted("t0", "p1", 0, 10, 2, 9.0, b"again", 7)])  # a replay: no second entry
        db = s._db
        assert db.execute("SELECT COUNT(*) FROM results WHERE payload IS NOT NULL").fetchone()[0] == 0
        assert db.execute("SELECT COUNT(*) FROM result_payloads").fetchone()[0] == 0
        assert db.execute("SELECT COUNT(*) FROM payload_refs").fetchone()[0] == 6
        led = {r[0]: r[1:] for r in db.execute("SELECT peer_id, accepted_results, accepted_rollouts, accepted_tokens,"
                                               " price_micro, saved_at FROM ledger")}
        assert led == {"p1": (3, 6, 10 + 11 + 12, 7, 0.0), "p2": (2, 4, 13 + 14, 7, 3.0)}
        assert len(s.ledger_entries()) == 5
        s.mark_trained(["t0", "t1"], step=1)
        assert s.prune_payloads(upto_step=1) == 2 + 1  # t0's replayed row was marked with it
        assert s.drop_pending(["t2"], "stale") == 1
        assert db.execute("SELECT COUNT(*) FROM payload_refs").fetchone()[0] == 2
        assert [(p.task_id, p.payload) for p in s.pending_results()] == [("t3", b"\x03" * 5), ("t4", b"\x04" * 5)]
        assert s.result_counts() == {"accepted": 6}


def test_payload_segments_survive_a_restart_and_go_once_freed(tmp_path: Path) -> None:
    """Payloads in the log are read back after the store is reopened (a new segment each open,
    and once one is full); a segment is deleted once no row refers to it, never while one does,
    and a segment lost outside the hub is a clear error, not garbage."""
    from echo2.learner_hub.payloadlog import PayloadMissing
    from echo2.learner_hub.store import Accepted

    seg_dir = tmp_path / ("hub.sqlite" + "-payloads")
    with open_store(tmp_path) as s:
        s._payloads.segment_bytes = 50  # a new segment once one holds 50 bytes: one per payload here
        for i in range(4):
            s.record_accepted_many([Accepted(f"t{i}", "p", 0, 1, 1, float(i), bytes([i]) * 60, 1)])
        assert len(s._payloads.segments()) == 4
    with open_store(tmp_path) as s:
        assert [(p.task_id, p.payload) for p in s.pending_results()] == [(f"t{i}", bytes([i]) * 60) for i in range(4)]
        s.record_accepted_many([Accepted("t4", "p", 0, 1, 1, 4.0, b"new", 1)])  # a fresh segment after reopening
        assert len(s._payloads.segments()) == 5
        s.mark_trained(["t0", "t1"], step=1)
        assert s.prune_payloads(upto_step=1) == 2
        assert len(s._payloads.segments()) == 3  # t0's and t1's segments went, the others hold live rows
        assert s.drop_pending(["t2"], "stale") == 1
        assert [p.task_id for p in s.pending_results()] == ["t3", "t4"]
        assert len(list(seg_dir.iterdir())) == 2
        (lost,) = [f for f in seg_dir.iterdir() if f.read_bytes() == bytes([3]) * 60]
        lost.unlink()
        with pytest.raises(PayloadMissing, match="missing"):
            s.pending_results()


def test_a_payload_segment_cut_short_is_refused(tmp_path: Path) -> None:
    from echo2.learner_hub.payloadlog import PayloadLog, PayloadMissing

    log = PayloadLog(tmp_path / "p")
    refs = log.append([b"a" * 10, b"", b"b" * 5], sync=True)
    assert log.read(refs) == [b"a" * 10, b"", b"b" * 5]
    log.close()
    (seg,) = list((tmp_path / "p").iterdir())
    seg.write_bytes(seg.read_bytes()[:12])
    with pytest.raises(PayloadMissing, match="2 of the 5 bytes"):
        PayloadLog(tmp_path / "p").read(refs)


def test_an_older_files_payloads_move_to_their_table(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "hub.sqlite")
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for i, m in enumerate(MIGRATIONS[:8 - 1]):  # before migration 8 (result_payloads)
        db.executescript(m)
        db.execute("INSERT INTO schema_version VALUES (?)", (i + 1,))
    db.execute("INSERT INTO results (task_id, node, version, accepted, reason, tokens, rollouts, received_at, payload)"
                " VALUES ('old', 'p1', 0, 1, 'accepted', 10, 2, 1.0, x'0102')")
    db.commit()
    db.close()
    with open_store(tmp_path) as s:
        (pend,) = s.pending_results()
        assert (pend.task_id, pend.payload) == ("old", b"\x01\x02")
        assert s._db.execute("SELECT payload FROM results").fetchall() == [(None,)]


def test_ledger_snapshot_round_trip(tmp_path: Path) -> None:
    led = Ledger()
    led.activate("a", 0.0, price=3.6)
    led.accept("a", rollouts=8, tokens=1000)
    led.refuse("a", "mismatch")
    with open_store(tmp_path) as s:
        s.save_ledger(led.snapshot(1800.0), now=1800.0)
    with open_store(tmp_path) as s:
        (row,) = s.load_ledger()
        assert row.active is False and row.active_s == 1800.0 and row.cost_usd == pytest.approx(1.8)
        assert (row.accepted_tokens, row.refused, row.refused_by_reason) == (1000, 1, {"mismatch": 1})
        led2 = Ledger.restore(s.load_ledger())
        led2.activate("a", 5000.0)
        assert led2.row("a", 5000.0 + 360.0).cost_usd == pytest.approx(1.8 + 0.36)  # type: ignore[union-attr]
        assert "TOTAL" in s.ledger_report() and s.ledger_report(as_csv=True).startswith("peer_id,")


def test_an_open_interval_is_billed_to_the_last_alive_mark_once(tmp_path: Path) -> None:
    """A billed account is saved when it changes, with the moment of the save as its open
    interval's start; later saves (of other accounts, or none) move the hub's alive mark, and a
    restart bills the open interval up to that mark, once: the settled rows are closed, so the
    alive marks of the next run do not bill the downtime."""
    led = Ledger()
    led.activate("a", 0.0, price=3.6)
    led.activate("b", 0.0, price=0.0)
    with open_store(tmp_path) as s:
        s.save_ledger(led.view(100.0, led.take_changed()).rows(), now=100.0)
        s.save_ledger([], now=200.0)  # nothing changed: only the alive mark moves
        (a, b) = s.load_ledger()
        assert (a.active, a.active_ms, a.cost_micro) == (False, 200_000, 200_000)  # 3.6 $/h for 200 s
        assert b.active_ms == 200_000 and b.cost_micro == 0
    with open_store(tmp_path) as s:  # the hub restarts
        restored = Ledger.restore(s.settle_ledger())
        assert restored.row("a", 900.0).active_ms == 200_000  # type: ignore[union-attr]
        s.save_ledger([], now=900.0)  # the new run's alive mark: the downtime is not billed
        assert [r.active_ms for r in s.load_ledger()] == [200_000, 200_000]
        assert s.load_ledger()[0].cost_micro == 200_000


def test_checkpoint_atomic_latest_keep_k(tmp_path: Path) -> None:
    s = open_store(tmp_path, keep_checkpoints=2)
    assert s.latest_checkpoint() is None
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    for step in (1, 2, 3):
        state = {"version": step, "model": model.state_dict(), "optimizer": opt.state_dict()}
        p = s.save_checkpoint(step, state)
        assert p == tmp_path / "checkpoints" / f"step-{step}.pt"
    assert s.checkpoint_steps() == [2, 3]
    assert sorted(x.name for x in (tmp_path / "checkpoints").iterdir()) == ["step-2.pt", "step-3.pt"]  # no temp files
    s.close()
    s = open_store(tmp_path, keep_checkpoints=2)
    got = s.latest_checkpoint()
    assert got is not None
    step, state = got
    assert step == 3 and state["version"] == 3
    assert torch.equal(state["model"]["weight"], model.state_dict()["weight"])
    opt2 = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=1e-3)
    opt2.load_state_dict(state["optimizer"])  # optimizer state really round-trips
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    # A damaged newest file (e.g. disk trouble) falls back to the previous checkpoint.
    (tmp_path / "checkpoints" / "step-3.pt").write_bytes(b"garbage")
    got = s.latest_checkpoint()
    assert got is not None and got[0] == 2
    # A crash mid-write leaves only a temp file, which is never taken for a checkpoint and is swept.
    (tmp_path / "checkpoints" / ".step-9.pt.tmp").write_bytes(b"partial")
    got = s.latest_checkpoint()
    assert got is not None and got[0] == 2
    s.save_checkpoint(4, {"version": 4})
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    s.close()


def test_the_banned_nodes_are_read_by_index(tmp_path: Path) -> None:
    """The hub reads the banned nodes every second: by a partial index, not a scan of every node
    row (~10 ms a read at 10,000 nodes)."""
    with open_store(tmp_path) as s:
        s.upsert_node("a", 1.0)
        s.upsert_node("b", 1.0)
        s.ban("b", "test", 2.0)
        assert s.banned() == {"b": "test"}
        plan = s._read("EXPLAIN QUERY PLAN SELECT peer_id, ban_reason FROM nodes WHERE banned = 1")
        assert any("nodes_banned" in str(row[-1]) for row in plan), plan
