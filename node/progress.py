"""What the node is waiting for, said so a person can read it (issue 19 item 4).

The node names each long step as it starts (:meth:`Progress.set`): loading the engine, connecting
(address, try, next retry), admission, waiting for and downloading a policy version (MB of MB,
from which peers, ETA), loading it, waiting for a task, each task. A watcher task says the current
step again, with how long it has lasted, whenever nothing was said for :data:`REPEAT_S`: no wait
is silent for longer than that, whatever the step (a dial that hangs, a download that stalls).

Three forms: log lines (``echo2.progress`` logger; the default); one JSON object per line on stdout
with ``--json`` (``{"t", "event", "message", ...fields}``), for machines; and on a terminal a tqdm
bar for the steps with a size (a version's download), log lines for the rest.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import trio

log = logging.getLogger("echo2.progress")

#: The longest the node stays silent about what it waits for (the issue's bound is 5 s; a
#: contended machine can be a second late waking the watcher).
REPEAT_S = 4.0
MB = 1e6


class Progress:
    def __init__(self, mode: str = "log", *, out: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if mode not in ("log", "json", "bar"):
            raise ValueError(f"progress mode is log, json or bar, not {mode!r}")
        self.mode = mode
        self.out = out if out is not None else sys.stdout
        self.clock = clock
        self.event = ""
        self.message: str | Callable[[], str] = ""
        self.fields: dict[str, Any] = {}
        self.repeat_s = REPEAT_S
        self.started = self.said = clock()
        self._bar: Any = None
        #: called by the watcher each second before it decides to speak: refreshes a step's figures
        self.poll: Callable[[], None] | None = None

    @classmethod
    def for_terminal(cls, json_events: bool) -> Progress:
        if json_events:
            return cls("json")
        return cls("bar" if sys.stderr.isatty() else "log")

    # --- steps ---------------------------------------------------------------------------------
    def set(self, event: str, message: str | Callable[[], str], *, level: int = logging.INFO,
            repeat_s: float = REPEAT_S, **fields: Any) -> None:
        """A new step (or news of the current one): said at once. ``message`` may be a function
        (a countdown: said afresh each time); ``repeat_s``: how long it may then go unsaid."""
        if event != self.event:
            self.started = self.clock()
            self._close_bar()
        self.event, self.message, self.fields, self.repeat_s = event, message, fields, repeat_s
        self._say(message, fields, level=level)

    def update(self, message: str | Callable[[], str], **fields: Any) -> None:
        """New figures for the current step: shown by a bar at once, otherwise said by the watcher
        (at most every :data:`REPEAT_S`, so a fast download does not flood the log)."""
        self.message, self.fields = message, fields
        if self.mode == "bar" and "done" in fields and "total" in fields:
            self._show_bar()

    def _say(self, message: str | Callable[[], str], fields: dict[str, Any], *, again: bool = False,
             level: int = logging.INFO) -> None:
        self.said = self.clock()
        if callable(message):
            message = message()
        if self.mode == "json":
            rec = {"t": round(time.time(), 3), "event": self.event, "message": message, **fields}
            if again:
                rec["still"] = True
                rec["elapsed_s"] = round(self.said - self.started, 1)
            self.out.write(json.dumps(rec) + "\n")
            self.out.flush()
            return
        if self.mode == "bar" and "done" in fields and "total" in fields:
            self._show_bar()
            return
        if again:
            message = f"still {message} ({self.said - self.started:.0f} s)"
        log.log(level, "%s", message)

    # --- terminal bar --------------------------------------------------------------------------
    def _show_bar(self) -> None:
        try:
            from tqdm import tqdm
        except ImportError:  # tqdm comes with transformers; without it, lines
            self.mode = "log"
            return
        total, done = float(self.fields["total"]), float(self.fields["done"])
        if self._bar is None:
            self._bar = tqdm(total=round(total / MB, 1), unit="MB", desc=self.event, file=sys.stderr, leave=True)
        self._bar.n = round(done / MB, 1)
        self._bar.set_postfix_str(str(self.fields.get("postfix", "")), refresh=False)
        self._bar.refresh()
        self.said = self.clock()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # --- the watcher ---------------------------------------------------------------------------
    def tick(self) -> None:
        """One look of the watcher: refresh the figures, and say the step again if it has been
        silent for :data:`REPEAT_S`."""
        try:
            if self.poll is not None:
                self.poll()
            if self.event and self.clock() - self.said >= self.repeat_s:
                self._say(self.message, self.fields, again=True)
        except Exception:  # the watcher only talks: it must never take the node down
            log.debug("progress watcher failed", exc_info=True)

    async def run(self) -> None:
        while True:
            await trio.sleep(1.0)
            self.tick()


def download_figures(bc: Any, links: Any, hub_peer: str, started: float, now: float) -> tuple[str, dict[str, Any]]:
    """What a version's download is at, from the relay's broadcast state (duck-typed: manifest,
    relay.have, relay.parents): the message and its fields."""
    chunks = bc.manifest.chunks
    have = bc.relay.have
    total = sum(c.enc_size for c in chunks)
    done = sum(chunks[i].enc_size for i in have if 0 <= i < len(chunks))
    peers = sorted({p for p in bc.relay.parents if p is not None} | set(links or ()))
    names = ", ".join("hub" if p == hub_peer else p[-8:] for p in peers[:4]) + ("..." if len(peers) > 4 else "")
    rate = done / max(now - started, 1e-3)
    eta = (total - done) / rate if rate > 0 else None
    eta_s = "?" if eta is None else f"{eta:.0f} s"
    msg = (f"downloading version {bc.version}: {done / MB:.1f} of {total / MB:.1f} MB "
           f"({len(have)}/{len(chunks)} chunks) from {names or 'no peer yet'}, ETA {eta_s}")
    return msg, {"version": bc.version, "done": done, "total": total, "chunks_done": len(have), "chunks": len(chunks),
                 "peers": peers, "eta_s": None if eta is None else round(eta, 1), "postfix": f"from {names}, ETA {eta_s}"}


#: A node with nothing to do says so this often: waiting for work is its steady state, not a
#: start-up wait, and a line every few seconds for hours would bury everything else in its log.
IDLE_REPEAT_S = 60.0


class NodeSteps:
    """The node's steps in words: one call per step in the runtime keeps its code readable."""

    def __init__(self, progress: Progress, node: Any = None) -> None:
        self.p = progress
        if node is not None:  # the watcher follows the node's version downloads
            progress.poll = lambda: self.poll_download(
                node.relay, node.hub_peer, node.held.version if node.held else None, trio.current_time())

    def engine(self, name: str) -> None:
        self.p.set("engine", f"loading the inference engine ({name}): importing torch and the engine library")

    def connecting(self, addr: str, attempt: int) -> None:
        self.p.set("connecting", f"connecting to the hub at {addr} (try {attempt})", addr=addr, attempt=attempt)

    def unreachable(self, addr: str, attempt: int, why: object, delay: float) -> None:
        at = self.p.clock() + delay
        text = str(why)
        if "no addresses established a successful connection" in text:  # py-libp2p's words for a refused dial
            text = "nothing accepted the connection (is the hub up, and is this its address?)"
        self.p.set("connecting", lambda: (f"cannot reach the hub at {addr} (try {attempt}): {text}; "
                                          f"next retry in {max(0.0, at - self.p.clock()):.1f} s"),
                   level=logging.WARNING, addr=addr, attempt=attempt, error=str(why), retry_in_s=round(delay, 1))

    def admission(self, hub: str) -> None:
        self.p.set("admission", f"connected; asking hub {hub} for admission (pending)", hub=hub)

    def admitted(self, version: int) -> None:
        self.p.set("admission", f"admitted; waiting for the hub's policy version (it has version {version})",
                   version=version)

    def refused(self, reason: str) -> None:
        self.p.set("admission", f"admission refused: {reason}", level=logging.ERROR, reason=reason)

    def loading(self, version: int) -> None:
        self.p.set("loading", f"loading version {version} into the engine", version=version)

    def measuring(self, version: int) -> None:
        self.p.set("measure", f"measuring this machine's throughput on version {version} (about 2 s)", version=version)

    def idle(self) -> None:
        if self.p.event == "task":  # between tasks of a busy node: said only if the wait lasts
            self.p.event, self.p.message, self.p.fields = "idle", "waiting for a task from the hub", {}
            self.p.started = self.p.said = self.p.clock()
            self.p.repeat_s = IDLE_REPEAT_S
        elif self.p.event != "idle":
            self.p.set("idle", "waiting for a task from the hub", repeat_s=IDLE_REPEAT_S)

    def task(self, task_id: str, prompts: int, group: int, max_new: int, meter: Any = None) -> None:
        """A task starts; with a ``meter`` (generate.TaskMeter) the repeated line says how far it is."""
        budget = prompts * group * max_new
        head = (f"task {task_id}: generating {prompts} prompts x {group} samples, up to {max_new} "
                f"new tokens each (at most {budget} tokens)")
        if meter is None:
            self.p.set("task", head, task_id=task_id, budget=budget)
        else:
            self.p.set("task", lambda: f"{head}: {meter.text()}", task_id=task_id, budget=budget)

    def generated(self, task_id: str, tokens: int, budget: int, seconds: float) -> None:
        self.p.set("task", f"task {task_id}: generated {tokens} of at most {budget} tokens in {seconds:.1f} s; "
                           "sending the result", task_id=task_id, tokens=tokens, budget=budget)

    def poll_download(self, relay: Any, hub_peer: str, held_version: int | None, now: float) -> None:
        """Called by the watcher: a version being received becomes the step, with its figures."""
        bc = getattr(relay, "bc", None)
        if bc is None or bc.done or (held_version is not None and held_version >= bc.version):
            return
        msg, fields = download_figures(bc, relay.links, hub_peer, bc.t0, now)
        if self.p.event != "download" or self.p.fields.get("version") != bc.version:
            self.p.set("download", msg, **fields)
        else:
            self.p.update(msg, **fields)
