"""A verifiers environment echo2 cannot run: the taskset bundles its own two-agent Env (a
solver and a critic taking turns), so an episode is several model runs, not one completion."""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf


class DuoConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    critic: vf.AgentConfig = vf.AgentConfig()


class DuoEnv(vf.Env[DuoConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        await agents.solver.run(task)
        await agents.critic.run(task)


class DuoTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self) -> Iterable[vf.Task]:
        yield vf.Task(vf.TaskData(prompt="Say hi."), self.config.task)


__all__ = ["DuoEnv", "DuoTaskset"]
