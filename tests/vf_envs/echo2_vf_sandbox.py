"""A verifiers environment echo2 cannot run: its tasks need a container sandbox."""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf


class BoxTask(vf.Task):
    NEEDS_CONTAINER = True

    @vf.reward
    async def file_written(self, trace: vf.Trace) -> float:
        return 0.0


class BoxTaskset(vf.Taskset[BoxTask, vf.TasksetConfig]):
    def load(self) -> Iterable[BoxTask]:
        yield BoxTask(vf.TaskData(prompt="Write /tmp/x."), self.config.task)


__all__ = ["BoxTaskset"]
