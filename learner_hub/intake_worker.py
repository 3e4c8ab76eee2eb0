"""An intake worker process: raw Result frames in, compact findings (and rewards) out.

Started by :class:`.intake_pool.IntakePool` as a fresh interpreter (``python -c``, the spawn
model: the hub has imported torch and runs threads, so a forked copy of it is unsafe), holding
one end of a socket pair. Not ``multiprocessing``'s spawn context: it re-runs the parent's main
script in each child (measured: a profiling script without a ``__main__`` guard started hubs in
its workers), which a hub embedded in an operator's script must not do.

The worker gets what it needs by spec, never as live objects, as the first frame on its socket:
the model's tokenizer files (loaded as the hub loads its tokenizer) and the reward functions'
specs (``file.py:func`` / ``package.module:func``, a verifiers environment id, or a
module-level function, which pickles by reference), with the hub's ``sys.path``. It then answers
requests one at a time, framed as ``[u32 header length][u32 frames length][header][raw frames]``;
the header (pickled) is small: per peer whose frames are in the request, its tasks in flight, the
trainer state, and the length of each frame (several results of one peer's batch, and those of
other peers that queued while this worker was busy, travel in one request and come back as one
list of replies, in order). The frames travel as the raw bytes the node signed.

Reward functions run here, each on its own thread with the hub's ``reward_timeout_s`` (the same
rules as :class:`.rewards.RewardRunner`: one call at a time per function, a hung call abandoned),
so a slow one costs this process time, never the hub's loop. The worker exits when the hub's end
of the socket closes (EOF: the hub stopped or died), so it cannot outlive the hub.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import pickle
import socket
import struct
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

from echo2.protocol.errors import Echo2Error

from .intake import sample_of
from .intake_check import Findings, Limits, TaskView, error_to_wire, find_many, open_batch, open_result
from .recipe import PromptItem
from .rewards import (
    Batch,
    FuncFailure,
    RewardFunc,
    Scored,
    TrainerState,
    apply_scores,
    batch_of,
    check_output,
    combine,
    failures_of,
    func_name,
    reward_kwargs,
)
from .rows import Group, encode_groups

log = logging.getLogger(__name__)

_LEN = struct.Struct("<II")
# replies as msgpack typed by Reply (msgspec): decoded in the hub ~3x faster than pickle, and no
# code in the hub process ever unpickles what a process handling hostile frames wrote
_ENCODER = msgspec.msgpack.Encoder()
_ONE = struct.Struct("<I")


@dataclass(frozen=True)
class WorkerSpec:
    """How a worker rebuilds the hub's tokenizer and reward functions (picklable, no live objects)."""

    artifacts: dict[str, bytes]  # the model's tokenizer files, as the manifest carries them
    limits: Limits
    reward_funcs: list[Any] = field(default_factory=list)  # specs (str) or module-level functions
    reward_weights: list[float] = field(default_factory=list)
    reward_timeout_s: float = 10.0
    environment: str = ""  # a verifiers environment: its reward functions are loaded from it
    environment_args: dict[str, Any] = field(default_factory=dict)
    # "module:function" making decode_batch from the tokenizer handle (the hub's decode function)
    decode_factory: str = "echo2.learner_hub.intake_worker:tokenizer_decode_batch"


class CheckContext(NamedTuple):
    """What the hub sends along with a frame: the peer whose connection sent it, the peer's tasks
    in flight (the result must answer one of them to be checked and scored) and the trainer state
    a reward function may read."""

    peer: str
    tasks: dict[str, TaskView]
    step: int  # TrainerState.global_step (a plain int: the dataclass pickled slower than the rest of the header)
    max_steps: int
    score: bool = True
    # the frames are items of a ResultBatch the hub verified, signed by ``peer`` (open_result's covered)
    covered: bool = False
    # the one frame is a whole sealed ResultBatch: this worker opens it (signature over its raw
    # bytes, signer ``peer``, expiry, schema) and then its items (covered); its replies are the
    # batch's head (:attr:`Reply.batch`, or the batch's error) followed by one per item
    batch: bool = False


