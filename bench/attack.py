"""``echo2 bench attack``: the security findings A1-A12 of issue 15, each tried against a live swarm.

A hub and two honest nodes run on 127.0.0.1 (:class:`echo2.bench.attack_swarm.Harness`, one swarm
for every attack, restarted where an attack killed a host or left a node holding something
hostile). For each id: honest accepted rollouts per second over a baseline window, then the
attack, run the way an attacker with one machine would (echo2's own ControlHost, data plane,
envelopes and identities, or raw sockets; :mod:`.attack_hub`, :mod:`.attack_node`,
:mod:`.attack_admitted`), measuring over a fixed window: the honest rate, the RSS of the hub and
of each honest node, whether every honest host stayed up, the refusals by reason, and the
attack's own effect with its verdict. The row format and the ``blocked`` rule are
:mod:`.attack_rows`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo2.bench import attack_cpu
from echo2.bench.attack_rows import Window, build_row, counter_delta, error_row, rate, summary, table
from echo2.bench.attack_swarm import Harness

Effect = tuple[dict[str, Any] | str, bool | None]


class Ctx:
    """What an attack sees: the harness (targets, readings) and its measured window."""

    def __init__(self, h: Harness, seconds: float) -> None:
        self.h = h
        self.seconds = seconds
        self.t0: float | None = None
        self.t1: float | None = None
        self.r0: int | None = None
        self.r1: int | None = None
        self._log_at: list[int] = []

    @property
    def fz(self) -> Any:
        assert self.h.fz is not None
        return self.h.fz

    def begin(self) -> None:
        self.t0, self.r0 = time.monotonic(), self.h.honest_rollouts()
        self._log_at = [len(self.h.node_log(i)) for i in range(self.h.n_nodes)]

    def end(self) -> None:
        if self.t1 is None:
            self.t1, self.r1 = time.monotonic(), self.h.honest_rollouts()

    async def window(self) -> None:
        """The measured part of the attack: ``seconds`` from now, attackers running meanwhile."""
        import trio

        self.begin()
        await trio.sleep(self.seconds)
        self.end()

    def node_log_since(self, i: int) -> str:
        return self.h.node_log(i)[self._log_at[i] if i < len(self._log_at) else 0 :]

    def attack_rate(self) -> float | None:
        if self.t0 is None or self.t1 is None:
            return None
        return rate(self.r0, self.r1, self.t1 - self.t0)


@dataclass(frozen=True)
class Attack:
    id: str
    title: str
    run: Callable[[Ctx], Awaitable[Effect]]
    restart_nodes: bool = False  # the attack may leave a node holding hostile state


def registry() -> dict[str, Attack]:
    from echo2.bench import attack_admitted as ad
    from echo2.bench import attack_hub as hb
    from echo2.bench import attack_node as nd

    return {a.id: a for a in [
        Attack("A1", "inflight-reserve: 8 streams announcing 64 MiB, trickling", hb.a1_inflight_reserve),
        Attack("A2", "decode-before-verify: 4 MB bad-signature frames, 1 MiB REQUEST frames", hb.a2_decode_before_verify),
        Attack("A3", "replay-flood: admission requests from throwaway keys", hb.a3_replay_flood),
        Attack("A4", "open data plane: a stranger at a node's data plane", nd.a4_open_dataplane),
        Attack("A5", "verification gaps: an admitted node forging rows", ad.a5_forged_rows),
        Attack("A6", "claims: 1e9 / 1e308 rate, price 0.01 -> 1e300", ad.a6_claims),
        Attack("A7", "hostile hub: a 1 TiB manifest", nd.a7_hostile_hub, restart_nodes=True),
        Attack("A8", "config injection: attn_implementation from the hub", nd.a8_config_injection, restart_nodes=True),
        Attack("A9", "data-plane exhaust and a garbage chunk in an honest parent's name", ad.a9_dataplane_exhaust),
        Attack("A10", "announced address: data_addr 0.0.0.0, reachable, huge upload", ad.a10_announced_address),
        Attack("A11", "connection flood and admission-bucket drain from one IP", hb.a11_connection_flood),
        Attack("A12", "probe sink: the bandwidth test, unauthenticated", hb.a12_probe_sink),
    ]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", default="", help="comma-separated ids (default: A1..A12)")
    # Windows long against the learner's step pacing: with a 6 s baseline and 15 s attack the same
    # A3 on a quiet machine read 0.37, 0.61 and 0.79 in three runs (the honest rate swings with
    # steps and staleness waits); 20 s and 40 s read 0.99.
    parser.add_argument("--seconds", type=float, default=30.0, help="attack window per id (default 30)")
    parser.add_argument("--baseline", type=float, default=15.0, help="baseline window per id (default 15)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nodes", type=int, default=2, help="honest node processes (default 2)")
    parser.add_argument("--startup-timeout", type=float, default=240.0)
    parser.add_argument("--dir", type=Path, default=None, help="keep the swarm's files here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument(
        "--attacker-cpus", default="auto",
        help="CPUs the attacker (this process) runs on, the hub and honest nodes on the rest: auto (the last CPU "
             "when there are 2+), none (all share), or a list like 3 or 2,3 (see bench/attack_cpu.py)",
    )


class _Sampler:
    """RSS of the hub and the honest nodes, twice a second, in a thread (the attack owns trio)."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.hub: list[float] = []
        self.nodes: list[list[float]] = [[] for _ in range(h.n_nodes)]
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            hub, nodes = self.h.rss()
            if hub is not None:
                self.hub.append(hub)
            for i, v in enumerate(nodes):
                if v is not None:
                    self.nodes[i].append(v)
            self._stop.wait(0.5)

    def __enter__(self) -> _Sampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(timeout=5)


