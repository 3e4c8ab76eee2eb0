"""``echo2 bench intake``: what one message costs the hub as the fleet grows (issue 20).

What this measures (first row of issue 20's bench; stated in the JSON as ``"measures"``): a real
:class:`~echo2.learner_hub.hub.Hub` object (tiny model, its SQLite store in its own thread, the
built-in reward functions) in this process, with N admitted node identities. The hub's handlers
are called directly with real signed messages, as the network layer would hand them over; the
network layer's own cost (py-libp2p streams, Noise, Yamux: 2.5-3.6 ms a request measured in the
issue) is not in these figures. Per fleet size it reports, as medians over the measured messages:

* ``result``: :meth:`Hub.on_result` for an accepted small result (8 completions x 64 tokens):
  CPU of the trio thread (``loop_cpu_ms``) and of the whole process across the call
  (``process_cpu_ms``: the store's and the reward functions' threads too), and wall time;
* ``heartbeat``: :meth:`Hub.on_work` of a node with a task waiting (it pumps, then returns it);
* ``holds``: :meth:`Hub.on_holds` (a node reports it holds version 0);
* ``status``: building the whole status dict at once (what ``/status.json`` does), and the
  longest the loop was kept from running (a 1 ms ticker) while the hub wrote status.json (json
  encoding holds the GIL even in a thread), next to the same ticker's longest gap on an idle loop
  for as long (``idle_loop_gap_max_ms``: what the machine's scheduler alone costs), and the
  loop thread's CPU for the whole write (``write_loop_cpu_ms``) and the longest single
  ``json.dumps`` in the writer's thread, which holds the GIL (``write_longest_stretch_cpu_ms``);
* ``housekeeping``: one pass of the hub's once-a-second duties (expiry, liveness, fleet tick);
* ``admission``: :meth:`Hub.on_admission` of one more node into a fleet of N (signed request,
  admission policy, store look-ups, activation): loop CPU and wall time;
* ``http_status``: ``GET /status.json`` from the hub's real status server (what ``echo2 hub
  serve`` runs, answering from the last status written), fetched by a client thread: the loop
  thread's CPU across the request and the longest a 1 ms ticker on the loop was kept waiting;
  ``build_loop_cpu_ms`` under ``status`` is what the same request cost when it built the status
  on the loop.

Set-up shortcuts, each stated in the JSON: nodes are admitted through :meth:`Hub.on_admission`
(signed requests), then marked hub-timed (as if each had returned one task: a fleet of untimed
nodes shares four probation slots) and as holding version 0 without a HoldsVersion message each.
Between measured results a stand-in for the learner takes the buffered rows (outside the timed
window) so that the pipeline keeps issuing tasks, as it does while training.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

SMALL_COMPLETIONS = 8
SMALL_TOKENS = 64
TIMED_RATE = 0.01  # rollouts/s: a small task is expected to take 800 s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", default="100,10000", help="comma-separated fleet sizes (default 100,10000)")
    parser.add_argument("--results", type=int, default=100, help="accepted results measured per fleet size")
    parser.add_argument("--holds", type=int, default=50, help="HoldsVersion messages measured per fleet size")
    parser.add_argument("--status", type=int, default=5, help="status writes measured per fleet size")
    parser.add_argument("--json", default=None, help="write results to this file")
    parser.add_argument("--workers", default="0",
                        help="comma-separated intake_workers values measured per fleet size (e.g. 0,2; default 0)")
    parser.add_argument("--reward-sleep", type=float, default=0.0, dest="reward_sleep",
                        help="add a reward function that sleeps this many seconds per call (default 0: none)")
    parser.add_argument("--tokens", type=int, default=SMALL_TOKENS,
                        help=f"tokens per completion of the measured results (default {SMALL_TOKENS}; 8 completions each)")
    parser.add_argument("--packed", action="store_true", help="results in the packed wire form nodes send (default: list form)")
    parser.add_argument("--clients", type=int, default=0,
                        help="a live hub driven by this many client processes (bench/intake_live.py); 0: in-process")
    parser.add_argument("--batch", type=int, default=1, help="live mode: results per message (a ResultBatch when > 1)")
    parser.add_argument("--duration", type=float, default=20.0, help="live mode: seconds of the results phase")
    parser.add_argument("--client-cpus", default="none", dest="client_cpus",
                        help="live mode: CPUs for the client processes, the hub on the rest: none (all share), auto "
                             "(the last CPU), or a list like 3 or 2,3")
    parser.add_argument("--repeat", type=int, default=1,
                        help="live mode: measure each fleet size and worker count this many times (every fleet size and "
                             "worker count back to back in each repeat) and report the median, min and max; ratios are taken within a repeat")
    parser.add_argument("--idle", type=float, default=5.0, help="live mode: seconds of the idle phase (hub CPU at rest)")
    parser.add_argument("--big-result-MB", type=float, default=0.0, dest="big_result_mb",
                        help="instead: one result of this size, list form vs packed form (bench/intake_big.py)")


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)
    return {"median": round(statistics.median(s), 4), "p90": round(s[int(0.9 * (len(s) - 1))], 4),
            "max": round(s[-1], 4), "n": len(s)}


class _Cpu:
    """CPU (ms) of this thread and of the whole process, and wall time, across a block."""

    def __enter__(self) -> _Cpu:
        self.t, self.p, self.w = time.thread_time(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *_: object) -> None:
        self.loop_ms = (time.thread_time() - self.t) * 1e3
        self.process_ms = (time.process_time() - self.p) * 1e3
        self.wall_ms = (time.perf_counter() - self.w) * 1e3


async def _ticker(gaps: list[float], stop: Any) -> None:
    import trio

    while not stop.is_set():
        t0 = time.perf_counter()
        await trio.sleep(0.001)
        gaps.append((time.perf_counter() - t0 - 0.001) * 1e3)


#: the environment variable :func:`sleepy_reward` reads (set by ``--reward-sleep``; intake
#: workers are spawned with the bench's environment, so they read it too)
SLEEP_ENV = "ECHO2_BENCH_REWARD_SLEEP_S"


def sleepy_reward(completions: list[Any], **_: Any) -> list[float | None]:
    """A slow operator reward function: sleeps ``$ECHO2_BENCH_REWARD_SLEEP_S`` seconds per call,
    then does not apply to any completion (None), so the task's own reward decides."""
    time.sleep(float(os.environ.get(SLEEP_ENV, "0") or 0))
    return [None] * len(completions)


