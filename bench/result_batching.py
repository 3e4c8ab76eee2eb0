"""Results/s and the mean ResultBatch size of real nodes against a real hub (issue 20): a local
swarm (hub and node processes on 127.0.0.1, the tiny model, the copy task with small tasks) run
for a fixed window per setting, the settings interleaved round by round so a loaded machine's
drift falls on all of them alike.

``python bench/result_batching.py --lingers none,0,2000 --rounds 2 --seconds 45 --json FILE``
(run it by path: ``none`` runs the node without ``--result-linger-ms``, so the same file measures a
tree from before the outbox). Per run: results and rollouts the hub accepted per second in the
window (after the first accepted result), the hub process's CPU per accepted result (from /proc:
it includes the learner's steps), and the nodes' mean batch size (node.state.json; a node from
before the outbox sends one result per request).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from echo2.bench.attack_cpu import process_cpu_s
from echo2.bench.swarm import LocalSwarm
from echo2.learner_hub.config import HubConfig


def one_run(root: Path, linger: str, nodes: int, seconds: float, task_target_s: float) -> dict[str, Any]:
    cfg = HubConfig(task="copy", steps=100_000, staleness=2, seed=0, task_target_s=task_target_s)
    args = [] if linger == "none" else ["--result-linger-ms", linger]
    with LocalSwarm(root, cfg, n_nodes=nodes, node_args=args) as swarm:
        swarm.start()
        assert swarm.hub is not None
        t0 = a0 = r0 = c0 = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            st = swarm.status()
            if st and st.get("results_accepted", 0) >= 1 and t0 is None:
                t0, a0, r0, c0 = time.monotonic(), st["results_accepted"], st["rollouts_accepted"], process_cpu_s(swarm.hub.pid)
            if t0 is not None and st is not None and time.monotonic() - t0 >= seconds:
                break
            time.sleep(0.25)
        else:
            raise RuntimeError(f"no results within 300 s; see {root}")
        assert st is not None and a0 is not None and r0 is not None and c0 is not None and t0 is not None
        wall = time.monotonic() - t0
        cpu = process_cpu_s(swarm.hub.pid) - c0
        accepted = st["results_accepted"] - a0
        sends = sent = 0
        for i in range(nodes):
            ns = json.loads((root / f"node{i}" / "node.state.json").read_text())
            sends += ns.get("result_sends", ns.get("tasks_done", 0))
            sent += ns.get("results_sent", ns.get("tasks_done", 0))
    return {"linger_ms": linger, "nodes": nodes, "window_s": round(wall, 1), "results_accepted": accepted,
            "results_per_s": round(accepted / wall, 3), "rollouts_per_s": round((st["rollouts_accepted"] - r0) / wall, 2),
            "hub_cpu_ms_per_result": round(1e3 * cpu / max(1, accepted), 2),
            "mean_batch": round(sent / sends, 3) if sends else None, "step": st.get("step")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--lingers", default="none,0,2000", help="node --result-linger-ms values; none = flag not given")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=45.0)
    p.add_argument("--task-target-s", type=float, default=0.3)
    p.add_argument("--root", type=Path, default=Path("/tmp/echo2-result-batching"))
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    rows = []
    for r in range(a.rounds):
        for linger in a.lingers.split(","):
            root = a.root / f"r{r}-{linger}"
            row = one_run(root, linger, a.nodes, a.seconds, a.task_target_s) | {"round": r}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
