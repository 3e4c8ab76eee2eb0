"""``echo2 bench fuzz``: hostile peers against a real training swarm on 127.0.0.1.

A real LocalSwarm (hub + 2 honest node processes, tiny model, copy task) trains while attackers
in this process hit every port the hub and the nodes listen on:

- libp2p control protocols of the hub (admission, work, result, decline, holds, probe): random
  bytes, mutated valid envelopes, envelopes signed by a key other than the stream's peer,
  replayed envelopes, forged results from an admitted attacker, oversized and truncated frames;
- GossipSub announce topic: random, malformed and oversized messages, faster than allowed;
- the hub's policy data plane and probe data plane: garbage before the handshake, a bad
  signature, garbage frames after it, oversized frame headers, truncated frames;
- the status HTTP port: garbage, wrong methods, oversized heads;
- the nodes' libp2p port: raw garbage, unknown protocols;
- one short flood burst beyond every limit (requests, connections, HTTP).

Each attacker is paced (the point is hostile input, not starving a 2-core machine of CPU).
Measured: hub and nodes alive, their RSS over time, learner steps and honest tasks during the
attack, refusals by reason (hub status.json, hub /metrics, what the attackers were told).

The nodes' libp2p listen port is found from /proc (the listening sockets of the node process),
since the node does not publish it in its state file.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from echo2.bench.fuzz_attacks import Fuzz
from echo2.bench.fuzz_observe import hub_log_refusals, scrape_metrics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=60.0, help="attack duration (default 60)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nodes", type=int, default=2, help="honest node processes (default 2)")
    parser.add_argument("--startup-timeout", type=float, default=240.0, help="wait this long for honest progress")
    parser.add_argument("--dir", type=Path, default=None, help="keep the swarm's files here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")


def fuzz_swarm(root: Path, seconds: float, seed: int = 0, n_nodes: int = 2, startup_timeout_s: float = 240.0) -> dict[str, Any]:
    """Start a swarm under ``root``, attack it for ``seconds`` once it makes progress, report."""
    import trio

    from echo2.bench.swarm import LocalSwarm
    from echo2.learner_hub.config import HubConfig

    cfg = HubConfig(steps=1_000_000, prompts_per_step=4, group_size=4, max_new_tokens=4, staleness=2,
                    task="copy", seed=seed, checkpoint_every=50)
    with LocalSwarm(root, cfg, n_nodes, threads=1) as swarm:
        swarm.start()
        assert swarm.hub is not None
        deadline = time.monotonic() + startup_timeout_s
        fz = Fuzz(root, seconds, seed, swarm.hub.pid, [p.pid for p in swarm.nodes])
        while time.monotonic() < deadline:
            if fz.honest_tasks() >= n_nodes and fz.hub_step() >= 1:
                break
            if swarm.hub.poll() is not None:
                raise RuntimeError("hub exited during start-up")
            time.sleep(1.0)
        else:
            raise TimeoutError(f"no honest progress within {startup_timeout_s:g}s")
        fz.discover()
        step0, tasks0 = fz.hub_step(), fz.honest_tasks()
        t0 = time.monotonic()
        trio.run(fz.run)
        attack_s = time.monotonic() - t0
        # progress is read a little after the attack: status.json is written once a second
        time.sleep(2.0)
        step1, tasks1 = fz.hub_step(), fz.honest_tasks()
        hub_alive = swarm.hub.poll() is None
        nodes_alive = [p.poll() is None for p in swarm.nodes]
        status = swarm.status() or {}
        metrics = scrape_metrics(fz.status_port) if fz.status_port else {}
        hub_rss = fz.rss["hub"] or [0.0]
        report: dict[str, Any] = {
            "seconds": round(attack_s, 1),
            "seed": seed,
            "targets": {
                "hub": fz.hub_addr, "hub_data_port": fz.hub_data_port, "probe_data_port": fz.probe_port,
                "status_port": fz.status_port, "node_addrs": fz.node_addrs,
            },
            "attacks_sent": dict(sorted(fz.sent.items())),
            "attacks_sent_total": sum(fz.sent.values()),
            "refusals_by_reason": {
                "hub_status": status.get("refused_by_reason", {}),
                "hub_metrics": metrics,
                "hub_log": hub_log_refusals(root / "hub" / "hub.log"),
                "attackers_saw": dict(sorted(fz.saw.items())),
            },
            "attacker_errors": dict(fz.errors),
            "hub_alive": hub_alive,
            "nodes_alive": nodes_alive,
            "hub_rss_max_MB": round(max(hub_rss), 1),
            "hub_rss_growth_MB": round(hub_rss[-1] - hub_rss[0], 1),
            "node_rss_max_MB": [round(max(fz.rss[f"node{i}"] or [0.0]), 1) for i in range(n_nodes)],
            "node_rss_growth_MB": [
                round((fz.rss[f"node{i}"] or [0.0])[-1] - (fz.rss[f"node{i}"] or [0.0])[0], 1) for i in range(n_nodes)
            ],
            "steps_during_attack": step1 - step0,
            "honest_tasks_during_attack": tasks1 - tasks0,
        }
        return report


def run(args: argparse.Namespace) -> int:
    root = args.dir or Path(tempfile.mkdtemp(prefix="echo2-fuzz-"))
    report = fuzz_swarm(Path(root), args.seconds, args.seed, args.nodes, args.startup_timeout)
    print(f"echo2 fuzz: {report['seconds']} s of attack on hub + {args.nodes} nodes ({root})")
    print(f"  attacks sent        {report['attacks_sent_total']}")
    for k, v in report["attacks_sent"].items():
        print(f"    {k:36s} {v}")
    print("  hub refusals (status.json)")
    for k, v in sorted(report["refusals_by_reason"]["hub_status"].items()):
        print(f"    {k:36s} {v}")
    print("  attackers were told")
    for k, v in report["refusals_by_reason"]["attackers_saw"].items():
        print(f"    {k:36s} {v}")
    print(f"  hub alive {report['hub_alive']}, nodes alive {report['nodes_alive']}")
    print(f"  hub RSS max {report['hub_rss_max_MB']} MB, growth {report['hub_rss_growth_MB']} MB")
    print(f"  learner steps during attack {report['steps_during_attack']}, "
          f"honest tasks during attack {report['honest_tasks_during_attack']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    ok = report["hub_alive"] and all(report["nodes_alive"])
    return 0 if ok else 1
