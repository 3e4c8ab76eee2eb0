"""``echo2 demo``: an embedded local swarm (one hub, N node processes) that learns a toy task."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from echo2.bench import plotting


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=2, help="node processes (default 2)")
    parser.add_argument("--steps", type=int, default=300, help="learner steps (default 300)")
    parser.add_argument("--staleness", type=int, default=1, help="staleness bound S (default 1)")
    parser.add_argument("--task", default="copy", choices=["copy", "reverse", "arith"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--link-MBps", type=float, default=0.0, help="emulated hub upload limit (0 = none)")
    parser.add_argument("--broadcast", default="star", choices=["star", "pipelined"], help="how versions reach nodes")
    parser.add_argument("--dir", type=Path, default=None, help="keep the swarm's files here (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of reward against step and wall time")
    parser.set_defaults(func=run)


def summarize(st: dict[str, Any], nodes: int, steps: int, staleness: int, task: str, wall_s: float) -> dict[str, Any]:
    hist = st.get("history", [])
    k = max(1, len(hist) // 10)
    rewards = [h["reward"] for h in hist]
    return {
        "nodes": nodes,
        "steps": len(hist),
        "steps_asked": steps,
        "staleness": staleness,
        "task": task,
        "reward_first": sum(rewards[:k]) / k if rewards else 0.0,
        "reward_last": sum(rewards[-k:]) / k if rewards else 0.0,
        "wall_s": round(wall_s, 2),
        "learner_busy_fraction": st.get("learner_busy_fraction", 0.0),
        "stale_dropped": st.get("stale_dropped", 0),
        "results_accepted": st.get("results_accepted", 0),
        "refused_by_reason": st.get("refused_by_reason", {}),
        "broadcast_last_node_s_median": (st.get("broadcast") or {}).get("last_node_s_median"),
        # the hub's trio loop health (None from a hub that does not report it)
        "loop_lag_p99_ms": st.get("loop_lag_p99_ms"),
        "loop_lag_max_ms": st.get("loop_lag_max_ms"),
        "history": hist,
    }


def run(args: argparse.Namespace) -> int:
    from echo2.bench.swarm import LocalSwarm
    from echo2.learner_hub.config import HubConfig

    if args.plot:
        plotting.require()
    root = args.dir or Path(tempfile.mkdtemp(prefix="echo2-demo-"))
    cfg = HubConfig(
        task=args.task,
        steps=args.steps,
        staleness=args.staleness,
        seed=args.seed,
        exit_when_done=True,
        upload_limit_MBps=args.link_MBps,
        broadcast=args.broadcast,
    )
    tty = sys.stdout.isatty()
    print(f"echo2 demo: hub + {args.nodes} nodes on 127.0.0.1, task {args.task}, {args.steps} steps, S={args.staleness}")
    print(f"files and logs in {root}")
    last_print = [0.0]

    def progress(st: dict[str, Any]) -> None:
        now = time.monotonic()
        if not tty and now - last_print[0] < 5:
            return
        last_print[0] = now
        hist = st.get("history", [])
        r = sum(h["reward"] for h in hist[-10:]) / max(1, len(hist[-10:]))
        versions = ",".join(str(n["held_version"]) for n in st.get("nodes", []))
        line = (f"step {st.get('step', 0):4d}/{args.steps}  reward {r:5.3f}  busy {st.get('learner_busy_fraction', 0):4.2f}  "
                f"node versions [{versions}]  stale dropped {st.get('stale_dropped', 0)}")
        print(("\r" + line) if tty else line, end="" if tty else "\n", flush=True)

    t0 = time.monotonic()
    with LocalSwarm(root, cfg, args.nodes) as swarm:
        swarm.start()
        st = swarm.wait(args.timeout, progress)
    wall = time.monotonic() - t0
    if tty:
        print()
    if not st or not st.get("history"):
        print(f"the swarm produced no learner steps; see the logs in {root}")
        return 1
    report = summarize(st, args.nodes, args.steps, args.staleness, args.task, wall)
    print(
        f"done: {report['steps']} steps in {report['wall_s']:.0f}s; reward {report['reward_first']:.3f} -> "
        f"{report['reward_last']:.3f}; learner busy {report['learner_busy_fraction']:.2f}; "
        f"{report['results_accepted']} results accepted, {report['stale_dropped']} stale dropped"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        print(f"report: {args.json}")
    if args.plot:
        plotting.demo_figure(report, args.plot)
        print(f"plot: {args.plot}")
    return 0 if st.get("final") else 1