def make_hub(n_nodes: int, workdir: Path, workers: int = 0, reward_sleep_s: float = 0.0, tokens: int = SMALL_TOKENS) -> Any:
    """A hub sized for the fleet: one prompt group per node per step, small results (built off
    the trio loop: the hub's constructor reads its store synchronously)."""
    from echo2.learner_hub.config import HubConfig
    from echo2.learner_hub.hub import Hub

    extra: dict[str, Any] = {}
    if reward_sleep_s > 0:
        os.environ[SLEEP_ENV] = repr(reward_sleep_s)
        extra["reward_funcs"] = ["echo2.learner_hub.rewards_builtin:copy_reward", "echo2.bench.intake:sleepy_reward"]
    cfg = HubConfig(dir=str(workdir), steps=10**6, prompts_per_step=n_nodes, group_size=SMALL_COMPLETIONS,
                    max_new_tokens=tokens, staleness=1, task_deadline_s=3600.0, intake_workers=workers, **extra)
    hub = Hub(cfg)
    gc.freeze()  # as run_hub does: start-up's objects are never scanned by a collection again
    return hub


async def measure(hub: Any, n_nodes: int, n_results: int, n_holds: int, n_status: int, workdir: Path,
                  packed: bool = False, tokens: int = SMALL_TOKENS) -> dict[str, Any]:
    """:func:`_measure` beside the collector policy a served hub runs (``run_hub`` sets
    ``Hub.freeze_gc``; learner_hub/gcpolicy.py): without it the 10,000 admissions made here are
    walked by every automatic full collection (24-81 ms each, measured with gc callbacks on this
    bench), a pause the hub that serves those nodes does not take."""
    import trio

    from echo2.learner_hub.gcpolicy import freeze_survivors

    async with trio.open_nursery() as nursery:
        nursery.start_soon(freeze_survivors)
        row = await _measure(hub, n_nodes, n_results, n_holds, n_status, workdir, packed, tokens)
        nursery.cancel_scope.cancel()
    return row


