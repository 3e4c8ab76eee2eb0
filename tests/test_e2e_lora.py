"""Issue 17 item 3 end to end: a hub training LoRA adapters and two node processes on 127.0.0.1,
the tiny model. Nodes apply every adapter version through peft, their rows pass verification,
and each version after the first costs a few per cent of version 0's bytes."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from echo2.bench.swarm import LocalSwarm
from echo2.learner_hub.config import HubConfig, LoraSpec


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_swarm_trains_lora_adapters(tmp_path: Path) -> None:
    steps = 12
    # 64 KiB chunks: the tiny model's base spans many chunks, as a real model's does at 2 MiB
    cfg = HubConfig(task="copy", steps=steps, staleness=1, seed=0, exit_when_done=True, prompts_per_step=4,
                    group_size=8, lr=3e-3, lora=LoraSpec(r=4, alpha=8), chunk_bytes=64 * 1024, full_every=5)
    with LocalSwarm(tmp_path, cfg, n_nodes=2) as swarm:
        swarm.start()
        st = swarm.wait(240)
    logs = "\n".join(p.read_text()[-3000:] for p in tmp_path.glob("*/*.log"))
    assert st is not None and st.get("final"), f"swarm did not finish its steps:\n{logs}"
    assert len(st["nodes"]) == 2 and all(n["tasks_done"] > 0 for n in st["nodes"]), st["nodes"]
    node_logs = [p.read_text() for p in tmp_path.glob("node*/node.log")]
    # every node ran adapter versions past 0 (loaded through peft: the engine refuses a mismatch)
    assert all("holds version" in t and "holds version 0 " in t for t in node_logs)
    assert all(any(f"holds version {v} " in t for v in range(3, steps + 1)) for t in node_logs), logs
    assert "could not be loaded" not in "".join(node_logs)
    db = sqlite3.connect(tmp_path / "hub" / "hub.sqlite")
    try:
        versions = dict(db.execute("SELECT version, encoded_bytes FROM versions").fetchall())
        banned = db.execute("SELECT COUNT(*) FROM nodes WHERE banned = 1").fetchone()[0]
        trained = db.execute("SELECT COUNT(*) FROM results").fetchone()[0]
    finally:
        db.close()
    assert versions[0] > 0 and len(versions) == steps + 1
    # snapshots (5, 10) included: the frozen base stays zero deltas
    assert max(versions[v] for v in range(1, steps + 1)) <= 0.05 * versions[0], versions
    hub_log = (tmp_path / "hub" / "hub.log").read_text()
    assert "verification: rows of" not in hub_log and banned == 0  # honest nodes' LoRA rows all passed
    assert trained > 0
