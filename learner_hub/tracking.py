"""Experiment tracking: ``report_to`` in hub.toml, one writer in front of TensorBoard, Weights &
Biases and trackio.

The hub hands :class:`Tracker` a plain ``str -> float`` dict per learner step (trainmetrics.py:
TRL's names and echo2's own) and one per evaluation; the tracker writes them as transformers'
callbacks write a TRL ``GRPOTrainer``'s logs (``train/<name>``, ``eval/<name>`` for ``eval_<name>``,
and ``train/global_step``), so a dashboard made for a TRL run reads an echo2 run unchanged.
echo2's own figures keep their ``echo2/`` prefix.

Why one thread of its own: a tracker's calls block (TensorBoard writes and flushes event files,
wandb and trackio write local databases) and the hub's loop must never wait on them, so
:meth:`Tracker.log` only puts the dict on a bounded queue and returns; the thread starts each
backend (logs the run's whole config once), writes, and closes them, in order. A backend that
fails to import, to start or to write is logged once (its name and the reason), dropped, and the
others go on; training never sees it. A queue that stays full (a tracker hung on its disk) drops
what does not fit, counted.

Everything stays offline and under the hub directory unless the operator says otherwise:
TensorBoard event files in ``DIR/tensorboard/<run_name>``, wandb in offline mode in ``DIR/wandb``
(``WANDB_MODE=online`` in the environment syncs), trackio's store in ``DIR/trackio``
(``TRACKIO_DIR`` overrides it).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "wandb", "trackio")
QUEUE_MAX = 10_000  # steps and evaluations waiting for a slow tracker (a few KB each)


def hf_keys(metrics: dict[str, float]) -> dict[str, float]:
    """transformers' ``rewrite_logs``: ``eval_x`` -> ``eval/x``, ``x`` -> ``train/x``; echo2's own
    (``echo2/...``) stay as they are."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if k.startswith("echo2/"):
            out[k] = v
        elif k.startswith("eval_"):
            out["eval/" + k[len("eval_"):]] = v
        else:
            out["train/" + k] = v
    return out


