"""The node's task loop: long-poll the hub for work, run each signed task in a worker thread
within the node's memory plan and preferences, and deliver its signed result (or decline it).

A mixin of :class:`echo2.node.runtime.Node`, which owns the state named below; apart so that
the node's start-up, downlink and heartbeat (runtime.py) and its work stay each under one read.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import trio

from echo2.models.engine_api import Interrupted
from echo2.protocol import envelope
from echo2.protocol.backoff import Backoff
from echo2.protocol.errors import Echo2Error, Expired, MeaningError
from echo2.protocol.framing import RemoteError
from echo2.protocol.identity import Identity
from echo2.protocol.messages import AdmissionDecision, Completion, Heartbeat, Task, TaskDecline, task_hash
from echo2.protocol.net.control import ControlHost
from echo2.protocol.packedresult import PackedCompletion, PackedResult, pack_ids, pack_logprobs
from echo2.protocol.wire import DECLINE, MAX_CONTROL_REQUEST, MAX_TASK, RESULT, WORK, WORK_POLL_S

from .budget import Budget, Footprint, TaskTooLarge, plan_task
from .config import NodeConfig, NodeStats
from .delivery import deliver_until
from .generate import TaskMeter, generate_bounded
from .hublink import HubLink
from .outbox import Entry
from .pausing import Pauser
from .progress import NodeSteps
from .receipts import ReceiptBook
from .taskloop_delivery import ResultDelivery
from .tasks import TaskRefused, check_task, open_task
from .versions import HeldVersion

log = logging.getLogger("echo2.node.runtime")  # one logger name for the node's work, as before the split

# The hub is the one peer a node cannot work without: retry it often (jittered), but not in a loop.
HUB_BACKOFF_CAP_S = 5.0
# Tasks a node asks for in one WORK request (the hub gives at most its tasks_per_node in flight).
TASKS_PER_ASK = 4


class TaskLoop:
    # owned and set up by Node.__init__
    cfg: NodeConfig
    identity: Identity
    hub_peer: str
    stats: NodeStats
    held: HeldVersion | None
    version_changed: trio.Event
    replay: envelope.ReplayGuard
    steps: NodeSteps
    pauser: Pauser
    receipts: ReceiptBook
    measured: dict[str, float]
    _engine: Any
    _engine_lock: trio.Lock
    _seq: int
    _stop: trio.Event
    _current_task: Task | None
    _queued: deque[Task]  # tasks of a TaskBundle waiting to run (set by _worker)
    _measured_version: int
    _footprint: Footprint | None
    _rows_cap: int
    link: HubLink | None  # the channel to the hub when it is up (hublink.py), else the host
    delivery: ResultDelivery  # the outbox of finished results and its delivery task
    _host: ControlHost | None  # the host the worker was started with (what the delivery sends through)

    @property
    def peer_id(self) -> str:
        raise NotImplementedError

    async def _admit(self, host: ControlHost) -> AdmissionDecision | None:
        raise NotImplementedError

    def _budget(self) -> Budget:
        raise NotImplementedError

    def _write_state(self) -> None:
        raise NotImplementedError

    def _to_hub(self, host: ControlHost) -> HubLink | ControlHost:
        """The link (channel when up) for requests to the hub; a host the caller wrapped (a
        bench's or test's instrumented host) is used as given, so it still sees every request."""
        link = self.link
        return link if link is not None and host is link.host else host

    async def _worker(self, host: ControlHost, scope: trio.CancelScope) -> None:
        backoff = Backoff(base_s=0.5, cap_s=HUB_BACKOFF_CAP_S)
        await self._wait_for_quota()  # results an earlier run left in the outbox count too
        queued = self._queued = deque()  # the rest of a TaskBundle: run before asking again
        while True:
            while queued and self.pauser.paused:  # handed back, as a running task is
                await self._decline(host, queued.popleft(), "paused", self.pauser.current.reason)
            await self.pauser.wait_running()
            if queued:
                task = queued.popleft()
                try:  # checked again: its deadline or the version held may have moved meanwhile
                    check_task(task, me=self.peer_id, held_version=self.held.version if self.held else None, now=time.time())
                except (MeaningError, Expired) as exc:
                    await self._decline(host, task, exc.code, exc.message)
                    continue
                await self._run_task(host, task)
                await self._wait_for_quota()
                continue
            if self.held is None:
                with trio.move_on_after(1.0):
                    await self.version_changed.wait()
                continue
            self._seq += 1
            self.steps.idle()
            hb = Heartbeat(
                peer_id=self.peer_id, seq=self._seq, versions_held=[self.held.version], busy_tasks=0,
                queue_free=self._ask_for(),
            )
            try:
                resp = await self._to_hub(host).request(
                    self.hub_peer, WORK, envelope.seal(self.identity, hb), max_response=MAX_TASK, timeout_s=WORK_POLL_S + 15
                )
            except RemoteError as exc:
                if exc.code == "not_admitted":
                    log.warning("hub no longer knows this node (restarted?): asking for admission again")
                    if await self._admit(host) is None:
                        self._stop.set()
                        return
                    continue
                log.warning("hub refused work request: %s", exc)
                await trio.sleep(backoff.failed())
                continue
            except (Echo2Error, OSError) as exc:
                delay = backoff.failed()
                log.warning("work request failed (%s); retrying in %.1fs", exc, delay)
                await trio.sleep(delay)
                continue
            backoff.reset()
            self.pauser.count_bytes(len(resp))
            try:
                acc = open_task(resp, hub_peer=self.hub_peer, me=self.peer_id,
                                held_version=self.held.version if self.held else None, replay=self.replay)
            except TaskRefused as exc:
                await self._decline(host, exc.task, exc.code, exc.message)
                continue
            except Echo2Error as exc:
                # forged or malformed: never run it, never answer it
                self.stats.tasks_refused += 1
                log.warning("refused task from hub link: %s", exc)
                continue
            for refused in acc.refused:
                await self._decline(host, refused.task, refused.code, refused.message)
            queued.extend(acc.more)
            if acc.task is None:
                if acc.reply is not None and acc.reply.code != "no_work":
                    log.info("hub: %s", acc.reply.message)
                    await trio.sleep(0.5)
                continue
            if self._stop.is_set():  # stopping while the poll was out: handed back at once
                await self._decline(host, acc.task, "shutdown", "node is shutting down")
                await self._abandon_queued(host)
                return
            if self.pauser.paused:  # paused while the poll was out: handed back at once
                await self._decline(host, acc.task, "paused", self.pauser.current.reason)
                continue
            await self._run_task(host, acc.task)
            await self._wait_for_quota()

    async def _abandon_queued(self, host: ControlHost) -> None:
        """Stopping: the tasks of a bundle not yet started go back to the hub at once."""
        while self._queued:
            await self._decline(host, self._queued.popleft(), "shutdown", "node is shutting down")

    def _ask_for(self) -> int:
        """Tasks to ask the hub for at once (Heartbeat.queue_free; > 1 asks for a TaskBundle): the
        hub caps it at its tasks_per_node, so one ask serves up to k tasks instead of one."""
        if not self.cfg.max_tasks:
            return TASKS_PER_ASK
        return max(1, min(TASKS_PER_ASK, self.cfg.max_tasks - self.stats.tasks_done - self.delivery.waiting))

    async def _wait_for_quota(self) -> None:
        """With ``max_tasks``: no more work once the accepted and the waiting results make it up
        (a refused one frees its place again); the delivery's answers stop the node."""
        while self.cfg.max_tasks and self.stats.tasks_done + self.delivery.waiting >= self.cfg.max_tasks:
            await self.delivery.changed()

    async def _decline(self, host: ControlHost, task: Task, code: str, reason: str) -> None:
        self.stats.tasks_declined += 1
        log.warning("declining task %s: %s", task.task_id, reason)
        msg = TaskDecline(task_id=task.task_id, task_hash=task_hash(task), node_id=self.peer_id, reason_code=code, reason=reason)
        try:
            await self._to_hub(host).request(self.hub_peer, DECLINE, envelope.seal(self.identity, msg), max_response=MAX_CONTROL_REQUEST, timeout_s=10)
        except Echo2Error as exc:
            log.debug("decline not delivered: %s", exc)

    def _plan(self, task: Task) -> int:
        """Samples to generate at once for this task; TaskTooLarge when it does not fit at all."""
        if self._footprint is None:
            raise TaskTooLarge("no model is loaded")
        plan = plan_task(
            self._footprint, self._budget(), prompts=len(task.prompts), group_size=task.group_size,
            prompt_len=max((len(p) for p in task.prompts), default=0), max_new_tokens=task.max_new_tokens,
            rows_cap=self._rows_cap,
        )
        return plan.batch_rows

    async def _run_task(self, host: ControlHost, task: Task) -> None:
        started = time.time()
        self._current_task = task
        meter = TaskMeter(len(task.prompts) * task.group_size, task.max_new_tokens)
        self.steps.task(task.task_id, len(task.prompts), task.group_size, task.max_new_tokens, meter)
        async with self._engine_lock:
            version = self._engine.version
            t0 = time.monotonic()
            declined: tuple[str, str] | None = None
            self.delivery.generating()  # what waits in the outbox may wait for this one (outbox.plan)
            try:
                batch_rows = self._plan(task)
                completions, worked = await trio.to_thread.run_sync(generate_bounded, self._engine, task, batch_rows,
                                                                    self.pauser.should_stop, meter)
                if worked < batch_rows:
                    self._rows_cap = worked  # what ran out of memory once is not tried again
            except Interrupted:  # the preferences paused the node: the task goes back to the hub now
                declined = ("paused", self.pauser.current.reason or "computing paused")
            except Echo2Error as exc:  # too large for this node, or the engine refused it (limits, vocabulary)
                declined = (exc.code, exc.message)
            except Exception as exc:  # whatever a task makes the engine do, the node stays up
                log.exception("task %s failed in the engine", task.task_id)
                declined = ("engine_error", f"{type(exc).__name__}: {str(exc)[:300]}")
            gen_s = time.monotonic() - t0
        self._current_task = None
        if declined is not None:
            self.delivery.idle()
            await self._decline(host, task, *declined)
            return
        tokens = sum(len(c.token_ids) for c in completions)
        self.steps.generated(task.task_id, tokens, len(task.prompts) * task.group_size * task.max_new_tokens, gen_s)
        if version != self._measured_version and gen_s > 0:
            self._measured_version = version
            self.measured["tokens_per_s"] = tokens / gen_s
            self.measured["rollouts_per_s"] = len(completions) / gen_s
        # the packed wire form: int32/float32 arrays the hub checks with numpy, where the list form
        # cost it ~4.6 s of per-token Python for a 36 MB result (issue 20; bench intake --big-result-MB)
        try:
            packed = await trio.to_thread.run_sync(pack_completions, completions)
        except ValueError as exc:  # an id outside int32 from the engine: nothing the hub could take
            await self._decline(host, task, "engine_error", str(exc)[:300])
            return
        result = PackedResult(
            task_id=task.task_id,
            task_hash=task_hash(task),
            node_id=self.peer_id,
            version=version,
            completions=packed,
            started_at=started,
            gen_seconds=gen_s,
            tokens=tokens,
        )
        entry = Entry(task_id=task.task_id, deadline=task.deadline, version=version, ready_at=time.time(), size=0,
                      result=result)
        if host is not self._host:  # a caller's own host (a test's or bench's instrumented one): through it, now
            await self._deliver_now(host, entry)
            return
        # into the outbox (on disk) and back to the hub for the next task: the delivery task sends
        # it, with whatever else is finished, while the next one runs (issue 20)
        await self.delivery.put(entry)
        self._write_state()

    async def _deliver_now(self, host: ControlHost, e: Entry) -> None:
        def send() -> Any:
            # sealed afresh for each try (a retry of a request the hub did take must not read as a
            # replay), and each try's bytes count against the transfer caps
            sealed = envelope.seal(self.identity, e.result, ttl_s=300)
            self.pauser.count_bytes(len(sealed))
            return host.request(self.hub_peer, RESULT, sealed, max_response=MAX_CONTROL_REQUEST, timeout_s=30)

        try:  # kept through transient refusals (busy, timeouts) until the task's deadline (A1)
            reply = await deliver_until(send, deadline=min(e.deadline, time.time() + 240),
                                        backoff=Backoff(base_s=0.5, cap_s=HUB_BACKOFF_CAP_S))
        except RemoteError as exc:
            log.warning("hub refused result of task %s: %s", e.task_id, exc)
            await self._on_refused(e, exc.code, exc.message)
            return
        except (Echo2Error, OSError) as exc:
            log.warning("result of task %s not delivered: %s", e.task_id, exc)
            return
        log.info("result of task %s accepted", e.task_id)  # what the crash bench counts as acknowledged
        await self._on_accepted(e, reply)

    async def _on_accepted(self, e: Entry, reply: bytes) -> None:
        self.stats.tasks_done += 1
        self.stats.tokens += e.result.tokens
        await self.receipts.accepted(reply, hub_peer=self.hub_peer, me=self.peer_id, task_id=e.task_id, replay=self.replay)
        self._write_state()
        if self.cfg.max_tasks and self.stats.tasks_done >= self.cfg.max_tasks:
            self._stop.set()

    async def _on_refused(self, e: Entry, code: str, reason: str) -> None:
        self.stats.results_refused += 1
        await self.receipts.refused(hub_peer=self.hub_peer, task_id=e.task_id, code=code, reason=reason)
        self._write_state()

    def _delivery_link(self) -> HubLink | ControlHost:
        assert self._host is not None, "the delivery task runs inside Node.run"
        return self._to_hub(self._host)

    def _make_delivery(self) -> ResultDelivery:
        return ResultDelivery(
            self.cfg.data_dir / "outbox", self.identity, self.hub_peer, to_hub=self._delivery_link,
            on_accepted=self._on_accepted, on_refused=self._on_refused,
            held_version=lambda: self.held.version if self.held is not None else None,
            count_bytes=self.pauser.count_bytes, linger_s=self.cfg.result_linger_ms / 1e3)


def pack_completions(completions: list[Completion]) -> list[PackedCompletion]:
    """The engine's completions in the packed wire form (one numpy conversion per completion)."""
    return [PackedCompletion(c.prompt_index, pack_ids(c.token_ids), pack_logprobs(c.logprobs), c.finish_reason)
            for c in completions]
