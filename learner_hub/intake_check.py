"""The stateless half of a Result's intake: raw signed frame in, compact findings out. Pure: no
trio, no dispatcher, no SQLite; the same code runs in the hub process (``intake_workers = 0``) and
in intake worker processes (:mod:`.intake_worker`), so the two modes judge alike by construction.

What runs here, in order: size, envelope, signature over the raw bytes, signer is the peer whose
connection sent it, expiry, payload decode with its schema (the envelope's steps 1-5 and 7), then
against the task the result names when it is one of the peer's tasks in flight (the hub sends
those along, :class:`TaskView`): completions per prompt, length, vocabulary, stop tokens,
log-probs; then rows as packed arrays and each completion's decoded text for the reward functions.

What stays with the hub (state): admission, the replay nonce (the envelope's step 6, applied by
:func:`check_replay` when the findings come back), the task book's hash, the dispatcher's verdict.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

import numpy as np

from echo2.protocol import envelope
from echo2.protocol import errors as perrors
from echo2.protocol.batchmessages import ResultBatch
from echo2.protocol.errors import Echo2Error, Expired, MeaningError
from echo2.protocol.messages import Completion, Result
from echo2.protocol.packedresult import PackedCompletion, PackedResult, logprob_array, token_array
from echo2.protocol.replay import ReplayCheck
from echo2.protocol.wire import MAX_RESULT

from .behaviour import LOGPROB_FLOOR, logprob_array_problem

AnyResult: TypeAlias = Result | PackedResult  # the list form (v1) and the packed form (int32/float32 bytes)


class TaskView(NamedTuple):
    """What the stateless checks need of one task in flight: its prompts and their group sizes,
    and each prompt's item (what the reward functions read: the prompt and dataset columns)."""

    task_id: str
    prompts: tuple[tuple[int, ...], ...]
    group_sizes: tuple[int, ...]
    items: tuple[Any, ...]  # per prompt: its PromptItem's fields, or (item,) (intake.item_fields)


@dataclass(frozen=True)
class Limits:
    """The hub's constants every check reads (from hub.toml and the tokenizer)."""

    vocab_size: int
    max_new_tokens: int
    stop_ids: frozenset[int]


class CompactSample(NamedTuple):
    """One completion as arrays: little-endian int32 ids and float32 log-probs as received for a
    packed result (``packed``), int64/float64 bytes for a list-form one (exact either way).

    Views, not bytes: the hub decodes an intake worker's reply with these fields as views of the
    reply's buffer (msgspec decodes a ``memoryview`` field without a copy). As ``bytes`` the
    decode copied every array out of it: for a 27.5 MB packed result that was 0.094 s of the hub's
    loop of its ~0.13-0.25 s with workers 2 (cProfile, ``echo2 bench intake --big-result-MB 36
    --workers 0,2``). A sample kept for training therefore keeps its reply's buffer alive: the
    samples of one reply are accepted together and trained within the same staleness bound, so
    that is about the bytes the copies held."""

    ids: memoryview
    logprobs: memoryview
    packed: bool
    finish_reason: str  # read off the tokens here, not the node's claim


class Findings(NamedTuple):
    """The stateless verdict on one opened frame. ``problem``: a completion check failed (the
    hub punishes if the task is still the peer's); ``samples``/``texts``: per prompt of the task,
    only when the task was in flight for this peer and every check passed."""

    signer: str
    nonce: bytes
    expires: float
    task_id: str
    task_hash: bytes
    node_id: str
    version: int
    n_completions: int
    tokens: int  # counted here, not the node's claim
    problem: str | None = None
    samples: tuple[tuple[CompactSample, ...], ...] | None = None
    texts: tuple[tuple[str, ...], ...] | None = None


def finish_of(last: int | None, stop_ids: frozenset[int]) -> str:
    """How a completion ended, read off its tokens: an engine stops on a stop token and keeps it
    (``"stop"``); anything else ran out of ``max_new_tokens`` (``"length"``), whatever the node
    claimed."""
    return "stop" if last is not None and last in stop_ids else "length"


