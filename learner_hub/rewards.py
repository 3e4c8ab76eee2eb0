"""Reward functions on TRL's convention: loaded from hub.toml, called in worker threads, combined.

A reward function is any Python callable that TRL's ``GRPOTrainer`` accepts: it is called with
keyword arguments ``prompts``, ``completions``, ``completion_ids``, every other dataset column
(one list entry per completion, e.g. ``answer``), ``trainer_state`` and TRL's ``log_extra`` /
``log_metric`` hooks, plus echo2's ``finish_reason`` (``"stop"`` or ``"length"``, read off the
tokens at the hub), and returns one ``float | None`` per completion. Completions are strings for
a plain prompt and ``[{"role": "assistant", "content": text}]`` for a conversational one, as in
TRL. Rewards combine as TRL's ``nansum``: the weighted sum of the functions that apply (None:
does not apply); a completion no function applies to cannot be scored and is excluded.

Why threads with a timeout: reward functions are the operator's code (regexes, parsers, sandboxed
execution) and must neither block the trio loop nor stall the hub. Each function has its own
one-thread limiter (TRL calls a function serially; a hung one then holds only its own thread,
never trio's shared pool the store and the learner need). A call that raises, outlives
``reward_timeout_s``, or returns a wrong length, a non-number, NaN or inf excludes its rows
(logged once per function and reason, counted by reason); the hub keeps training on the rest.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import numbers
import sys
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from .config import ConfigError
from .recipe import PromptItem
from .rows import Group

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., Any]
# the keyword arguments TRL itself passes: a dataset column of the same name cannot replace them
RESERVED = frozenset({"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                      "finish_reason", "prompt", "completion"})


# --- loading ---------------------------------------------------------------------------------------
def load_reward_func(spec: str | RewardFunc, base_dir: str | Path = ".") -> RewardFunc:
    """``"path/to/file.py:func"`` (relative to ``base_dir``, the hub.toml's folder, or absolute),
    ``"pkg.module:func"``, or a callable as is. A bad spec is a ConfigError at startup."""
    if callable(spec):
        return spec
    where, sep, name = str(spec).rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(f"reward function {spec!r}: expected 'file.py:func' or 'package.module:func'")
    try:
        if where.endswith(".py"):
            path = Path(where) if Path(where).is_absolute() else Path(base_dir) / where
            if not path.is_file():
                raise ConfigError(f"reward function {spec!r}: no file {path}")
            mod_name = f"echo2_reward_{abs(hash(str(path.resolve()))):x}"
            mod_spec = importlib.util.spec_from_file_location(mod_name, path)
            if mod_spec is None or mod_spec.loader is None:
                raise ConfigError(f"reward function {spec!r}: cannot load {path}")
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[mod_name] = module  # dataclasses and pickling inside the file look it up
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as exc:  # the operator's module failed to import: say which and why
        raise ConfigError(f"reward function {spec!r}: importing {where} failed: {type(exc).__name__}: {exc}") from exc
    func = getattr(module, name, None)
    if not callable(func):
        raise ConfigError(f"reward function {spec!r}: {where} has no callable {name!r}")
    return func  # type: ignore[no-any-return]


def load_reward_funcs(
    specs: Sequence[str | RewardFunc], weights: Sequence[float] = (), base_dir: str | Path = "."
) -> tuple[list[RewardFunc], list[float]]:
    """The functions and their weights (1.0 each when none are given), checked at startup."""
    if not specs:
        raise ConfigError("no reward functions: set reward_funcs (or use a built-in task)")
    funcs = [load_reward_func(s, base_dir) for s in specs]
    ws = [1.0] * len(funcs) if not weights else [float(w) for w in weights]
    if len(ws) != len(funcs):
        raise ConfigError(f"reward_weights has {len(ws)} entries but reward_funcs has {len(funcs)}: give one weight per function")
    if not all(math.isfinite(w) for w in ws):
        raise ConfigError(f"reward_weights must be finite numbers, got {ws}")
    return funcs, ws


def func_name(f: RewardFunc) -> str:
    return str(getattr(f, "__name__", None) or type(f).__name__)


# --- one batch, pure -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainerState:
    """The part of TRL's ``TrainerState`` a reward function may read (same names)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


@dataclass(frozen=True)
class Batch:
    """The completions of one accepted result, one entry per completion (its prompt repeated)."""

    items: list[PromptItem]
    texts: list[str]  # decoded completion, its stop token left out
    completion_ids: list[Sequence[int]]
    finish_reasons: list[str]

    def __len__(self) -> int:
        return len(self.texts)


def as_prompt_item(item: Any) -> PromptItem:
    """A built-in task's legacy item (``text``, ``answer``) in the recipe's shape."""
    if isinstance(item, PromptItem):
        return item
    return PromptItem(text=item.text, prompt=item.text, row={"answer": item.answer})


def reward_kwargs(batch: Batch, state: TrainerState) -> dict[str, Any]:
    """TRL's keyword arguments for one batch: fresh lists each call, so a function that mutates
    its inputs cannot change what the next one sees."""
    completions: list[Any] = [
        [{"role": "assistant", "content": t}] if it.conversational else t
        for it, t in zip(batch.items, batch.texts, strict=True)
    ]
    kw: dict[str, Any] = {
        "prompts": [it.prompt if isinstance(it.prompt, str) else [dict(m) for m in it.prompt] for it in batch.items],
        "completions": completions,
        # TRL's lists, whatever the rows hold (a packed result's ids are an array: rows.Sample)
        "completion_ids": [c.tolist() if isinstance(c, array) else list(c) for c in batch.completion_ids],
    }
    columns = dict.fromkeys(k for it in batch.items for k in it.row if k not in RESERVED)
    for k in columns:
        kw[k] = [it.row.get(k) for it in batch.items]
    kw["finish_reason"] = list(batch.finish_reasons)
    kw["trainer_state"] = state
    kw["log_extra"] = _log_extra
    kw["log_metric"] = _log_metric
    return kw


def _log_extra(column: str, values: list[Any]) -> None:
    """TRL's hook for extra completion-table columns: echo2 has no completions table (kept so a
    TRL function that calls it runs unchanged)."""


def _log_metric(name: str, value: float) -> None:
    logger.debug("reward metric %s = %s", name, value)


class FuncFailure(Exception):
    """A reward function's whole batch is unusable; ``reason`` is the counted reason."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def check_output(out: Any, n: int) -> list[float | None]:
    """A function's return value as one ``float | None`` per completion (NaN and inf kept: the
    caller excludes those samples), or FuncFailure."""
    if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):
        out = out.tolist()  # a numpy array or torch tensor, as TRL would take it
    if not isinstance(out, (list, tuple)):
        raise FuncFailure("wrong_type", f"returned {type(out).__name__}, expected a list of float | None")
    if len(out) != n:
        raise FuncFailure("wrong_length", f"returned {len(out)} rewards for {n} completions")
    vals: list[float | None] = []
    for v in out:
        if v is None:
            vals.append(None)
        elif isinstance(v, numbers.Real):
            vals.append(float(v))
        else:
            raise FuncFailure("wrong_type", f"returned a {type(v).__name__} among the rewards, expected float | None")
    return vals


@dataclass
class Scored:
    """Per completion: its combined reward, or None when excluded (``reasons`` says why)."""

    rewards: list[float | None]
    reasons: list[str | None]
    # per completion, each function's own value by name where it applied (for TRL's
    # rewards/<name>/mean and /std); empty when the batch failed
    parts: list[dict[str, float]] = field(default_factory=list)


def combine(
    outputs: Sequence[list[float | None] | FuncFailure], weights: Sequence[float], n: int, names: Sequence[str] = ()
) -> Scored:
    """TRL's weighted ``nansum`` over the functions that apply. A function that failed on the
    batch excludes every completion; a NaN or inf excludes its completion (TRL would silently
    read NaN as "does not apply"); a completion no function applies to is excluded too."""
    rewards: list[float | None] = [None] * n
    reasons: list[str | None] = [None] * n
    failed = next((o for o in outputs if isinstance(o, FuncFailure)), None)
    if failed is not None:
        return Scored(rewards, [failed.reason] * n)
    for j in range(n):
        total, applies = 0.0, False
        for out, w in zip(outputs, weights, strict=True):
            assert not isinstance(out, FuncFailure)
            v = out[j]
            if v is None:
                continue
            if not math.isfinite(v):
                reasons[j] = "nonfinite"
                break
            total, applies = total + w * v, True
        else:
            if applies:
                rewards[j] = total
            else:
                reasons[j] = "all_none"
    parts: list[dict[str, float]] = [{} for _ in range(n)]
    for name, out in zip(names, outputs, strict=False):
        assert not isinstance(out, FuncFailure)
        for j, v in enumerate(out):
            if v is not None and rewards[j] is not None:
                parts[j][name] = v
    return Scored(rewards, reasons, parts)


def batch_of(groups: Sequence[Group], items: Sequence[Any], texts: Sequence[Sequence[str]]) -> Batch:
    """One accepted result's completions as a batch: group ``i`` answers ``items[i]``."""
    b = Batch([], [], [], [])
    for g, item, ts in zip(groups, items, texts, strict=True):
        pi = as_prompt_item(item)
        for s, t in zip(g.samples, ts, strict=True):
            b.items.append(pi)
            b.texts.append(t)
            b.completion_ids.append(s.token_ids)
            b.finish_reasons.append(s.finish_reason)
    return b


