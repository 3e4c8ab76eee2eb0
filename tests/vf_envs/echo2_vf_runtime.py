"""A verifiers environment echo2 cannot run: its reward reads files from the rollout's runtime."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import verifiers.v1 as vf


class CheckTask(vf.Task):
    @vf.reward
    async def tests_pass(self, trace: vf.Trace, runtime: Any) -> float:
        return 0.0


class CheckTaskset(vf.Taskset[CheckTask, vf.TasksetConfig]):
    def load(self) -> Iterable[CheckTask]:
        yield CheckTask(vf.TaskData(prompt="Fix the bug."), self.config.task)


__all__ = ["CheckTaskset"]
