"""Issue 20, a real node's batched results: a real hub process (one intake worker, the tiny model)
and a real node process on 127.0.0.1. The node keeps generating while its outbox delivers, its
lingering results go in ResultBatches of more than one, and the hub's intake worker is killed
while it checks one of them: the hub answers ``busy``, the node keeps the result and sends it
again. Every result ends acknowledged exactly once (the node's receipts and the hub's store name
the same task ids, once each), and none is lost or refused."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import pytest

from echo2.bench.swarm import LocalSwarm
from echo2.learner_hub.config import HubConfig
from echo2.node.receipts import read_records

TASKS = 14
# the intake worker's reward function sleeps while the flag file exists, so that the test can
# kill the worker while it is checking a result (module level: the worker loads it by name)
REWARD = '''
import os, time
def reward(completions, **_):
    if os.path.exists({flag!r}):
        time.sleep(3.0)
    return [0.5] * len(completions)
'''


def _wait(what: str, cond, timeout_s: float, swarm: LocalSwarm, root: Path) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return
        if swarm.hub is not None and swarm.hub.poll() is not None:
            break
        time.sleep(0.2)
    pytest.fail(f"{what} not seen in {timeout_s} s\nhub:\n{(root / 'hub' / 'hub.log').read_text()[-2000:]}\n"
                f"node:\n{(root / 'node0' / 'node.log').read_text()[-3000:] if (root / 'node0' / 'node.log').exists() else ''}")


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_node_batches_results_and_loses_none_across_a_busy_hub(tmp_path: Path) -> None:
    flag = tmp_path / "slow.flag"
    flag.touch()
    (tmp_path / "nbreward.py").write_text(REWARD.format(flag=str(flag)))
    # small tasks (~0.3 s each): a 2 s linger lets a finished result wait for the next one
    cfg = HubConfig(task="copy", steps=10_000, staleness=2, seed=0, task_target_s=0.3, intake_workers=1,
                    reward_funcs=[f"{tmp_path / 'nbreward.py'}:reward"])
    node_dir = tmp_path / "node0"
    with LocalSwarm(tmp_path, cfg, n_nodes=0, node_args=["--result-linger-ms", "2000", "--max-tasks", str(TASKS)]) as swarm:
        swarm.start()
        node = swarm.start_node(0)

        def pool() -> dict:  # type: ignore[type-arg]
            return (swarm.status() or {}).get("intake_pool") or {}

        # the first result sits in the worker's (sleeping) reward function: kill the worker
        _wait("a result in the intake worker", lambda: pool().get("in_flight", 0) >= 1, 180, swarm, tmp_path)
        os.kill(pool()["pids"][0], signal.SIGKILL)
        flag.unlink()
        try:
            node.wait(timeout=240)
        except Exception:
            pytest.fail("node did not finish its tasks:\n" + (node_dir / "node.log").read_text()[-3000:])
        _wait("the restart in the hub's status", lambda: pool().get("restarts", 0) >= 1, 20, swarm, tmp_path)
        p = pool()
        hub_dir = tmp_path / "hub"
        with sqlite3.connect(hub_dir / "hub.sqlite") as db:
            peer = json.loads((node_dir / "node.state.json").read_text())["peer_id"]
            rows = db.execute("SELECT task_id, accepted FROM results WHERE node = ?", (peer,)).fetchall()
    state = json.loads((node_dir / "node.state.json").read_text())
    log = (node_dir / "node.log").read_text()
    # the hub refused one result as busy (its worker died) and restarted the worker ...
    assert p["busy_by_reason"].get("worker_died", 0) >= 1 and p["verdicts"].get("busy", 0) >= 1, p
    # ... and the node kept it and sent it again
    assert state["results_retried"] >= 1 and "retry 1" in log, state
    # batches of more than one result went over the channel
    sizes = {int(k): v for k, v in state["batch_sizes"].items()}
    assert max(sizes) >= 2 and state["mean_batch"] > 1.0, state
    # every result acknowledged exactly once, none lost, none refused
    assert state["tasks_done"] == TASKS and state["results_refused"] == 0 and state["results_expired"] == 0, state
    assert state["outbox_waiting"] == 0 and not list((node_dir / "outbox").glob("*.result"))
    receipts = [r.receipt for r in read_records(node_dir / "receipts.bin")[0] if r.receipt is not None]
    receipted = [t for r in receipts for t in r.task_ids]
    accepted = [t for t, ok in rows if ok]
    assert len(receipted) == len(set(receipted)) == TASKS
    assert sorted(accepted) == sorted(receipted) and all(ok for _, ok in rows), rows
    assert state["results_sent"] == TASKS + state["results_retried"]
    print(f"node: {TASKS} results in {state['result_sends']} sends, batch sizes {state['batch_sizes']}, "
          f"{state['results_retried']} retried; hub pool: {p}")
