"""Intake: a verified Result in, a verdict out. Pure: no I/O, no trio, no SQLite, no clock.

The hub opens the envelope (signature, replay, signer admitted) and hands the Result here. Intake
checks it against the task it answers and decides one of three things:

* :class:`Accept`: rows (one :class:`~echo2.learner_hub.rows.Group` per prompt) and each
  completion's decoded text, which the hub's reward functions (:mod:`.rewards`, in threads: they
  are the operator's code) score before the store, the ledger and training see the rows;
* :class:`Refuse`: a well-formed result the hub cannot use (stale, duplicate, reassigned, ...),
  with the dispatcher's reason code; the node is not blamed;
* :class:`Punish`: a result that cannot be honest (another node's task, a task hash that does not
  match, completions the task could not have produced); the node's reputation pays.

Intake also issues tasks (it must remember what it asked for to judge the answer), and owns the
:class:`TaskBook`, the one record of task state outside the dispatcher's scheduling view.
"""

from __future__ import annotations

import array
import dataclasses
import sys
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from echo2.protocol.errors import Echo2Error, MeaningError, SignerNotAllowed
from echo2.protocol.hashing import digest
from echo2.protocol.messages import Task, task_payload

from .dispatch import Dispatcher, TaskAssignment
from .intake_check import (
    AnyResult,
    CompactSample,
    Findings,
    Limits,
    TaskView,
    completion_arrays,
    find,
    finish_of,
    result_tokens,
)
from .recipe import PromptItem
from .rows import Group, Sample

__all__ = ["Accept", "AnyResult", "Intake", "Punish", "Refuse", "TaskBook", "TaskParams", "Verdict",
           "completion_arrays", "derive_finish_reason", "float32_array", "result_tokens", "sample_of"]


@dataclass
class TaskEntry:
    """What the hub must remember about one task until it is fully done with it."""

    node_id: str
    _hash: bytes = b""
    buffered: int = 0  # groups of its accepted result still waiting to be trained (0: in flight)
    accepted: bool = False
    payload: bytes | None = None  # the task's canonical bytes (its hash's input) until it is sealed
    # the issued task until it is first encoded: when its node takes it (Outbox.seal) or a result
    # names it. Encoding and hashing at issue put ~20 us a task into the pump, and a learner step
    # that frees hundreds of tasks issues them in one pass of the loop (`echo2 bench intake`:
    # ~14 ms a step at ~750 results/s, the loop's lag p99 with workers 0); now the cost comes with
    # each node's WORK ask, and a task never taken (its node left) is never encoded
    task: Task | None = None

    @property
    def task_hash(self) -> bytes:
        """The task's hash (what a result must be bound to); b"" for an entry without a task."""
        if self.task is not None:
            self._encode(self.task)
        return self._hash

    def _encode(self, task: Task) -> None:
        self.payload = task_payload(task)
        self._hash, self.task = digest(self.payload), None


