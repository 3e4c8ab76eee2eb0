"""A single-turn verifiers environment for echo2's tests: an installed-module-style taskset plugin
(verifiers finds a taskset by importing the module named after its id and taking the Taskset
subclass it exports through ``__all__``). Two weighted rewards; verifiers awaits every reward
(Task.score gathers them), so both are async."""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf


class ToyData(vf.TaskData):
    answer: str = ""


class ToyTask(vf.Task[ToyData]):
    @vf.reward(weight=1.0)
    async def correct(self, task: ToyData, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply == task.answer else 0.0

    @vf.reward(weight=0.25)
    async def brevity(self, trace: vf.Trace) -> float:
        return 1.0 / (1.0 + len(trace.last_reply))


class ToyConfig(vf.TasksetConfig):
    n: int = 4
    system: str | None = None


class ToyTaskset(vf.Taskset[ToyTask, ToyConfig]):
    def load(self) -> Iterable[ToyTask]:
        for i in range(self.config.n):
            data = ToyData(prompt=f"What is {i} + {i}?", answer=str(2 * i), system_prompt=self.config.system)
            yield ToyTask(data, self.config.task)


__all__ = ["ToyTaskset"]
