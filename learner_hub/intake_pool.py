"""Intake workers (``intake_workers = N`` in hub.toml): the stateless half of a Result's intake
(signature, decode, checks, detokenising, reward functions) in N processes, so that neither a
large result's per-token work nor a slow reward function holds the hub's trio loop.

One API for both modes, ``await pool.check(raw, ctx) -> Checked``:

* ``N = 0``: :func:`.intake_check.examine` runs in the hub process, on the loop, as it always
  did; rewards are left to the hub's :class:`.rewards.RewardRunner` (threads) after the
  dispatcher accepts.
* ``N > 0``: the raw frame and a small header (the peer, its tasks in flight, the trainer state)
  go to the least busy worker over a socket (:mod:`.intake_worker`); the worker examines it and,
  when it answers one of the peer's tasks, scores it. The hub then applies the stateful half
  (replay nonce, task book, dispatcher, store) to the compact findings. The worker scores before
  the dispatcher's verdict (one round trip, not two); a result the dispatcher then refuses
  (stale, duplicate) was scored for nothing, in the worker's time, and its rewards are not counted.

Measured (``echo2 bench intake --nodes 100 --workers 0,2 --packed``, 2 shared cores, load ~7):
the hub process's CPU per small result (8 x 64 tokens) went from 2.88 to 1.44 ms (0.50x; 0.43x
for the list form), each result alone. A node's ResultBatch goes to the workers in one request
per worker (:meth:`IntakePool.check_many`), its rewards scored in one call per function, its
acceptance stored in one transaction with one receipt (batchintake.py). In-process, batches of 8
at 100 nodes (load ~11, one run each): the hub's CPU per result with workers 0 went from 3.63 to
1.57 ms; with workers 2 the hub process's own from 2.63 to 0.97 ms (all processes 4.95 -> 2.18).
What stays in the hub per result then: issuing the node's next task (sealing it and its hash,
~45% of the loop's share), the dispatcher's verdict and the IPC.

Session 12 (live, ``echo2 bench intake --nodes 100 --clients 2 --batch 8 --workers 0,2``, the
same client back to back, 2 shared cores, load ~1.5): a batch's packed results checked on one join
of their arrays (intake_check.find_many, in the hub or a worker alike), the fast decoder vouching
for a result's completions together (fastdecode), the task book encoding a task when first needed:
hub CPU per result with workers 0 from 1.13 to 0.84 ms; with workers 2 the hub process's own from
0.63 to 0.56 ms (all processes 1.33 -> 0.94). With workers 0 the examining runs in slices under
the pool's :class:`~.cpugate.CpuGate` (the loop's lag p99 with 32 working nodes 97 -> 35 ms).

Hostile input is bounded: at most ``per_worker`` results wait on a worker and ``per_peer`` results
of one peer are in the pool at once; beyond that the answer is ``busy`` (a node retries it). A
worker that dies or hangs past its deadline is killed and restarted, and the results it held (all
that went in its request: what waited on it goes together, :meth:`IntakePool._take`) are each
refused as ``busy`` with the reason (the node sends it again; its nonce was never recorded), so
no result is lost silently. :meth:`IntakePool.close` stops every worker (the hub's stop); a worker
also exits by itself when the hub's end of its socket closes.
"""

from __future__ import annotations

import logging
import pickle
import socket
import struct
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from echo2.protocol import envelope
from echo2.protocol.batchmessages import MAX_BATCH_RESULTS
from echo2.protocol.errors import Echo2Error, ProtocolError

from .config import ConfigError, HubConfig
from .cpugate import CpuGate
from .intake import Intake
from .intake_check import AnyResult, BatchHead, Findings, error_from_wire, find_many, open_result
from .intake_worker import CheckContext, Reply, WorkerSpec, recv_exact
from .recipe import Recipe
from .rewards import Scored

log = logging.getLogger(__name__)

