"""Tasks out: prompts into the dispatcher's queue, signed tasks into the nodes' mailboxes.

The refill keeps just enough prompt groups in the pipeline for the staleness bound, drawing them
from the recipe's prompt source and saving its position in the store as it goes; the pump asks
intake for tasks (intake remembers what it asked, to judge the answers) for the nodes that hold a
fresh enough version, signs them and wakes the node's pending heartbeat.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from echo2.protocol import envelope
from echo2.protocol.identity import Identity
from echo2.protocol.messages import MAX_BUNDLE_TASKS, Task, TaskBundle, bundle_payload, task_payload

from .config import HubConfig
from .data import POSITION_KEY, PromptSource
from .dispatch import PromptGroup
from .dispatch_index import HeldVersions
from .evaluation import Evaluator, parse_eval_prompt_id
from .fleet import Fleet
from .intake import Intake, TaskParams
from .store import HubStore
from .storeworker import StoreWorker
from .training import Trainer


class Outbox:
    def __init__(
        self,
        cfg: HubConfig,
        identity: Identity,
        source: PromptSource,
        tok: Any,
        intake: Intake,
        trainer: Trainer,
        fleet: Fleet,
        store: StoreWorker,
    ) -> None:
        self.cfg, self.identity, self.source, self.tok = cfg, identity, source, tok
        self.intake, self.trainer, self.fleet, self.store = intake, trainer, fleet, store
        self.dispatcher = intake.dispatcher
        self.rng = random.Random(cfg.seed)
        # Why the draw position and not prompt_seq: prompt_seq comes back from the last checkpoint,
        # so prompts drawn after it (some already trained: their results are restored) would be
        # drawn again. The position is queued to the store before the tasks holding its prompts,
        # so a task on record implies its prompts are past the saved position.
        source.restore(store.get_meta(POSITION_KEY))
        self.evaluator: Evaluator | None = None  # set by the hub when eval_every > 0
        # Tasks issued per pump at most (None: all there are), and what to call when a pump stopped
        # there: the hub then pumps again on its loop's next pass (Hub.issue_slices). Why: one pump
        # after a learner step or a batch of results issued thousands of tasks in one step of the
        # loop (one step of 240 ms at 10,000 nodes, the loop's lag p99, `echo2 bench intake`).
        self.pump_slice: int | None = None
        self.more_to_pump: Callable[[], object] = lambda: None
        # Prompt groups one refill draws at most (None: all it needs), the rest on the next passes
        # with the pump's. Why: a refill after a learner step draws a whole batch (prompts_per_step
        # groups, each rendered into a PromptItem: ~10-15 us), and `echo2 bench intake --clients 2
        # --nodes 10000` measured 2.5-6 ms of the loop per 330 groups drawn at once: a hub training
        # 10,000 prompts a step would stall its loop for ~100 ms at each step.
        self.refill_slice: int | None = None
        self._refill_more = False  # a refill stopped at its slice: the next slice is due
        self._eligible_min_v: int | None = None  # the min_v the dispatcher's active flags were set for
        self._held = HeldVersions()  # the nodes by the version they hold
        self.eval_params = TaskParams(1 if cfg.eval_temperature == 0 else cfg.group_size, cfg.max_new_tokens,
                                      cfg.eval_temperature, cfg.top_p)

    def refill(self) -> None:
        """Keep B·max(1, S-1) groups in the pipeline: the next batch(es), never more than S allows."""
        remaining_steps = self.cfg.steps - self.trainer.learner.version
        if remaining_steps <= 0:
            return
        # Rollouts queued beyond B·(S-1) would be consumed more than S steps after their version
        # was current (one step of lag is the version still travelling to the nodes), so they
        # would be dropped as stale: over-generation is pure waste.
        target = self.cfg.prompts_per_step * min(max(1, self.cfg.staleness - 1), remaining_steps)
        # only work the hub can count on coming back: not a lost task, nor a node's first (A10)
        in_flight = self.dispatcher.groups_to_count_on(time.time())
        need = target - (len(self.dispatcher.queue) + in_flight + len(self.trainer.buffer))
        self._refill_more = False
        if need <= 0:
            return
        if self.refill_slice is not None and need > self.refill_slice:
            need, self._refill_more = self.refill_slice, True
            self.more_to_pump()
        groups = []
        for item in self.source.draw(need):
            self.trainer.prompt_seq += 1
            groups.append(PromptGroup(f"p{self.trainer.prompt_seq}", item.ids, self.cfg.group_size, item))
        self.store.submit(HubStore.set_meta, POSITION_KEY, self.source.position())
        self.dispatcher.submit(groups)

    def pump(self) -> None:
        """Hand queued prompt groups to nodes that hold a fresh enough version."""
        now = time.time()
        t = self.trainer.consume_step()
        min_v, active, nodes = max(0, t - self.cfg.staleness), self.fleet.active, self.fleet.nodes
        self._apply_eligibility(min_v, active, nodes)
        tasks = self._eval_tasks(now) + self.intake.issue(now, t, nodes, lambda: self.rng.randrange(2**62),
                                                          self.pump_slice)
        if self.dispatcher.index.resume is not None:  # stopped at the slice: the rest on the next pass
            self.more_to_pump()
        if tasks:  # one store transaction for what this pump issued
            self.store.submit(HubStore.record_tasks, [(x.task_id, x.node_id, now, x.deadline, len(x.prompts) * x.group_size)
                                                      for x in tasks])
        for task in tasks:
            self.fleet.task_issued(task.task_id, task.node_id)
            node = nodes[task.node_id]
            node.mailbox.append(task)
            node.wake()

    def seal(self, task: Task) -> bytes:
        """The signed task, when its node takes it."""
        ttl = self._ttl(task)
        # the bytes issue hashed (Intake._tasks): a task is encoded once, not validated again
        payload = self.intake.book.take_payload(task.task_id)
        return envelope.seal(self.identity, task, ttl_s=ttl, payload=payload)

    def seal_some(self, mailbox: deque[Task], k: int) -> bytes:
        """The first task of ``mailbox`` alone (k <= 1: every node before TaskBundle) or up to
        ``k`` of them in one signed TaskBundle, taken from the mailbox; tasks that would not fit
        the bundle's size stay for the next ask."""
        if k <= 1 or len(mailbox) == 1:
            return self.seal(mailbox.popleft())
        tasks: list[Task] = []
        payloads: list[bytes] = []
        room = TaskBundle.MAX_SIZE - 4096  # the envelope's own fields and the bundle's header
        while mailbox and len(tasks) < min(k, MAX_BUNDLE_TASKS):
            task = mailbox[0]
            payload = self.intake.book.take_payload(task.task_id) or task_payload(task)
            if tasks and len(payload) > room:
                self.intake.book.put_payload(task.task_id, payload)
                break
            mailbox.popleft()
            tasks.append(task)
            payloads.append(payload)
            room -= len(payload)
        if len(tasks) == 1:
            return envelope.seal(self.identity, tasks[0], ttl_s=self._ttl(tasks[0]), payload=payloads[0])
        bundle = TaskBundle(tasks=tasks)
        return envelope.seal(self.identity, bundle, ttl_s=min(self._ttl(t) for t in tasks), payload=bundle_payload(payloads))

    @staticmethod
    def _ttl(task: Task) -> float:
        # within the node's replay window (600 s), however long the deadline
        return min(540.0, max(60.0, task.deadline - time.time() + 60.0))

    def _apply_eligibility(self, min_v: int, active: set[str] | None, nodes: dict[str, Any]) -> None:
        """Only nodes that hold a version >= ``min_v`` and are activated get tasks: the nodes the
        fleet saw change, and when ``min_v`` moves up (once a learner step) the nodes holding a
        version it passed (dispatch_index.HeldVersions); a full pass only the first time, or if
        ``min_v`` ever moves down."""
        changed, held, last = self.fleet.eligibility_changed, self._held, self._eligible_min_v
        if last is None or min_v < last:
            for p in changed:
                if p not in nodes:
                    held.held(p, None)
            for p, n in nodes.items():
                held.held(p, n.held_version)
            self.dispatcher.set_active(
                p for p, n in nodes.items() if n.held_version >= min_v and (active is None or p in active)
            )
        else:
            for p in held.between(last, min_v):  # fell behind: none of them is eligible any more
                self.dispatcher.set_node_active(p, False)
            for p in changed:
                n = nodes.get(p)
                held.held(p, n.held_version if n is not None else None)
                self.dispatcher.set_node_active(
                    p, n is not None and n.held_version >= min_v and (active is None or p in active))
        self._eligible_min_v = min_v
        changed.clear()

    def _eval_tasks(self, now: float) -> list[Task]:
        """Start the evaluation due at the learner's step; eval tasks for the nodes holding the
        version each queued evaluation measures (issued before training tasks: it is waited for)."""
        ev = self.evaluator
        if ev is None:
            return []
        step = self.trainer.learner.version
        target = ev.due(step)
        if target is not None:
            self.dispatcher.eval_queue.extend(ev.start(target))
        if not self.dispatcher.eval_queue:
            return []
        # the oldest queued evaluation's step: a task asks a version at least that
        version = min(parse_eval_prompt_id(g.prompt_id) or (step, 0) for g in self.dispatcher.eval_queue)[0]
        active, nodes = self.fleet.active, self.fleet.nodes
        holders = [p for p, n in nodes.items() if n.held_version >= version and (active is None or p in active)]
        return self.intake.issue_eval(now, version, holders, lambda: self.rng.randrange(2**62), self.eval_params)

    def feed(self) -> None:
        self.refill()
        self.pump()

    def next_slice(self) -> None:
        """What a refill or a pump stopped at its slice left: the next slice of each."""
        if self._refill_more:
            self.refill()
        self.pump()
