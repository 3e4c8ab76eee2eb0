"""The store adapter: every SQLite call of the running hub goes through one worker thread.

Why a bare thread, not ``trio.to_thread``: an sqlite3 connection is bound to the thread that
opened it, and ``trio.to_thread`` runs each call on whichever pool thread is free. One thread that
opens the store and serves a FIFO queue also orders every write exactly as the loop issued it
(a result is recorded before the step that trains it is marked), with no lock held across calls.

Three ways in, none of which blocks the trio loop:

* :meth:`StoreWorker.submit`: fire and forget (log lines, state flags); a failure is logged.
* ``await`` :meth:`StoreWorker.call` (or :meth:`StoreWorker.request` now, ``await .wait()``
  later): the loop task waits for the answer (reads, and writes that must be durable before a
  reply, such as an accepted result).
* :meth:`StoreWorker.call_sync`: for code outside the loop (start-up, shutdown, tests). Called on
  the trio thread it raises instead of stalling the loop.

Attribute access (``worker.ban_reason(peer)``) is ``call_sync`` of that ``HubStore`` method,
so synchronous users (start-up, tests) read the store as before.

Group commit: accepted results (``HubStore.record_accepted_many``, each node's batch a durable
transaction) waiting next to each other in the queue are written in one transaction, each caller
still answered only after its rows are committed. Measured here (a loop of
``record_accepted_many`` on a fresh store, 8 results of 6.2 KB a batch): 42 us of the thread's
CPU a result with a transaction per batch, 30 with 4 batches a transaction; live at ~800
results/s the store thread spent ~85 us a result on them (`echo2 bench intake`, its jobs timed by
name), 14% of the hub's CPU per result. A group that fails is run again batch by batch,
so one bad batch fails only its own caller.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

import outcome
import trio

from .store import HubStore

log = logging.getLogger(__name__)

T = TypeVar("T")

_Job = Callable[[HubStore], None]
_STOP = object()
#: batches merged into one transaction at most (a group waits for nothing: it is what is queued)
MAX_GROUP = 64


class StoreReply(Generic[T]):
    """The answer to a queued store call, once the worker has run it."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.outcome: outcome.Outcome[T] | None = None

    async def wait(self) -> T:
        await self.done.wait()
        assert self.outcome is not None
        return self.outcome.unwrap()


