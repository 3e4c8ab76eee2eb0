"""``echo2 bench e2e``: the demo's whole loop once per staleness bound, same seed and step budget.

Dissemination is made costly with an emulated hub uplink (``--link-MBps``), so the synchronous
run (S=0) pays receive + load + generate every step while S>=1 overlaps them with training.
For each S the hub's measured learner busy fraction is set beside the capacity model's
prediction from the same run's measured T_train, D_i, G_i and r_i.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from echo2.bench import plotting


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--staleness", default="0,1,2,4", help="comma list of S values (default 0,1,2,4)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--task", default="copy", choices=["copy", "reverse", "arith"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--link-MBps", type=float, default=20.0, help="emulated hub upload (MB/s, 1 MB = 10^6 B)")
    parser.add_argument("--broadcast", default="star", choices=["star", "pipelined"], help="how versions reach nodes")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=1200.0, help="per run")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)


def run_one(root: Path, s: int, args: argparse.Namespace) -> dict[str, Any]:
    from echo2.bench.demo import summarize
    from echo2.bench.swarm import LocalSwarm
    from echo2.learner_hub.config import HubConfig

    cfg = HubConfig(task=args.task, steps=args.steps, staleness=s, seed=args.seed, exit_when_done=True,
                    upload_limit_MBps=args.link_MBps, broadcast=args.broadcast)
    t0 = time.monotonic()
    with LocalSwarm(root / f"S{s}", cfg, args.nodes) as swarm:
        swarm.start()
        st = swarm.wait(args.timeout)
    wall = time.monotonic() - t0
    if not st or not st.get("final"):
        raise SystemExit(f"run with S={s} did not finish; see {root / f'S{s}'}")
    rep = summarize(st, args.nodes, args.steps, s, args.task, wall)
    hist = st.get("history", [])
    train_wall = hist[-1]["t"] - hist[0]["t"] + hist[0]["train_s"] if hist else 0.0
    return {
        "staleness": s,
        "wall_s": round(wall, 2),
        "train_wall_s": round(train_wall, 2),
        "learner_busy_fraction": round(float(st.get("learner_busy_fraction", 0.0)), 4),
        "predicted_busy_fraction": round(float(st.get("predicted_busy_fraction", 0.0)), 4),
        "t_train_s": st.get("t_train_s"),
        "reward_first": rep["reward_first"],
        "reward_last": rep["reward_last"],
        "stale_dropped": st.get("stale_dropped", 0),
        "results_accepted": st.get("results_accepted", 0),
        "broadcast_last_node_s": (st.get("broadcast") or {}).get("last_node_s_median"),
        "loop_lag_p99_ms": rep["loop_lag_p99_ms"],
        "loop_lag_max_ms": rep["loop_lag_max_ms"],
        "curve": [(h["t"], h["reward"]) for h in hist],
    }


def run(args: argparse.Namespace) -> int:
    if args.plot:
        plotting.require()
    values = [int(v) for v in str(args.staleness).split(",") if v.strip()]
    root = args.dir or Path(tempfile.mkdtemp(prefix="echo2-e2e-"))
    rows = []
    for s in values:
        print(f"S={s}: {args.steps} steps, {args.nodes} nodes, hub uplink {args.link_MBps:g} MB/s ...", flush=True)
        rows.append(run_one(root, s, args))
        r = rows[-1]
        print(f"  wall {r['wall_s']:.1f}s  busy {r['learner_busy_fraction']:.3f} (predicted {r['predicted_busy_fraction']:.3f})  "
              f"reward {r['reward_first']:.3f} -> {r['reward_last']:.3f}  stale dropped {r['stale_dropped']}  "
              f"broadcast last node {r['broadcast_last_node_s']}", flush=True)
    print(f"\n{'S':>3} {'wall_s':>8} {'busy':>6} {'pred':>6} {'reward_last':>12} {'stale':>6} {'bcast_s':>8}")
    for r in rows:
        b = r["broadcast_last_node_s"]
        print(f"{r['staleness']:>3} {r['wall_s']:>8.1f} {r['learner_busy_fraction']:>6.3f} {r['predicted_busy_fraction']:>6.3f} "
              f"{r['reward_last']:>12.3f} {r['stale_dropped']:>6} {b if b is None else round(b, 3)!s:>8}")
    out = {"nodes": args.nodes, "steps": args.steps, "link_MBps": args.link_MBps, "broadcast": args.broadcast, "task": args.task, "seed": args.seed,
           "results": [{k: v for k, v in r.items() if k != "curve"} for r in rows]}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
        print(f"report: {args.json}")
    if args.plot:
        plotting.e2e_figure(rows, args.plot)
        print(f"plot: {args.plot}")
    return 0
