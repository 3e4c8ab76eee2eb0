"""A verifiers environment echo2 cannot run: a @vf.stop hook decides when a multi-turn rollout ends."""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf


class LoopTask(vf.Task):
    @vf.stop
    def solved(self, trace: vf.Trace) -> bool:
        return "DONE" in trace.last_reply

    @vf.reward
    async def done(self, trace: vf.Trace) -> float:
        return float("DONE" in trace.last_reply)


class LoopTaskset(vf.Taskset[LoopTask, vf.TasksetConfig]):
    def load(self) -> Iterable[LoopTask]:
        yield LoopTask(vf.TaskData(prompt="Keep going until DONE."), self.config.task)


__all__ = ["LoopTaskset"]