def completion_arrays(c: Completion | PackedCompletion) -> tuple[np.ndarray, np.ndarray]:
    """A completion's token ids and log-probs as numpy arrays: views of the received bytes for a
    packed one (no copy), one C-level conversion for a list one."""
    if isinstance(c, PackedCompletion):
        return token_array(c.token_ids), logprob_array(c.logprobs)
    return np.asarray(c.token_ids, dtype=np.int64), np.asarray(c.logprobs, dtype=np.float64)


def result_tokens(r: AnyResult) -> int:
    """The completion tokens a Result carries, counted here: what the ledger and the store record
    (``Result.tokens`` is the node's claim and goes unused)."""
    if isinstance(r, PackedResult):
        return sum(c.n_tokens for c in r.completions)
    return sum(len(c.token_ids) for c in r.completions)


def completions_problem(groups: Sequence[int], r: AnyResult, lim: Limits, stop_arr: np.ndarray) -> str | None:
    """Why the completions cannot answer a task with these group sizes, or None.
    Whole-array numpy checks: the per-token Python scans here (vocabulary, stop tokens,
    log-probs) cost 4.4 s of a 3.1 M-token result under cProfile. A packed result's completions
    are checked as one array (per-completion numpy calls were ~0.3 ms of a small result's 2.8 ms)."""
    counts = Counter(c.prompt_index for c in r.completions)
    for i, size in enumerate(groups):
        if counts.get(i, 0) != size:
            return f"prompt {i} has {counts.get(i, 0)} completions, expected {size}"
    for c in r.completions:
        if c.prompt_index >= len(groups):
            return f"completion for prompt {c.prompt_index} outside the task"
    if isinstance(r, PackedResult) and r.completions:
        k = _first_bad_packed(r.completions, lim, stop_arr)
        if k is None:
            return None
        return _completion_problem(r.completions[k], lim, stop_arr)
    for c in r.completions:
        bad = _completion_problem(c, lim, stop_arr)
        if bad is not None:
            return bad
    return None


def _completion_problem(c: Completion | PackedCompletion, lim: Limits, stop_arr: np.ndarray) -> str | None:
    ids, lps = completion_arrays(c)
    if ids.size > lim.max_new_tokens:
        return "completion longer than max_new_tokens"
    if ids.size and int(ids.max()) >= lim.vocab_size:
        return "token id outside the vocabulary"
    if ids.size > 1 and np.isin(ids[:-1], stop_arr).any():
        # engines stop at the first stop token: text after one cannot be a sample
        return "completion goes on after a stop token"
    # a NaN or a -1e30 would poison the step or, clamped, dominate it: refused at the door
    bad = logprob_array_problem(lps)
    if bad is not None:
        return f"completion for prompt {c.prompt_index}: {bad}"
    return None


def _first_bad_packed(comps: Sequence[PackedCompletion], lim: Limits, stop_arr: np.ndarray) -> int | None:
    """The first completion that fails a check (its message is :func:`_completion_problem`'s),
    found with whole-result arrays."""
    lens = np.fromiter((c.n_tokens for c in comps), dtype=np.int64, count=len(comps))
    ends = np.cumsum(lens)  # one past each completion's last token
    ids = np.frombuffer(b"".join([c.token_ids for c in comps]), dtype="<i4")
    lps = np.frombuffer(b"".join([c.logprobs for c in comps]), dtype="<f4").astype(np.float64)
    firsts = []
    long = np.flatnonzero(lens > lim.max_new_tokens)
    if long.size:
        firsts.append(int(long[0]))
    for where in (ids >= lim.vocab_size, ~((lps >= LOGPROB_FLOOR) & (lps <= 0.0))):
        at = np.flatnonzero(where)
        if at.size:
            firsts.append(int(np.searchsorted(ends, at[0], side="right")))
    stops = np.flatnonzero(np.isin(ids, stop_arr))
    if stops.size:
        inner = stops[~np.isin(stops, ends - 1)]  # a stop token that is not its completion's last
        if inner.size:
            firsts.append(int(np.searchsorted(ends, inner[0], side="right")))
    return min(firsts) if firsts else None