class Reply(NamedTuple):
    """What a worker sends back: findings and their rewards, or the envelope's error."""

    findings: Findings | None = None
    error: tuple[str, str] | None = None
    # Scored's fields (rewards, reasons, parts) as plain lists (Scored is a rewards.py dataclass)
    scored: tuple[list[float | None], list[str | None], list[dict[str, float]]] | None = None
    failures: tuple[tuple[str, str, str], ...] = ()  # (function, reason, detail) of this batch
    # the scored rows as the store keeps them (rows.encode_groups after apply_scores): the
    # canonical encoding was ~12% of the hub's CPU per small result once checks moved here
    payload: memoryview | None = None  # decoded as a view of the reply, as CompactSample's arrays
    # a ResultBatch opened here: (signer, nonce, expires) of its envelope, for the hub's replay step
    batch: tuple[str, bytes, float] | None = None


def tokenizer_decode_batch(tok: Any) -> Callable[[list[list[int]]], list[str]]:
    """The hub's decode function (``Intake.decode_batch``) made from a tokenizer handle, the way
    the hub makes it: the table detokeniser (``detok.BatchDecoder``), which falls back to the
    tokenizer's own ``decode_batch`` where the table does not apply."""
    from .detok import BatchDecoder

    return BatchDecoder(tok.tokenizer)


def _import(spec: str) -> Any:
    import importlib

    mod, _, name = spec.rpartition(":")
    return getattr(importlib.import_module(mod), name)


class SyncRewards:
    """:class:`.rewards.RewardRunner`'s rules off trio: each function on its own single thread,
    a call bounded by ``timeout_s`` (a hung one is abandoned and holds only its thread)."""

    def __init__(self, funcs: Sequence[RewardFunc], weights: Sequence[float], timeout_s: float) -> None:
        self.funcs, self.weights, self.timeout_s = list(funcs), list(weights), timeout_s
        self.names = [func_name(f) for f in self.funcs]
        self._pools = [cf.ThreadPoolExecutor(1, thread_name_prefix=f"reward-{n}") for n in self.names]

    def score(self, batch: Any, state: TrainerState) -> tuple[Scored, tuple[tuple[str, str, str], ...]]:
        n = len(batch)
        if n == 0:
            return Scored([], []), ()
        def call(f: RewardFunc) -> Any:
            return f(**reward_kwargs(batch, state))  # fresh arguments per function, as the runner gives

        futs = [pool.submit(call, f) for pool, f in zip(self._pools, self.funcs, strict=True)]
        outputs: list[list[float | None] | FuncFailure] = []
        deadline = time.monotonic() + self.timeout_s  # the functions run at once and share it, as in the runner
        for fut in futs:
            try:
                outputs.append(check_output(fut.result(timeout=max(0.0, deadline - time.monotonic())), n))
            except cf.TimeoutError:
                fut.cancel()  # not started yet (its function's thread is still held by a hung call): never run
                outputs.append(FuncFailure("timeout", f"took longer than reward_timeout_s = {self.timeout_s:g} s (abandoned)"))
            except FuncFailure as exc:
                outputs.append(exc)
            except Exception as exc:  # the operator's code: any exception is its failure, not the hub's
                outputs.append(FuncFailure("raised", f"raised {type(exc).__name__}: {exc}"))
        failures = failures_of(self.names, outputs)
        return combine(outputs, self.weights, n, self.names), tuple(failures)


def load(spec: WorkerSpec) -> tuple[Callable[[list[list[int]]], list[str]], SyncRewards]:
    """The tokenizer and reward functions, loaded as the hub loads them."""
    from echo2.models.spec import load_tokenizer

    from .rewards import load_reward_funcs

    decode_batch = _import(spec.decode_factory)(load_tokenizer(spec.artifacts))
    if spec.environment:
        from .verifiers_env import load_environment_recipe

        _, _, env_funcs, env_weights = load_environment_recipe(spec.environment, spec.environment_args)
        funcs, weights = load_reward_funcs(env_funcs, env_weights)
    else:
        funcs, weights = load_reward_funcs(spec.reward_funcs, spec.reward_weights)
    return decode_batch, SyncRewards(funcs, weights, spec.reward_timeout_s)


