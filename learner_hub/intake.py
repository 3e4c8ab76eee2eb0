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
import sys
from collections import Counter
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np

from echo2.protocol.errors import Echo2Error, MeaningError, SignerNotAllowed
from echo2.protocol.messages import Completion, Result, Task, task_hash
from echo2.protocol.packedresult import PackedCompletion, PackedResult, logprob_array, token_array

from .behaviour import logprob_array_problem
from .dispatch import Dispatcher, TaskAssignment
from .rows import Group, Sample


@dataclass
class TaskEntry:
    """What the hub must remember about one task until it is fully done with it."""

    node_id: str
    task_hash: bytes
    buffered: int = 0  # groups of its accepted result still waiting to be trained (0: in flight)
    accepted: bool = False


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

    def open(self, task_id: str, node_id: str, thash: bytes) -> None:
        self._tasks[task_id] = TaskEntry(node_id, thash)

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
        e = self._tasks.setdefault(task_id, TaskEntry("", b""))
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


AnyResult: TypeAlias = Result | PackedResult  # the list form (v1) and the packed form (int32/float32 bytes)


def result_tokens(r: AnyResult) -> int:
    """The completion tokens a Result carries, counted here: what the ledger and the store record
    (``Result.tokens`` is the node's claim and goes unused)."""
    if isinstance(r, PackedResult):
        return sum(c.n_tokens for c in r.completions)
    return sum(len(c.token_ids) for c in r.completions)


def float32_array(data: bytes) -> array.array[float]:
    """Little-endian float32 bytes as an ``array('f')``: a Sequence of floats made by one copy."""
    a = array.array("f", data)
    if sys.byteorder != "little":
        a.byteswap()
    return a


def completion_arrays(c: Completion | PackedCompletion) -> tuple[np.ndarray, np.ndarray]:
    """A completion's token ids and log-probs as numpy arrays: views of the received bytes for a
    packed one (no copy), one C-level conversion for a list one."""
    if isinstance(c, PackedCompletion):
        return token_array(c.token_ids), logprob_array(c.logprobs)
    return np.asarray(c.token_ids, dtype=np.int64), np.asarray(c.logprobs, dtype=np.float64)


def _text_ids(s: Sample) -> Any:
    """The ids a sample's text is decoded from (a stop token ends it, it is not text)."""
    ids: Any = token_array(s.packed[0]) if s.packed is not None else s.token_ids
    return ids[:-1] if s.finish_reason == "stop" else ids


