"""Faults with real processes: the hub SIGKILLed and restarted; nodes SIGKILLed and replaced."""

from __future__ import annotations

import socket
import sqlite3
import time
from pathlib import Path

import pytest

from echo2.bench.swarm import LocalSwarm
from echo2.learner_hub.config import HubConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_step(swarm: LocalSwarm, step: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = swarm.status()
        if st and st.get("step", 0) >= step:
            return st
        time.sleep(0.3)
    raise AssertionError(f"step {step} not reached in {timeout_s}s; last status {swarm.status()}")


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_hub_sigkill_and_restart_resumes(tmp_path: Path) -> None:
    steps = 70  # leaves the restarted hub time to see both nodes re-admit and work
    cfg = HubConfig(task="copy", steps=steps, staleness=1, seed=1, exit_when_done=True, checkpoint_every=5,
                    listen_port=free_port(), data_port=free_port())
    with LocalSwarm(tmp_path, cfg, n_nodes=2) as swarm:
        swarm.start()
        before = wait_for_step(swarm, 17, 180)
        swarm.kill_hub()
        db = tmp_path / "hub" / "hub.sqlite"
        with sqlite3.connect(db) as c:
            accepted_before = c.execute("SELECT COUNT(*) FROM results WHERE accepted = 1").fetchone()[0]
        assert accepted_before > 0
        swarm.start_hub()  # same key, same ports, same directory
        st = swarm.wait(300)
    assert st is not None and st.get("final"), f"restarted hub did not finish: {st}"
    # resumed from the last checkpoint (every 5 steps) at or before the kill, not from scratch
    assert st["resumed_from"] is not None and 15 <= st["resumed_from"] <= before["step"] + 5
    steps_seen = [h["step"] for h in st["history"]]
    assert steps_seen == list(range(1, steps + 1)), "a learner step was lost or repeated"
    # nodes reconnected by themselves (re-admission) and worked for the new hub process
    assert len(st["nodes"]) == 2 and all(n["tasks_done"] > 0 for n in st["nodes"])
    with sqlite3.connect(tmp_path / "hub" / "hub.sqlite") as c:
        rows = c.execute("SELECT task_id, trained_step FROM results WHERE accepted = 1").fetchall()
    # every result accepted before the crash is still there; none lost its record
    assert len(rows) >= accepted_before
    ids = [t for t, _ in rows]
    assert len(ids) == len(set(ids)), "a result was recorded twice"
