"""Hostile nodes with real processes: each runs beside two honest nodes and must be refused,
recorded with its reason, banned where the reputation rules say so, and must not stop the run.

The adversary is tests/hostile_node.py: a real echo2 Node with altered behaviour. How a node
routes around a corrupt relay is tested in test_relay_runtime.py; here the relay is reported to
the hub, recorded and banned.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hostile_node import (
    LOGPROB_SHIFT,
    assert_run_ok,
    logs,
    peer_of,
    query,
    small_cfg,
    start_hostile,
    wait_until,
)

from echo2.bench.swarm import LocalSwarm


# not in the README's run (was `ci`): the suite took 706 s on a 2-core machine; the verifier's
# spot check and ban are covered at the hub by test_verify_a5.py, and CI keeps the corrupt relay's swarm
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_wrong_logprobs_node_is_banned(tmp_path: Path) -> None:
    # The liar works alone first, so that its rows are certainly the ones checked (beside two
    # fast honest nodes it sometimes got too few tasks before a short run ended); the honest
    # nodes join once it is banned and must finish the run with the steps it trained.
    steps = 30
    cfg = small_cfg(steps)
    with LocalSwarm(tmp_path, cfg, n_nodes=2) as swarm:
        swarm.start_hub()
        hostile = start_hostile(swarm, 2, "logprobs")
        wait_until(lambda: query(tmp_path, "SELECT 1 FROM nodes WHERE banned = 1"), 120,
                   lambda: f"the lying node banned\n{logs(tmp_path)}")
        for i in range(2):
            swarm.start_node(i)
        st = swarm.wait(150)
        assert_run_ok(st, steps, tmp_path)
        bad = peer_of(tmp_path / "node2")
        honest = {peer_of(tmp_path / f"node{i}") for i in range(2)}
        # banned, with the rule that fired persisted
        bans = dict(query(tmp_path, "SELECT peer_id, ban_reason FROM nodes WHERE banned = 1"))
        assert set(bans) == {bad}, f"bans {bans}\n{logs(tmp_path)}"
        assert "log-prob mismatches" in bans[bad]
        rep = json.loads(query(tmp_path, "SELECT rep_state FROM nodes WHERE peer_id = ?", (bad,))[0][0])
        assert rep["mismatches"] >= 3 and rep["banned"], rep
        # it was shut out: re-admission refused for the ban, and it left
        wait_until(lambda: query(tmp_path, "SELECT 1 FROM admissions WHERE peer_id = ? AND admitted = 0 AND code = 'banned'",
                                 (bad,)), 30, "re-admission of the banned node refused")
        wait_until(lambda: hostile.poll() is not None, 20, "banned node exits")
        assert st is not None and st["refused_by_reason"].get("banned", 0) >= 1
        assert {n["peer_id"] for n in st["nodes"]} <= honest
    # the shift is large enough that tolerance never hides it
    assert abs(LOGPROB_SHIFT) > cfg.logprob_tolerance


# not in the README's run (was `ci`): the suite took 706 s on a 2-core machine; forged, replayed
# and duplicated frames are refused by a real hub in test_intake_workers.py and test_batch_intake.py
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_forged_and_replayed_results_are_refused(tmp_path: Path) -> None:
    # The forger joins first and the run is long enough that it is handed tasks before the
    # honest nodes finish the steps on their own: on a quiet machine the two honest nodes ran
    # 40 steps in 3-4 s, before the forger (ready about a second after them) got a task.
    steps = 200
    cfg = small_cfg(steps)
    with LocalSwarm(tmp_path, cfg, n_nodes=2) as swarm:
        swarm.start_hub()
        hostile = start_hostile(swarm, 2, "forge")
        for i in range(2):
            swarm.start_node(i)
        report_path = tmp_path / "node2" / "hostile.json"

        def acted() -> dict[str, Any] | None:
            rep: dict[str, Any] = json.loads(report_path.read_text()) if report_path.exists() else {}
            return rep if len(rep.get("actions", [])) >= 4 else None

        report = wait_until(acted, 120, lambda: f"hostile node acted\n{logs(tmp_path)}")
        st = swarm.wait(120)
        assert_run_ok(st, steps, tmp_path)
        bad = report["peer_id"]
        acts = {a["action"]: a for a in report["actions"]}
        # what the hub answered to each action
        assert acts["replay_exact"]["code"] == "replay", acts
        assert acts["replay_resealed"]["code"] == "meaning" and "duplicate" in acts["replay_resealed"]["message"]
        assert acts["unknown_task"]["code"] == "meaning" and "unknown_task" in acts["unknown_task"]["message"]
        assert acts["other_nodes_task"]["code"] == "meaning" and "task hash" in acts["other_nodes_task"]["message"]
        # what the hub recorded (hub.sqlite results); the exact replay dies at the envelope layer
        rows = query(tmp_path, "SELECT task_id, accepted, reason FROM results WHERE node = ?", (bad,))
        reasons = {(t, r) for t, a, r in rows if not a}
        assert (acts["replay_resealed"]["task_id"], "duplicate") in reasons, rows
        assert (acts["unknown_task"]["task_id"], "unknown_task") in reasons, rows
        assert (report["other_task_id"], "meaning") in reasons, rows
        assert sum(a for _, a, _ in rows) >= 1, "its honest first result was accepted"
        hub_log = (tmp_path / "hub" / "hub.log").read_text()
        assert "[replay]" in hub_log and bad in hub_log
        # forged binding -> banned at once; the replays/unknown id alone do not ban
        bans = dict(query(tmp_path, "SELECT peer_id, ban_reason FROM nodes WHERE banned = 1"))
        assert set(bans) == {bad} and "forged" in bans[bad], bans
        # the other node's task was not taken over: nothing of the hostile node accepted for it
        stolen = query(tmp_path, "SELECT node, accepted FROM results WHERE task_id = ?", (report["other_task_id"],))
        assert all(node != bad for node, acc in stolen if acc), stolen
        assert st is not None
        refused = st["refused_by_reason"]
        assert refused.get("control.replay", 0) >= 1, refused  # the network layer's count of the replay
        assert refused.get("duplicate", 0) >= 1 and refused.get("unknown_task", 0) >= 1 and refused.get("banned", 0) >= 1
        wait_until(lambda: query(tmp_path, "SELECT 1 FROM admissions WHERE peer_id = ? AND admitted = 0 AND code = 'banned'",
                                 (bad,)), 30, "re-admission of the banned node refused")
        wait_until(lambda: hostile.poll() is not None, 20, "banned node exits")


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_corrupt_relay_is_reported_and_banned(tmp_path: Path) -> None:
    # Pipelined broadcast with a hub uplink slow enough that nodes relay, small chunks so a
    # version has many, and a relay that flips a byte of every chunk it forwards and has the
    # fastest uplink as the hub measures it (its claimed 10 GB/s counts for nothing since A10:
    # the honest nodes cap theirs at 20 MB/s, so the planner gives it children once the hub has
    # dialled it back and timed it). Its children find the chunks off the
    # signed manifest, take them from elsewhere and report it; the hub then asks it for a chunk,
    # gets a corrupt one and bans it (A9: the reports alone ban nothing). It joins once the three
    # honest nodes hold a version, so that its first plan gives it children. From its joining to
    # the ban took 8 s (v95 of 100) alone and more than the rest of a 100-step run under CI's load
    # (2026-12-05: reports at v100, the run over before the challenge): 250 steps leave room.
    steps = 250
    cfg = small_cfg(steps, broadcast="pipelined", upload_limit_MBps=20.0, chunk_bytes=64 * 1024)
    with LocalSwarm(tmp_path, cfg, n_nodes=3) as swarm:
        swarm.start_hub()
        for i in range(3):
            swarm.start_node(i, ["--max-upload-MBps", "20"])

        def honest_ready() -> bool:
            st = swarm.status() or {}
            return sum(1 for n in st.get("nodes", []) if n.get("held_version", -1) >= 0) >= 3

        wait_until(honest_ready, 120, lambda: f"three honest nodes hold a version\n{logs(tmp_path)}")
        hostile = start_hostile(swarm, 3, "corrupt")
        wait_until(lambda: (tmp_path / "node3" / "hostile.json").exists(), 60, "hostile node started")
        bad = peer_of(tmp_path / "node3")
        reports = wait_until(
            lambda: query(tmp_path, "SELECT reporter, version, chunk_index FROM relay_reports WHERE accused = ?", (bad,)),
            150,
            lambda: f"no relay report on the corrupt relay\n{logs(tmp_path)}",
        )
        wait_until(lambda: query(tmp_path, "SELECT 1 FROM nodes WHERE peer_id = ? AND banned = 1", (bad,)), 120,
                   lambda: f"the corrupt relay is banned\n{logs(tmp_path)}")
        st = swarm.wait(150)
        assert_run_ok(st, steps, tmp_path)
        honest = {peer_of(tmp_path / f"node{i}") for i in range(3)}
        reports = query(tmp_path, "SELECT reporter, accused FROM relay_reports")
        # only the corrupt relay was reported, and only by honest nodes
        assert {a for _, a in reports} == {bad}, reports
        assert {r for r, _ in reports} <= honest, reports
        bans = dict(query(tmp_path, "SELECT peer_id, ban_reason FROM nodes WHERE banned = 1"))
        assert set(bans) == {bad}, f"bans {bans}\n{logs(tmp_path)}"
        assert "relayed corrupt chunks" in bans[bad]
        assert reports  # the reports made it a suspect; its own corrupt answer to the hub banned it (A9)
        wait_until(lambda: hostile.poll() is not None, 30, "banned node exits")
        # one report suffices since A9 (the hub's own challenge bans; before, a quorum of 2 reporters
        # did): how many arrive before the ban is timing. Each counted report is recorded.
        assert st is not None and 1 <= st["relay_reports"] <= len(reports)
        # every honest node still ends with the final version, verified against the manifest
        held = {n["peer_id"]: n.get("held_version") for n in st["nodes"]}
        assert set(held) <= honest