class TaskBook:
    """Every task the hub still has to think about, one entry each: in flight (its hash judges
    the answer) or accepted with groups still waiting to be trained (their step marks the result
    trained in the store). An entry goes when the task closes unaccepted or when its last group
    is trained or dropped, so the book holds at most the tasks in flight plus those in the buffer."""

    def __init__(self) -> None:
        self._tasks: dict[str, TaskEntry] = {}

    def __len__(self) -> int:
        return len(self._tasks)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._tasks

    def open(self, task: Task) -> None:
        """A task issued: its bytes and hash are made when first needed (:class:`TaskEntry`)."""
        self._tasks[task.task_id] = TaskEntry(task.node_id, task=task)

    def take_payload(self, task_id: str) -> bytes | None:
        """The task's canonical bytes, once: the outbox signs them when the node takes the task."""
        e = self._tasks.get(task_id)
        if e is None:
            return None
        if e.task is not None:
            e._encode(e.task)
        payload, e.payload = e.payload, None
        return payload

    def put_payload(self, task_id: str, payload: bytes) -> None:
        """Give back a payload taken but not sent (the task stays waiting)."""
        e = self._tasks.get(task_id)
        if e is not None:
            e.payload = payload

    def get(self, task_id: str) -> TaskEntry | None:
        return self._tasks.get(task_id)

    def close(self, task_id: str) -> None:
        """The task closed without an accepted result (expired, declined, refused, node left)."""
        e = self._tasks.get(task_id)
        if e is not None and not e.accepted:
            del self._tasks[task_id]

    def accept(self, task_id: str) -> None:
        """Its result was accepted: the entry stays until its rows are buffered and trained."""
        e = self._tasks.get(task_id)
        if e is not None:
            e.accepted = True

    def buffered(self, task_id: str, n: int) -> None:
        """``n`` groups of the task's accepted result went into the buffer (a restored result
        has no entry yet); with none buffered there is nothing left to wait for."""
        e = self._tasks.setdefault(task_id, TaskEntry(""))
        e.accepted, e.buffered = True, e.buffered + n
        if e.buffered <= 0:
            del self._tasks[task_id]

    def group_gone(self, task_id: str) -> bool:
        """One group of the task left the buffer (trained or dropped); True when it was the last."""
        e = self._tasks.get(task_id)
        if e is None:
            return True
        e.buffered -= 1
        if e.buffered > 0:
            return False
        del self._tasks[task_id]
        return True


@dataclass(frozen=True)
class Accept:
    task: TaskAssignment
    rows: list[Group]  # rewards not yet given (0.0): the hub scores them before storing
    late: bool
    texts: list[list[str]] = field(default_factory=list)  # per group, per sample: what reward functions read


def float32_array(data: bytes | memoryview) -> array.array[float]:
    """Little-endian float32 bytes as an ``array('f')``: a Sequence of floats made by one copy.
    ``frombytes``, not the constructor: given a memoryview, ``array(code, view)`` iterates it and
    makes one element of each byte."""
    a = array.array("f")
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a


def int32_array(data: bytes | memoryview) -> Sequence[int]:
    """Little-endian int32 bytes as an ``array`` of 4-byte ints: one copy, and a garbage
    collection's walk over it visits no element, where a list's visits every int (rows.Sample)."""
    if _I4 is None:
        return np.frombuffer(data, dtype="<i4").tolist()  # type: ignore[no-any-return]
    a = array.array(_I4)
    a.frombytes(data)  # not array(_I4, data): a memoryview would be iterated byte by byte
    if sys.byteorder != "little":
        a.byteswap()
    return a


def int32_list(data: bytes) -> list[int]:
    """Little-endian int32 bytes as a list of ints (``array('i')``: ~0.6 us for a small
    completion's 64 ids where numpy's frombuffer + tolist took ~1.1, 8 of them a small result)."""
    a = int32_array(data)
    return a.tolist() if isinstance(a, array.array) else list(a)


_I4 = next((code for code in ("i", "l") if array.array(code).itemsize == 4), None)


def derive_finish_reason(token_ids: list[int], stop_ids: frozenset[int]) -> str:
    """How a completion ended, read off its tokens (see :func:`.intake_check.finish_of`)."""
    return finish_of(token_ids[-1] if token_ids else None, stop_ids)


#: rows.Sample's fields in order, as sample_of passes them: checked at import, so a field added
#: to Sample cannot shift the positional arguments silently
_SAMPLE_FIELDS = ("token_ids", "logprobs", "reward", "version", "node_id", "finish_reason", "reward_parts", "packed")
if tuple(f.name for f in dataclasses.fields(Sample)) != _SAMPLE_FIELDS:
    raise ImportError(f"rows.Sample's fields changed; update intake.sample_of: {dataclasses.fields(Sample)}")


def sample_of(s: CompactSample, version: int, peer: str) -> Sample:
    """A training row's sample from its arrays: the lists training reads, built in C (tolist);
    a packed result's received bytes ride along so the store keeps them as received instead of
    re-encoding 3 M numbers (7.5 s profiled)."""
    if s.packed:
        # positional, in the field order of rows.Sample: with keywords its __init__ took 1.27 us,
        # 0.34 this way (8 of them a small result, on the hub's loop whatever the workers)
        return Sample(int32_array(s.ids), float32_array(s.logprobs), 0.0, version, peer, s.finish_reason, {},
                      (s.ids, s.logprobs))
    return Sample(token_ids=np.frombuffer(s.ids, dtype="<i8").tolist(), logprobs=np.frombuffer(s.logprobs, dtype="<f8").tolist(),
                  reward=0.0, version=version, node_id=peer, finish_reason=s.finish_reason)