def _swarm_pids(h: Harness) -> tuple[list[int], list[int]]:
    hub = h.swarm.hub
    return ([hub.pid] if hub is not None else []), [p.pid for p in h.swarm.nodes[: h.n_nodes]]


def run_one(h: Harness, attack: Attack, seconds: float, baseline_s: float,
            cpus: tuple[set[int], set[int]] | None = None) -> dict[str, Any]:
    import trio

    if not h.heal():
        try:
            h.wait_progress(90)  # the previous attack may have left the honest nodes waiting on its tasks
        except (RuntimeError, TimeoutError):
            h.heal(restart_nodes=True)
    if cpus is not None:  # after heal: a host restarted by this process must be moved back too
        hub_pids, node_pids = _swarm_pids(h)
        for pid in hub_pids + node_pids:
            attack_cpu.pin(pid, cpus[0])
        attack_cpu.pin(os.getpid(), cpus[1])
    r0, t0 = h.honest_rollouts(), time.monotonic()
    time.sleep(baseline_s)
    base = rate(r0, h.honest_rollouts(), time.monotonic() - t0)
    before = h.refusals()
    ctx = Ctx(h, seconds)

    async def main() -> Effect:
        # setup (a liar to start, a plan to wait for) is bounded too; the window itself is ``seconds``
        with trio.move_on_after(seconds + 120) as scope:
            return await attack.run(ctx)
        assert scope.cancelled_caught
        return "not measured: the attack overran its time", None

    t_start = time.monotonic()
    hub_pids, node_pids = _swarm_pids(h)
    cpu0 = [attack_cpu.cpu_seconds([os.getpid()]), attack_cpu.cpu_seconds(hub_pids), attack_cpu.cpu_seconds(node_pids)]
    with _Sampler(h) as sampler:
        try:
            effect, prevented = trio.run(main)
        except Exception as exc:  # a bug of the bench, not of the target: the row says so
            import traceback

            traceback.print_exc()
            effect, prevented = f"not measured: {type(exc).__name__}: {exc}", None
        ctx.end()
        time.sleep(3.0)  # a host that is dying at the end of the window gets a moment to show it
    cpu1 = [attack_cpu.cpu_seconds([os.getpid()]), attack_cpu.cpu_seconds(hub_pids), attack_cpu.cpu_seconds(node_pids)]
    dead = h.dead()
    after = h.refusals()
    w = Window(
        baseline_rate=base, attack_rate=ctx.attack_rate(), hub_rss=sampler.hub, node_rss=sampler.nodes,
        hosts_alive=not dead, dead=dead, seconds=time.monotonic() - t_start,
        refusals={k: counter_delta(before.get(k, {}), v) for k, v in after.items()},
    )
    row = build_row(attack.id, w, effect, prevented)
    row["title"] = attack.title
    try:
        healed = h.heal(restart_nodes=attack.restart_nodes)
    except (RuntimeError, TimeoutError) as exc:
        healed = [f"failed: {exc}"]
    row["detail"]["restarted_after"] = healed
    row["detail"]["cpu_s"] = {k: round(b - a, 1) for k, a, b in zip(("attacker", "hub", "nodes"), cpu0, cpu1, strict=True)}
    row["detail"]["cpus"] = None if cpus is None else {"victims": sorted(cpus[0]), "attacker": sorted(cpus[1])}
    return row


