"""Task dispatch and staleness admission: pure, sans-IO state machines.

Nothing here touches the network, a clock or trio: every decision takes ``now`` (seconds, any
monotonic or wall clock the caller uses consistently) and the current learner step. The hub's
trio code signs and sends the :class:`TaskAssignment` objects, feeds results/declines/departures
back in, and routes accepted rollouts into a :class:`ReplayBuffer`.

Staleness (BRIEF section 7), with ``S`` the staleness bound and ``t`` the learner step:

* A task carries ``min_version = max(0, t - S)`` where ``t`` is the learner step when the task is
  issued. The node must generate with a policy version ``>= min_version`` (in practice the newest
  it holds); a result reporting a lower version is refused as ``below_min_version``.
* A result is admitted at learner step ``t`` iff ``version >= t - S`` (:func:`admissible`). So
  ``version == t - S`` is admitted and ``t - S - 1`` is dropped and counted (``stale_dropped``).
  The same rule is applied again inside the buffer when a batch is taken, because the learner
  may have advanced while results waited.

Reassignment policy: a task is *closed* exactly once - by an accepted (or stale-dropped) result,
by a decline, by its node leaving, or by expiring past its deadline. Once closed, every further
result for it is refused without counting anything: ``duplicate`` if it had already produced a
result, ``reassigned`` if its prompts were handed back to the queue (decline / node left /
expired). A result that arrives after the deadline but *before* :meth:`Dispatcher.expire` ran is
still accepted (flagged ``late``): the prompts were never handed out twice, so nothing is
double-counted. This keeps every prompt group counted at most once.
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .dispatch_index import CountOn, Deadlines, NodeIndex, plan
from .rate_timing import Timing, rate_of, timed
from .replay_buffer import BufferStats, ReplayBuffer, admissible

__all__ = [
    "BufferStats",
    "DispatchConfig",
    "DispatchStats",
    "Dispatcher",
    "NodeState",
    "PromptGroup",
    "ReplayBuffer",
    "TaskAssignment",
    "Verdict",
    "VerdictCode",
    "admissible",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptGroup:
    """One prompt to be rolled out ``group_size`` times (one GRPO group)."""

    prompt_id: str
    prompt: tuple[int, ...]
    group_size: int
    # what the hub scores the completions against (an env's PromptItem); it travels with the
    # group through requeues, so no side table of prompts is needed
    item: Any = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError("group_size must be >= 1")


@dataclass(frozen=True)
class TaskAssignment:
    """A decided task; the caller turns it into a signed ``messages.Task``."""

    task_id: str
    node_id: str
    groups: tuple[PromptGroup, ...]
    min_version: int
    max_version_lag: int
    issued_at: float
    deadline: float
    expected_s: float

    @property
    def n_rollouts(self) -> int:
        return sum(g.group_size for g in self.groups)

    @property
    def prompts(self) -> list[list[int]]:
        return [list(g.prompt) for g in self.groups]


class VerdictCode(StrEnum):
    ACCEPTED = "accepted"
    STALE = "stale"  # well-formed but version < t - S: dropped and counted, prompts requeued
    DUPLICATE = "duplicate"  # task already produced a result
    REASSIGNED = "reassigned"  # task was declined / expired / its node left; prompts went back
    UNKNOWN_TASK = "unknown_task"
    WRONG_NODE = "wrong_node"
    BELOW_MIN_VERSION = "below_min_version"  # node broke the task's min_version contract
    WRONG_COUNT = "wrong_count"  # completions != sum of group sizes


@dataclass(frozen=True)
class Verdict:
    code: VerdictCode
    task: TaskAssignment | None = None
    late: bool = False  # arrived after the deadline but before expire() reassigned it

    @property
    def accepted(self) -> bool:
        return self.code is VerdictCode.ACCEPTED


_INDEXED = frozenset({"rate", "claimed", "active", "completed_tasks"})


@dataclass
class NodeState:
    node_id: str
    rate: float  # rollouts/s: EWMA of hub-timed completed tasks, seeded by the announced figure
    active: bool = True
    in_flight: set[str] = field(default_factory=set)
    busy_until: float = -math.inf  # when the node's queued work is expected to be done
    last_done_at: float = -math.inf
    completed_tasks: int = 0
    # True while ``rate`` is only the node's own claim: the node is on probation (small tasks,
    # one at a time, weighed at no more than the fleet's median measured rate) until the hub has
    # timed a task of its own
    claimed: bool = False
    # the last timing (rollouts, seconds, rate before it, weight): results that come back
    # together (a node's ResultBatch) extend it instead of reading as done in no time
    last_obs: Timing | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        # the dispatcher's indexes follow rate, probation and activity, whoever assigns them; an
        # assignment of the value already there changes nothing (each result set claimed = False
        # again: an index update of ~4 us for nothing)
        d = self.__dict__
        hook = d.get("_on_change")
        if hook is None or name not in _INDEXED:
            object.__setattr__(self, name, value)
            return
        same = name in d and d[name] == value
        object.__setattr__(self, name, value)
        if not same:
            hook(self, name)


@dataclass
class DispatchStats:
    issued: int = 0
    accepted: int = 0
    accepted_rollouts: int = 0
    stale_dropped: int = 0
    expired: int = 0
    declined: int = 0
    requeued_groups: int = 0
    refused_by_reason: dict[str, int] = field(default_factory=dict)

    def refuse(self, code: VerdictCode) -> None:
        self.refused_by_reason[code.value] = self.refused_by_reason.get(code.value, 0) + 1


@dataclass(frozen=True)
class DispatchConfig:
    staleness: int = 1
    target_task_s: float = 20.0  # a task should take about this long on its node
    max_prompts_per_task: int = 256  # messages.Task allows at most 256 prompts
    max_in_flight_per_node: int = 2  # 2 lets a node start the next task while one result uploads
    deadline_slack: float = 3.0  # deadline = now + slack * expected duration ...
    min_deadline_s: float = 30.0  # ... clamped to [min, max]
    max_deadline_s: float = 900.0
    ewma_alpha: float = 0.3  # weight of the newest observation in the node rate
    min_rate: float = 1e-3  # floor so a node with a bad observation still gets 1-prompt tasks
    closed_memory: int = 100_000  # closed task ids remembered for duplicate detection
    probation_groups: int = 1  # prompt groups per task of a node whose rate the hub has not timed
    # Tasks of all untimed nodes together: admission is cheap (open mode: a key), so a flood of
    # fresh nodes that never answer would otherwise hold one task each until its deadline and
    # take their weight out of every honest node's share (measured: 92 such nodes in 15 s
    # halved the honest rate in `echo2 bench attack` A3). New honest nodes wait their turn; the
    # cap grows with the timed fleet (at least one slot per timed node), so onboarding doubles.
    probation_max_in_flight: int = 4

    def __post_init__(self) -> None:
        if self.staleness < 0:
            raise ValueError("staleness must be >= 0")
        if not 0 < self.ewma_alpha <= 1:
            raise ValueError("ewma_alpha must be in (0, 1]")
        if self.max_prompts_per_task < 1 or self.max_in_flight_per_node < 1:
            raise ValueError("max_prompts_per_task and max_in_flight_per_node must be >= 1")
        if self.min_deadline_s > self.max_deadline_s:
            raise ValueError("min_deadline_s > max_deadline_s")


class Dispatcher:
    """Queue of prompt groups, connected nodes with observed rates, and in-flight tasks."""

    def __init__(self, config: DispatchConfig | None = None, *, task_id_prefix: str | None = None) -> None:
        self.config = config or DispatchConfig()
        # A random prefix keeps task ids unique across hub restarts (nodes may still hold old ones).
        self._prefix = task_id_prefix if task_id_prefix is not None else secrets.token_hex(4)
        self._counter = itertools.count(1)
        self.queue: deque[PromptGroup] = deque()
        self.nodes: dict[str, NodeState] = {}
        self.in_flight: dict[str, TaskAssignment] = {}
        # task id -> (verdict code that later results get, the node it was assigned to); bounded,
        # oldest forgotten first. The assignee outlives the task so that a result naming another
        # node's closed task is still recognised as a forged binding, not a harmless duplicate.
        self._closed: OrderedDict[str, tuple[VerdictCode, str]] = OrderedDict()
        self.stats = DispatchStats()
        # evaluation prompts (learner_hub/evaluation.py): their own queue, since a task carries one
        # group size and temperature; the ids of eval tasks in flight or accepted and not yet handled
        self.eval_queue: deque[PromptGroup] = deque()
        self.eval_tasks: set[str] = set()
        self.index = NodeIndex(self.config.max_in_flight_per_node)
        self._count_on, self._deadlines = CountOn(), Deadlines()
        self.timing_changed: set[str] = set()

    # ---- queue and nodes -------------------------------------------------------------------
    def submit(self, groups: Iterable[PromptGroup]) -> None:
        self.queue.extend(groups)

    def add_node(self, node_id: str, rate: float, *, active: bool = True, claimed: bool = False) -> None:
        """Register (or refresh) a node; ``rate`` is its rollouts per second, used until hub-timed
        results replace it. ``claimed``: the figure is the node's own word (its Announce), so the
        node is on probation until the hub has timed one of its tasks."""
        st = self.nodes.get(node_id)
        if st is None:
            st = self.nodes[node_id] = NodeState(node_id, max(rate, self.config.min_rate), active, claimed=claimed)
            st.__dict__["_on_change"] = self._node_changed
            self.index.update(st)
        else:
            st.active = active

    def _node_changed(self, st: NodeState, name: str) -> None:
        self.index.update(st)
        if name != "active" and not st.claimed:  # a hub-timed rate moved: the fleet's overclaim check
            self.timing_changed.add(st.node_id)  # and rate save read these (10,000 claims seeded at
            # admission, or a step's activity changes, were as many useless visits by the next tick)
        if name == "claimed":
            self._count_on.node_timed(st.in_flight, not st.claimed)

    def set_active(self, node_ids: Iterable[str]) -> None:
        """Apply an activation decision: only these nodes receive new tasks (in-flight tasks of
        deactivated nodes are left to finish)."""
        wanted = set(node_ids)
        for nid, st in self.nodes.items():
            st.active = nid in wanted

    def set_node_active(self, node_id: str, active: bool) -> None:
        """One node's part of :meth:`set_active` (the hub applies changes as they happen)."""
        st = self.nodes.get(node_id)
        if st is not None and st.active != active:
            st.active = active

    def rate_of(self, node_id: str) -> float:
        return self.nodes[node_id].rate

    def measured_rate(self, node_id: str) -> float | None:
        """The hub-timed rate, or None while the node's figure is only its claim."""
        st = self.nodes.get(node_id)
        return None if st is None or st.claimed else st.rate

    def groups_to_count_on(self, now: float) -> int:
        """Prompt groups in flight that the pipeline may count on to come back: tasks of nodes the
        hub has timed, until twice their expected time (a task that late is probably lost).

        A task of a node on probation is speculative: its expected time is the node's own claim.
        Counted as supply, one such task that is never answered held a step's last groups until
        its deadline while the honest fleet idled (A10: an admitted liar cut the honest rate to
        0.31 of the baseline in ``echo2 bench attack``). Not counting it costs at most the
        probation tasks' groups in extra rollouts (``probation_max_in_flight`` x
        ``probation_groups``), which the next step uses.
        """
        counted = self._count_on.at(now)
        if counted is not None:
            return counted
        n = 0  # asked about an earlier moment than before: the index moved on, so scan
        for t in self.in_flight.values():
            st = self.nodes.get(t.node_id)
            if st is not None and not st.claimed and now <= t.issued_at + 2 * t.expected_s + 1.0:
                n += len(t.groups)
        return n

    def timed_tasks(self, node_id: str) -> int:
        st = self.nodes.get(node_id)
        return 0 if st is None else st.completed_tasks

    def _reference_rate(self) -> float | None:
        """The median hub-timed rate of the fleet: what a node on probation is weighed at, at most."""
        return self.index.reference_rate()

    def planning_rate(self, node_id: str) -> float:
        """The rate to plan with: measured if timed, else the claim capped at the fleet's median
        measured rate (a claim alone never outweighs what the hub has seen)."""
        st = self.nodes[node_id]
        if not st.claimed:
            return st.rate
        ref = self._reference_rate()
        return st.rate if ref is None else min(st.rate, ref)

    # ---- decisions -------------------------------------------------------------------------
    def next_tasks(self, now: float, learner_version: int, limit: int | None = None) -> list[TaskAssignment]:
        """Fill every active node up to ``max_in_flight_per_node`` tasks, fastest node first, each
        task sized so it takes about ``target_task_s`` at the node's observed rate; a node's task
        never takes more than its rate-weighted share of the queue, and nodes on probation share
        ``probation_max_in_flight`` slots (at least one per timed node). Read off the indexes, so
        its cost follows the tasks issued (:func:`.dispatch_index.plan`); ``limit``: in slices."""
        return plan(self, now, learner_version, limit)

    def next_eval_tasks(self, now: float, min_version: int, holders: Iterable[str]) -> list[TaskAssignment]:
        """Tasks from the eval queue for the active nodes in ``holders`` (those holding the
        evaluated version), fastest first, before any training task: an evaluation is waited for."""
        cfg = self.config
        out: list[TaskAssignment] = []
        wanted = set(holders)
        order = sorted((st for st in self.nodes.values() if st.active and st.node_id in wanted),
                       key=lambda s: (-self.planning_rate(s.node_id), s.node_id))
        total_rate = sum(self.planning_rate(st.node_id) for st in order) or 1.0
        queued, progress = len(self.eval_queue), True
        while self.eval_queue and progress:
            progress = False
            for st in order:
                if not self.eval_queue:
                    break
                if len(st.in_flight) >= (1 if st.claimed else cfg.max_in_flight_per_node):
                    continue
                share = max(1, math.ceil(queued * self.planning_rate(st.node_id) / total_rate))
                task = self._make_task(now, st, min_version, share, queue=self.eval_queue)
                self.eval_tasks.add(task.task_id)
                out.append(task)
                self.index.update(st)
                progress = True
        return out

    def eval_handled(self, task_id: str) -> bool:
        """True (once) for an accepted eval task: the hub scores it and forgets it."""
        if task_id in self.eval_tasks and task_id not in self.in_flight:
            self.eval_tasks.discard(task_id)
            return True
        return False

    def _make_task(
        self, now: float, st: NodeState, min_version: int, max_groups: int | None = None,
        queue: deque[PromptGroup] | None = None,
    ) -> TaskAssignment:
        cfg = self.config
        q = self.queue if queue is None else queue
        budget = st.rate * cfg.target_task_s  # rollouts the node should do in target_task_s
        cap = cfg.max_prompts_per_task if max_groups is None else min(cfg.max_prompts_per_task, max(1, max_groups))
        groups: list[PromptGroup] = [q.popleft()]
        n = groups[0].group_size
        while q and len(groups) < cap and n + q[0].group_size <= budget:
            g = q.popleft()
            groups.append(g)
            n += g.group_size
        expected = n / st.rate
        deadline = now + min(cfg.max_deadline_s, max(cfg.min_deadline_s, cfg.deadline_slack * expected))
        # Tasks queued behind others on the same node only start later; the deadline must allow it.
        start = max(now, st.busy_until)
        deadline += start - now
        st.busy_until = start + expected
        task = TaskAssignment(
            task_id=f"{self._prefix}-{next(self._counter)}",
            node_id=st.node_id,
            groups=tuple(groups),
            min_version=min_version,
            max_version_lag=cfg.staleness,
            issued_at=now,
            deadline=deadline,
            expected_s=expected,
        )
        self.in_flight[task.task_id] = task
        st.in_flight.add(task.task_id)  # the caller re-indexes st (not while it walks the index)
        self._count_on.opened(task.task_id, st.node_id, now + 2 * expected + 1.0, len(groups), not st.claimed)
        self._deadlines.add(task.task_id, deadline)
        self.stats.issued += 1
        return task

    def on_result(
        self,
        now: float,
        task_id: str,
        node_id: str,
        result_version: int,
        learner_version: int,
        n_completions: int,
    ) -> Verdict:
        """Judge a (signature-checked) result. Only ``accepted`` results go to the buffer."""
        task = self.in_flight.get(task_id)
        if task is None:
            code = self._closed.get(task_id, (VerdictCode.UNKNOWN_TASK, ""))[0]
            self.stats.refuse(code)
            log.info("result for task %s from %s refused: %s", task_id, node_id, code.value)
            return Verdict(code)
        if task.node_id != node_id:
            # Leave the task in flight: a third party's result says nothing about the real node.
            self.stats.refuse(VerdictCode.WRONG_NODE)
            log.warning("result for task %s from %s but assigned to %s", task_id, node_id, task.node_id)
            return Verdict(VerdictCode.WRONG_NODE, task)
        if n_completions != task.n_rollouts:
            self._close(task, VerdictCode.REASSIGNED, requeue=True)
            self.stats.refuse(VerdictCode.WRONG_COUNT)
            log.warning("task %s: %d completions, expected %d", task_id, n_completions, task.n_rollouts)
            return Verdict(VerdictCode.WRONG_COUNT, task)
        if result_version < task.min_version:
            self._close(task, VerdictCode.REASSIGNED, requeue=True)
            self.stats.refuse(VerdictCode.BELOW_MIN_VERSION)
            log.warning("task %s: version %d < min_version %d", task_id, result_version, task.min_version)
            return Verdict(VerdictCode.BELOW_MIN_VERSION, task)
        late = now > task.deadline
        # The work was done either way, so the timing is a valid rate observation.
        self._observe_rate(now, task)
        # an eval result is never trained: its version was fixed by min_version, staleness is moot
        if task_id not in self.eval_tasks and not admissible(result_version, learner_version, self.config.staleness):
            # Stale rollouts are useless to the learner, but the prompts still need rollouts.
            self._close(task, VerdictCode.DUPLICATE, requeue=True)
            self.stats.stale_dropped += 1
            self.stats.refuse(VerdictCode.STALE)
            return Verdict(VerdictCode.STALE, task, late)
        self._close(task, VerdictCode.DUPLICATE, requeue=False)
        self.stats.accepted += 1
        self.stats.accepted_rollouts += task.n_rollouts
        return Verdict(VerdictCode.ACCEPTED, task, late)

    def _observe_rate(self, now: float, task: TaskAssignment) -> None:
        st = self.nodes.get(task.node_id)
        if st is None:
            return
        # Hub-timed: the node works its queue serially, so this task started when it was issued or
        # when the node's previous result came back, whichever is later.
        start = max(task.issued_at, st.last_done_at)
        elapsed = now - start
        st.last_done_at = now
        st.completed_tasks += 1
        obs = timed(st.last_obs, task.n_rollouts, elapsed, st.rate, st.claimed, self.config.ewma_alpha)
        if obs is None:
            return
        st.last_obs, st.claimed = obs, False
        st.rate = rate_of(obs, self.config.min_rate)

    def assignee(self, task_id: str) -> str | None:
        """The node a task in flight or recently closed was issued to (None: not known)."""
        task = self.in_flight.get(task_id)
        if task is not None:
            return task.node_id
        closed = self._closed.get(task_id)
        return closed[1] if closed is not None else None

    def on_decline(self, task_id: str, node_id: str, reason: str = "") -> bool:
        """The node refused the task; its prompts go back to the front. False if not applicable."""
        task = self.in_flight.get(task_id)
        if task is None or task.node_id != node_id:
            return False
        log.info("task %s declined by %s: %s", task_id, node_id, reason)
        self.stats.declined += 1
        self._close(task, VerdictCode.REASSIGNED, requeue=True)
        return True

    def on_node_left(self, node_id: str) -> list[str]:
        """Forget the node; its in-flight tasks' prompts go back to the front of the queue."""
        st = self.nodes.pop(node_id, None)
        if st is None:
            return []
        st.__dict__["_on_change"] = None
        self.index.remove(node_id)
        # in_flight is in issue order; requeue newest first so the oldest prompts end up in front
        ids = [tid for tid in reversed(self.in_flight) if tid in st.in_flight]
        for tid in ids:
            self._close(self.in_flight[tid], VerdictCode.REASSIGNED, requeue=True)
        return ids

    def expire(self, now: float) -> list[str]:
        """Close tasks past their deadline; their prompts go back to the front of the queue."""
        # newest first (in_flight is in issue order) so the oldest prompts end up in front
        late = self._deadlines.due(now, self.in_flight)
        for t in late:
            self.stats.expired += 1
            st = self.nodes.get(t.node_id)
            if st is not None:
                # it could not do n rollouts in (now - issued) seconds: its rate is at most that
                observed = t.n_rollouts / max(now - t.issued_at, 1e-9)
                st.rate = max(self.config.min_rate, min(st.rate, observed))
            self._close(t, VerdictCode.REASSIGNED, requeue=True)
        return [t.task_id for t in late]

    def seed_rate(self, node_id: str, rate: float) -> None:
        """Use a node's own measured rate until the hub has timed one of its tasks."""
        st = self.nodes.get(node_id)
        if st is not None and st.claimed and st.completed_tasks == 0 and rate > 0:
            st.rate = max(self.config.min_rate, rate)

    def _close(self, task: TaskAssignment, later: VerdictCode, *, requeue: bool) -> None:
        del self.in_flight[task.task_id]
        self._count_on.closed(task.task_id)
        st = self.nodes.get(task.node_id)
        if st is not None:
            st.in_flight.discard(task.task_id)
            if not st.in_flight:
                st.busy_until = -math.inf
            self.index.update(st)
        self._closed[task.task_id] = (later, task.node_id)
        while len(self._closed) > self.config.closed_memory:
            self._closed.popitem(last=False)
        if requeue:
            if task.task_id in self.eval_tasks:
                self.eval_tasks.discard(task.task_id)
                self.eval_queue.extendleft(reversed(task.groups))
            else:
                self.queue.extendleft(reversed(task.groups))
            self.stats.requeued_groups += len(task.groups)