def handle(raw: bytes, req: CheckContext, lim: Limits, decode_batch: Callable[[list[list[int]]], list[str]],
           rewards: SyncRewards | None) -> Reply:
    """One frame: examine it, and score its completions when it answers one of the peer's tasks."""
    return handle_many([raw], req, lim, decode_batch, rewards)[0]


def handle_many(raws: Sequence[bytes], req: CheckContext, lim: Limits,
                decode_batch: Callable[[list[list[int]]], list[str]], rewards: SyncRewards | None) -> list[Reply]:
    """Frames of one peer (a share of its ResultBatch): each examined, and those that answer one
    of the peer's tasks scored together, in one call of each reward function."""
    return handle_groups([(raws, req)], lim, decode_batch, rewards)[0]


def handle_groups(requests: Sequence[tuple[Sequence[bytes], CheckContext]], lim: Limits,
                  decode_batch: Callable[[list[list[int]]], list[str]], rewards: SyncRewards | None) -> list[list[Reply]]:
    """Several peers' frames that waited on this worker together (the pool sends what queued
    while the worker was busy as one request): each peer's examined with its own context, and
    every scored completion of them all in one call of each reward function per trainer state, as
    the hub's reward threads coalesce what waits. Measured (``echo2 bench intake --clients 2
    --batch 8 --workers 0,2 --reward-sleep 1``, 100 nodes): scored request by request, a reward
    that sleeps 1 s a call let 2 workers accept 5.2 results/s (17 client timeouts) against 23 with
    the scoring in the hub; coalesced, 111 (the hub's 22.9 in the same run). A function that fails on a call fails for all of its rows; its failures
    ride on the first scored item's reply of that call."""
    replies: list[list[Reply]] = []
    heads: list[Reply | None] = []
    todo: list[tuple[int, int, Findings, list[Group]]] = []
    for r, (raws, req) in enumerate(requests):
        mine: list[Reply] = []
        head: Reply | None = None
        if req.batch:
            try:
                batch = open_batch(raws[0], req.peer)
            except Echo2Error as exc:
                heads.append(Reply(error=error_to_wire(exc)))
                replies.append(mine)
                continue
            head, raws = Reply(batch=(batch.signer, batch.nonce, batch.expires)), batch.message.results
            req = req._replace(covered=True)
        heads.append(head)
        opened: list[tuple[int, Any]] = []
        for i, raw in enumerate(raws):
            try:
                opened.append((i, open_result(raw, req.peer, covered=req.covered)))
            except Echo2Error as exc:
                mine.append(Reply(error=error_to_wire(exc)))
                continue
            mine.append(Reply())
        replies.append(mine)
        # the opened ones checked together (numpy's per-call costs once per share of a batch)
        for (i, _), f in zip(opened, find_many([v for _, v in opened], req.peer, req.tasks, lim, decode_batch), strict=True):
            mine[i] = Reply(findings=f)
            if rewards is None or not req.score or f.samples is None or f.texts is None:
                continue
            task = req.tasks[f.task_id]
            # batch_of reads token ids and finish reasons off Group/Sample rows: built here from the arrays
            groups = [Group(list(p), [sample_of(s, f.version, req.peer) for s in ss])
                      for p, ss in zip(task.prompts, f.samples, strict=True)]
            todo.append((r, i, f, groups))
    if todo and rewards is not None:
        _score_groups(requests, todo, replies, rewards)
    return [mine if head is None else [head, *mine] for head, mine in zip(heads, replies, strict=True)]