async def _measure(hub: Any, n_nodes: int, n_results: int, n_holds: int, n_status: int, workdir: Path,
                   packed: bool = False, tokens: int = SMALL_TOKENS) -> dict[str, Any]:
    import trio

    from echo2.learner_hub import hubstatus
    from echo2.learner_hub.store import HubStore
    from echo2.looplag import LoopLag
    from echo2.protocol import envelope
    from echo2.protocol.identity import Identity
    from echo2.protocol.messages import (
        AdmissionRequest,
        Announce,
        Completion,
        Heartbeat,
        HoldsVersion,
        Result,
        Task,
        task_hash,
    )
    from echo2.protocol.packedresult import PackedCompletion, PackedResult, pack_ids, pack_logprobs

    await hub.publish()  # version 0, as serve() does before nodes come
    rng = random.Random(0)
    nodes = [Identity.generate() for _ in range(n_nodes)]

    def announce(peer: str) -> Announce:
        return Announce(
            peer_id=peer, software_version="0.1.0", accelerator="", accelerator_count=0, accelerator_memory_bytes=0,
            cpu_model="bench", cpu_cores=1, ram_bytes=1 << 30, free_disk_bytes=1 << 30, engine="transformers",
            engine_version="", tokens_per_s=0.0, rollouts_per_s=8.0, upload_MBps=0.0, download_MBps=0.0,
            price_usd_per_hour=0.0, listen_addrs=[], data_addr="", reachable=False, versions_held=[],
            max_upload_MBps=0.0,
        )

    t0 = time.perf_counter()
    for node in nodes:
        req = AdmissionRequest(peer_id=node.peer_id, join_token="", announce=announce(node.peer_id))
        await hub.on_admission(node.peer_id, envelope.seal(node, req))
    admit_s = time.perf_counter() - t0
    assert len(hub.nodes) == n_nodes, "every bench node is admitted"
    by_peer = {n.peer_id: n for n in nodes}
    for p, st in hub.dispatcher.nodes.items():
        # set-up shortcut: as if the hub had timed one task of each, at a rate slow enough that no
        # task looks lost while the bench runs (at 8 rollouts/s a 1-group task is expected in 1 s and
        # stops counting as supply after 3 s: the refill would then double the work out)
        st.claimed, st.rate = False, TIMED_RATE
        hub.nodes[p].held_version = 0  # set-up shortcut: as if each had sent HoldsVersion(0)
    t0 = time.perf_counter()
    hub.outbox.feed()
    first_dispatch_s = time.perf_counter() - t0
    await hub.store.call(lambda st: None)
    vocab = hub.tok.vocab_size
    stop_ids = set(hub.tok.stop_ids)
    plain = [t for t in range(3, min(vocab, 1000)) if t not in stop_ids]
    seq = 0

    def result_for(task: Task, node: Identity) -> bytes:
        comps = [Completion(prompt_index=i, token_ids=[rng.choice(plain) for _ in range(tokens)],
                            logprobs=[-0.5] * tokens, finish_reason="length")
                 for i in range(len(task.prompts)) for _ in range(task.group_size)]
        r = Result(task_id=task.task_id, task_hash=task_hash(task), node_id=node.peer_id, version=0, completions=comps,
                   started_at=time.time(), gen_seconds=0.1, tokens=tokens * len(comps))
        if packed:  # the form nodes send (node/taskloop.py)
            pcs = [PackedCompletion(c.prompt_index, pack_ids(c.token_ids), pack_logprobs(c.logprobs), c.finish_reason)
                   for c in comps]
            return envelope.seal(node, PackedResult(task_id=r.task_id, task_hash=r.task_hash, node_id=r.node_id, version=0,
                                                    completions=pcs, started_at=r.started_at, gen_seconds=0.1,
                                                    tokens=r.tokens))
        return envelope.seal(node, r)

    async def learner_stand_in() -> None:
        """Take the buffered rows as a training step would (untimed), so that tasks keep flowing."""
        batch = hub.buffer.take_batch(hub.learner.version, len(hub.buffer)) or []
        done = [tid for _, (tid, _g) in batch if hub.intake.book.group_gone(tid)]
        hub.store.submit(HubStore.mark_trained, done, hub.learner.version)
        hub.outbox.feed()
        await hub.store.call(lambda st: None)

    res: dict[str, list[float]] = {k: [] for k in ("result_loop", "result_proc", "result_wall", "hb_loop",
                                                    "hb_proc", "holds_loop", "holds_proc")}
    sizes: list[int] = []

    turn = collections.deque(hub.nodes)

    def next_with_task() -> str:
        """A node with a task waiting, taken in turn (untimed). Not a scan of every node per
        result: at 10,000 nodes that scan walked ~2 MB of node objects between the timed calls
        and evicted what the hub's handlers had cached, a cost no serving hub pays."""
        for _ in range(len(turn)):
            peer = turn[0]
            turn.rotate(-1)
            if hub.nodes[peer].mailbox:
                return peer
        raise RuntimeError("no node has a task waiting: the pipeline ran dry")

    async def _results(count: int) -> None:
        nonlocal seq
        for _ in range(count):
            peer = next_with_task()
            node = by_peer[peer]
            seq += 1
            hb = envelope.seal(node, Heartbeat(peer_id=peer, seq=seq, versions_held=[0], busy_tasks=0, queue_free=1))
            with _Cpu() as c:
                reply = await hub.on_work(peer, hb)
            res["hb_loop"].append(c.loop_ms)
            res["hb_proc"].append(c.process_ms)
            task = envelope.open_envelope(reply, Task, replay=None).message
            data = result_for(task, node)
            sizes.append(len(data))
            with _Cpu() as c:
                await hub.on_result(peer, data)
            res["result_loop"].append(c.loop_ms)
            res["result_proc"].append(c.process_ms)
            res["result_wall"].append(c.wall_ms)
            await learner_stand_in()

    accepted0 = hub.dispatcher.stats.accepted
    # the loop's lag while results are checked (echo2/looplag.py: 100 ms ticks, as the hub runs it)
    lag = LoopLag()
    lag_scope = trio.CancelScope()

    async def run_lag() -> None:
        with lag_scope:
            await lag.run()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_lag)
        await _results(n_results)
        lag_scope.cancel()
    accepted = hub.dispatcher.stats.accepted - accepted0
    for node in rng.sample(nodes, min(n_holds, len(nodes))):
        msg = envelope.seal(node, HoldsVersion(peer_id=node.peer_id, version=0, seconds=0.1))
        with _Cpu() as c:
            await hub.on_holds(node.peer_id, msg)
        res["holds_loop"].append(c.loop_ms)
        res["holds_proc"].append(c.process_ms)

    build, block, write_wall, idle, stretch = [], [], [], [], []
    write_loop, writer_cpu, rebuilt = [], [], []
    for _ in range(n_status):
        with _Cpu() as c:
            hub.status()
        build.append(c.loop_ms)
        with _Cpu() as c:
            await hub.write_status()  # alone: the loop thread's CPU is the write's
        write_loop.append(c.loop_ms)
        # the writer thread's CPU for the entries, the join and the encoding (status_nodes.py)
        writer_cpu.append(hubstatus.last_write.get("build_cpu_ms", float("nan")))
        rebuilt.append(hubstatus.last_write.get("entries_rebuilt", float("nan")))
        gaps: list[float] = []
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_ticker, gaps, stop)
            await trio.sleep(0.01)
            with _Cpu() as c:
                await hub.write_status()
            stop.set()
        write_wall.append(c.wall_ms)
        block.append(max(gaps) if gaps else 0.0)
        stretch.append(hubstatus.last_write.get("longest_stretch_ms", float("nan")))
        # the same ticker for as long with nothing else to do: what this (shared) machine's
        # scheduler alone costs the loop, to read the figure above against
        gaps = []
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_ticker, gaps, stop)
            await trio.sleep(0.01 + c.wall_ms / 1e3)
            stop.set()
        idle.append(max(gaps) if gaps else 0.0)
    status_bytes = (workdir / "status.json").stat().st_size

    http = await _measure_http(hub, n_status)
    admission = []
    for _ in range(20):
        extra = Identity.generate()
        req = AdmissionRequest(peer_id=extra.peer_id, join_token="", announce=announce(extra.peer_id))
        msg = envelope.seal(extra, req)
        with _Cpu() as c:
            await hub.on_admission(extra.peer_id, msg)
        admission.append((c.loop_ms, c.wall_ms))
    assert len(hub.nodes) == n_nodes + 20, "every extra node is admitted"

    house = []
    for _ in range(5):
        now = time.time()
        with _Cpu() as c:
            hub.intake.expire(now)
            hub.fleet.drop_silent(now, 3600.0)
            hub.fleet.tick(now)
        house.append(c.loop_ms)
    return {
        "nodes": n_nodes,
        "setup": {"admit_s": round(admit_s, 2), "first_dispatch_s": round(first_dispatch_s, 3),
                  "tasks_in_flight": len(hub.dispatcher.in_flight)},
        "accepted": accepted,
        "workers": hub.intake_pool.workers,
        "packed": packed,
        "loop_lag_during_results": lag.report() | {"samples": lag.samples},
        "result_bytes": int(statistics.median(sizes)) if sizes else 0,
        "result": {"loop_cpu_ms": _stats(res["result_loop"]), "process_cpu_ms": _stats(res["result_proc"]),
                   "wall_ms": _stats(res["result_wall"])},
        "heartbeat": {"loop_cpu_ms": _stats(res["hb_loop"]), "process_cpu_ms": _stats(res["hb_proc"])},
        "holds": {"loop_cpu_ms": _stats(res["holds_loop"]), "process_cpu_ms": _stats(res["holds_proc"])},
        "status": {"build_loop_cpu_ms": _stats(build), "write_loop_blocked_max_ms": _stats(block),
                   "write_wall_ms": _stats(write_wall), "write_loop_cpu_ms": _stats(write_loop),
                   "write_thread_cpu_ms": _stats(writer_cpu), "write_entries_rebuilt": _stats(rebuilt),
                   "write_longest_stretch_cpu_ms": _stats(stretch), "curves_encode_cpu_ms": hubstatus.last_write.get("curves_cpu_ms"),
                   "idle_loop_gap_max_ms": _stats(idle), "bytes": status_bytes},
        "housekeeping": {"loop_cpu_ms": _stats(house)},
        "admission": {"loop_cpu_ms": _stats([a for a, _ in admission]), "wall_ms": _stats([w for _, w in admission])},
        "http_status": http,
    }