_LEN = struct.Struct("<II")
_DECODER = msgspec.msgpack.Decoder(list[list[Reply]])
_ONE = struct.Struct("<I")
#: a worker's answer beyond its reward deadline by this much means it is stuck outside the reward
#: functions (their own timeout already bounds them): it is killed and restarted
REPLY_SLACK_S = 30.0
#: how long a spawned worker may take to load (it imports the tokenizer's modules and the
#: operator's reward code; measured ~2 s on the shared 2-core machine)
READY_TIMEOUT_S = 120.0
#: a worker's reply at most: a batch's arrays, stored rows and texts are a few times its frame
#: (MAX_BATCH_BYTES, 64 MiB), the largest request a worker takes alone
MAX_REPLY = 8 * 64 * 1024 * 1024
#: frames up to this size are sent with their header in one write (a copy costs less than a syscall)
SMALL_FRAME = 256 * 1024
#: results waiting on one worker at most. It was 2 batches' worth (64): with 32 nodes sending
#: batches of 8 at once (`echo2 bench intake --clients 2 --batch 8 --workers 2`, nodes resending
#: what is refused busy as a node does) ~1/3 of the items were answered busy, each received,
#: checked and refused for nothing, and sent again after a backoff (409 results/s against ~800
#: with no workers). The bytes of what waits are bounded apart: the channel holds at most 96 MiB
#: per peer and 512 MiB in all (protocol/net/channel.py), and per_peer bounds one node's share.
PER_WORKER = 8 * MAX_BATCH_RESULTS
#: what waited on a busy worker goes in its next request together, up to this many results and
#: bytes (a large frame goes alone: its copy into one request would cost more than the trip).
#: Measured (`echo2 bench intake --clients 2 --batch 8 --workers 2 --reward-sleep 1`, 100 nodes):
#: one request per node's share, a reward that sleeps 1 s a call let 2 workers take 5.2 results/s;
#: what waited sent together and scored in one call, 111 (22.9 with the scoring in the hub's threads)
COALESCE_ITEMS = PER_WORKER
COALESCE_BYTES = 16 * 1024 * 1024
#: a whole ResultBatch sent to a worker is charged to the per-peer and per-worker bounds (counted
#: in results) before it is opened, so by its bytes: one result per this many, at most a batch's
#: MAX_BATCH_RESULTS (a small result, 8 x 64 tokens packed, is 6.2 KB sealed: a batch of 8 of
#: them counts 13, and a node's two batches fit its per-peer bound, as one at a time is sent)
BATCH_BYTES_PER_RESULT = 4096


