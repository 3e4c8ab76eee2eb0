"""Applying the computing preferences (issue 19): sample, decide, tell the hub, pause and resume.

One trio task: every ``check_every_s`` it re-reads ``DATA_DIR/node.toml`` when it changed (flags
still override it), takes the readings in a worker thread (:mod:`.sysread`), and asks the pure
policy (:mod:`.prefs`). On a change it tells the hub with a signed :class:`NodePause` (the hub
counts the node unavailable, not failed), and while paused repeats it as the node's keepalive.
The worker waits in :meth:`Pauser.wait_running`; a running task sees :meth:`Pauser.should_stop`
between tokens and is handed back (declined ``paused``). A node-side block (a model that does not
fit the memory the preferences allow) pauses the node the same way until a version fits.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import trio

from echo2.fsutil import atomic_write
from echo2.protocol import envelope
from echo2.protocol.errors import Echo2Error
from echo2.protocol.framing import RemoteError
from echo2.protocol.identity import Identity
from echo2.protocol.messages import NodePause
from echo2.protocol.wire import MAX_CONTROL_REQUEST, PAUSE, WORK_POLL_S

from .prefs import (
    RUN,
    Decision,
    Prefs,
    PrefsError,
    PrefsPolicy,
    Readings,
    TransferMeter,
    load_prefs,
    merge_prefs,
)

log = logging.getLogger(__name__)

PREFS_FILE = "node.toml"
TRANSFER_FILE = "transfer.json"


def local_now() -> datetime:
    return datetime.now().astimezone()


class ReadingSource(Protocol):
    def read(self, transfer_day_bytes: int = 0, transfer_month_bytes: int = 0) -> Readings: ...


class Requester(Protocol):
    async def request(self, peer: str, protocol: str, payload: bytes, **kw: Any) -> bytes: ...


def effective_prefs(data_dir: Path, overrides: dict[str, Any]) -> Prefs:
    """What the node runs with: ``DATA_DIR/node.toml``'s ``[prefs]``, flags overriding."""
    return merge_prefs(load_prefs(data_dir / PREFS_FILE), overrides)


