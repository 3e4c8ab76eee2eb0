"""A verifiers environment whose taskset fails to load its rows (a missing data file)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import verifiers.v1 as vf


class BrokenTask(vf.Task):
    @vf.reward
    async def one(self) -> float:
        return 1.0


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self) -> Iterable[BrokenTask]:
        for line in Path("/nonexistent/echo2-vf-rows.txt").read_text().splitlines():
            yield BrokenTask(vf.TaskData(prompt=line), self.config.task)


__all__ = ["BrokenTaskset"]