def apply_scores(groups: Sequence[Group], scored: Scored) -> tuple[list[Group], int]:
    """The groups with their rewards; an excluded completion leaves its group, and a group left
    with fewer than 2 completions has no baseline to learn from and goes (counted: the second
    value)."""
    out, dropped, j = [], 0, 0
    for g in groups:
        kept = []
        for s in g.samples:
            r = scored.rewards[j]
            j += 1
            if r is not None:
                s.reward = r
                if scored.parts:
                    s.reward_parts = dict(scored.parts[j - 1])
                kept.append(s)
        if len(kept) >= 2:
            out.append(Group(prompt_ids=g.prompt_ids, samples=kept))
        else:
            dropped += 1
    return out, dropped


# --- the runner: threads, timeout, counts ----------------------------------------------------------
def failures_of(names: Sequence[str], outputs: Sequence[Any]) -> list[tuple[str, str, str]]:
    """(function, reason, message) for each reward function that failed or returned NaN/inf."""
    failures = []
    for name, out in zip(names, outputs, strict=True):
        if isinstance(out, FuncFailure):
            failures.append((name, out.reason, str(out)))
        elif any(v is not None and not math.isfinite(v) for v in out):
            failures.append((name, "nonfinite", "returned NaN or inf"))
    return failures


@dataclass
class RewardRunner:
    """Scores batches with the recipe's reward functions; one per hub."""

    funcs: list[RewardFunc]
    weights: list[float]
    timeout_s: float = 30.0
    excluded: Counter[str] = field(default_factory=Counter)  # completions excluded, by reason
    failures: Counter[tuple[str, str]] = field(default_factory=Counter)  # (function, reason) -> batches
    scored: int = 0  # completions given a reward
    groups_dropped: int = 0  # groups left with < 2 completions (set by the caller)

    def __post_init__(self) -> None:
        if len(self.funcs) != len(self.weights):
            raise ConfigError("one weight per reward function")
        self.names = [func_name(f) for f in self.funcs]
        # one thread per function: TRL calls each serially, and a hung one holds only its own
        self._limiters = [trio.CapacityLimiter(1) for _ in self.funcs]

    async def score(self, batch: Batch, state: TrainerState) -> Scored:
        n = len(batch)
        if n == 0:
            return Scored([], [])
        outputs: list[list[float | None] | FuncFailure] = [FuncFailure("timeout", "")] * len(self.funcs)

        async def one(i: int) -> None:
            func, kw = self.funcs[i], reward_kwargs(batch, state)

            def call() -> Any:
                return func(**kw)

            with trio.move_on_after(self.timeout_s):
                try:
                    # (trio_typing's stale stubs predate abandon_on_cancel, which trio 0.35 has)
                    out = await trio.to_thread.run_sync(call, limiter=self._limiters[i], abandon_on_cancel=True)  # type: ignore[call-arg]
                    outputs[i] = check_output(out, n)
                except FuncFailure as exc:
                    outputs[i] = exc
                except Exception as exc:  # the operator's code: any exception is its failure, not the hub's
                    outputs[i] = FuncFailure("raised", f"raised {type(exc).__name__}: {exc}")
                return
            outputs[i] = FuncFailure("timeout", f"took longer than reward_timeout_s = {self.timeout_s:g} s (abandoned)")

        async with trio.open_nursery() as nursery:
            for i in range(len(self.funcs)):
                nursery.start_soon(one, i)
        failures = failures_of(self.names, outputs)
        res = combine(outputs, self.weights, n, self.names)
        self.count(res, failures)
        return res

    def count(self, res: Scored, failures: Sequence[tuple[str, str, str]]) -> None:
        """Count one scored batch (here, or in an intake worker: :mod:`.intake_worker`)."""
        for name, reason, detail in failures:
            self._failed(name, reason, detail)
        for why in res.reasons:
            if why is not None:
                self.excluded[why] += 1
        self.scored += sum(r is not None for r in res.rewards)

    def _failed(self, name: str, reason: str, detail: str) -> None:
        self.failures[(name, reason)] += 1
        if self.failures[(name, reason)] == 1:  # once per function and reason: a broken one would flood the log
            logger.warning("reward function %s: %s; its completions are excluded (logged once, counted in status "
                           "rewards.excluded_by_reason)", name, detail or reason)

    def report(self) -> dict[str, Any]:
        return {
            "functions": list(self.names),
            "weights": list(self.weights),
            "completions_scored": self.scored,
            "excluded_by_reason": dict(self.excluded),
            "failures": [{"function": f, "reason": r, "batches": c} for (f, r), c in sorted(self.failures.items())],
            "groups_dropped": self.groups_dropped,
        }
