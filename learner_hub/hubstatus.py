"""The hub's status: one dict for status.json, the status page and /metrics.

Built on the loop (it reads live state), serialized and written in a thread: the loop never
waits on json or the disk for it.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from echo2.fsutil import atomic_write

if TYPE_CHECKING:
    from .hub import Hub


def hub_status(hub: Hub) -> dict[str, Any]:
    st = hub.dispatcher.stats
    tr, fleet = hub.trainer, hub.fleet
    now = time.time()
    hub.curves.update(hub, now)
    rates = hub.curves.node_rates(hub, now)
    latest = hub.publisher.latest_version
    return {
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
        "nodes": [
            {
                "peer_id": n.peer_id,
                "held_version": n.held_version,
                # how far its weights are behind the newest version, and its accepted tokens/s lately
                "versions_behind": None if latest < 0 or n.held_version < 0 else latest - n.held_version,
                # mean staleness of its rows that were trained (learner version before the step - theirs)
                "staleness_mean": round(tr.trained_staleness[n.peer_id] / rows, 3) if (rows := tr.trained_rows[n.peer_id]) else None,
                **rates.get(n.peer_id, {}),
                "tasks_done": n.tasks_done,
                "rollouts": n.rollouts,
                "tokens": n.tokens,
                "refused": n.refused,
                "price_usd_per_hour": n.announce.price_usd_per_hour,
                "reputation": round(fleet.reputation.score(n.peer_id), 4),
                "state": "active" if fleet.active is None or n.peer_id in fleet.active else "standby",
                "cost_usd": _cost(hub.ledger.row(n.peer_id, now)),
            }
            for n in fleet.nodes.values()
        ],
        # the last steps' figures under TRL's names and echo2/ (trainmetrics.py; all of them: the store)
        "train_metrics": list(tr.train_metrics),
        "tracking": tr.tracker.report(),
        # past entries are never changed again; the newest may still get its overhead_s
        "history": tr.history[:-1] + [dict(h) for h in tr.history[-1:]],
        "status_url": hub.status_url,
        "resumed_from": hub.resumed_from,
        "restored_results": hub.restored_results,
        "ledger": hub.ledger.totals(now).as_dict(),
        "activation": fleet.last_activation,
        "spot_checks": tr.spot_checks,
        # rows recomputed before a step, and those whose node failed the check (never trained)
        "verification": {"rows_checked": tr.verifier.rows_checked, "rows_rejected": tr.verifier.rows_rejected},
        # the operator's reward functions: completions scored, and those excluded by reason
        "rewards": hub.rewards.report(),
        # evaluations through the swarm: {"history": [{"step", "wall_s", "mean_reward", "accuracy", "n"}...], "latest"}
        "eval": hub.evaluator.report(),
        # the run's curves for the status page (curves.py): bounded, the whole run downsampled
        "curves": hub.curves.as_dict(),
        # replay state by pool: admitted peers' never shares room with strangers' (A3)
        "replay_guards": {
            "admitted": {"entries": len(hub.replay), "max_entries": hub.replay.per_peer * hub.replay.max_peers},
            "gossip": {"entries": len(hub.gossip_replay), "max_entries": hub.gossip_replay.per_peer * hub.gossip_replay.max_peers},
            "unadmitted_admission": {"entries": len(hub.admission_replay), "max_entries": hub.admission_replay.max_entries},
        },
        **hub.loop_lag.report(),
    }


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
