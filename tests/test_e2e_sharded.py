"""A real swarm whose hub trains with 2 FSDP2 learner ranks (issue 17): one hub process (the ranks
its children, gloo on 127.0.0.1) and one node process run a short copy-task run to the end."""

from __future__ import annotations

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
