"""``echo2 bench crash``: SIGKILL the hub at random moments while real nodes send results; count
what was acknowledged against what the restarted hub finds.

One hub process and N node processes on 127.0.0.1 (bench/swarm.py). Each round lets the swarm
run for a random time, SIGKILLs the hub (no shutdown, no final write) and starts it again on the
same port and directory; the nodes re-admit themselves. At the end the swarm is stopped and the
hub's store is read:

* acknowledged: the task ids whose result a node was told "accepted" (each node logs them);
* found: accepted results in the store, and ledger entries (one per accepted result, written in
  the result's own transaction), and the per-node ledger counters the restarted hub resumes from;
* lost: acknowledged but not found. Found but not acknowledged is allowed (the hub committed,
  then died before its answer got out: the node sends it again or the task is reassigned).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_ACK = re.compile(r"result of task (\S+) accepted")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=20, help="hub SIGKILLs (default 20)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--min-s", type=float, default=1.0, help="shortest run of the hub before a kill")
    p.add_argument("--max-s", type=float, default=6.0, help="longest run of the hub before a kill")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def acknowledged(root: Path) -> set[str]:
    """Task ids the nodes under ``root`` were told were accepted."""
    out: set[str] = set()
    for log in root.glob("node*/node.log"):
        out.update(_ACK.findall(log.read_text(errors="replace")))
    return out


def _accepted_so_far(root: Path) -> int:
    return len(acknowledged(root))


def _wait_progress(root: Path, timeout_s: float) -> float | None:
    """Seconds until a node is told of one more accepted result (None: not within the timeout)."""
    t0 = time.monotonic()
    start = _accepted_so_far(root)
    while time.monotonic() - t0 < timeout_s:
        if _accepted_so_far(root) > start:
            return time.monotonic() - t0
        time.sleep(0.5)
    return None


def count_store(hub_dir: Path) -> dict[str, Any]:
    """What a restarted hub finds: accepted results, ledger entries, ledger counters."""
    from echo2.learner_hub.store import HubStore

    with HubStore.in_dir(hub_dir) as st:
        results = st.accepted_task_ids()
        entries = {e[0] for e in st.ledger_entries()}
        counters = sum(r.accepted_results for r in st.load_ledger())
    return {"results": results, "entries": entries, "ledger_accepted_results": counters}


def run_crash(
    root: Path,
    rounds: int,
    *,
    n_nodes: int = 2,
    min_s: float = 1.0,
    max_s: float = 6.0,
    seed: int = 0,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    from echo2.learner_hub.config import HubConfig

    from .swarm import LocalSwarm

    rng = random.Random(seed)
    # fixed ports: the nodes find the restarted hub where they left it
    cfg = HubConfig(task="copy", steps=1_000_000, staleness=1, seed=seed, listen_port=_free_port(),
                    data_port=_free_port(), checkpoint_every=5, prompts_per_step=4, group_size=4)
    kills: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with LocalSwarm(root, cfg, n_nodes=n_nodes) as swarm:
        swarm.start()
        # every kill comes while results flow (the nodes took the restarted hub back), at a random
        # moment after that, so that it can cut through the accept path anywhere
        flowing = _wait_progress(root, 180)
        for r in range(rounds):
            wait = rng.uniform(min_s, max_s)
            time.sleep(wait)
            before = _accepted_so_far(root)
            swarm.kill_hub()
            kills.append({"round": r + 1, "results_flowed_after_s": None if flowing is None else round(flowing, 1),
                          "killed_after_s": round(wait, 2), "acknowledged_so_far": before})
            say(f"round {r + 1}/{rounds}: hub killed {wait:.1f}s into the flow ({before} results acknowledged so far)")
            swarm.start_hub()
            flowing = _wait_progress(root, 120)  # the last hub takes the nodes back too, then stops cleanly
    acked = acknowledged(root)
    found = count_store(root / "hub")
    lost_results = sorted(acked - found["results"])
    lost_entries = sorted(acked - found["entries"])
    report = {
        "rounds": rounds,
        "nodes": n_nodes,
        "wall_s": round(time.monotonic() - t0, 1),
        "acknowledged_results": len(acked),
        "found_results": len(found["results"] & acked),
        "found_results_total": len(found["results"]),
        "found_ledger_entries": len(found["entries"] & acked),
        "found_ledger_entries_total": len(found["entries"]),
        "ledger_accepted_results": found["ledger_accepted_results"],
        "lost_results": len(lost_results),
        "lost_ledger_entries": len(lost_entries),
        "lost_ids": sorted(set(lost_results) | set(lost_entries))[:20],
        "kills": kills,
    }
    return report


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.min_s < 0 or args.max_s < args.min_s:
        raise SystemExit("need --rounds >= 1 and 0 <= --min-s <= --max-s")
    with tempfile.TemporaryDirectory(prefix="echo2-crash-") as tmp:
        root = args.dir if args.dir is not None else Path(tmp)
        rep = run_crash(root, args.rounds, n_nodes=args.nodes, min_s=args.min_s, max_s=args.max_s, seed=args.seed)
    print(
        f"{rep['rounds']} hub SIGKILLs in {rep['wall_s']}s: {rep['acknowledged_results']} results acknowledged to nodes, "
        f"{rep['found_results']} found after restart, {rep['found_ledger_entries']} ledger entries found; "
        f"lost {rep['lost_results']} results, {rep['lost_ledger_entries']} ledger entries"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(rep, indent=1))
    return 0 if rep["lost_results"] == 0 and rep["lost_ledger_entries"] == 0 else 1
