"""A verifiers environment echo2 cannot run: its tasks give the model a tool (a multi-turn tool loop)."""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf


class Calculator(vf.Toolset):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class ToolTask(vf.Task):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))


class ToolTaskset(vf.Taskset[ToolTask, vf.TasksetConfig]):
    def load(self) -> Iterable[ToolTask]:
        yield ToolTask(vf.TaskData(prompt="Use the calculator: 2 + 3?"), self.config.task)


__all__ = ["ToolTaskset"]