def task_view(t: TaskAssignment) -> TaskView:
    return TaskView(t.task_id, tuple(g.prompt for g in t.groups), tuple(g.group_size for g in t.groups),
                    tuple(item_fields(g.item) for g in t.groups))


def item_fields(item: Any) -> tuple[Any, ...]:
    """A prompt's item as the plain tuple an intake worker gets (``PromptItem(*fields)`` there):
    pickling the frozen dataclass itself cost ~2x as much per result (bench intake --workers 2)."""
    if isinstance(item, PromptItem):
        return (item.text, item.prompt, item.row, item.index, item.ids)
    return (item,)  # anything else (a legacy item, a test's stand-in) travels as it is


@dataclass(frozen=True)
class Refuse:
    code: str

    @property
    def error(self) -> MeaningError:
        return MeaningError(f"result refused: {self.code}")


@dataclass(frozen=True)
class Punish:
    error: Echo2Error


Verdict = Accept | Refuse | Punish


@dataclass(frozen=True)
class TaskParams:
    """What every task asks of a node, besides its prompts (from the hub's config)."""

    group_size: int
    max_new_tokens: int
    temperature: float
    top_p: float


class Intake:
    """Issues tasks, judges results. ``decode(ids)`` is the tokenizer's (a pure function);
    ``stop_ids`` end a completion's text. Rewards are not intake's: the operator's reward functions
    may hang or raise, so the hub runs them in threads after the verdict."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        params: TaskParams,
        *,
        vocab_size: int,
        stop_ids: Iterable[int],
        decode: Callable[[list[int]], str],
        decode_batch: Callable[[list[list[int]]], list[str]] | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.params = params
        self.book = TaskBook()
        self.vocab_size = vocab_size
        self.stop_ids = frozenset(stop_ids)
        self.decode = decode
        # one call for a result's completions: per-completion decode calls were 0.8 s of a
        # 3.1 M-token result's cost (cProfile), mostly the Python<->Rust list crossing each time
        self.decode_batch = decode_batch or (lambda seqs: [decode(x) for x in seqs])
        self._stop_arr = np.array(sorted(self.stop_ids), dtype=np.int64)

    # --- tasks out ---------------------------------------------------------------------------------
    def issue(self, now: float, consume_step: int, nodes: Container[str], seed: Callable[[], int],
              limit: int | None = None) -> list[Task]:
        """Tasks for the nodes in ``nodes`` (those present and fresh enough), to sign and send; at
        most ``limit`` (Dispatcher.next_tasks). ``nodes`` is only asked ``in``: copying the hub's
        10,000 node ids into a set on every message cost ~0.5 ms (`echo2 bench intake`)."""
        return self._tasks(self.dispatcher.next_tasks(now, consume_step, limit), nodes, seed, self.params)

    def issue_eval(
        self, now: float, version: int, holders: Iterable[str], seed: Callable[[], int], params: TaskParams
    ) -> list[Task]:
        """Eval tasks (their own group size and temperature) for nodes holding ``version``."""
        present = set(holders)
        return self._tasks(self.dispatcher.next_eval_tasks(now, version, present), present, seed, params)

    def _tasks(self, assignments: list[TaskAssignment], present: Container[str], seed: Callable[[], int],
               p: TaskParams) -> list[Task]:
        out = []
        for a in assignments:
            if a.node_id not in present:
                self.node_left(a.node_id)
                continue
            task = Task(
                task_id=a.task_id, node_id=a.node_id, prompts=a.prompts, group_size=p.group_size,
                max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p, seed=seed(),
                min_version=a.min_version, max_version_lag=a.max_version_lag, deadline=a.deadline,
            )
            self.book.open(task)  # encoded once, when first needed: hashed, and signed as is by Outbox.seal
            out.append(task)
        return out

    def expire(self, now: float) -> list[tuple[str, str]]:
        """(task id, node) of the tasks past their deadline, closed."""
        # in issue order (expire lists the newest first); a closed task's node is still known
        late = [(tid, self.dispatcher.assignee(tid) or "") for tid in reversed(self.dispatcher.expire(now))]
        for tid, _ in late:
            self.book.close(tid)
        return late

    def node_left(self, peer: str) -> list[str]:
        ids = self.dispatcher.on_node_left(peer)
        for tid in ids:
            self.book.close(tid)
        return ids

    def decline(self, task_id: str, peer: str, reason: str) -> bool:
        if not self.dispatcher.on_decline(task_id, peer, reason):
            return False
        self.book.close(task_id)
        return True

    # --- results in --------------------------------------------------------------------------------
    @property
    def limits(self) -> Limits:
        return Limits(self.vocab_size, self.params.max_new_tokens, self.stop_ids)

    def tasks_of(self, peer: str) -> dict[str, TaskView]:
        """The peer's tasks in flight (at most ``max_in_flight_per_node``), as the stateless checks
        need them: what the hub sends along with a result's frame to an intake worker."""
        st = self.dispatcher.nodes.get(peer)
        if st is None:
            return {}
        flying = self.dispatcher.in_flight
        return {tid: task_view(flying[tid]) for tid in st.in_flight if tid in flying}

    def judge(self, peer: str, r: AnyResult, now: float, learner_step: int) -> Verdict:
        """The verdict on a Result whose envelope ``peer`` signed."""
        task = self.dispatcher.in_flight.get(r.task_id)
        view = task_view(task) if task is not None and task.node_id == peer else None
        problem, samples, texts = find(r, peer, view, self.limits, self.decode_batch, self._stop_arr)
        return self.judge_found(peer, Findings(peer, b"", 0.0, r.task_id, r.task_hash, r.node_id, r.version,
                                               len(r.completions), 0, problem, samples, texts), now, learner_step)

    def judge_found(self, peer: str, f: Findings, now: float, learner_step: int) -> Verdict:
        """The stateful half of the verdict, on what :func:`.intake_check.examine` found (in this
        process or in an intake worker): binding, task book, dispatcher."""
        try:
            if f.node_id != peer:
                raise SignerNotAllowed("result names another node")
            entry = self.book.get(f.task_id)
            if entry is not None and entry.task_hash and entry.task_hash != f.task_hash:
                raise MeaningError("result is bound to a different task (task hash mismatch)")
            assignee = self.dispatcher.assignee(f.task_id) if entry is None else None
            if assignee is not None and assignee != peer:
                # The task closed and its hash left the book, but a task's hash covers its
                # node_id, so a result naming another node's task cannot carry a hash of it.
                raise MeaningError("result is bound to a different task (task hash mismatch: issued to another node)")
            task = self.dispatcher.in_flight.get(f.task_id)
            if task is not None and task.node_id == peer and f.problem is not None:
                raise MeaningError(f.problem)
        except Echo2Error as exc:
            return Punish(exc)
        verdict = self.dispatcher.on_result(now, f.task_id, peer, f.version, learner_step, f.n_completions)
        if verdict.accepted and f.samples is None:
            # cannot happen: a task the dispatcher accepts was in flight for this peer when the
            # frame was examined (task ids are never reissued); refused rather than trained blind
            self.book.close(f.task_id)
            return Refuse("unknown_task")
        if verdict.accepted:
            self.book.accept(f.task_id)
        elif f.task_id not in self.dispatcher.in_flight:
            self.book.close(f.task_id)  # keeps the entry if its result was accepted earlier
        if not verdict.accepted:
            return Refuse(verdict.code.value)
        assert verdict.task is not None and f.samples is not None
        version = f.version
        rows = [Group(list(g.prompt), [sample_of(s, version, peer) for s in ss])
                for g, ss in zip(verdict.task.groups, f.samples, strict=True)]
        texts = [list(t) for t in f.texts] if f.texts is not None else []
        return Accept(verdict.task, rows, verdict.late, texts)