class Backend(Protocol):
    """One tracker. Its methods run in the tracker's thread only, never on the hub's loop."""

    name: str

    def start(self, run_name: str, config: dict[str, Any], config_text: str) -> None: ...

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardBackend:
    name = "tensorboard"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.writer: Any = None

    def start(self, run_name: str, config: dict[str, Any], config_text: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.logdir = self.root / "tensorboard" / run_name
        self.writer = SummaryWriter(log_dir=str(self.logdir))
        # TensorBoard's text plugin renders markdown: the hub.toml as a code block
        self.writer.add_text("hub.toml", "```toml\n" + config_text + "```", 0)
        self.writer.flush()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in hf_keys(metrics).items():
            self.writer.add_scalar(k, v, step)
        # every step is on disk at once (a reader sees it while the hub runs; a crash loses none)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbBackend:
    name = "wandb"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.run: Any = None

    def start(self, run_name: str, config: dict[str, Any], config_text: str) -> None:
        import wandb

        # offline unless the operator asks for more (WANDB_MODE is wandb's own switch)
        mode = os.environ.get("WANDB_MODE", "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "echo2"), name=run_name, config=config,
                              dir=str(self.root), mode=mode, reinit="create_new",  # type: ignore[arg-type]
                              settings=wandb.Settings(console="off"))  # the hub's own stdout stays its own
        # as transformers' WandbCallback: every metric against train/global_step, so an evaluation
        # logged after later steps still lands at its own step
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({**hf_keys(metrics), "train/global_step": step})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


class TrackioBackend:
    name = "trackio"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.run: Any = None

    def start(self, run_name: str, config: dict[str, Any], config_text: str) -> None:
        # trackio reads TRACKIO_DIR when first imported: the hub directory unless the operator set it
        os.environ.setdefault("TRACKIO_DIR", str(self.root / "trackio"))
        import trackio

        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "echo2"), name=run_name, config=config,
                                embed=False, auto_log_gpu=False, auto_log_cpu=False)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({**hf_keys(metrics), "train/global_step": step}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def make_backend(name: str, root: Path) -> Backend:
    kinds: dict[str, type[Any]] = {"tensorboard": TensorBoardBackend, "wandb": WandbBackend, "trackio": TrackioBackend}
    return kinds[name](root)  # type: ignore[no-any-return]


def report_targets(report_to: str | Sequence[str]) -> list[str]:
    """hub.toml's ``report_to`` as a list of tracker names ("none" -> [])."""
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    return [n for n in dict.fromkeys(names) if n != "none"]


_STOP = object()


class Tracker:
    """The one writer: ``log`` from the hub's loop, the writes in a thread of its own."""

    def __init__(self, backends: Sequence[Backend], *, run_name: str, config: dict[str, Any], config_text: str) -> None:
        self.names = [b.name for b in backends]
        self.disabled: dict[str, str] = {}  # tracker -> why it stopped (logged once)
        self.dropped = 0
        self.written = 0  # dicts handed to the live backends
        self._backends = list(backends)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=QUEUE_MAX)
        self._thread: threading.Thread | None = None
        if self._backends:
            self._thread = threading.Thread(target=self._work, args=(run_name, config, config_text),
                                            name="echo2-tracker", daemon=True)
            self._thread.start()

    @classmethod
    def for_hub(cls, report_to: str | Sequence[str], hub_dir: Path, run_name: str, config: dict[str, Any],
                config_text: str) -> Tracker:
        backends = [make_backend(n, hub_dir) for n in report_targets(report_to)]
        return cls(backends, run_name=run_name, config=config, config_text=config_text)

    @property
    def enabled(self) -> bool:
        return self._thread is not None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Queue one step's (or evaluation's) figures; never blocks."""
        if self._thread is None:
            return
        try:
            self._queue.put_nowait((step, dict(metrics)))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("tracking: the trackers fall behind (%d records queued); records are dropped and counted "
                            "(status tracking.dropped)", QUEUE_MAX)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait (bounded) until everything queued so far is written; False on timeout."""
        if self._thread is None or not self._thread.is_alive():
            return True
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued and close the trackers (bounded: a hung one is left to the
        daemon thread)."""
        if self._thread is None:
            return
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        self._thread = None

    def report(self) -> dict[str, Any]:
        return {"report_to": list(self.names), "active": [b.name for b in self._backends],
                "disabled": dict(self.disabled), "written": self.written, "dropped": self.dropped}

    # --- the thread --------------------------------------------------------------------------------
    def _work(self, run_name: str, config: dict[str, Any], config_text: str) -> None:
        for b in list(self._backends):
            self._call(b, "start", b.start, run_name, config, config_text)
        if self._backends:
            log.info("tracking run %r with %s", run_name, ", ".join(b.name for b in self._backends))
        while True:
            job = self._queue.get()
            if job is _STOP:
                break
            if isinstance(job, threading.Event):
                job.set()
                continue
            step, metrics = job
            for b in list(self._backends):
                self._call(b, "write", b.log, step, metrics)
            self.written += 1
        for b in list(self._backends):
            self._call(b, "close", b.close)

    def _call(self, b: Backend, what: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # a tracker's failure is never the hub's: logged once, that tracker dropped
            reason = f"{what} failed: {type(exc).__name__}: {exc}"
            if isinstance(exc, ImportError):
                reason = f"not installed ({exc}); pip install 'echo2[{b.name}]'"
            self.disabled[b.name] = reason
            self._backends.remove(b)
            log.warning("tracking: %s disabled, training goes on: %s", b.name, reason)
            if what != "close":
                try:
                    b.close()
                except Exception:  # noqa: S110 (it already failed; its close may too)
                    pass