def compact_rows(n_groups: int, r: AnyResult, lim: Limits, decode_batch: Callable[[list[list[int]]], list[str]]
                 ) -> tuple[tuple[tuple[CompactSample, ...], ...], tuple[tuple[str, ...], ...]]:
    """Per prompt of the task, its completions as arrays and their decoded texts (a completion's
    stop token left out). One decode call for the whole result: per-completion calls were 0.8 s
    of a 3.1 M-token result's cost (cProfile), mostly the Python<->Rust list crossing each time."""
    by_prompt: list[list[CompactSample]] = [[] for _ in range(n_groups)]
    text_ids: list[Any] = []
    for c in r.completions:
        ids, lps = completion_arrays(c)
        last = int(ids[-1]) if ids.size else None
        finish = finish_of(last, lim.stop_ids)
        if isinstance(c, PackedCompletion):
            s = CompactSample(memoryview(c.token_ids), memoryview(c.logprobs), True, finish)
        else:
            s = CompactSample(memoryview(ids.astype("<i8").tobytes()), memoryview(lps.astype("<f8").tobytes()), False, finish)
        by_prompt[c.prompt_index].append(s)
    for group in by_prompt:
        for s in group:
            ids = np.frombuffer(s.ids, dtype="<i4" if s.packed else "<i8")
            ids = ids[:-1] if s.finish_reason == "stop" else ids
            # a packed sample's ids stay an int32 view of the received bytes: the table
            # detokeniser (detok.py) gathers from arrays; from lists it first pays ~25 ns a token
            text_ids.append(ids if s.packed else ids.tolist())
    flat = iter(decode_batch(text_ids))
    texts = tuple(tuple(next(flat) for _ in g) for g in by_prompt)
    return tuple(tuple(g) for g in by_prompt), texts


def find(r: AnyResult, peer: str, task: TaskView | None, lim: Limits,
         decode_batch: Callable[[list[list[int]]], list[str]], stop_arr: np.ndarray) -> tuple[str | None, Any, Any]:
    """(problem, samples, texts) of an opened result against ``task`` (the peer's task in flight
    that it names, or None: then the dispatcher refuses it and nothing needs checking)."""
    if task is None or r.node_id != peer:
        return None, None, None
    if isinstance(r, PackedResult) and r.completions:
        return packed_find(task.group_sizes, r, lim, decode_batch, stop_arr)
    problem = completions_problem(task.group_sizes, r, lim, stop_arr)
    if problem is not None:
        return problem, None, None
    samples, texts = compact_rows(len(task.group_sizes), r, lim, decode_batch)
    return None, samples, texts


def packed_find(groups: Sequence[int], r: PackedResult, lim: Limits,
                decode_batch: Callable[[list[list[int]]], list[str]], stop_arr: np.ndarray
                ) -> tuple[str | None, Any, Any]:
    """:func:`find` for one packed result (see :func:`packed_find_many`)."""
    return packed_find_many([(groups, r)], lim, decode_batch, stop_arr)[0]


Found: TypeAlias = tuple[str | None, Any, Any]  # (problem, samples, texts), as find() gives