async def _measure_http(hub: Any, n: int) -> dict[str, Any]:
    """``GET /status.json`` against the hub's status server as serve.py starts it, from a client
    in another thread (urllib), while a 1 ms ticker runs on the loop."""
    import urllib.request

    import trio

    from echo2.learner_hub.status_http import StatusServer, hub_metrics

    server = StatusServer(hub.status, lambda: hub_metrics(hub.status()), snapshot=lambda: hub.status_snapshot)
    loop_ms, blocked, sizes = [], [], []

    def get(url: str) -> int:
        with urllib.request.urlopen(url, timeout=30) as r:
            return len(r.read())

    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve)
        for _ in range(n):
            with _Cpu() as c:  # alone: the loop thread's CPU is the request's
                sizes.append(await trio.to_thread.run_sync(get, f"http://127.0.0.1:{port}/status.json"))
            loop_ms.append(c.loop_ms)
            gaps: list[float] = []
            stop = trio.Event()
            async with trio.open_nursery() as inner:
                inner.start_soon(_ticker, gaps, stop)
                await trio.sleep(0.01)
                await trio.to_thread.run_sync(get, f"http://127.0.0.1:{port}/status.json")
                stop.set()
            blocked.append(max(gaps) if gaps else 0.0)
        nursery.cancel_scope.cancel()
    return {"loop_cpu_ms": _stats(loop_ms), "loop_blocked_max_ms": _stats(blocked), "bytes": max(sizes, default=0)}


