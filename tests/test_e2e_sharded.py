"""A real swarm whose hub trains with 2 FSDP2 learner ranks (issue 17): one hub process (the ranks
its children, gloo on 127.0.0.1) and one node process run a short copy-task run to the end."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from echo2.bench.swarm import LocalSwarm
from echo2.learner_hub.config import HubConfig


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_swarm_with_two_learner_ranks(tmp_path: Path) -> None:
    steps = 8
    cfg = HubConfig(task="copy", steps=steps, staleness=1, seed=0, exit_when_done=True, learner_procs=2,
                    checkpoint_every=4, prompts_per_step=8, group_size=8)
    with LocalSwarm(tmp_path, cfg, n_nodes=1) as swarm:
        swarm.start()
        st = swarm.wait(180)
    logs = "\n".join(p.read_text()[-3000:] for p in tmp_path.glob("*/*.log"))
    assert st is not None, f"hub wrote no status:\n{logs}"
    assert st.get("final"), f"swarm did not finish its steps:\n{logs}"
    assert st["step"] == steps
    hub_log = "\n".join(p.read_text() for p in tmp_path.glob("hub*/*.log"))
    assert "sharded learner: 2 ranks" in hub_log, hub_log[-3000:]
    # the ranks' full state dicts became the hub's checkpoints (one-process format)
    assert sorted(p.name for p in tmp_path.glob("hub*/checkpoints/step-*.pt")) == ["step-4.pt", "step-8.pt"]
    assert st["nodes"] and st["nodes"][0]["tasks_done"] > 0


def _rank_pids(hub_pid: int) -> list[int]:
    """The hub's spawned children that are learner ranks (not multiprocessing's resource tracker)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == hub_pid and b"spawn_main" in cmd:
            out.append(int(d.name))
    return sorted(out)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_hub_stops_when_a_learner_rank_dies(tmp_path: Path) -> None:
    cfg = HubConfig(task="copy", steps=400, staleness=1, seed=0, exit_when_done=True, learner_procs=2,
                    prompts_per_step=8, group_size=8)
    with LocalSwarm(tmp_path, cfg, n_nodes=1) as swarm:
        swarm.start()
        assert swarm.hub is not None
        st = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and ((st := swarm.status()) is None or st.get("step", 0) < 2):
            time.sleep(0.5)
        assert st is not None and st.get("step", 0) >= 2
        ranks = _rank_pids(swarm.hub.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1], signal.SIGKILL)
        rc = swarm.hub.wait(timeout=90)  # no hang: the hub stops by itself
        hub_log = (tmp_path / "hub" / "hub.log").read_text()
    assert rc != 0
    assert "learner rank" in hub_log and "died" in hub_log, hub_log[-3000:]
    assert not any(Path(f"/proc/{pid}").exists() and b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
                   for pid in ranks), "a learner rank outlived the hub"
