"""A real swarm: one hub process and two node processes on 127.0.0.1 learn the copy task."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from echo2.bench.demo import summarize
from echo2.bench.swarm import LocalSwarm
from echo2.learner_hub.config import HubConfig


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_swarm_learns_copy(tmp_path: Path) -> None:
    steps = 120
    cfg = HubConfig(task="copy", steps=steps, staleness=1, seed=0, exit_when_done=True)
    pages: dict[str, str] = {}

    def fetch_pages(status: dict) -> None:
        url = status.get("status_url")
        if url and status.get("step", 0) >= 5 and not pages:
            for path in ("", "status.json", "metrics"):
                with urllib.request.urlopen(url + path, timeout=10) as resp:
                    assert resp.status == 200
                    pages[path] = resp.read().decode()

    with LocalSwarm(tmp_path, cfg, n_nodes=2) as swarm:
        swarm.start()
        st = swarm.wait(360, fetch_pages)
    assert st is not None, "hub wrote no status"
    logs = "\n".join(p.read_text()[-3000:] for p in tmp_path.glob("*/*.log"))
    assert st.get("final"), f"swarm did not finish its steps:\n{logs}"
    report = summarize(st, 2, steps, 1, "copy", 0.0)
    assert report["steps"] == steps
    # both nodes contributed and hold recent versions
    assert len(st["nodes"]) == 2 and all(n["tasks_done"] > 0 for n in st["nodes"])
    assert report["results_accepted"] > 0
    # the running hub served its status page, JSON status and Prometheus metrics over HTTP
    assert "<html" in pages[""].lower() and "echo2" in pages[""]
    assert json.loads(pages["status.json"])["steps"] == steps
    assert "# TYPE" in pages["metrics"] and "echo2_" in pages["metrics"]
    # learning: a clear rise from random init within the budget
    assert report["reward_last"] >= 2 * report["reward_first"] + 0.1, report