def size_ratios(rows: list[dict[str, Any]], worker_counts: list[int]) -> dict[str, Any]:
    """Result CPU at the largest fleet over the smallest, per intake worker count: dividing the
    last row by the first mixed worker counts with ``--workers 0,2`` (10,000 nodes with 2
    workers over 100 nodes with none). ``ratio_result_*_cpu`` keep the first worker count's."""
    by: dict[str, dict[str, float]] = {}
    for w in worker_counts:
        mine = [r for r in rows if r["workers"] == w]
        if len(mine) < 2:
            continue
        a, b = mine[0], mine[-1]
        by[str(w)] = {k: round(b["result"][f"{k}_cpu_ms"]["median"] / max(a["result"][f"{k}_cpu_ms"]["median"], 1e-9), 3)
                      for k in ("loop", "process")}
    out: dict[str, Any] = {"ratio_result_cpu_by_size": by}
    first = by.get(str(worker_counts[0]))
    if first is not None:
        out["ratio_result_loop_cpu"], out["ratio_result_process_cpu"] = first["loop"], first["process"]
    return out


def run(args: argparse.Namespace) -> int:
    import logging

    import trio

    logging.getLogger("echo2").setLevel(logging.WARNING)
    if getattr(args, "big_result_mb", 0.0) > 0:
        from .intake_big import run_big

        counts = tuple(int(x) for x in str(getattr(args, "workers", "0")).split(",") if x.strip())
        big = {"bench": "intake", "big_result": run_big(args.big_result_mb, workers=counts or (0,))}
        if args.json:
            Path(args.json).write_text(json.dumps(big, indent=2))
        return 0
    if getattr(args, "clients", 0) > 0:
        from .intake_live import run_live

        return run_live(args)
    sizes = [int(x) for x in str(args.nodes).split(",") if x.strip()]
    worker_counts = [int(x) for x in str(getattr(args, "workers", "0")).split(",") if x.strip()]
    sleep_s, packed = float(getattr(args, "reward_sleep", 0.0)), bool(getattr(args, "packed", False))
    tokens = int(getattr(args, "tokens", SMALL_TOKENS))
    rows = []
    for n in sizes:
        for w in worker_counts:
            with tempfile.TemporaryDirectory(prefix="echo2-bench-intake-") as d:
                hub = make_hub(n, Path(d), w, sleep_s, tokens)
                try:
                    row = trio.run(measure, hub, n, args.results, args.holds, args.status, Path(d), packed, tokens)
                finally:
                    hub.intake_pool.close()
                    hub.store.close()
            rows.append(row)
            r = row["result"]
            print(f"nodes={n:>6} workers={w}  result loop {r['loop_cpu_ms']['median']:.3f} ms  process {r['process_cpu_ms']['median']:.3f} ms"
                  f" (wall {r['wall_ms']['median']:.1f} ms; loop lag p99 {row['loop_lag_during_results']['loop_lag_p99_ms']} ms,"
                  f" max {row['loop_lag_during_results']['loop_lag_max_ms']} ms)"
                  f"  heartbeat {row['heartbeat']['loop_cpu_ms']['median']:.3f} ms  holds {row['holds']['loop_cpu_ms']['median']:.3f} ms"
                  f"  status build (whole dict on the loop: Hub.status(), tests and the Ctrl-C write) {row['status']['build_loop_cpu_ms']['median']:.1f} ms,"
                  f" periodic write: writer thread CPU {row['status']['write_thread_cpu_ms']['median']:.1f} ms"
                  f" ({row['status']['write_entries_rebuilt']['median']:.0f} entries rebuilt),"
                  f" loop CPU {row['status']['write_loop_cpu_ms']['median']:.1f} ms,"
                  f" loop blocked {row['status']['write_loop_blocked_max_ms']['median']:.1f} ms"
                  f" (idle {row['status']['idle_loop_gap_max_ms']['median']:.1f} ms,"
                  f" longest CPU stretch {row['status']['write_longest_stretch_cpu_ms']['median']:.1f} ms)"
                  f"  housekeeping {row['housekeeping']['loop_cpu_ms']['median']:.1f} ms"
                  f"  admission {row['admission']['loop_cpu_ms']['median']:.2f} ms"
                  f"  HTTP status.json: loop CPU {row['http_status']['loop_cpu_ms']['median']:.1f} ms,"
                  f" loop blocked {row['http_status']['loop_blocked_max_ms']['median']:.1f} ms"
                  f"  (setup: admit {row['setup']['admit_s']} s)",
                  flush=True)
    out: dict[str, Any] = {
        "bench": "intake",
        "measures": ("in-process: a real Hub's handlers called directly with real signed messages from N admitted "
                     "identities; CPU per message of the trio thread (loop_cpu_ms) and of the whole process "
                     "(process_cpu_ms, store and reward threads included); the libp2p stream cost is not included"),
        "setup_shortcuts": [f"nodes marked hub-timed after admission (as if each had returned one task) at {TIMED_RATE} rollouts/s",
                            "held_version=0 set directly after admission (holds are measured on a sample)",
                            "the learner is a stand-in that takes buffered rows between results, untimed"],
        "small_result": {"completions": SMALL_COMPLETIONS, "tokens_each": tokens, "packed": packed},
        "reward_sleep_s": sleep_s,
        "rows": rows,
    }
    if len(worker_counts) >= 2:
        # issue 20 item 4: the hub process's own CPU per result (process_time: every thread of this
        # process, the intake workers apart) with intake workers against without, per fleet size
        out["ratio_result_process_cpu_by_workers"] = {}
        for n in sizes:
            base = next(r for r in rows if r["nodes"] == n and r["workers"] == worker_counts[0])
            for r in rows:
                if r["nodes"] == n and r["workers"] != worker_counts[0]:
                    k = f"{n}:{r['workers']}/{worker_counts[0]}"
                    out["ratio_result_process_cpu_by_workers"][k] = round(
                        r["result"]["process_cpu_ms"]["median"] / max(base["result"]["process_cpu_ms"]["median"], 1e-9), 3)
        print(f"hub process CPU per result, workers ratio: {out['ratio_result_process_cpu_by_workers']}")
    if len(sizes) >= 2:
        out |= size_ratios(rows, worker_counts)
        for w, r in out["ratio_result_cpu_by_size"].items():
            print(f"result CPU ratio {sizes[-1]} / {sizes[0]} nodes, workers={w}: loop {r['loop']}, process {r['process']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0
