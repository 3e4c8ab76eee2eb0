"""The node's result delivery (issue 20): finished results wait in the outbox (:mod:`.outbox`,
on disk) and one trio task sends what is ready, several at once in one signed ResultBatch, while
the task loop already runs the next task.

Each try seals the results afresh (a retried copy of an envelope the hub took would read as a
replay). Per result, the hub's answer decides: a receipt ends it (kept by the ReceiptBook); a
verdict (stale, duplicate, forged, ...) ends it too, recorded as refused; ``busy`` and the other
transient codes, a transport failure, or ``not_admitted`` (a restarted hub; the task loop asks
for admission again meanwhile) keep it, retried with capped jittered backoff until its task's
deadline (security rule A1: a hub kept busy for a moment must not cost anyone their work).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeAlias

import trio

from echo2.fsutil import atomic_write
from echo2.protocol import envelope
from echo2.protocol.backoff import backoff_delay
from echo2.protocol.errors import Echo2Error
from echo2.protocol.framing import RemoteError
from echo2.protocol.identity import Identity
from echo2.protocol.net.control import ControlHost
from echo2.protocol.wire import MAX_CONTROL_REQUEST, RESULT

from .delivery import RETRY_CODES
from .hublink import HubLink
from .outbox import MAX_BYTES, MAX_ENTRIES, SUFFIX, Entry, WorkerState, decode_entry, encode_entry, plan

log = logging.getLogger("echo2.node.runtime")  # the crash bench reads "result of task ... accepted" here

#: kept and retried, beside the transient codes: a restarted hub answers this until the task loop
#: has been admitted again, and the task may still be open there (a resumed hub)
KEEP_CODES = RETRY_CODES | {"not_admitted"}
#: the longest wait between tries of one result
RETRY_CAP_S = 5.0
#: default linger: see ResultDelivery and the README's figures
LINGER_S = 0.0

Outcome: TypeAlias = bytes | RemoteError | Exception  # a receipt, the hub's refusal, or a failure to deliver


class ResultDelivery:
    """The outbox and its delivery task. ``to_hub()``: the hub link now (a HubLink when the
    channel may carry batches, else a host); ``on_accepted(entry, reply)`` / ``on_refused(entry,
    code, reason)``: the node's receipts and counters; ``held_version()``: the newest policy held."""

    def __init__(self, directory: Path, identity: Identity, hub_peer: str, *,
                 to_hub: Callable[[], HubLink | ControlHost],
                 on_accepted: Callable[[Entry, bytes], Awaitable[None]],
                 on_refused: Callable[[Entry, str, str], Awaitable[None]],
                 held_version: Callable[[], int | None],
                 count_bytes: Callable[[int], None] = lambda n: None,
                 linger_s: float = LINGER_S, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.dir, self.identity, self.hub_peer = directory, identity, hub_peer
        self.to_hub, self.on_accepted, self.on_refused = to_hub, on_accepted, on_refused
        self.held_version, self.count_bytes = held_version, count_bytes
        self.linger_s, self.max_entries, self.max_bytes = linger_s, max_entries, max_bytes
        self.entries: list[Entry] = []  # oldest first
        self.worker = WorkerState()  # what the task loop is doing (the linger's prediction)
        self._changed = trio.Event()
        self._storing: dict[str, trio.Event] = {}  # entries whose file is being written
        self._nursery: trio.Nursery | None = None
        # counters (node.state.json, tests, the bench)
        self.sends = 0  # requests that carried results (a batch or a lone result)
        self.results_sent = 0  # results in them (a retried one counts each time)
        self.batch_sizes: dict[int, int] = {}
        self.accepted = self.refused = self.expired = self.retried = 0

    # --- the outbox ------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self.entries)

    def _bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def load(self) -> int:
        """Take up what an earlier run left in the outbox directory (before the delivery task
        starts); an unreadable file is moved aside, never sent."""
        found = await trio.to_thread.run_sync(_read_dir, self.dir)
        for name, data in found:
            try:
                e = decode_entry(data)
            except (ValueError, Echo2Error, KeyError, TypeError) as exc:
                log.warning("outbox file %s is unreadable (%s): moved aside", name, exc)
                await trio.to_thread.run_sync(_set_aside, self.dir / name)
                continue
            if e.name != name:
                log.warning("outbox file %s does not name its task: moved aside", name)
                await trio.to_thread.run_sync(_set_aside, self.dir / name)
                continue
            if all(x.task_id != e.task_id for x in self.entries):
                self.entries.append(e)
        self.entries.sort(key=lambda x: x.ready_at)
        if self.entries:
            log.info("outbox: %d finished results from an earlier run to deliver", len(self.entries))
        self._wake()
        return len(self.entries)

    async def put(self, entry: Entry) -> None:
        """Keep ``entry`` for the delivery task (and on disk); waits while the outbox is full.

        The file is written beside the task loop's next work request, not before it: ~7 ms median
        and 60 ms at worst per fsynced write here (2 shared cores, loaded), which the task loop
        would otherwise spend idle on every result. A crash in those milliseconds loses the result,
        as a crash a moment earlier, while it was generated, would have."""
        while self.entries and (len(self.entries) >= self.max_entries or self._bytes() + entry.size > self.max_bytes):
            await self._changed.wait()
        data = encode_entry(entry)
        entry.size = len(data)
        self.entries.append(entry)
        now = time.time()
        self.worker.generated(now)  # packed and kept: the whole time it took to make counts
        self.worker.polling(now)  # the task loop asks for its next task now
        self._wake()
        stored = self._storing[entry.name] = trio.Event()
        if self._nursery is not None:
            self._nursery.start_soon(self._store, entry, data, stored)
        else:
            await self._store(entry, data, stored)

    async def _store(self, entry: Entry, data: bytes, stored: trio.Event) -> None:
        try:
            await trio.to_thread.run_sync(_write, self.dir, entry.name, data)
        except OSError as exc:  # a full disk costs the crash safety of this result, not the result
            log.error("outbox: could not keep the result of task %s on disk: %s", entry.task_id, exc)
        finally:
            stored.set()
            if self._storing.get(entry.name) is stored:
                del self._storing[entry.name]

    # what the task loop does (each may change the linger's decision)
    def generating(self) -> None:
        self.worker.generating(time.time())
        self._wake()

    def idle(self) -> None:
        if self.worker.state != "idle":
            self.worker.idle(time.time())
            self._wake()

    async def changed(self) -> None:
        """Return at the next change of the outbox (an entry put, answered or dropped)."""
        await self._changed.wait()

    async def drain(self) -> None:
        """Return once the outbox is empty (bound it with a cancel scope)."""
        while self.entries:
            await self._changed.wait()

    # --- the delivery task -----------------------------------------------------------------------
    async def run(self) -> None:
        async with trio.open_nursery() as nursery:  # the outbox's file writes
            self._nursery = nursery
            try:
                await self._deliver()
            finally:
                self._nursery = None

    async def _deliver(self) -> None:
        while True:
            link = self.to_hub()
            max_count, max_bytes = link.batch_limits() if isinstance(link, HubLink) else (1, 0)
            now = time.time()
            next_at, recheck_at = self.worker.predict(now)
            p = plan(self.entries, now, max_count=max_count, max_bytes=max_bytes, linger_s=self.linger_s,
                     next_at=next_at, recheck_at=recheck_at, held_version=self.held_version())
            for e in p.expired:
                self.expired += 1
                log.warning("result of task %s not delivered before its deadline (%s): dropped", e.task_id,
                            e.last_error or "no answer")
                await self._forget(e)
            if p.send:
                await self._send(link, p.send)
                continue
            changed = self._changed
            if p.wake_at is None:
                await changed.wait()
            else:
                with trio.move_on_after(max(0.0, p.wake_at - time.time())):
                    await changed.wait()

    async def _send(self, link: HubLink | ControlHost, batch: list[Entry]) -> None:
        sealed = [envelope.seal(self.identity, e.result, ttl_s=300) for e in batch]
        for s in sealed:
            self.count_bytes(len(s))
        self.sends += 1
        self.results_sent += len(batch)
        self.batch_sizes[len(batch)] = self.batch_sizes.get(len(batch), 0) + 1
        outcomes: list[Outcome]
        try:
            if len(batch) > 1 and isinstance(link, HubLink):
                outcomes = list(await link.send_batch(sealed))
            else:
                outcomes = [await link.request(self.hub_peer, RESULT, sealed[0], max_response=MAX_CONTROL_REQUEST,
                                               timeout_s=30)]
        except (Echo2Error, OSError) as exc:  # the batch as a whole: refused, or nothing known
            outcomes = [exc] * len(batch)
        for e, out in zip(batch, outcomes, strict=True):
            await self._settle(e, out)

    async def _settle(self, e: Entry, out: Outcome) -> None:
        if isinstance(out, bytes):
            self.accepted += 1
            log.info("result of task %s accepted", e.task_id)  # what the crash bench counts as acknowledged
            await self.on_accepted(e, out)  # the receipt on disk before the result leaves it
            await self._forget(e)
            return
        if isinstance(out, RemoteError) and out.code not in KEEP_CODES:
            self.refused += 1
            log.warning("hub refused result of task %s: %s", e.task_id, out)
            await self._forget(e)
            await self.on_refused(e, out.code, out.message)
            return
        e.failures += 1
        e.last_error = str(out)[:300]
        delay = backoff_delay(e.failures, base_s=0.5, cap_s=RETRY_CAP_S)
        e.not_before = time.time() + delay
        self.retried += 1
        log.info("result of task %s not delivered (%s); retry %d in %.1f s", e.task_id, e.last_error, e.failures, delay)

    async def _forget(self, e: Entry) -> None:
        if e in self.entries:
            self.entries.remove(e)
        stored = self._storing.get(e.name)
        if stored is not None:  # its file is still being written: removed once it is
            await stored.wait()
        try:
            await trio.to_thread.run_sync(_remove, self.dir / e.name)
        except OSError as exc:
            log.warning("outbox: could not remove %s: %s", e.name, exc)
        self._wake()

    def report(self) -> dict[str, Any]:
        sizes = self.batch_sizes
        return {"outbox_waiting": len(self.entries), "result_sends": self.sends, "results_sent": self.results_sent,
                "mean_batch": round(self.results_sent / self.sends, 3) if self.sends else None,
                "batch_sizes": {str(k): sizes[k] for k in sorted(sizes)}, "results_expired": self.expired,
                "results_retried": self.retried}


# --- files (in worker threads) -------------------------------------------------------------------

def _read_dir(d: Path) -> list[tuple[str, bytes]]:
    if not d.is_dir():
        return []
    return [(p.name, p.read_bytes()) for p in sorted(d.iterdir()) if p.name.endswith(SUFFIX) and p.is_file()]


def _write(d: Path, name: str, data: bytes) -> None:
    d.mkdir(parents=True, exist_ok=True)
    atomic_write(d / name, data)


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _set_aside(path: Path) -> None:
    try:
        os.replace(path, path.with_name(path.name + ".bad"))
    except OSError:
        pass
