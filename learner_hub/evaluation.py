"""Evaluation through the swarm: held-out prompts dispatched like rollouts, scored, never trained.

Every ``eval_every`` learner steps (and at step 0, so a "before" exists, and at the last step)
the eval prompts go to the dispatcher's eval queue as groups of ``1`` completion when
``eval_temperature`` is 0 (greedy: more would be copies) or of ``group_size`` otherwise. An
evaluation of step K is measured at policy version K: its tasks ask ``min_version = K`` and go
only to nodes holding K, and staleness does not apply to them (they are never trained). The hub
scores each eval result with the same reward functions as training; when every prompt of an
evaluation has its result, its mean reward and accuracy (the share of scored completions whose
reward reaches ``eval_pass_threshold``) are recorded: status (``eval``), metrics, the store.
Completions no reward function could score are left out of both figures and counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .dispatch import PromptGroup
from .recipe import PromptItem
from .rewards import Scored, as_prompt_item

logger = logging.getLogger(__name__)

EVAL_SEED = 1_000_003  # a built-in task's held-out prompts: a fixed stream apart from training's


@dataclass
class _Run:
    step: int
    expected: int  # prompts
    started_wall: float
    done: set[int] = field(default_factory=set)
    rewards: list[float] = field(default_factory=list)
    parts: list[dict[str, float]] = field(default_factory=list)  # each function's own value, where it applied
    excluded: int = 0
    versions: set[int] = field(default_factory=set)  # policy versions that produced its completions


def eval_prompt_id(step: int, index: int) -> str:
    return f"e{step}.{index}"


def parse_eval_prompt_id(prompt_id: str) -> tuple[int, int] | None:
    """(step, prompt index) of an eval group's id, None for a training group."""
    if not prompt_id.startswith("e"):
        return None
    step, _, index = prompt_id[1:].partition(".")
    return (int(step), int(index)) if step.isdigit() and index.isdigit() else None


class Evaluator:
    """Which evaluations are due, their prompt groups, and their figures as results come in."""

    def __init__(
        self,
        items: Sequence[Any],
        prompt_ids: Sequence[Sequence[int]],
        *,
        every: int,
        steps: int,
        pass_threshold: float,
        group_size: int,
        started: float,
        history: Sequence[dict[str, Any]] = (),
    ) -> None:
        if len(items) != len(prompt_ids):
            raise ValueError("one token sequence per eval prompt")
        self.items: list[PromptItem] = [as_prompt_item(it) for it in items]
        self.prompt_ids = [tuple(p) for p in prompt_ids]
        self.every, self.steps, self.pass_threshold = every, steps, pass_threshold
        self.group_size = group_size
        self.started = started
        self.history: list[dict[str, Any]] = [dict(h) for h in history]  # restored from the store on a restart
        self.runs: dict[int, _Run] = {}

    @property
    def enabled(self) -> bool:
        return self.every > 0 and bool(self.items)

    def due(self, step: int) -> int | None:
        """The step to evaluate now that the learner is at ``step``: the last multiple of
        ``every`` (0 included), or the last step; each once, never one older than the newest
        started (the learner may pass a multiple between two calls: its evaluation then runs on
        the version of that moment, which the record's ``versions`` shows)."""
        if not self.enabled:
            return None
        target = step if step == self.steps else step - step % self.every
        seen = [h["step"] for h in self.history] + list(self.runs)
        if target in seen or (seen and target < max(seen)):
            return None
        return target

    def start(self, step: int) -> list[PromptGroup]:
        self.runs[step] = _Run(step, len(self.items), time.time())
        logger.info("evaluation at step %d: %d prompts x %d completions dispatched", step, len(self.items), self.group_size)
        return [
            PromptGroup(eval_prompt_id(step, i), ids, self.group_size, item)
            for i, (ids, item) in enumerate(zip(self.prompt_ids, self.items, strict=True))
        ]

    def pending(self, step: int) -> bool:
        return step in self.runs

    def add(self, groups: Sequence[PromptGroup], scored: Scored, version: int) -> list[dict[str, Any]]:
        """One eval result's scores (its groups in order, ``group_size`` completions each, made
        with policy ``version``); the evaluations it completes, as recorded."""
        j, done = 0, []
        for g in groups:
            n = g.group_size
            rewards = scored.rewards[j : j + n]
            j += n
            key = parse_eval_prompt_id(g.prompt_id)
            run = self.runs.get(key[0]) if key is not None else None
            if run is None or key is None or key[1] in run.done:
                continue  # an evaluation already recorded (a restart, a duplicate prompt)
            run.done.add(key[1])
            run.versions.add(version)
            run.rewards += [r for r in rewards if r is not None]
            run.parts += [p for r, p in zip(rewards, scored.parts[j - n : j], strict=False) if r is not None]
            run.excluded += sum(r is None for r in rewards)
            if len(run.done) == run.expected:
                done.append(self._finish(run))
        return done

    def _finish(self, run: _Run) -> dict[str, Any]:
        del self.runs[run.step]
        n = len(run.rewards)
        mean = sum(run.rewards) / n if n else None
        acc = sum(r >= self.pass_threshold for r in run.rewards) / n if n else None
        rec: dict[str, Any] = {
            "step": run.step,
            "wall_s": round(time.time() - self.started, 3),
            "mean_reward": mean,
            "accuracy": acc,
            "n": n,
            "excluded": run.excluded,
            "eval_s": round(time.time() - run.started_wall, 3),
            "versions": [min(run.versions), max(run.versions)] if run.versions else [],
            # spread and per reward function, for the trackers' eval_reward_std, eval_rewards/<name>/mean and /std
            "reward_std": _sample_std(run.rewards),
            "rewards_by_func": {
                name: {"mean": sum(vs) / len(vs), "std": _sample_std(vs)}
                for name in sorted({k for p in run.parts for k in p})
                for vs in [[p[name] for p in run.parts if name in p]]
            },
        }
        self.history.append(rec)
        self.history.sort(key=lambda h: h["step"])
        logger.info("evaluation at step %d: mean reward %s, accuracy %s over %d completions (%d excluded) in %.1f s",
                    run.step, _fmt(mean), _fmt(acc), n, run.excluded, rec["eval_s"])
        return rec

    def report(self) -> dict[str, Any]:
        return {
            "history": [dict(h) for h in self.history],
            "latest": dict(self.history[-1]) if self.history else None,
            "in_progress": [{"step": r.step, "done": len(r.done), "of": r.expected} for r in self.runs.values()],
            "every": self.every,
            "prompts": len(self.items),
            "pass_threshold": self.pass_threshold,
        }


def _sample_std(xs: Sequence[float]) -> float | None:
    """Bessel-corrected, as TRL's ``nanstd`` (None for fewer than two values)."""
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return float((sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