def _score_groups(requests: Sequence[tuple[Sequence[bytes], CheckContext]], todo: list[tuple[int, int, Findings, list[Group]]],
                  replies: list[list[Reply]], rewards: SyncRewards) -> None:
    """``todo``'s rows scored, one call of each reward function per trainer state; each item's
    reply in ``replies`` gets its rewards and the rows' stored form."""
    by_state: dict[tuple[int, int], list[tuple[int, int, Findings, list[Group]]]] = {}
    for item in todo:
        req = requests[item[0]][1]
        by_state.setdefault((req.step, req.max_steps), []).append(item)
    for (step, max_steps), items in by_state.items():
        parts = []
        for r, _, f, groups in items:
            tasks = requests[r][1].tasks
            assert f.texts is not None
            parts.append(batch_of(groups, [PromptItem(*it) if len(it) > 1 else it[0] for it in tasks[f.task_id].items], f.texts))
        whole = parts[0] if len(parts) == 1 else Batch(
            [x for b in parts for x in b.items], [x for b in parts for x in b.texts],
            [x for b in parts for x in b.completion_ids], [x for b in parts for x in b.finish_reasons])
        scored, failures = rewards.score(whole, TrainerState(step, max_steps))
        at = 0
        for n, ((r, i, f, groups), b) in enumerate(zip(items, parts, strict=True)):
            lo, at = at, at + len(b)
            got = Scored(scored.rewards[lo:at], scored.reasons[lo:at], scored.parts[lo:at] if scored.parts else [])
            kept, _ = apply_scores(groups, got)
            # the texts went into the rewards; the hub has no use for them
            replies[r][i] = Reply(findings=_without_texts(f), scored=(got.rewards, got.reasons, got.parts),
                                  failures=failures if n == 0 else (), payload=memoryview(encode_groups(kept)))


def _without_texts(f: Findings) -> Findings:
    return f._replace(texts=None)


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes from a blocking socket, or None when it closed first (both ends of the pool)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def main(sock: socket.socket, spec: WorkerSpec) -> None:
    """The worker's loop (the spawned process's target). Sends a ready frame first (empty, or a
    pickled error string when loading failed), then answers each request in turn."""
    try:
        decode_batch, rewards = load(spec)
    except Exception as exc:  # reported to the hub, which refuses to use this worker
        msg = f"{type(exc).__name__}: {exc}".encode()
        sock.sendall(_ONE.pack(len(msg)) + msg)
        return
    sock.sendall(_ONE.pack(0))
    while True:
        head = recv_exact(sock, _LEN.size)
        if head is None:
            break  # the hub closed its end (stop, or it died): never outlive it
        hlen, flen = _LEN.unpack(head)
        header, frames = recv_exact(sock, hlen), recv_exact(sock, flen)
        if header is None or frames is None:
            break
        # from the hub process, our own code: trusted. Several frames per request (a ResultBatch's
        # items, and the other peers' that queued meanwhile): one round trip per batch, not per
        # result (each cost the hub's loop ~0.3 ms)
        contexts: list[tuple[CheckContext, list[int]]] = pickle.loads(header)
        requests: list[tuple[list[bytes], CheckContext]] = []
        at = 0
        lone = len(contexts) == 1 and len(contexts[0][1]) == 1
        for req, sizes in contexts:
            raws = []
            for n in sizes:
                raws.append(frames if lone else frames[at:at + n])  # a lone (maybe 36 MB) frame uncopied
                at += n
            requests.append((raws, req))
        replies = handle_groups(requests, spec.limits, decode_batch, rewards)
        # one list per request entry (a batch's: its head, then its items), encoded behind its
        # length: joining the two copied the reply once more (~55 MB for a 27.5 MB result, ~36 ms)
        out = bytearray(_ONE.size)
        _ENCODER.encode_into(replies, out, _ONE.size)
        _ONE.pack_into(out, 0, len(out) - _ONE.size)
        sock.sendall(out)
    # reward threads of abandoned (hung) calls would keep a normal exit waiting
    os._exit(0)


def run(fd: int) -> None:
    """The worker process's entry (``python -c``): read the spec frame, then serve."""
    sock = socket.socket(fileno=fd)
    head = recv_exact(sock, _ONE.size)
    body = recv_exact(sock, _ONE.unpack(head)[0]) if head is not None else None
    if body is None:
        os._exit(0)  # the hub went away before sending the spec
    spec, path = pickle.loads(body)  # from the hub process: trusted
    sys.path[:0] = [p for p in path if p not in sys.path]  # the operator's modules, as the hub sees them
    main(sock, spec)