class StoreWorker:
    """Owns a :class:`HubStore` opened in, and only used from, its own thread."""

    def __init__(self, hub_dir: str | Path, *, before_call: Callable[[], None] | None = None, **store_kw: Any) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._opened: queue.SimpleQueue[outcome.Outcome[HubStore]] = queue.SimpleQueue()
        #: test hook: run in the worker thread before every job (e.g. a sleep to slow the store)
        self.before_call = before_call
        self.grouped = 0  # calls written in a transaction shared with others (group commit)
        self._thread = threading.Thread(
            target=self._serve, args=(Path(hub_dir), store_kw), name="echo2-hub-store", daemon=True
        )
        self._thread.start()
        self._store = self._opened.get().unwrap()  # raises StoreError here if the file is unusable
        self.path = self._store.path
        self.checkpoint_dir = self._store.checkpoint_dir

    def _serve(self, hub_dir: Path, store_kw: dict[str, Any]) -> None:
        opened = outcome.capture(HubStore.in_dir, hub_dir, check_same_thread=True, **store_kw)
        self._opened.put(opened)
        if isinstance(opened, outcome.Error):
            return
        store = opened.value
        after: Any = None  # the job that ended a group, run next (the queue's order is kept)
        try:
            while True:
                job, after = (after, None) if after is not None else (self._q.get(), None)
                if job is _STOP:
                    return
                if self.before_call is not None:
                    self.before_call()
                if not isinstance(job, _Grouped):
                    job(store)
                    continue
                group = [job]
                while len(group) < MAX_GROUP:
                    try:
                        nxt = self._q.get_nowait()
                    except queue.Empty:
                        break
                    if isinstance(nxt, _Grouped) and nxt.fn is job.fn:
                        group.append(nxt)
                    else:
                        after = nxt
                        break
                self.grouped += _Grouped.run(store, group)
        finally:
            store.close()

    # --- the three ways in -------------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
        """Queue ``fn(store, *args, **kw)``; do not wait for it."""

        def job(store: HubStore) -> None:
            try:
                fn(store, *args, **kw)
            except Exception:
                log.exception("hub store call %s failed", getattr(fn, "__name__", fn))

        self._q.put(job)

    def request(self, fn: Callable[..., T], *args: Any, **kw: Any) -> StoreReply[T]:
        """Queue ``fn(store, *args, **kw)`` now (from the trio thread); ``await reply.wait()``
        later for its answer. If the waiter is cancelled the call still runs."""
        reply: StoreReply[T] = StoreReply()
        token = trio.lowlevel.current_trio_token()
        if fn in GROUPED and len(args) == 1 and not kw:  # see "Group commit" above
            self._q.put(_Grouped(fn, list(args[0]), reply, token))
            return reply

        def job(store: HubStore) -> None:
            reply.outcome = outcome.capture(fn, store, *args, **kw)
            try:
                token.run_sync_soon(reply.done.set)
            except trio.RunFinishedError:
                pass

        self._q.put(job)
        return reply

    async def call(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``fn(store, *args, **kw)`` in the worker; the calling task waits, the loop does not."""
        return await self.request(fn, *args, **kw).wait()

    def call_sync(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``fn(store, *args, **kw)`` in the worker, blocking this (non-trio) thread."""
        if _on_trio_thread():
            raise RuntimeError("a blocking store call on the trio loop: use `await call(...)` or `submit(...)`")
        reply: queue.SimpleQueue[outcome.Outcome[T]] = queue.SimpleQueue()
        self._q.put(lambda store: reply.put(outcome.capture(fn, store, *args, **kw)))
        return reply.get().unwrap()

    def flush(self) -> None:
        """Wait until every job queued so far has run (outside the loop)."""
        self.call_sync(lambda _s: None)

    def close(self) -> None:
        """Run what is queued, then close the connection and stop the thread."""
        if self._thread.is_alive():
            self._q.put(_STOP)
            self._thread.join()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(HubStore, name, None)
        if method is None or name.startswith("_") or not callable(method):
            raise AttributeError(name)

        def sync_call(*args: Any, **kw: Any) -> Any:
            return self.call_sync(method, *args, **kw)

        return sync_call


#: store calls of one list argument whose calls queued together may run as one call on the lists
#: joined: one transaction for all (each must write its items independently of the others')
GROUPED: frozenset[Callable[..., Any]] = frozenset({HubStore.record_accepted_many})


class _Grouped:
    """A queued call of a :data:`GROUPED` store method, and its caller's reply."""

    __slots__ = ("fn", "items", "reply", "token")

    def __init__(self, fn: Callable[..., Any], items: list[Any], reply: StoreReply[Any], token: trio.lowlevel.TrioToken) -> None:
        self.fn, self.items, self.reply, self.token = fn, items, reply, token

    def answer(self, result: outcome.Outcome[Any]) -> None:
        self.reply.outcome = result
        try:
            self.token.run_sync_soon(self.reply.done.set)
        except trio.RunFinishedError:
            pass

    @staticmethod
    def run(store: HubStore, group: list[_Grouped]) -> int:
        """Run ``group`` (queued next to each other, same method); the calls that shared a transaction."""
        if len(group) > 1:
            joined = outcome.capture(group[0].fn, store, [x for g in group for x in g.items])
            if isinstance(joined, outcome.Value):
                for g in group:
                    g.answer(outcome.Value(joined.value))  # an Outcome is unwrapped once: one each
                return len(group)
            # rolled back whole: each again alone, so only the bad one's caller hears its error
            log.info("a group of %d store writes failed (%s); writing them one by one", len(group), joined.error)
        for g in group:
            g.answer(outcome.capture(g.fn, store, g.items))
        return 0


def _on_trio_thread() -> bool:
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return False
    return True
