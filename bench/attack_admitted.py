"""Attacks by admitted nodes (A5, A6, A9, A10): the hub's open admission lets anyone in, so an
attacker joins under throwaway keys and then lies: about its rows (a real node process,
:mod:`echo2.bench.attack_liar`), its rate and price, a peer's chunks, its own address."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from echo2.bench.attack_common import RssPeak, admit, announce
from echo2.bench.attack_swarm import attacker_source
from echo2.bench.fuzz_observe import read_json

if TYPE_CHECKING:
    from echo2.bench.attack import Ctx, Effect


def _node_entry(status: dict[str, Any], peer: str) -> dict[str, Any]:
    for n in status.get("nodes", []):
        if n.get("peer_id") == peer:
            return dict(n)
    return {}


def _counters(status: dict[str, Any]) -> dict[str, Any]:
    """Status figures about checking rows, if the hub publishes any."""
    keys = ("spot", "verif", "forg", "mismatch", "check")
    return {k: v for k, v in status.items() if any(w in k.lower() for w in keys) and isinstance(v, (int, float, dict))}


# --- A5 -------------------------------------------------------------------------------------------


def _trained_rows(db_path: Path, task_ids: list[str]) -> tuple[int, int]:
    """(rows of these tasks a GRPO step trained, rows dropped unverified), from the hub's store
    (read-only; WAL lets a reader look while the hub writes)."""
    import sqlite3

    if not task_ids or not db_path.exists():
        return 0, 0
    q = ",".join("?" * len(task_ids))
    with contextlib.closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=10)) as db:
        trained = db.execute(f"SELECT COALESCE(SUM(rollouts), 0) FROM results WHERE accepted = 1 AND trained_step IS NOT NULL"
                             f" AND task_id IN ({q})", task_ids).fetchone()[0]
        dropped = db.execute(f"SELECT COALESCE(SUM(rollouts), 0) FROM results WHERE accepted = 1 AND trained_step IS NULL"
                             f" AND reason != 'accepted' AND task_id IN ({q})", task_ids).fetchone()[0]
    return int(trained), int(dropped)



async def a5_forged_rows(ctx: Ctx) -> Effect:
    """A real node that answers honestly once per version, then forges log-probs and finish
    reasons. Effect: forged rows the hub accepted into training (they reach a gradient)."""
    from echo2.bench.swarm import _child_env

    h = ctx.h
    d = h.root / f"liar-{int(time.time())}"
    d.mkdir(parents=True)
    log = open(d / "node.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "echo2.bench.attack_liar", "--hub", h.swarm.hub_addr, "--data-dir", str(d)],
                            stdout=log, stderr=subprocess.STDOUT, env=_child_env(1))
    try:
        ready = False
        with trio.move_on_after(90):
            while not ready:
                # from its admission on: its first results (honest, then forged) come seconds later
                ready = bool((read_json(d / "node.state.json") or {}).get("admitted"))
                if proc.poll() is not None:
                    return f"not measured: the liar exited ({proc.returncode}); see {d / 'node.log'}", None
                await trio.sleep(0.5)
        if not ready:
            return "not measured: the liar was not admitted within 90 s", None
        peer = str((read_json(d / "liar.json") or {}).get("peer_id", ""))
        st0 = h.status()
        rep0 = read_json(d / "liar.json") or {}
        await ctx.window()
        await trio.sleep(1.5)  # the step that trains the last accepted rows
        st1 = h.status()
        rep1 = read_json(d / "liar.json") or {}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
    # A forged result the hub acknowledged reached a gradient only if the store marks its task
    # trained (a batch that fails verification is dropped before the step: reason 'mismatch').
    new_ids = [t for t in rep1.get("forged_task_ids", []) if t not in set(rep0.get("forged_task_ids", []))]
    forged, dropped = _trained_rows(h.root / "hub" / "hub.sqlite", new_ids)
    node1 = _node_entry(st1, peer)
    effect: dict[str, Any] = {
        "forged_rows_reached_training": forged,
        "forged_rows_acknowledged": int(rep1.get("forged_rows_accepted", 0)) - int(rep0.get("forged_rows_accepted", 0)),
        "forged_rows_dropped_by_verification": dropped,
        "forged_rows_sent": sum(int(v) for k, v in rep1.items() if k.startswith("forged_rows")) - sum(
            int(v) for k, v in rep0.items() if k.startswith("forged_rows")),
        "liar": {k: v for k, v in rep1.items() if k not in ("updated",)},
        "liar_at_hub": {k: node1.get(k) for k in ("rollouts", "refused", "reputation", "state")},
        "liar_banned": not node1 or node1.get("state") == "banned",
        "spot_checks": (st0.get("spot_checks"), st1.get("spot_checks")),
        "hub_check_counters": _counters(st1),
    }
    if effect["forged_rows_sent"] == 0:
        return effect, None  # no forged result was sent in the window: nothing was prevented
    return effect, forged == 0


# --- A6 -------------------------------------------------------------------------------------------


class Claimer:
    """An admitted node that claims a rate it does not have, reports holding every version
    (HoldsVersion is believed), polls for work and never answers it."""

    def __init__(self, ctx: Ctx, claimed_rate: float, price: float, extra: dict[str, Any] | None = None,
                 hold_versions: bool = True) -> None:
        self.ctx = ctx
        self.extra = extra or {}
        self.hold_versions = hold_versions
        self.rate = claimed_rate
        self.price = price
        self.tasks = 0
        self.groups = 0
        self.seen: Counter[str] = Counter()
        self.peer = ""
        self.host: Any = None

    async def run(self, reprice_at: float | None = None, new_price: float = 0.0) -> None:
        from echo2.protocol import envelope, wire
        from echo2.protocol.errors import Echo2Error
        from echo2.protocol.identity import Identity
        from echo2.protocol.messages import ErrorReply, Heartbeat, HoldsVersion, Task
        from echo2.protocol.net.control import ANNOUNCE_TOPIC, ControlHost

        fz, h = self.ctx.fz, self.ctx.h
        ident = Identity.generate()
        self.peer = ident.peer_id
        claims = dict(rollouts_per_s=self.rate, tokens_per_s=min(self.rate * 8, 1e308), price_usd_per_hour=self.price,
                      upload_MBps=100.0, download_MBps=100.0)
        claims.update(self.extra)
        async with ControlHost(ident, dial_timeout_s=5) as host:
            self.host = host
            try:
                d = await admit(host, fz.hub_addr, **claims)
            except Echo2Error as exc:
                self.seen[f"refused:{getattr(exc, 'code', type(exc).__name__)}"] += 1
                self.seen["refused"] += 1
                return
            self.seen["admitted" if d.admitted else "refused"] += 1
            if not d.admitted:
                return
            await host.connect(fz.hub_addr)
            await host.subscribe(ANNOUNCE_TOPIC, _ignore)
            held, seq, t0 = -1, 0, time.monotonic()
            while True:
                if reprice_at is not None and time.monotonic() - t0 > reprice_at:
                    reprice_at, claims["price_usd_per_hour"] = None, new_price
                    try:
                        await host.publish(ANNOUNCE_TOPIC, envelope.seal(ident, announce(ident, **claims), ttl_s=120))
                        self.seen["repriced_gossip"] += 1
                        d = await admit(host, fz.hub_addr, **claims)
                        self.seen["repriced_admission"] += 1
                    except Echo2Error as exc:
                        self.seen[f"reprice:{getattr(exc, 'code', type(exc).__name__)}"] += 1
                latest = int(h.status().get("latest_version", 0) or 0)
                try:
                    if latest != held and self.hold_versions:
                        holds = HoldsVersion(peer_id=ident.peer_id, version=latest, seconds=0.1)
                        await host.request(fz.hub_addr, wire.HOLDS, envelope.seal(ident, holds), max_response=4096, timeout_s=10)
                        held = latest
                    seq += 1
                    hb = Heartbeat(peer_id=ident.peer_id, seq=seq, versions_held=[held] if held >= 0 else [], busy_tasks=0,
                                   queue_free=8)
                    resp = await host.request(fz.hub_addr, wire.WORK, envelope.seal(ident, hb), max_response=wire.MAX_TASK,
                                              timeout_s=20)
                    v = envelope.open_envelope(resp, (Task, ErrorReply), replay=None)
                    if isinstance(v.message, Task):
                        self.tasks += 1
                        self.groups += len(v.message.prompts)
                    else:
                        self.seen[f"work:{v.message.code}"] += 1
                except Echo2Error as exc:
                    self.seen[f"error:{getattr(exc, 'code', type(exc).__name__)}"] += 1
                    await trio.sleep(0.5)


async def _ignore(_peer: str, _data: bytes) -> None:
    return None


async def a6_claims(ctx: Ctx) -> Effect:
    """Two admitted liars: one claims 1e9 rollouts/s for free (so it is active at once) and half
    way re-announces a price of 1e300 $/h; the other claims 1e308. Effect: their share of the
    tasks issued, the amount billed to them."""
    h = ctx.h
    liars = [Claimer(ctx, 1e9, 0.0), Claimer(ctx, 1e308, 0.0)]
    async with trio.open_nursery() as n:
        with attacker_source():
            n.start_soon(liars[0].run, ctx.seconds / 2, 1e300)
        with trio.move_on_after(20):
            while not (liars[0].seen["admitted"] or liars[0].seen["refused"]):
                await trio.sleep(0.2)
        st0 = h.status()
        ctx.begin()
        await trio.sleep(ctx.seconds * 2 / 3)
        with attacker_source():  # late: the overflow it may cause must not hide the first liar's share
            n.start_soon(liars[1].run)
        await trio.sleep(ctx.seconds / 3)
        ctx.end()
        await trio.sleep(1.5)  # the ledger's next status write
        st1 = h.status()
        n.cancel_scope.cancel()
    issued = max(1, int(st1.get("tasks_issued", 0)) - int(st0.get("tasks_issued", 0)))
    liar_tasks = sum(c.tasks for c in liars)
    billed = [float(_node_entry(st1, c.peer).get("cost_usd", 0.0) or 0.0) for c in liars]
    share = round(min(1.0, liar_tasks / issued), 3)
    effect = {
        "liar_share_of_tasks": share, "liar_tasks": liar_tasks, "tasks_issued": issued,
        "liar_groups": sum(c.groups for c in liars),
        "billed_usd": billed, "ledger_total": st1.get("ledger"),
        "liars": [{"claimed_rate": c.rate, "seen": dict(c.seen), "at_hub": _node_entry(st1, c.peer)} for c in liars],
        "activation": st1.get("activation"),
    }
    admitted = sum(1 for c in liars if c.seen["admitted"])
    ok_bill = all(math.isfinite(b) and b <= 1.0 for b in billed)
    if admitted == 0:
        return effect, True  # claims refused at the door
    return effect, share <= 0.5 and ok_bill


# --- plans, as an admitted node's data link receives them ----------------------------------------


class PlanListener:
    """The data link to the hub of an admitted attacker (``claimer``): says hello with ``addr``
    and ``up``, keeps the hub-signed plans and manifests it is sent."""

    def __init__(self, ctx: Ctx, claimer: Claimer, addr: str, up: float) -> None:
        self.ctx, self.claimer, self.addr, self.up = ctx, claimer, addr, up
        self.plans: dict[int, Any] = {}
        self.manifests: dict[int, Any] = {}
        self.stats: Counter[str] = Counter()

    def children_of(self, peer: str, plan: Any) -> int:
        return sum(len(k) for k in plan.children.get(peer, []))

    async def run(self) -> None:
        from echo2.protocol import envelope, wire
        from echo2.protocol.dataframe import FrameType
        from echo2.protocol.errors import Echo2Error
        from echo2.protocol.messages import BroadcastPlan, Manifest
        from echo2.protocol.net.dataplane import connect

        fz = self.ctx.fz
        while True:
            try:
                conn = await connect(f"127.0.0.1:{fz.hub_data_port}", self.claimer.host.identity, fz.hub_peer, timeout_s=5)
            except Echo2Error as exc:
                self.stats[f"data_link:{getattr(exc, 'reason', getattr(exc, 'code', type(exc).__name__))}"] += 1
                await trio.sleep(1.0)
                continue
            try:
                await conn.send_request(wire.encode_request(wire.REQ_HELLO, addr=self.addr, up=self.up))
                while True:
                    f = await conn.receive()
                    if f.type is not FrameType.MESSAGE:
                        continue
                    msg = envelope.open_envelope(bytes(f.payload), (BroadcastPlan, Manifest), replay=None).message
                    if isinstance(msg, BroadcastPlan):
                        self.stats["plans"] += 1
                        self.plans[msg.version] = msg
                        kids = self.children_of(self.claimer.peer, msg)
                        if kids:
                            self.stats["planned_as_parent"] += 1
                            self.stats["children"] += kids
                    else:
                        self.manifests[msg.version] = msg
            except Exception as exc:
                self.stats[f"data_link_ended:{getattr(exc, 'code', type(exc).__name__)}"] += 1
            finally:
                await conn.abort()


# --- A9 -------------------------------------------------------------------------------------------


async def a9_dataplane_exhaust(ctx: Ctx) -> Effect:
    """Admitted throwaway keys: one opens many connections to the hub's data plane asking for
    every chunk in full and never reads; another, a leaf of the hub's plan, reports its planned
    parent (an honest node) for a corrupt chunk it never sent. Effect: that node demoted (its
    reputation, and whether later plans still give it children) and the hub's memory."""
    from echo2.bench.attack_node import held_manifest
    from echo2.protocol import envelope, wire
    from echo2.protocol.errors import Echo2Error
    from echo2.protocol.messages import ChunkRequest, RelayReport
    from echo2.protocol.net.dataplane import connect

    h, fz = ctx.h, ctx.fz
    got = held_manifest(ctx, 0)
    if got is None:
        return "not measured: node 0 holds no complete version", None
    m, _hub = got
    honest = list(fz.node_peers)
    victim = [honest[0]]  # the honest node the plan makes the accuser's parent (node 0 until then)
    stats: Counter[str] = Counter()
    assert h.swarm.hub is not None
    peak = RssPeak(h.swarm.hub.pid)
    status0 = h.status()
    # a leaf that needs every version (it claims to hold none), so the plans give it parents
    accuser = Claimer(ctx, 1.0, 0.0, dict(upload_MBps=0.0, reachable=False), hold_versions=False)
    plans = PlanListener(ctx, accuser, "", 0.0)

    async def exhaust(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        from echo2.bench.attack_common import control_host

        async with control_host() as host:
            d = await admit(host, fz.hub_addr)
            stats["exhauster_admitted"] += int(d.admitted)
            task_status.started()
            req = wire.encode_request(wire.REQ_FULL, m=ChunkRequest(version=m.version, indices=[c.index for c in m.chunks]).to_wire())
            conns = []
            try:
                for _ in range(64):
                    try:
                        conns.append(await connect(f"127.0.0.1:{fz.hub_data_port}", host.identity, fz.hub_peer, timeout_s=5))
                        stats["connections"] += 1
                    except Echo2Error as exc:
                        stats[f"refused:{getattr(exc, 'reason', getattr(exc, 'code', type(exc).__name__))}"] += 1
                while True:
                    for c in conns:
                        try:
                            with trio.move_on_after(0.5):
                                await c.send_request(req)
                                stats["full_requests"] += 1
                        except Exception:
                            stats["send_failed"] += 1
                    await trio.sleep(0.2)
            finally:
                for c in conns:
                    await c.abort()

    def victim_parent_of_me() -> tuple[int, int, str] | None:
        """(version, chunk index, parent) of a chunk the plan made an honest node our parent for."""
        for v in sorted(plans.plans, reverse=True):
            plan, man = plans.plans[v], plans.manifests.get(v)
            mine = plan.parents.get(accuser.peer)
            if man is None or not mine:
                continue
            for c in man.chunks:
                if mine[c.index % plan.stripes] in honest:
                    return v, c.index, mine[c.index % plan.stripes]
        return None

    async def accuse() -> None:
        while True:
            target = victim_parent_of_me()
            if target is None:
                await trio.sleep(0.2)
                continue
            v, idx, victim[0] = target
            stats["victim_children_before"] = plans.children_of(victim[0], plans.plans[v])
            rep = RelayReport(peer_id=accuser.peer, accused=victim[0], version=v, index=idx,
                              expected_hash=plans.manifests[v].chunks[idx].enc_hash, got_hash=os.urandom(32))
            try:
                await accuser.host.request(fz.hub_addr, wire.REPORT, envelope.seal(accuser.host.identity, rep),
                                           max_response=4096, timeout_s=10)
                stats["reports_accepted"] += 1
            except Echo2Error as exc:
                stats[f"report:{getattr(exc, 'code', type(exc).__name__)}"] += 1
            stats["reported_at_version"] = v
            return

    async with trio.open_nursery() as n:
        n.start_soon(peak.run)
        with attacker_source():
            n.start_soon(accuser.run)
        with trio.move_on_after(20):
            while accuser.host is None or not (accuser.seen["admitted"] or accuser.seen["refused"]):
                await trio.sleep(0.2)
        ctx.begin()
        with attacker_source():
            if accuser.seen["admitted"]:
                n.start_soon(plans.run)
                n.start_soon(accuse)
            await n.start(exhaust)
        await trio.sleep(ctx.seconds)
        ctx.end()
        n.cancel_scope.cancel()
    before, after = _node_entry(status0, victim[0]), _node_entry(h.status(), victim[0])
    later = [plans.children_of(victim[0], p) for v, p in plans.plans.items() if v > stats.get("reported_at_version", 1 << 62)]
    rep0, rep1 = float(before.get("reputation", 1.0) or 0.0), float(after.get("reputation", 0.0) or 0.0)
    lost_children = stats["victim_children_before"] > 0 and bool(later) and max(later) == 0
    # Since A9's fix an accusation moves no score (reputation.record: RELAY_REPORTED records the
    # reporter only; CORRUPT_RELAY, the hub's own evidence, bans): so the accusation demotes by a
    # ban (gone from the fleet) or by taking the node's children. Its score can move for other
    # reasons in the window (a task of it timing out: 0.908 -> 0.856 measured, children kept at 3),
    # reported below but not counted as the accusation's effect.
    demoted = (not after) or lost_children
    effect = {
        "honest_parent_demoted": demoted, "victim_before": {k: before.get(k) for k in ("reputation", "state")},
        "victim_after": {k: after.get(k) for k in ("reputation", "state")} if after else "gone from the fleet",
        "victim_reputation_change": round(rep1 - rep0, 4), "victim_children_in_later_plans": later[-5:], "hub_rss_peak_growth_mib": round(peak.peak, 1),
        "attacker": dict(stats), "accuser": dict(accuser.seen), "plans": dict(plans.stats),
    }
    if not stats["reports_accepted"] and not any(k.startswith("report:") for k in stats):
        effect["note"] = "no plan made an honest node the accuser's parent within the window: the accusation was not tried"
        return effect, None if peak.peak <= 64 else False
    return effect, not demoted and peak.peak <= 64


# --- A10 ------------------------------------------------------------------------------------------


async def a10_announced_address(ctx: Ctx) -> Effect:
    """An admitted node announcing data_addr 0.0.0.0, reachable, a 1e6 MB/s upload, holding every
    version; it reads the hub-signed broadcast plans sent to it. Effect: planned as a parent."""
    claims: dict[str, Any] = dict(data_addr="0.0.0.0:9", reachable=True, upload_MBps=1e6, max_upload_MBps=0.0)
    liar = Claimer(ctx, 1.0, 0.0, claims)
    plans = PlanListener(ctx, liar, "0.0.0.0:9", 1e6)
    async with trio.open_nursery() as n:
        with attacker_source():
            n.start_soon(liar.run)
        with trio.move_on_after(20):
            while liar.host is None or not (liar.seen["admitted"] or liar.seen["refused"]):
                await trio.sleep(0.2)
        if not liar.seen["admitted"]:
            n.cancel_scope.cancel()
            return {"admission": dict(liar.seen)}, True
        with attacker_source():
            n.start_soon(plans.run)
        await ctx.window()
        n.cancel_scope.cancel()
    st = plans.stats
    effect = {"planned_as_parent": st["planned_as_parent"], "plans_seen": st["plans"], "children_given": st["children"],
              "link": dict(st), "liar": dict(liar.seen), "liar_tasks": liar.tasks}
    if st["plans"] == 0:
        effect["note"] = "no broadcast plan reached the liar in the window"
        return effect, None
    return effect, st["planned_as_parent"] == 0