def batch_units(size: int) -> int:
    """What a sealed ResultBatch of ``size`` bytes counts against the bounds, unopened."""
    return max(1, min(MAX_BATCH_RESULTS, -(-size // BATCH_BYTES_PER_RESULT)))


class IntakeBusy(ProtocolError):
    """The hub's intake cannot take this result right now (a node retries it)."""

    code = "busy"


@dataclass(frozen=True)
class Checked:
    """A frame's findings, with its rewards when an intake worker scored it."""

    findings: Findings
    scored: Scored | None = None
    failures: tuple[tuple[str, str, str], ...] = ()
    payload: memoryview | None = None  # the scored rows' stored form (rows.encode_groups), made by the worker


@dataclass
class _Entry:
    """One caller's frames waiting on a worker slot, and what came back for them."""

    raws: list[bytes]
    ctx: CheckContext
    units: int  # what it counts against COALESCE_ITEMS: its results (a whole batch: batch_units)
    taken: bool = False  # sent (or being sent) in some caller's request
    replies: list[Reply] | None = None
    error: IntakeBusy | None = None


class _Worker:
    """One worker slot: its process (replaced on a restart), the hub's end of its socket, and the
    lock and queue count that outlive restarts."""

    def __init__(self, index: int, spec: WorkerSpec) -> None:
        self.index, self.spec = index, spec
        self.queued = 0
        self.lock: trio.Lock | None = None
        self.pending: list[_Entry] = []  # requests waiting for the slot, oldest first
        self.spawn()

    def spawn(self) -> None:
        self.ready = False
        self.sock, child = socket.socketpair()
        fd = child.fileno()
        # a fresh interpreter (see intake_worker's docstring for why not multiprocessing's spawn)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from echo2.learner_hub.intake_worker import run; run({fd})"],
            pass_fds=(fd,), stdin=subprocess.DEVNULL, close_fds=True,
        )
        child.close()
        spec = pickle.dumps((self.spec, list(sys.path)), protocol=pickle.HIGHEST_PROTOCOL)
        # sent from a thread: the tokenizer files can exceed the socket's buffer, and the child
        # reads them only once its interpreter is up (~1 s); start-up need not wait for each
        self._sender = threading.Thread(target=self._send_spec, args=(spec,), daemon=True, name="intake-spec")
        self._sender.start()

    def _send_spec(self, spec: bytes) -> None:
        try:
            self.sock.sendall(_ONE.pack(len(spec)) + spec)
        except OSError:
            pass  # the worker died at once: its ready frame never comes, and that is reported

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def wait_ready_sync(self, timeout: float) -> None:
        """The worker's ready frame, read before any trio wrapper exists (hub start-up)."""
        self.sock.settimeout(timeout)
        try:
            head = recv_exact(self.sock, _ONE.size)
            if head is None:
                raise ConfigError(f"intake worker {self.index} exited while loading (exit code {self.proc.wait(5)})")
            (n,) = _ONE.unpack(head)
            if n:
                msg = (recv_exact(self.sock, n) or b"").decode(errors="replace")
                raise ConfigError(f"intake worker {self.index} could not load the tokenizer or reward functions: {msg}")
        except TimeoutError as exc:
            raise ConfigError(f"intake worker {self.index} not ready after {timeout:.0f} s") from exc
        finally:
            self.sock.settimeout(None)
        self.ready = True

    async def wait_ready(self, timeout: float) -> None:
        await trio.to_thread.run_sync(self.wait_ready_sync, timeout)

    def stop(self, grace_s: float = 2.0) -> None:
        """Close the hub's end (the worker sees EOF and exits), then make sure it is gone."""
        try:
            self.sock.close()
        except OSError:
            pass
        for sig in ("wait", "terminate", "kill"):
            if sig != "wait":
                getattr(self.proc, sig)()
            try:
                self.proc.wait(grace_s if sig == "wait" else 2.0)  # reaped: no zombie left either
                return
            except subprocess.TimeoutExpired:
                continue


# The socket is driven with trio's low-level waits, not a trio SocketStream: per small result the
# stream's wrappers cost the loop more than the exchange itself (cProfile of bench intake --workers 2)
async def _send_all(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock.fileno())


async def _read_reply(sock: socket.socket) -> bytearray | None:
    """One length-prefixed reply (None at EOF), received straight into one buffer of its size.
    Why not chunks joined: a reply carries each result's arrays and stored rows (~1 MB for a batch
    of 8 results of 8 x 1,024 tokens), and appending received pieces then slicing out the body
    copied it three times: ~23% of the hub's loop with workers 2 at 1,024 tokens a completion
    (py-spy --gil, `echo2 bench intake --tokens 1024`). A small reply still comes in one receive
    (the length and the body land together; the body's first bytes are copied once from it)."""
    first = b""
    while len(first) < _ONE.size:
        await trio.lowlevel.wait_readable(sock.fileno())
        try:
            b = sock.recv(1 << 16)
        except BlockingIOError:
            continue
        if not b:
            return None
        first += b
    (n,) = _ONE.unpack_from(first)
    if n > MAX_REPLY:  # our own worker, but a size is checked before it is allocated all the same
        raise OSError(f"intake worker announced a reply of {n} bytes (at most {MAX_REPLY})")
    body = bytearray(n)
    view = memoryview(body)
    have = min(n, len(first) - _ONE.size)
    view[:have] = first[_ONE.size:_ONE.size + have]
    while have < n:
        try:
            k = sock.recv_into(view[have:])
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock.fileno())
            continue
        if not k:
            return None
        have += k
    return body


class IntakePool:
    """``workers`` intake processes (0: the checks run in this process)."""

    def __init__(self, workers: int, spec: WorkerSpec, decode_batch: Callable[[list[list[int]]], list[str]], *,
                 per_worker: int = PER_WORKER, per_peer: int = MAX_BATCH_RESULTS) -> None:
        # a node's ResultBatch is judged item by item, all at once (batchintake.py): a per-peer
        # bound below a batch's size would answer busy to the rest of an honest batch
        self.spec, self.decode_batch = spec, decode_batch
        self.per_worker, self.per_peer = per_worker, per_peer
        self.reply_timeout_s = spec.reward_timeout_s + REPLY_SLACK_S
        self._peers: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()  # busy answers by reason (status)
        self.restarts = 0
        self.checked = 0  # frames examined (whatever the finding)
        self.verdicts: Counter[str] = Counter()  # what check() answered: "ok" (findings) or the error code
        self._closed = False
        # intake's CPU work on the hub's loop (examining here with workers 0; judging and
        # accepting in batchintake.py either way) runs one task at a time, in slices
        self.gate = CpuGate()
        self._workers = [_Worker(i, spec) for i in range(workers)]

    @property
    def workers(self) -> int:
        return len(self._workers)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Block until every worker has loaded (start-up: a bad spec is a ConfigError here)."""
        for w in self._workers:
            if not w.ready:
                w.wait_ready_sync(timeout)

    async def check(self, raw: bytes, ctx: CheckContext) -> Checked:
        """The findings on ``raw`` (a Result envelope ``ctx.peer``'s connection sent). Raises the
        envelope's Echo2Error, or IntakeBusy when the pool cannot take it now."""
        out = (await self.check_many([raw], ctx))[0]
        if isinstance(out, Echo2Error):
            raise out
        return out

    async def check_many(self, raws: list[bytes], ctx: CheckContext) -> list[Checked | Echo2Error]:
        """The findings on each of ``raws`` (the items of one peer's ResultBatch), in order: each
        one's Checked, or its Echo2Error (the envelope's, or IntakeBusy). With workers, the items
        go in one request per worker (a share each), not one round trip per item: per small
        result the round trip was the largest part of the hub's own cost (~0.3 ms on the loop)."""
        if not self._workers:
            out: list[Checked | Echo2Error | None] = [None] * len(raws)
            opened: list[tuple[int, envelope.Verified[AnyResult]]] = []
            async with self.gate.held() as gate:  # the loop's lag: a batch is examined in slices (cpugate.py)
                for i, raw in enumerate(raws):
                    self.checked += 1
                    try:
                        opened.append((i, open_result(raw, ctx.peer, covered=ctx.covered)))
                    except Echo2Error as exc:
                        self.verdicts[exc.code] += 1
                        out[i] = exc
                    await gate.tick()
                # the opened ones checked together (numpy's per-call costs once per batch)
                found = find_many([v for _, v in opened], ctx.peer, ctx.tasks, self.spec.limits, self.decode_batch)
            for (i, _), f in zip(opened, found, strict=True):
                self.verdicts["ok"] += 1
                out[i] = Checked(f)
            return [o for o in out if o is not None]
        if self._closed:
            return [self._busy("stopping", "the hub is stopping") for _ in raws]
        room = max(0, self.per_peer - self._peers[ctx.peer])
        results: list[Checked | Echo2Error] = [
            self._busy("per_peer", f"{self.per_peer} results of this node are already being checked; retry later")
            for _ in raws[room:]]
        take = raws[:room]
        if not take:
            return results
        # a share per worker, least busy first, each within its queue bound
        shares: list[tuple[_Worker, int, int]] = []
        at = 0
        per = -(-len(take) // len(self._workers))
        for w in sorted(self._workers, key=lambda x: x.queued):
            n = min(per, len(take) - at, max(0, self.per_worker - w.queued))
            if n > 0:
                shares.append((w, at, at + n))
                w.queued += n
                at += n
        checked: list[Checked | Echo2Error | None] = [None] * len(take)
        for i in range(at, len(take)):
            checked[i] = self._busy("queue_full", "every intake worker's queue is full; retry later")
        self._peers[ctx.peer] += at

        async def one(w: _Worker, lo: int, hi: int) -> None:
            try:
                replies = await self._ask(w, take[lo:hi], ctx)
            except IntakeBusy as exc:
                for i in range(lo, hi):
                    checked[i] = exc
                return
            finally:
                w.queued -= hi - lo
            for i, reply in zip(range(lo, hi), replies, strict=True):
                checked[i] = self._checked(reply)

        try:
            if len(shares) == 1:
                await one(*shares[0])
            else:
                async with trio.open_nursery() as nursery:
                    for share in shares:
                        nursery.start_soon(one, *share)
        finally:
            self._peers[ctx.peer] -= at
            if self._peers[ctx.peer] <= 0:
                del self._peers[ctx.peer]
        done = [c for c in checked if c is not None]
        assert len(done) == len(take)
        return done + results

    async def check_batch(self, frame: bytes, ctx: CheckContext) -> tuple[BatchHead, list[Checked | Echo2Error]]:
        """A whole sealed ResultBatch from ``ctx.peer``, opened by a worker (its signature, over
        the raw bytes, checked there instead of on the hub's loop: the batch's verification and
        decoding were ~8% of the hub's loop per result with workers 2, py-spy of `echo2 bench
        intake --batch 8`), then each item as :meth:`check_many` does: the batch's envelope for
        the hub's replay step and each item's Checked or Echo2Error. Raises the batch's
        Echo2Error (its envelope refused), or IntakeBusy. Needs workers."""
        if not self._workers:
            raise RuntimeError("check_batch needs intake workers (batchintake.judge_batch opens it here otherwise)")
        if self._closed:
            raise self._busy("stopping", "the hub is stopping")
        units = batch_units(len(frame))
        if self._peers[ctx.peer] and self._peers[ctx.peer] + units > self.per_peer:
            raise self._busy("per_peer", f"{self.per_peer} results of this node are already being checked; retry later")
        w = min(self._workers, key=lambda x: x.queued)
        if w.queued and w.queued + units > self.per_worker:
            raise self._busy("queue_full", "every intake worker's queue is full; retry later")
        w.queued += units
        self._peers[ctx.peer] += units
        try:
            replies = await self._ask(w, [frame], ctx._replace(batch=True), units)  # covered once the worker verified it
        finally:
            w.queued -= units
            self._peers[ctx.peer] -= units
            if self._peers[ctx.peer] <= 0:
                del self._peers[ctx.peer]
        head = replies[0]
        if head.batch is None:
            err = error_from_wire(*head.error) if head.error is not None else IntakeBusy("the worker did not open the batch")
            self.verdicts["batch:" + err.code] += 1
            raise err
        return BatchHead(*head.batch), [self._checked(r) for r in replies[1:]]

    def _checked(self, reply: Reply) -> Checked | Echo2Error:
        self.checked += 1
        if reply.error is not None:
            err = error_from_wire(*reply.error)
            self.verdicts[err.code] += 1
            return err
        self.verdicts["ok"] += 1
        assert reply.findings is not None
        scored = Scored(*reply.scored) if reply.scored is not None else None
        return Checked(reply.findings, scored, reply.failures, reply.payload)

    async def _ask(self, w: _Worker, raws: list[bytes], ctx: CheckContext, units: int | None = None) -> list[Reply]:
        """The worker's replies to ``raws``. What queues on a busy worker goes in its next request
        together (:meth:`_take`): the first caller to get the slot sends its own frames and those
        of everyone waiting behind it, and each of them finds its replies when it gets the slot."""
        entry = _Entry(raws, ctx, len(raws) if units is None else units)
        w.pending.append(entry)
        w.lock = w.lock or trio.Lock()
        try:
            try:  # uncontended, no extra trip through the scheduler (each costs the loop ~30 us)
                w.lock.acquire_nowait()
            except trio.WouldBlock:
                await w.lock.acquire()  # cancellable: nothing of ours is sent until we are taken
        except BaseException:
            if not entry.taken:
                w.pending.remove(entry)
            raise
        try:
            if not entry.taken:
                await self._exchange(w, self._take(w, entry))
        finally:
            w.lock.release()
        if entry.error is not None:
            raise entry.error
        if entry.replies is None:  # the exchange that took it failed outside its own handling
            raise self._busy("worker_died", "the intake worker's exchange failed; send the result again")
        return entry.replies

    def _take(self, w: _Worker, first: _Entry) -> list[_Entry]:
        """``first`` and what waits behind it (in order, while the request stays under
        COALESCE_ITEMS results and COALESCE_BYTES): the slot's lock is fair, so no older entry
        waits untaken."""
        batch, items, size = [first], first.units, sum(len(r) for r in first.raws)
        first.taken = True
        for e in w.pending:
            if e.taken:
                continue
            n = sum(len(r) for r in e.raws)
            if items + e.units > COALESCE_ITEMS or size + n > COALESCE_BYTES:
                break
            e.taken = True
            batch.append(e)
            items, size = items + e.units, size + n
        w.pending = [e for e in w.pending if not e.taken]
        return batch

    async def _exchange(self, w: _Worker, batch: list[_Entry]) -> None:
        """One request with every entry of ``batch``; each gets its replies, or the same busy
        error when the worker dies or hangs (it is restarted; nothing was recorded for them)."""
        header = pickle.dumps([(e.ctx, [len(r) for r in e.raws]) for e in batch], protocol=pickle.HIGHEST_PROTOCOL)
        raws = [r for e in batch for r in e.raws]
        reply: list[list[Reply]] | None = None
        why = "timed out"
        try:
            if w.exitcode is not None:  # died while idle: a fresh one takes these results
                self._restart(w, f"exited with code {w.exitcode} while idle")
            # shielded: a request half sent or an answer half read would leave the socket out of
            # step; the deadline still bounds it (a worker past it is restarted)
            limit = sum(e.units for e in batch) * self.reply_timeout_s + (0 if w.ready else READY_TIMEOUT_S)
            with trio.CancelScope(shield=True, deadline=trio.current_time() + limit):
                try:
                    if not w.ready:
                        await w.wait_ready(READY_TIMEOUT_S)
                        w.sock.setblocking(False)
                    total = sum(len(r) for r in raws)
                    head = _LEN.pack(len(header), total) + header
                    if total <= SMALL_FRAME:  # one write: each wakes the worker (a syscall and a switch)
                        await _send_all(w.sock, b"".join([head, *raws]))
                    else:  # no copy of a large frame
                        await _send_all(w.sock, head)
                        for raw in raws:
                            await _send_all(w.sock, raw)
                    body = await _read_reply(w.sock)
                    if body is not None:
                        reply = _DECODER.decode(body)  # a list of replies per entry
                        if len(reply) != len(batch) or any(not e.ctx.batch and len(r) != len(e.raws)
                                                           for e, r in zip(batch, reply, strict=False)):
                            reply, why = None, "answered out of step"
                    else:
                        why = "died"
                except (OSError, ConfigError, msgspec.DecodeError) as exc:
                    why = f"died ({type(exc).__name__})"
            if reply is not None:
                for e, mine in zip(batch, reply, strict=True):
                    e.replies = mine
                return
            peers = sorted({e.ctx.peer for e in batch})
            self._restart(w, f"{why} while checking {len(raws)} results of {', '.join(peers[:3])}"
                             f"{' and others' if len(peers) > 3 else ''} (exit code {w.exitcode})")
        finally:
            for e in batch:
                if e.replies is None and e.error is None:
                    e.error = self._busy("worker_died", f"the intake worker {why} while checking this result; it "
                                                        "was restarted: send the result again")

    def _restart(self, w: _Worker, why: str) -> None:
        log.warning("intake worker %d %s: restarting it", w.index, why)
        w.stop(grace_s=0.5)
        self.restarts += 1
        w.spawn()  # whoever waits on the slot's lock is served by the new process

    def _busy(self, reason: str, message: str) -> IntakeBusy:
        self.refused[reason] += 1
        self.verdicts[IntakeBusy.code] += 1
        return IntakeBusy(message)

    def close(self) -> None:
        """Stop every worker (idempotent): the hub's stop leaves no process behind."""
        self._closed = True
        for w in self._workers:
            w.stop()

    def report(self) -> dict[str, Any]:
        """The pool's counters (status.json's "intake_pool", `echo2 hub status`): cheap, from
        counters kept as it goes (and a waitpid poll per worker, not per result)."""
        return {"workers": self.workers, "workers_alive": sum(1 for w in self._workers if w.exitcode is None),
                "checked": self.checked, "restarts": self.restarts, "in_flight": sum(w.queued for w in self._workers),
                "verdicts": dict(self.verdicts), "busy_by_reason": dict(self.refused),
                "queued": sum(w.queued for w in self._workers), "pids": self.pids()}


def worker_spec(cfg: HubConfig, recipe: Recipe, artifacts: dict[str, bytes], intake: Intake) -> WorkerSpec:
    """What a worker needs to rebuild the hub's tokenizer and reward functions. Reward functions
    travel as specs: strings, a verifiers environment id, or module-level functions (pickled by
    reference); a function that cannot (a lambda, a closure) is a ConfigError with workers on."""
    funcs: list[Any] = [] if cfg.environment else list(recipe.reward_funcs)
    if cfg.intake_workers:
        for f in funcs:
            if not isinstance(f, str):
                try:
                    pickle.dumps(f)
                except Exception as exc:
                    raise ConfigError(f"intake_workers = {cfg.intake_workers}: reward function {f!r} cannot be "
                                      "sent to a worker by name; give it as 'file.py:func' or 'package.module:func'") from exc
    return WorkerSpec(artifacts=dict(artifacts), limits=intake.limits, reward_funcs=funcs,
                      reward_weights=list(recipe.reward_weights), reward_timeout_s=cfg.reward_timeout_s,
                      environment=cfg.environment, environment_args=dict(cfg.environment_args))


__all__ = ["CheckContext", "Checked", "IntakeBusy", "IntakePool", "WorkerSpec", "worker_spec"]