def packed_find_many(items: Sequence[tuple[Sequence[int], PackedResult]], lim: Limits,
                     decode_batch: Callable[[list[list[int]]], list[str]], stop_arr: np.ndarray) -> list[Found]:
    """:func:`find` for packed results (each with its task's group sizes), on one join of all
    their arrays: the checks, each completion's finish and the texts all read the same arrays,
    once for a node's whole batch. Per result, checks then rows were ~150 us of a small result's
    ~460 us examine, most of it numpy calls per completion and the same bytes joined three times;
    per batch, the numpy calls are paid once for all its results. When the joint check finds a
    fault, each result is checked alone, and :func:`completions_problem` names the fault as before."""
    out: list[Found | None] = [None] * len(items)
    todo = []
    for k, (groups, r) in enumerate(items):
        counts = Counter(c.prompt_index for c in r.completions)
        if not r.completions or len(counts) > len(groups) or any(counts.get(i, 0) != n for i, n in enumerate(groups)):
            problem = completions_problem(groups, r, lim, stop_arr)  # None only for an empty result of an empty task
            out[k] = (problem, None, None) if problem is not None else (None, *compact_rows(len(groups), r, lim, decode_batch))
        else:
            todo.append(k)
    comps = [c for k in todo for c in items[k][1].completions]
    lens = [len(c.token_ids) >> 2 for c in comps]
    ends = list(itertools.accumulate(lens))  # one past each completion's last token
    ids = np.frombuffer(b"".join([c.token_ids for c in comps]), dtype="<i4")
    lps = np.frombuffer(b"".join([c.logprobs for c in comps]), dtype="<f4")
    stop_at = _stop_positions(ids, stop_arr)
    # more than one a completion: some stop token is not a last one (no set of them is built)
    good = stop_at.size <= len(comps)
    stops = set(stop_at.tolist()) if good else set()
    stopped = [n > 0 and e - 1 in stops for e, n in zip(ends, lens, strict=True)]
    good = good and (not lens or max(lens) <= lim.max_new_tokens) and (not ids.size or (
        int(ids.max()) < lim.vocab_size
        # reduced in float32, compared as Python floats (exact: float32 -> float64 loses nothing)
        and float(lps.min()) >= LOGPROB_FLOOR and float(lps.max()) <= 0.0
        and len(stops) == sum(stopped)))  # a stop token only as its completion's last
    if not good:
        for k in todo:
            if len(todo) > 1:
                out[k] = packed_find_many([items[k]], lim, decode_batch, stop_arr)[0]
            else:
                groups, r = items[k]
                out[k] = (completions_problem(groups, r, lim, stop_arr) or "completion check failed", None, None)
        return [o for o in out if o is not None]
    # the texts: each completion's ids without its stop token, per result in prompt order
    decode_flat = getattr(decode_batch, "decode_flat", None)
    in_order = all(_sorted_prompts(items[k][1]) for k in todo)
    if decode_flat is not None and in_order:
        keep_ids = ids if not stops else np.delete(ids, sorted(stops))
        bounds = np.fromiter(itertools.accumulate((n - x for n, x in zip(lens, stopped, strict=True)), initial=0),
                             dtype=np.int64, count=len(comps) + 1)
        flat = iter(decode_flat(keep_ids, bounds))
    at = 0
    for k in todo:
        groups, r = items[k]
        n = len(r.completions)
        by_prompt: list[list[CompactSample]] = [[] for _ in groups]
        for c, x in zip(r.completions, stopped[at:at + n], strict=True):
            by_prompt[c.prompt_index].append(CompactSample(memoryview(c.token_ids), memoryview(c.logprobs), True,
                                                           "stop" if x else "length"))
        at += n
        if decode_flat is None or not in_order:
            text_ids = [np.frombuffer(s.ids, dtype="<i4")[:-1 if s.finish_reason == "stop" else None]
                        for g in by_prompt for s in g]
            flat = iter(decode_batch(text_ids))  # type: ignore[arg-type]
        texts = tuple(tuple(next(flat) for _ in g) for g in by_prompt)
        out[k] = (None, tuple(tuple(g) for g in by_prompt), texts)
    return [o for o in out if o is not None]


def _sorted_prompts(r: PackedResult) -> bool:
    index = [c.prompt_index for c in r.completions]
    return index == sorted(index)


def _stop_positions(ids: np.ndarray, stop_arr: np.ndarray) -> np.ndarray:
    """Where stop tokens are in ``ids``: one comparison per stop id (a tokenizer has one or two),
    cheaper than ``np.isin``'s sort for a small result."""
    if stop_arr.size > 4:
        return np.flatnonzero(np.isin(ids, stop_arr))
    hit = np.zeros(ids.shape, dtype=bool)
    for s in stop_arr.tolist():
        hit |= ids == s
    return np.flatnonzero(hit)


def examine(raw: bytes, peer: str, tasks: dict[str, TaskView], lim: Limits,
            decode_batch: Callable[[list[list[int]]], list[str]], *, now: float | None = None) -> Findings:
    """Open ``raw`` (a Result envelope that ``peer``'s connection sent) and check it against the
    peer's tasks in flight. Raises the envelope's Echo2Error (TooLarge, BadSignature, ...)."""
    return find_many([open_result(raw, peer, now=now)], peer, tasks, lim, decode_batch)[0]


