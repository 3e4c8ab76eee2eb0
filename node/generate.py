"""Running a task within the memory budget (A7): in batches that fit, smaller after running out.

``budget.plan_task`` says how many samples fit at once; this runs the task as a series of
engine calls of at most that many samples (whole prompts where they fit, else part of one
prompt's samples), each with its own seed derived from the task's, so a task is deterministic
for a batch size and an unsplit task is exactly one engine call with the task's seed. When the
engine runs out of memory anyway, the batch is halved and the task goes on from where it was;
out of memory on a single sample is :class:`OutOfMemory` (the task is declined). Blocking: the
node runs it in a worker thread.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from echo2.models.engine_api import EngineError, Interrupted, is_out_of_memory
from echo2.protocol.messages import Completion, Task

from .budget import OutOfMemory

log = logging.getLogger(__name__)

_SEED_MIX = 0x9E3779B97F4A7C15


def batch_seed(seed: int, index: int) -> int:
    """Seed of the ``index``-th engine call of a task (the first one uses the task's seed)."""
    return seed if index == 0 else (int(seed) + index * _SEED_MIX) % (2**63)


def _release_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception as exc:  # best effort only: the retry itself tells whether it helped
        log.debug("could not release accelerator memory: %r", exc)


@dataclass
class TaskMeter:
    """How far a running task is, for the progress line (read by the loop, written by the worker
    thread: plain int assignments). ``step`` counts decoding steps of the current engine call, as
    seen by an engine with an ``interrupt`` hook (transformers); others report whole calls only."""

    samples: int
    max_new_tokens: int
    samples_done: int = 0
    tokens_done: int = 0
    batch: int = 0
    step: int = 0

    def text(self) -> str:
        now = f"; {self.batch} samples at token {min(self.step, self.max_new_tokens)} of {self.max_new_tokens}" if self.batch else ""
        return f"{self.samples_done} of {self.samples} samples done ({self.tokens_done} tokens){now}"


def generate_bounded(
    engine: Any, task: Task, batch_rows: int, should_stop: Callable[[], bool] | None = None,
    meter: TaskMeter | None = None,
) -> tuple[list[Completion], int]:
    """(the task's completions, in prompt order; the batch size that worked, ≤ ``batch_rows``).
    ``should_stop`` is asked before each engine call and, by an engine with an ``interrupt`` hook
    (transformers), between tokens: True raises :class:`Interrupted`. The hook is set for this
    call only: a version's throughput measurement must not fail because the node is paused.
    ``meter`` follows the task's progress (samples done, the current call's decoding step)."""
    if (should_stop is None and meter is None) or not hasattr(engine, "interrupt"):
        return _generate_bounded(engine, task, batch_rows, should_stop, meter)

    def between_tokens() -> bool:
        if meter is not None:
            meter.step += 1
        return should_stop() if should_stop is not None else False

    engine.interrupt = between_tokens
    try:
        return _generate_bounded(engine, task, batch_rows, should_stop, meter)
    finally:
        engine.interrupt = None


def _generate_bounded(
    engine: Any, task: Task, batch_rows: int, should_stop: Callable[[], bool] | None, meter: TaskMeter | None = None,
) -> tuple[list[Completion], int]:
    prompts = [list(p) for p in task.prompts]
    if not prompts:
        raise EngineError("no prompts")  # else the loop below would answer an empty result
    g = task.group_size
    batch_rows = max(1, batch_rows)
    out: list[Completion] = []
    p, done_in_p, call = 0, 0, 0
    while p < len(prompts):
        if done_in_p == 0 and batch_rows >= g:
            n, k = min(batch_rows // g, len(prompts) - p), g
        else:
            n, k = 1, min(batch_rows, g - done_in_p)
        if should_stop is not None and should_stop():
            raise Interrupted(f"task {task.task_id} stopped after {len(out)} of {len(prompts) * g} samples")
        oom = ""
        if meter is not None:
            meter.batch, meter.step = n * k, 0
        try:
            got = engine.generate(
                prompts[p : p + n], k, task.max_new_tokens, task.temperature, task.top_p, batch_seed(task.seed, call)
            )
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            oom = f"{type(exc).__name__}: {str(exc)[:200]}"
        if oom:
            # outside the except block: the traceback's frames (and their tensors) are gone
            _release_memory()
            if n * k == 1:
                raise OutOfMemory(f"out of memory on one sample of task {task.task_id} ({oom})")
            batch_rows = max(1, (n * k) // 2)
            log.warning("task %s: out of memory with %d samples at once; going on with %d", task.task_id, n * k,
                        batch_rows)
            continue
        out.extend(dataclasses.replace(c, prompt_index=c.prompt_index + p) for c in got)
        if meter is not None:
            meter.samples_done, meter.batch = len(out), 0
            meter.tokens_done += sum(len(c.token_ids) for c in got)
        call += 1
        if k == g:
            p += n
        else:
            done_in_p += k
            if done_in_p == g:
                p, done_in_p = p + 1, 0
    return out, batch_rows