class Pauser:
    def __init__(
        self,
        identity: Identity,
        hub_peer: str,
        data_dir: Path,
        overrides: dict[str, Any],
        *,
        reader: ReadingSource | None = None,
        clock: Callable[[], datetime] = local_now,
    ) -> None:
        self.identity, self.hub_peer, self.data_dir = identity, hub_peer, data_dir
        self.overrides = dict(overrides)
        self.path = data_dir / PREFS_FILE
        self.prefs = effective_prefs(data_dir, overrides)  # a bad file stops the start, with its message
        self._mtime = self._stat()
        self.policy = PrefsPolicy(self.prefs)
        if reader is None:
            from .sysread import SystemReader

            reader = SystemReader()
        self.reader = reader
        self.clock = clock
        self.meter = TransferMeter(self._load_meter())
        self.decision: Decision = RUN
        self.block: Decision | None = None  # set by the node itself (a model that does not fit)
        self.readings = Readings()
        self._running = trio.Event()
        self._running.set()
        self._relay_changed = trio.Event()
        self._relaying = True
        self._told: tuple[bool, str] = (True, "")  # what the hub last acknowledged
        self._told_at = 0.0
        self.on_prefs_changed: Callable[[Prefs], None] = lambda _p: None
        self.on_change: Callable[[], None] = lambda: None  # paused or resumed (the node rewrites its state file)
        self.on_reply: Callable[[bytes], Awaitable[None]] | None = None  # the hub's answer (a statement of account)
        self.pauses = 0  # times computing paused (for status and tests)
        self.relay_bytes: Callable[[], int] = lambda: 0  # the policy downlink's bytes in and out so far
        self._relay_seen = 0

    # --- what the node reads -----------------------------------------------------------------------
    @property
    def current(self) -> Decision:
        return self.block if self.block is not None else self.decision

    @property
    def paused(self) -> bool:
        return not self.current.run

    def should_stop(self) -> bool:
        """Called between generated tokens (a worker thread): a cheap attribute read."""
        return not self.current.run

    async def wait_running(self) -> None:
        while not self.current.run:
            self._apply()  # a block set from a worker thread takes effect here at the latest
            await self._running.wait()

    async def wait_relay(self, allowed: bool) -> None:
        """Until relaying is ``allowed`` (True) or stopped (False) by the preferences."""
        while self.current.relay != allowed:
            await self._relay_changed.wait()

    async def while_relaying(self, run: Callable[..., Awaitable[None]], task_status: Any) -> None:
        """Run the policy downlink ``run`` (started with a task status) while relaying is allowed;
        cancel it when the preferences stop relaying (a transfer cap, or relay_while_paused =
        false while computing is paused) and start it again after: its children route around it."""
        started = False
        while True:
            async with trio.open_nursery() as nursery:
                await nursery.start(run)
                if not started:
                    task_status.started()
                    started = True
                await self.wait_relay(False)
                nursery.cancel_scope.cancel()
            log.warning("relaying stopped: %s", self.current.reason)
            await self.wait_relay(True)
            log.info("relaying again")

    def count_bytes(self, n: int) -> None:
        self.meter.add(n, self.clock())

    def set_block(self, code: str, reason: str) -> None:
        """Pause for a reason of the node's own (a refused model). May be called from a worker
        thread: one assignment; the loop applies it (and tells the hub) at its next reading."""
        self.block = Decision(False, code, reason, relay=True)

    def clear_block(self) -> None:
        if self.block is not None:
            self.block = None
            self._apply()

    # --- the loop ------------------------------------------------------------------------------
    def _stat(self) -> float | None:
        try:
            return self.path.stat().st_mtime
        except OSError:
            return None

    def _load_meter(self) -> dict[str, Any] | None:
        try:
            state = json.loads((self.data_dir / TRANSFER_FILE).read_text())
            return state if isinstance(state, dict) else None
        except (OSError, ValueError):
            return None

    def _reload(self) -> None:
        m = self._stat()
        if m == self._mtime:
            return
        self._mtime = m
        try:
            prefs = effective_prefs(self.data_dir, self.overrides)
        except PrefsError as exc:
            log.error("preferences not changed: %s", exc)  # the running set stays
            return
        if prefs != self.prefs:
            log.info("preferences changed: %s", _diff(self.prefs, prefs))
            self.prefs = prefs
            self.policy.prefs = prefs
            self.on_prefs_changed(prefs)

    def _apply(self) -> None:
        d = self.current
        if d.relay != self._relaying:
            self._relaying = d.relay
            self._relay_changed.set()
            self._relay_changed = trio.Event()
        if d.run:
            if not self._running.is_set():
                log.info("resuming computing")
                self._running.set()
                self.on_change()
        elif self._running.is_set():
            self.pauses += 1
            log.warning("pausing computing: %s", d.reason)
            self._running = trio.Event()
            self.on_change()

    def sample(self) -> Decision:
        """One reading and decision (blocking: the readings are file reads)."""
        now = self.clock()
        seen = self.relay_bytes()
        self.meter.add(seen - self._relay_seen if seen >= self._relay_seen else seen, now)
        self._relay_seen = seen
        day, month = self.meter.totals(now)
        self.readings = self.reader.read(day, month)
        self.policy.observe(self.readings, now.timestamp())
        return self.policy.decide(self.readings, now)

    async def run(self, host: Requester) -> None:
        while True:
            self._reload()
            self.decision = await trio.to_thread.run_sync(self.sample)
            self._apply()
            await self._tell_hub(host)
            await trio.to_thread.run_sync(self._save_meter)
            await trio.sleep(self.prefs.check_every_s)

    def _save_meter(self) -> None:
        atomic_write(self.data_dir / TRANSFER_FILE, json.dumps(self.meter.state()), durable=False)

    async def _tell_hub(self, host: Requester) -> None:
        d = self.current
        key = (d.run, d.code)
        # a change is told at once; a pause is repeated as the node's keepalive (it polls no work)
        if key == self._told and (d.run or time.monotonic() - self._told_at < WORK_POLL_S):
            return
        if await self.tell(host, paused=not d.run, code=d.code, reason=d.reason, resume_at=d.resume_at):
            self._told, self._told_at = key, time.monotonic()

    async def tell(self, host: Requester, *, paused: bool, code: str, reason: str, resume_at: float = 0.0) -> bool:
        """One NodePause to the hub; True if it took it. The hub answers a pause with a signed
        statement of our account (billing stopped), handed to ``on_reply``."""
        msg = NodePause(peer_id=self.identity.peer_id, paused=paused, reason_code=code[:64], reason=reason[:512],
                        resume_at=max(0.0, resume_at))
        try:
            reply = await host.request(self.hub_peer, PAUSE, envelope.seal(self.identity, msg),
                                       max_response=MAX_CONTROL_REQUEST, timeout_s=10)
        except RemoteError as exc:
            log.debug("hub did not take our pause message (%s); will retry", exc)
            return False
        except (Echo2Error, OSError) as exc:
            log.debug("pause message not delivered (%s); will retry", exc)
            return False
        if self.on_reply is not None:
            await self.on_reply(reply)
        return True

    def status(self) -> dict[str, Any]:
        d = self.current
        return {"paused": not d.run, "pause_code": d.code, "pause_reason": d.reason, "pauses": self.pauses,
                "transfer_day_MB": round(self.meter.day_bytes / 1e6, 3),
                "transfer_month_MB": round(self.meter.month_bytes / 1e6, 3)}


def _diff(a: Prefs, b: Prefs) -> str:
    da, db = a.to_dict(), b.to_dict()
    return ", ".join(f"{k} {da[k]!r} -> {db[k]!r}" for k in da if da[k] != db[k]) or "none"
