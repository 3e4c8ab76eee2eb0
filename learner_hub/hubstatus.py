"""The hub's status: one dict for status.json, the status page and /metrics.

Built on the loop (it reads live state), serialized and written in a thread: the loop never
waits on json or the disk for it. The periodic write (:func:`write_status_in_chunks`) builds the
per-node parts in its thread too and encodes them a few hundred at a time: at 10,000 nodes
building them took the loop ~100 ms and encoding them in one ``json.dumps`` (which holds the
GIL, thread or not) kept the loop from running for ~330 ms (`echo2 bench intake`). The curves
are encoded there too, and only when a point was added (curves.py). What it wrote is kept in
memory (:class:`StatusSnapshot`): the HTTP server serves that, never a status built on the loop
(148 ms of the loop per request at 10,000 nodes).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import trio

from echo2.fsutil import atomic_write

from .ledger import totals_of
from .status_http import StatusSnapshot, json_safe

if TYPE_CHECKING:
    from .fleet import NodeInfo
    from .hub import Hub
    from .ledger import AccountRow


NODES_PER_CHUNK = 250  # one json.dumps of 250 entries: ~0.5 ms of GIL on this machine
PAGE_NODES = 200  # the status page's fleet table shows this many nodes (status_http.render_tables)


def hub_status(hub: Hub, *, with_nodes: bool = True) -> dict[str, Any]:
    """The status; ``with_nodes=False`` leaves "nodes" and "ledger" empty and "curves" out (the
    chunked writer fills them in, off the loop)."""
    st = hub.dispatcher.stats
    tr, fleet = hub.trainer, hub.fleet
    now = time.time()
    hub.curves.update(hub, now)
    latest = hub.publisher.latest_version
    out = {
        "peer_id": hub.identity.peer_id,
        "addrs": hub.addrs,
        "step": tr.learner.version,
        "steps": hub.cfg.steps,
        "staleness": hub.cfg.staleness,
        "task": hub.cfg.task,
        "wall_s": round(now - hub.started, 3),
        "learner_busy_fraction": tr.busy_fraction(),
        "predicted_busy_fraction": fleet.predicted_busy_fraction(),
        "t_train_s": tr.t_train(),
        "learner_memory": hub.memory_plan.as_dict(),
        "results_accepted": st.accepted,
        "rollouts_accepted": st.accepted_rollouts,
        "stale_dropped": st.stale_dropped + tr.buffer.stale_dropped,
        "refused_by_reason": dict(Counter(st.refused_by_reason) + fleet.refusals + edge_refusals(hub)),
        "relay_reports": fleet.relay_reports_received,
        "tasks_issued": st.issued,
        "tasks_expired": st.expired,
        "tasks_declined": st.declined,
        "latest_version": hub.publisher.latest_version,
        "broadcast": hub.publisher.broadcast_metrics(),
        "nodes": [node_entry(hub, n, now, latest) for n in fleet.nodes.values()] if with_nodes else [],
        # the last steps' figures under TRL's names and echo2/ (trainmetrics.py; all of them: the store)
        "train_metrics": list(tr.train_metrics),
        "tracking": tr.tracker.report(),
        # past entries are never changed again; the newest may still get its overhead_s
        "history": tr.history[:-1] + [dict(h) for h in tr.history[-1:]],
        "status_url": hub.status_url,
        "resumed_from": hub.resumed_from,
        "restored_results": hub.restored_results,
        "ledger": hub.ledger.totals(now).as_dict() if with_nodes else {},
        "activation": fleet.last_activation,
        "spot_checks": tr.spot_checks,
        # rows recomputed before a step, and those whose node failed the check (never trained)
        "verification": {"rows_checked": tr.verifier.rows_checked, "rows_rejected": tr.verifier.rows_rejected},
        # the operator's reward functions: completions scored, and those excluded by reason
        "rewards": hub.rewards.report(),
        # the intake workers (intake_pool.py): alive, restarts, results in flight, verdicts by kind, busy refusals
        "intake_pool": hub.intake_pool.report(),
        # evaluations through the swarm: {"history": [{"step", "wall_s", "mean_reward", "accuracy", "n"}...], "latest"}
        "eval": hub.evaluator.report(),
        # replay state by pool: admitted peers' never shares room with strangers' (A3)
        "replay_guards": {
            "admitted": {"entries": len(hub.replay), "max_entries": hub.replay.per_peer * hub.replay.max_peers,
                         "evicted_own": hub.replay.evicted()},  # a fast signer's own oldest nonces (replay.py)
            "gossip": {"entries": len(hub.gossip_replay), "max_entries": hub.gossip_replay.per_peer * hub.gossip_replay.max_peers},
            "unadmitted_admission": {"entries": len(hub.admission_replay), "max_entries": hub.admission_replay.max_entries},
        },
        **hub.loop_lag.report(),
    }
    if with_nodes:
        # the run's curves for the status page (curves.py): bounded, the whole run downsampled
        out["curves"] = hub.curves.as_dict()
    return out


def node_entry(hub: Hub, n: NodeInfo, now: float, latest: int) -> dict[str, Any]:
    fleet, tr = hub.fleet, hub.trainer
    rows = tr.trained_rows[n.peer_id]
    return {
        "peer_id": n.peer_id,
        "held_version": n.held_version,
        # how far its weights are behind the newest version, and its accepted tokens/s lately
        "versions_behind": None if latest < 0 or n.held_version < 0 else latest - n.held_version,
        # mean staleness of its rows that were trained (learner version before the step - theirs)
        "staleness_mean": round(tr.trained_staleness[n.peer_id] / rows, 3) if rows else None,
        **hub.curves.node_rate(hub, n, now),
        "tasks_done": n.tasks_done,
        "rollouts": n.rollouts,
        "tokens": n.tokens,
        "refused": n.refused,
        "price_usd_per_hour": n.announce.price_usd_per_hour,
        "reputation": round(fleet.reputation.score(n.peer_id), 4),
        "state": "paused" if n.paused else "active" if fleet.active is None or n.peer_id in fleet.active else "standby",
        "paused": n.paused,
        "cost_usd": _cost(hub.ledger.row(n.peer_id, now)),
    }


async def write_status_in_chunks(hub: Hub, path: Path, extra: dict[str, Any]) -> None:
    """status.json as :func:`hub_status` | ``extra`` has it, without holding the loop. The loop
    builds the fleet-wide part and snapshots the lists of nodes and ledger accounts; a thread
    builds the per-node entries and ledger totals and encodes them a chunk at a time.

    Why a thread may read live state here: it only reads, the lists it walks are the loop's
    snapshots, and each live figure it reads is one attribute or one dict lookup or copy, which
    the GIL makes atomic (a node that leaves meanwhile is still listed, as it was at the snapshot).
    Its Python code gives the GIL back to the loop every switch interval (5 ms); ``json.dumps``
    does not, so it encodes one chunk per call.
    """
    base = hub_status(hub, with_nodes=False) | extra
    now = time.time()
    base["written_at"] = round(now, 3)
    latest = hub.publisher.latest_version
    nodes, peers = list(hub.fleet.nodes.values()), hub.ledger.peers()
    longest = 0.0  # the longest json.dumps (the GIL held throughout), CPU seconds

    def encode(c: Any) -> str:
        nonlocal longest
        t0 = time.thread_time()
        try:  # strict JSON (a browser's JSON.parse refuses NaN); rarely needed, so tried second
            out = json.dumps(c, allow_nan=False, default=str)
        except ValueError:
            out = json.dumps(json_safe(c), allow_nan=False, default=str)
        longest = max(longest, time.thread_time() - t0)
        return out

    def build_and_write() -> None:
        body: list[str] = []
        shown: list[dict[str, Any]] = []
        states: Counter[str] = Counter()
        for i in range(0, len(nodes), NODES_PER_CHUNK):
            chunk = [node_entry(hub, n, now, latest) for n in nodes[i:i + NODES_PER_CHUNK]]
            shown += chunk[:max(0, PAGE_NODES - len(shown))]
            states.update(e["state"] for e in chunk)
            text = encode(chunk)
            if len(text) > 2:
                body.append(text[1:-1])
        rows = cast("list[AccountRow]", [r for p in peers if (r := hub.ledger.row(p, now)) is not None])
        base.pop("nodes", None)
        base["ledger"] = totals_of(rows).as_dict()
        t0 = time.thread_time()
        curves, curves_text = hub.curves.encoded()  # cached: rebuilt only when a point was added
        last_write["curves_cpu_ms"] = round((time.thread_time() - t0) * 1e3, 3)
        head = encode(base)
        text = (head[:-1] + ", " if len(head) > 2 else "{") + '"curves": ' + curves_text + ', "nodes": [' + ",".join(body) + "]}"
        data = text.encode()
        atomic_write(path, data, durable=False)
        # the page and /metrics read the first nodes and the count by state, not 10,000 entries:
        # keeping those alive between writes would leave the collector more to scan on the loop
        page = base | {"curves": curves, "nodes": shown, "node_count": len(nodes), "node_states": dict(states)}
        hub.status_snapshot = StatusSnapshot(data, page, now)

    await trio.to_thread.run_sync(build_and_write)
    last_write["longest_stretch_ms"] = round(longest * 1e3, 3)


#: figures of the last chunked write (read by `echo2 bench intake`)
last_write: dict[str, float] = {}


def edge_refusals(hub: Hub) -> Counter[str]:
    """Refusals counted by the network layer (control host, data planes), by reason."""
    out: Counter[str] = Counter()
    if hub.host is not None:
        out.update({f"control.{k}": v for k, v in hub.host.refusals.items()})
    for name, srv in (("dataplane", hub.data_server), ("probe", hub.probe_server)):
        if srv is not None:
            out.update({f"{name}.{k}": v for k, v in srv.stats.refusals.items()})
    return out


def write_status_file(path: Path, status: dict[str, Any]) -> None:
    # a status snapshot is rewritten every second: cheap to lose, so no fsync
    atomic_write(path, json.dumps(status), durable=False)


async def write_status(path: Path, status: dict[str, Any]) -> None:
    await trio.to_thread.run_sync(write_status_file, path, status)


def _cost(row: Any) -> float:
    return float(row.cost_usd) if row is not None else 0.0
