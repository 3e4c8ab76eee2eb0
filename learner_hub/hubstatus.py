"""The hub's status: one dict for status.json, the status page and /metrics.

Built on the loop (it reads live state), serialized and written in a thread: the loop never
waits on json or the disk for it. The periodic write (:func:`write_status_in_chunks`) rebuilds
only the per-node entries that changed (status_nodes.py) and joins the others' cached JSON: at
10,000 nodes rebuilding and encoding every entry each second cost its thread 200-240 ms of CPU a
second with the GIL held, which was the loop's lag at rest. The ledger's totals are running sums
(ledger.py). The curves are encoded there too, and only when a point was added (curves.py). What
it wrote is kept in memory (:class:`StatusSnapshot`): the HTTP server serves that, never a status
built on the loop (148 ms of the loop per request at 10,000 nodes).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from echo2.fsutil import atomic_write, atomic_write_with

from .status_http import StatusSnapshot, json_safe
from .status_lists import StepLists
from .status_nodes import strict_json

if TYPE_CHECKING:
    from .fleet import NodeInfo
    from .hub import Hub
    from .ledger import AccountRow


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
        "predicted_busy_fraction": fleet.predicted_busy_fraction_recent(now),
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


def node_entry(hub: Hub, n: NodeInfo, now: float, latest: int, account: AccountRow | None | bool = True) -> dict[str, Any]:
    """``n``'s entry in status.json; ``account``: its ledger row as of ``now`` (True: read it here)."""
    fleet, tr = hub.fleet, hub.trainer
    rows = tr.trained_rows[n.peer_id]
    row = hub.ledger.row(n.peer_id, now) if account is True else account
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
        "cost_usd": _cost(row),
        # when this entry was built: an entry is rebuilt when its node changes, and at most
        # status_nodes.REFRESH_S after the last build when its rates or cost move with time
        "as_of": round(now, 3),
    }


async def write_status_in_chunks(hub: Hub, path: Path, extra: dict[str, Any]) -> None:
    """status.json as :func:`hub_status` | ``extra`` has it, without holding the loop. The loop
    builds the fleet-wide part, picks the nodes whose entries must be rebuilt (status_nodes.py:
    those that changed, those whose figures move with time and are due, all on a new version or
    step) and copies their ledger accounts; a thread builds and encodes those entries and joins
    every node's cached text into the file.

    Why a thread may read live state here: it only reads, the node records it walks are the
    loop's snapshot, and each live figure it reads is one attribute or one dict lookup or copy,
    which the GIL makes atomic (a node that leaves meanwhile is still listed, as it was at the
    snapshot). Its Python code gives the GIL back to the loop every switch interval (5 ms); one
    entry's encoding, the join and the file's encoding are single C calls (``longest_stretch_ms``).
    """
    base = hub_status(hub, with_nodes=False) | extra
    now = time.time()
    base["written_at"] = round(now, 3)
    latest = hub.publisher.latest_version
    fleet, frags, ledger = hub.fleet, hub.status_nodes, hub.ledger
    live = fleet.nodes
    peers = list(live)  # the file's order: admission order
    changed = fleet.status_changed | ledger.touched | fleet.reputation.changed
    fleet.status_changed.clear()  # in place: each NodeInfo holds this set
    ledger.touched.clear()
    fleet.reputation.changed.clear()
    t0 = time.thread_time()
    todo = [live[p] for p in frags.select(now, peers, changed, (latest, hub.learner.version)) if p in live]
    accounts = ledger.view(now, [n.peer_id for n in todo])
    base["ledger"] = ledger.totals(now).as_dict()
    loop_ms = (time.thread_time() - t0) * 1e3
    longest = 0.0  # the longest single C call (the GIL held throughout), CPU seconds

    def timed(f: Any, *a: Any) -> Any:
        nonlocal longest
        t = time.thread_time()
        out = f(*a)
        longest = max(longest, time.thread_time() - t)
        return out

    def build_and_write() -> None:
        t_build = time.thread_time()
        hub.curves.catch_up()  # before the entries read the node rates
        rows = {r.peer_id: r for r in accounts.rows()}

        def entries() -> Iterator[tuple[dict[str, Any], bool]]:
            for n in todo:
                row = rows.get(n.peer_id)
                yield node_entry(hub, n, now, latest, row), row is not None and row.active and row.price_micro > 0

        nonlocal peers
        frags.update(entries(), now)
        rebuilt = frags.rebuilt
        if late := frags.missing(peers):  # joined without being named in the changes: built now
            frags.update(((node_entry(hub, n, now, latest), False) for p in late if (n := live.get(p)) is not None), now)
            rebuilt += frags.rebuilt
            peers = [p for p in peers if p in frags.text]  # gone meanwhile, never built: not listed
        t1 = time.thread_time()
        curves, curves_text = hub.curves.encoded()  # cached: rebuilt only when a point was added
        last_write["curves_cpu_ms"] = round((time.thread_time() - t1) * 1e3, 3)
        small = {k: v for k, v in base.items() if k not in StepLists.KEYS}
        try:  # strict JSON (a browser's JSON.parse refuses NaN); rarely needed, so tried second
            head = timed(strict_json, small)
        except ValueError:
            head = timed(strict_json, json_safe(small))
        steps = hub.status_lists.members(base)  # cached per entry: status_lists.py
        body = frags.body(peers)  # parts joined apart: none a long C call (NodeFragments.body)
        start = ((head[:-1] + ", " if len(head) > 2 else "{") + (steps + ", " if steps else "")
                 + '"curves": ' + curves_text + ', "nodes": ')
        data = (start.encode(), *body, b"}")  # written, and served, part by part (NodeFragments.body)
        last_write["build_cpu_ms"] = round((time.thread_time() - t_build) * 1e3, 3)
        last_write["entries_rebuilt"] = rebuilt
        atomic_write_with(path, lambda f: f.writelines(data), durable=False)
        # the page and /metrics read the first nodes and the count by state, not 10,000 entries:
        # keeping those alive between writes would leave the collector more to scan on the loop
        page = base | {"curves": curves, "nodes": frags.first(peers, PAGE_NODES), "node_count": len(peers),
                       "node_states": frags.states(peers)}
        hub.status_snapshot = StatusSnapshot(data, page, now)
        frags.forget_absent(peers)

    await trio.to_thread.run_sync(build_and_write)
    last_write["longest_stretch_ms"] = round(longest * 1e3, 3)
    last_write["loop_cpu_ms"] = round(loop_ms, 3)
    for k in ("build_cpu_ms", "entries_rebuilt", "longest_stretch_ms", "loop_cpu_ms"):
        write_max[k] = max(write_max.get(k, 0.0), last_write[k])
    write_max["writes"] = write_max.get("writes", 0) + 1


#: figures of the last chunked write, and the largest of each since a reader cleared it (read by
#: `echo2 bench intake`: ``build_cpu_ms`` the writer thread's CPU for entries, join and encoding;
#: ``loop_cpu_ms`` the loop's share; ``longest_stretch_ms`` the longest single C call, GIL held)
last_write: dict[str, float] = {}
write_max: dict[str, float] = {}


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
