"""The client processes of ``echo2 bench intake --clients K`` (bench/intake_live.py holds the hub
process and the orchestration, and says what each phase measures): each drives its share of the
simulated fleet's identities, every one over its own authenticated channel, answering tasks with
valid signed PackedResults (alone, or several in one ResultBatch) or asking for work as a
heartbeat, and puts its counts on the orchestrator's queue at the phase's end."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter
from typing import Any

SMALL_COMPLETIONS = 8
SMALL_TOKENS = 64


def _seed(i: int) -> bytes:
    return (b"echo2-bench-intake-live" + i.to_bytes(8, "big")).ljust(32, b"\x00")[:32]


@dataclasses.dataclass
class _SenderState:
    ready: Any  # a trio.Event: something is finished
    busy: bool = False
    dry: bool = False  # the hub had no task for the last ask: send what is finished


def _client_proc(role: str, info: dict[str, Any], seeds: list[int], batch: int, duration_s: float, out: Any,
                 go: Any, close: Any) -> None:
    import logging

    import trio

    logging.getLogger("echo2").setLevel(logging.ERROR)
    out.put(trio.run(_client_main, role, info, seeds, batch, duration_s, out, go, close))


async def _client_main(role: str, info: dict[str, Any], seeds: list[int], batch: int, duration_s: float, out: Any,
                       go: Any, close: Any) -> dict[str, Any]:
    """Every identity's channel is opened first (untimed: a node keeps its channel), then the
    phase starts when the orchestrator says go; the counts are put on ``out`` at its end, and
    the channels closed when the orchestrator says ``close`` (untimed as well)."""
    import random

    import trio

    from echo2.protocol import envelope
    from echo2.protocol.backoff import backoff_delay
    from echo2.protocol.batchmessages import BatchAck, ResultBatch
    from echo2.protocol.errors import Echo2Error
    from echo2.protocol.framing import RemoteError
    from echo2.protocol.identity import Identity
    from echo2.protocol.messages import ErrorReply, Heartbeat, Task, TaskBundle, task_hash
    from echo2.protocol.net.channel import ChannelClient
    from echo2.protocol.packedresult import PackedCompletion, PackedResult, pack_ids, pack_logprobs
    from echo2.protocol.wire import MAX_CONTROL_REQUEST, MAX_TASK, RESULT, RESULTS, WORK

    rng = random.Random(seeds[0] if seeds else 0)
    plain: list[int] = info["plain"]
    c: Counter[str] = Counter()
    first_error: dict[str, str] = {}
    n_tokens = int(info.get("tokens", SMALL_TOKENS))  # the hub's max_new_tokens (--tokens)
    lps = pack_logprobs([-0.5] * n_tokens)
    # completions drawn from a pool made once: at 512 tokens a fresh draw of every id was ~4,000
    # random choices a result, and the clients' core, not the hub, set the pace. The hub's work
    # per completion (its checks, detokenising, rewards, storing) does not depend on repeats.
    pool = [pack_ids([rng.choice(plain) for _ in range(n_tokens)]) for _ in range(64)]

    def result_for(node: Identity, task: Task) -> bytes:
        comps = [PackedCompletion(i, rng.choice(pool), lps, "length")
                 for i in range(len(task.prompts)) for _ in range(task.group_size)]
        c["completions"] += len(comps)
        r = PackedResult(task_id=task.task_id, task_hash=task_hash(task), node_id=node.peer_id, version=0,
                         completions=comps, started_at=time.time(), gen_seconds=0.1, tokens=n_tokens * len(comps))
        return envelope.seal(node, r, ttl_s=300)

    async def heartbeat(ch: ChannelClient, node: Identity, seq: int, want: int = 1) -> list[Task]:
        """One WORK ask for up to ``want`` tasks (a TaskBundle when the hub has several waiting)."""
        hb = Heartbeat(peer_id=node.peer_id, seq=seq, versions_held=[0], busy_tasks=0, queue_free=want)
        reply = await ch.request(WORK, envelope.seal(node, hb), max_response=MAX_TASK, timeout_s=30)
        c["heartbeats"] += 1
        m = envelope.open_envelope(reply, (Task, TaskBundle, ErrorReply), replay=None).message
        tasks = [m] if isinstance(m, Task) else m.tasks if isinstance(m, TaskBundle) else []
        if tasks:
            c["heartbeats_with_task"] += 1
            c["tasks_received"] += len(tasks)
        return tasks

    async def send_once(node: Identity, ch: ChannelClient, sealed: list[bytes]) -> list[bytes]:
        """One RESULT or RESULTS request; the items the hub answered ``busy``."""
        c["messages"] += 1
        if len(sealed) == 1:
            try:
                await ch.request(RESULT, sealed[0], max_response=MAX_CONTROL_REQUEST, timeout_s=60)
                c["accepted"] += 1
            except RemoteError as exc:
                c["refused:" + exc.code] += 1
                return sealed if exc.code == "busy" else []
            return []
        msg = envelope.seal(node, ResultBatch(node_id=node.peer_id, results=sealed), ttl_s=300)
        reply = await ch.request(RESULTS, msg, max_response=MAX_CONTROL_REQUEST, timeout_s=60)
        again = []
        for item, v in zip(sealed, envelope.open_envelope(reply, BatchAck, replay=None).message.verdicts, strict=True):
            c["accepted" if v.accepted else "refused:" + v.code] += 1
            if v.code == "busy":
                again.append(item)
        return again

    async def send(node: Identity, ch: ChannelClient, sealed: list[bytes]) -> None:
        """Delivers ``sealed`` as a node does (node/taskloop_delivery.py): what the hub answers
        ``busy`` (its intake queues are full for a moment) is sent again after the node's jittered
        capped backoff (0.5 s doubling). Dropped, each busy item's task stayed in flight until its deadline, and the
        identity's batches shrank for the rest of the phase (with 2 workers 225-320 results/s
        against ~800 with none, ~120 items refused)."""
        failures = 0
        while sealed := await send_once(node, ch, sealed):
            failures += 1
            c["resent"] += len(sealed)
            await trio.sleep(backoff_delay(failures, base_s=0.5, cap_s=5.0, rng=rng))

    async def worker(node: Identity, ch: ChannelClient, end: float) -> None:
        """Asks for work and "runs" each task at once, as a node whose B tasks finish together: the
        sender sends when B are finished, or fewer when the hub had no more work to give."""
        finished: list[bytes] = []
        state = _SenderState(trio.Event())

        async def fetch() -> None:
            seq = 0
            while trio.current_time() < end:  # never cancelled mid-request: the phase ends between asks
                seq += 1
                # asks for what its next batch still lacks, as a node asks for its free queue
                # (taskloop): a full batch waiting for the sender is on its way, not held (counted
                # as held, every ask after the first was for 1 task once the hub answered quickly)
                tasks = await heartbeat(ch, node, seq, batch - len(finished) % batch)
                finished.extend(result_for(node, t) for t in tasks)
                state.dry = not tasks
                if finished and (len(finished) >= batch or state.dry):
                    state.ready.set()

        async def sender() -> None:
            while True:
                if not (finished and (len(finished) >= batch or state.dry)):
                    state.ready = trio.Event()
                    await state.ready.wait()
                if not finished:
                    continue  # woken at the end of the asks with nothing left to send
                items = finished[:batch]
                del finished[:batch]
                state.busy = True
                try:
                    await send(node, ch, items)
                finally:
                    state.busy = False

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ch.run)
            try:
                async with trio.open_nursery() as inner:
                    inner.start_soon(sender)
                    await fetch()
                    state.dry = True  # no more asks: what is finished goes now, whatever its count
                    state.ready.set()
                    with trio.move_on_after(60):  # what is finished is still delivered
                        while finished or state.busy:
                            await trio.sleep(0.05)
                    inner.cancel_scope.cancel()
            except* Echo2Error as group:
                for exc in group.exceptions:
                    code = getattr(exc, "code", "error")
                    c["errors:" + code] += 1
                    first_error.setdefault(code, str(exc)[:300])
            finally:
                nursery.cancel_scope.cancel()

    async def poller(node: Identity, ch: ChannelClient) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ch.run)
            with contextlib.suppress(Echo2Error):
                # as many asks as it holds tasks (the hub's tasks_per_node): each answered at once
                # (two asks each at 100 nodes were 136 heartbeats, ~40 ms of hub CPU, and /proc counts
                # CPU in 10 ms ticks: the figure moved in steps of 0.07 ms a heartbeat)
                for seq in range(1, min(max(2, batch), 16) + 1):
                    if not await heartbeat(ch, node, seq):
                        break
            nursery.cancel_scope.cancel()

    nodes = [Identity.from_seed(_seed(s)) for s in seeds]
    channels = [await ChannelClient.open(info["addr"], node, info["hub_id"]) for node in nodes]
    out.put("ready")
    await trio.to_thread.run_sync(go.wait)
    t0 = trio.current_time()
    with trio.move_on_after(duration_s + 120) as bound:  # a stuck exchange ends the phase, counted
        async with trio.open_nursery() as nursery:
            for node, ch in zip(nodes, channels, strict=True):
                if role == "work":
                    nursery.start_soon(worker, node, ch, t0 + duration_s)
                else:
                    nursery.start_soon(poller, node, ch)
    if bound.cancelled_caught:
        c["errors:phase_timeout"] += 1
    # the counts go first and the channels close after the orchestrator has read the hub's CPU: a
    # node keeps its channel for its whole session, so closing 1,000 at once (the heartbeat phase's
    # pollers) is not the phase's work (it was ~0.05 ms "per heartbeat" of teardown)
    out.put(dict(c) | {"wall_s": trio.current_time() - t0, "first_error": first_error})
    await trio.to_thread.run_sync(close.wait)
    for ch in channels:
        await ch.aclose()
    return {"closed": len(channels)}