def attack_swarm(root: Path, ids: list[str], seconds: float, baseline_s: float, seed: int = 0, n_nodes: int = 2,
                 startup_timeout_s: float = 240.0, on_row: Callable[[dict[str, Any]], None] | None = None,
                 attacker_cpus: str = "none") -> dict[str, Any]:
    attacks = registry()
    unknown = [i for i in ids if i not in attacks]
    if unknown:
        raise ValueError(f"unknown attack ids {unknown}; known: {', '.join(attacks)}")
    cpus = attack_cpu.split(attacker_cpus)
    h = Harness(root, n_nodes, seed)
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        h.start(startup_timeout_s)
        for aid in ids:
            try:
                row = run_one(h, attacks[aid], seconds, baseline_s, cpus)
            except (RuntimeError, TimeoutError) as exc:
                row = error_row(aid, str(exc))
            rows.append(row)
            if on_row is not None:
                on_row(row)
    finally:
        h.stop()
        if cpus is not None:
            attack_cpu.pin(os.getpid(), cpus[0] | cpus[1])
    return {"rows": rows, "summary": summary(rows), "seconds": round(time.monotonic() - t0, 1),
            "attack_seconds": seconds, "baseline_seconds": baseline_s, "restarts": h.restarts, "dir": str(root),
            "rebuilt_swarms": h.rebuilds}


def run(args: argparse.Namespace) -> int:
    ids = [i.strip().upper() for i in args.only.split(",") if i.strip()] or list(registry())
    root = Path(args.dir or tempfile.mkdtemp(prefix="echo2-attack-"))

    import logging

    # the attackers' own hosts log every refusal they meet: the rows say it, not a log line each
    # (py-libp2p logs a dial the hub refuses before its handshake at ERROR, two lines a dial;
    # importing it resets its logger to WARNING, hence the import first)
    import libp2p  # noqa: F401

    logging.getLogger("echo2").setLevel(logging.ERROR)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    done: list[dict[str, Any]] = []

    def show(row: dict[str, Any]) -> None:
        print(table([row]).splitlines()[1], flush=True)
        done.append(row)
        if args.json:  # written as rows come, so an interrupted run keeps what it measured
            Path(args.json).write_text(json.dumps(done, indent=1))

    print(table([]), flush=True)
    report = attack_swarm(root, ids, args.seconds, args.baseline, args.seed, args.nodes, args.startup_timeout, show,
                          args.attacker_cpus)
    print(f"echo2 bench attack: {len(report['rows'])} attacks in {report['seconds']} s ({root})")
    for k, v in sorted(report["summary"].items()):
        print(f"  {k:9s} {', '.join(v)}")
    if args.json:
        Path(args.json).write_text(json.dumps(report["rows"], indent=1))
        Path(str(args.json) + ".meta.json").write_text(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1))
    return 0
