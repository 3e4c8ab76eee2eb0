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
    # each rank wrote its shards of the checkpoints (torch.distributed.checkpoint folders)
    assert sorted(p.name for p in tmp_path.glob("hub*/checkpoints/step-*.pt")) == ["step-4.pt", "step-8.pt"]
    assert len(list(tmp_path.glob("hub*/checkpoints/step-8.dcp/*.distcp"))) == 2
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


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_two_rank_run_resumes_in_one_process(tmp_path: Path) -> None:
    """A hub with 2 learner ranks checkpoints (sharded folders); restarted with learner_procs = 1
    it resumes from them and finishes the run."""
    kw: dict[str, object] = {"task": "copy", "staleness": 1, "seed": 0, "exit_when_done": True,
                             "checkpoint_every": 2, "prompts_per_step": 8, "group_size": 8}
    with LocalSwarm(tmp_path, HubConfig(steps=4, learner_procs=2, **kw), n_nodes=1) as swarm:  # type: ignore[arg-type]
        swarm.start()
        st = swarm.wait(150)
    assert st is not None and st.get("final") and st["step"] == 4
    with LocalSwarm(tmp_path, HubConfig(steps=6, learner_procs=1, **kw), n_nodes=1) as swarm:  # type: ignore[arg-type]
        swarm.start()
        st = swarm.wait(150)
    hub_log = (tmp_path / "hub" / "hub.log").read_text()
    assert st is not None and st.get("final") and st["step"] == 6, hub_log[-3000:]
    assert "resumed from checkpoint at step 4" in hub_log