def open_result(raw: bytes, peer: str, *, now: float | None = None, covered: bool = False) -> envelope.Verified[AnyResult]:
    """The envelope's steps on ``raw`` (size, signature over the raw bytes, signer is ``peer``,
    expiry, payload decode and schema): the result, or the envelope's Echo2Error raised.
    ``covered``: ``raw`` is an item of a ResultBatch whose signature ``peer`` made and the hub
    verified (over these bytes among the rest), so the item's own signature is not checked again
    (open_envelope's ``covered``): that was 55 us of a small result's ~0.65 ms, and the batch's
    check already costs ~17 us a result (`echo2 bench intake --batch 8`, py-spy, 2026-12-05)."""
    allowed: Callable[[str, type], bool] = lambda signer, _t: signer == peer  # noqa: E731
    return envelope.open_envelope(raw, (PackedResult, Result), now=now, replay=None, allowed=allowed, max_size=MAX_RESULT,
                                  covered=covered)


def open_batch(raw: bytes, peer: str, *, now: float | None = None, replay: ReplayCheck | None = None,
               allowed: Callable[[str, type], bool] | None = None) -> envelope.Verified[ResultBatch]:
    """A ResultBatch's envelope steps on ``raw`` (replay only when given: an intake worker has no
    replay state, and the hub applies :func:`check_replay` to what it returns), signed by ``peer``
    (or as ``allowed`` says), and the batch must name ``peer``: the opened batch, or the
    Echo2Error raised. Its items are then opened ``covered`` (:func:`open_result`)."""
    if allowed is None:
        allowed = lambda signer, _t: signer == peer  # noqa: E731
    batch = envelope.open_envelope(raw, ResultBatch, now=now, replay=replay, allowed=allowed, max_size=MAX_RESULT)
    if batch.message.node_id != peer:
        raise MeaningError("result batch names another node")
    return batch


def find_many(opened: Sequence[envelope.Verified[AnyResult]], peer: str, tasks: dict[str, TaskView], lim: Limits,
              decode_batch: Callable[[list[list[int]]], list[str]]) -> list[Findings]:
    """The findings on results opened by :func:`open_result` (one node's batch): the packed ones
    that answer the peer's tasks checked together (:func:`packed_find_many`), the rest alone."""
    stop_arr = np.array(sorted(lim.stop_ids), dtype=np.int64)
    found: list[Found | None] = [None] * len(opened)
    packed: list[int] = []
    for k, v in enumerate(opened):
        r, task = v.message, tasks.get(v.message.task_id)
        if isinstance(r, PackedResult) and r.completions and task is not None and r.node_id == peer:
            packed.append(k)
        else:
            found[k] = find(r, peer, task, lim, decode_batch, stop_arr)
    joint = packed_find_many([(tasks[opened[k].message.task_id].group_sizes, opened[k].message) for k in packed],
                             lim, decode_batch, stop_arr)
    for k, jf in zip(packed, joint, strict=True):
        found[k] = jf
    out = []
    for v, f in zip(opened, found, strict=True):
        assert f is not None
        r = v.message
        out.append(Findings(v.signer, v.nonce, v.expires, r.task_id, r.task_hash, r.node_id, r.version,
                            len(r.completions), result_tokens(r), *f))
    return out


class BatchHead(NamedTuple):
    """A ResultBatch's envelope, opened by an intake worker: what the hub's replay step reads."""

    signer: str
    nonce: bytes
    expires: float


def check_replay(replay: ReplayCheck | None, f: Findings | BatchHead, now: float) -> None:
    """The envelope's replay step (6), applied by the hub to findings that came back: the same
    rule as :func:`echo2.protocol.envelope.open_envelope` (an expiry beyond the window is refused,
    then the nonce must be new)."""
    if replay is None:
        return
    if f.expires > now + replay.window_s:
        raise Expired(f"{'result batch' if isinstance(f, BatchHead) else 'result'} from {f.signer} expires {f.expires - now:.0f}s from now, "
                      f"beyond the {replay.window_s:.0f}s replay window")
    replay.check_and_add(f.signer, f.nonce, f.expires, now)


def error_to_wire(exc: Echo2Error) -> tuple[str, str]:
    """An envelope error as (class name, message): the hub raises the same class again."""
    return type(exc).__name__, exc.message


def error_from_wire(name: str, message: str) -> Echo2Error:
    cls = getattr(perrors, name, None)
    if isinstance(cls, type) and issubclass(cls, Echo2Error):
        return cls(message)
    return MeaningError(message)