def derive_finish_reason(token_ids: list[int], stop_ids: frozenset[int]) -> str:
    """How a completion ended, read off its tokens: an engine stops on a stop token and keeps it
    (``"stop"``); anything else ran out of ``max_new_tokens`` (``"length"``), whatever the node
    claimed."""
    return "stop" if token_ids and token_ids[-1] in stop_ids else "length"


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
        decode_batch: Callable[[list[Any]], list[str]] | None = None,  # lists of ids or int arrays
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
    def issue(self, now: float, consume_step: int, nodes: Container[str], seed: Callable[[], int]) -> list[Task]:
        """Tasks for the nodes in ``nodes`` (those present and fresh enough), to sign and send.
        ``nodes`` is only asked ``in``: copying the hub's 10,000 node ids into a set on every
        message cost ~0.5 ms (`echo2 bench intake`)."""
        return self._tasks(self.dispatcher.next_tasks(now, consume_step), nodes, seed, self.params)

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
            self.book.open(a.task_id, a.node_id, task_hash(task))
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
    def judge(self, peer: str, r: AnyResult, now: float, learner_step: int) -> Verdict:
        """The verdict on a Result whose envelope ``peer`` signed."""
        try:
            if r.node_id != peer:
                raise SignerNotAllowed("result names another node")
            entry = self.book.get(r.task_id)
            if entry is not None and entry.task_hash and entry.task_hash != r.task_hash:
                raise MeaningError("result is bound to a different task (task hash mismatch)")
            assignee = self.dispatcher.assignee(r.task_id) if entry is None else None
            if assignee is not None and assignee != peer:
                # The task closed and its hash left the book, but a task's hash covers its
                # node_id, so a result naming another node's task cannot carry a hash of it.
                raise MeaningError("result is bound to a different task (task hash mismatch: issued to another node)")
            task = self.dispatcher.in_flight.get(r.task_id)
            if task is not None and task.node_id == peer:
                self._check_completions(task, r)
        except Echo2Error as exc:
            return Punish(exc)
        verdict = self.dispatcher.on_result(now, r.task_id, peer, r.version, learner_step, len(r.completions))
        if verdict.accepted:
            self.book.accept(r.task_id)
        elif r.task_id not in self.dispatcher.in_flight:
            self.book.close(r.task_id)  # keeps the entry if its result was accepted earlier
        if not verdict.accepted:
            return Refuse(verdict.code.value)
        assert verdict.task is not None
        rows, texts = self._rows(verdict.task, r, peer)
        return Accept(verdict.task, rows, verdict.late, texts)

    def _check_completions(self, task: TaskAssignment, r: AnyResult) -> None:
        # Whole-array numpy checks: the per-token Python scans here (vocabulary, stop tokens,
        # log-probs) cost 4.4 s of a 3.1 M-token result under cProfile.
        counts = Counter(c.prompt_index for c in r.completions)
        for i, g in enumerate(task.groups):
            if counts.get(i, 0) != g.group_size:
                raise MeaningError(f"prompt {i} has {counts.get(i, 0)} completions, expected {g.group_size}")
        for c in r.completions:
            if c.prompt_index >= len(task.groups):
                raise MeaningError(f"completion for prompt {c.prompt_index} outside the task")
            ids, lps = completion_arrays(c)
            if ids.size > self.params.max_new_tokens:
                raise MeaningError("completion longer than max_new_tokens")
            if ids.size and int(ids.max()) >= self.vocab_size:
                raise MeaningError("token id outside the vocabulary")
            if ids.size > 1 and np.isin(ids[:-1], self._stop_arr).any():
                # engines stop at the first stop token: text after one cannot be a sample
                raise MeaningError("completion goes on after a stop token")
            # a NaN or a -1e30 would poison the step or, clamped, dominate it: refused at the door
            bad = logprob_array_problem(lps)
            if bad is not None:
                raise MeaningError(f"completion for prompt {c.prompt_index}: {bad}")

    def _rows(self, task: TaskAssignment, r: AnyResult, peer: str) -> tuple[list[Group], list[list[str]]]:
        by_prompt: dict[int, list[Any]] = {}
        for c in r.completions:
            by_prompt.setdefault(c.prompt_index, []).append(c)
        rows: list[Group] = []
        text_ids: list[Any] = []
        for i, g in enumerate(task.groups):
            samples = [self._sample(c, r.version, peer) for c in by_prompt.get(i, [])]
            rows.append(Group(prompt_ids=list(g.prompt), samples=samples))
            # a packed sample's ids as a view of the received int32 bytes: the table detokeniser
            # (detok.py) gathers from arrays; from lists it first pays ~25 ns a token converting
            text_ids.extend(_text_ids(s) for s in samples)
        flat = iter(self.decode_batch(text_ids))
        texts = [[next(flat) for _ in g.samples] for g in rows]
        return rows, texts

    def _sample(self, c: Completion | PackedCompletion, version: int, peer: str) -> Sample:
        if isinstance(c, PackedCompletion):
            # the lists training reads, built in C (tolist); the received bytes ride along so the
            # store keeps them as received instead of re-encoding 3 M numbers (7.5 s profiled)
            ids: list[int] = token_array(c.token_ids).tolist()
            lps: Sequence[float] = float32_array(c.logprobs)
            packed: tuple[bytes, bytes] | None = (c.token_ids, c.logprobs)
        else:
            ids, lps, packed = list(c.token_ids), list(c.logprobs), None
        finish = derive_finish_reason(ids, self.stop_ids)  # c.finish_reason is only the node's claim
        return Sample(token_ids=ids, logprobs=lps, reward=0.0, version=version, node_id=peer,
                      finish_reason=finish, packed=packed)
