"""A recipe: what the operator brings (prompts from a dataset, reward functions) in the hub's terms.

One prompt travels as a :class:`PromptItem`: the dataset row it came from, the prompt as the
dataset holds it (what TRL hands reward functions as ``prompts``), and the text the policy's
tokenizer encodes (a conversational prompt rendered with the chat template). Reward functions see
``item.prompt`` and every other column of ``item.row``; nodes see only the token ids of ``text``.

:func:`build_recipe` assembles one from hub.toml: a verifiers ``environment``, else a local
``dataset`` (the old ``task = "jsonl"`` form included), else a built-in task turned into a
generated dataset of the same kind (columns ``prompt`` and ``answer``) with its built-in reward.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import ConfigError, HubConfig

if TYPE_CHECKING:
    from .data import PromptSource, Rows

Message = dict[str, str]

#: rows generated for a built-in task, with the hub's seed: one epoch (copy has 100 distinct
#: prompts, reverse 1000). Every prompt is encoded at start-up to check its length, which costs
#: ~0.15 ms a prompt with the byte tokenizer: more rows would slow every hub start.
BUILTIN_ROWS = {"copy": 1000, "reverse": 2000, "arith": 5000}
#: the built-in tasks' eval set is generated with this seed, the same for every hub and run
BUILTIN_EVAL_SEED = 1_000_003
_BUILTIN_REWARDS = {
    "copy": "echo2.learner_hub.rewards_builtin:copy_reward",
    "reverse": "echo2.learner_hub.rewards_builtin:reverse_reward",
    "arith": "echo2.learner_hub.rewards_builtin:numeric_reward",
    "jsonl": "echo2.learner_hub.rewards_builtin:numeric_reward",
}


@dataclass(frozen=True)
class PromptItem:
    """One prompt of a recipe."""

    text: str  # what the tokenizer encodes (chat template applied for a conversational prompt)
    prompt: str | list[Message]  # as in the dataset: a string, or a list of {"role", "content"} messages
    row: dict[str, Any] = field(default_factory=dict, compare=False)  # the other columns (e.g. "answer")
    index: int = -1  # position in its split (for logs and the stored dataset position)
    # the token ids nodes are sent (set by the prompt source; a chat template's special tokens
    # are parsed as such, so this is not always tok.encode(text))
    ids: tuple[int, ...] = field(default=(), compare=False)

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


@dataclass
class Recipe:
    """Prompts to train on, a held-out set, and the reward functions with their weights."""

    source: PromptSource
    eval_items: list[PromptItem]
    reward_funcs: list[str | Callable[..., Any]]
    reward_weights: list[float]


def build_recipe(cfg: HubConfig, tok: Any, artifacts: Mapping[str, bytes] | None = None) -> Recipe:
    """The recipe hub.toml describes; every problem with it is a ConfigError, raised here at start-up.
    ``artifacts`` (the model's manifest files) carry the chat template for conversational prompts."""
    from . import data

    # the built-in tasks (and the old jsonl one) keep the bos their prompts always had
    builtin = not cfg.environment and (cfg.task == "jsonl" or not cfg.dataset.path)
    renderer = data.Renderer(tok, artifacts, cfg.dataset.system_prompt, add_bos=builtin)
    funcs: list[str | Callable[..., Any]] = list(cfg.reward_funcs)
    column = cfg.dataset.prompt_column
    if cfg.environment:
        from .verifiers_env import load_environment_recipe

        train, held_out, env_funcs, env_weights = load_environment_recipe(cfg.environment, cfg.environment_args)
        name, column = f"environment:{cfg.environment}", "prompt"
        funcs, weights = list(env_funcs), list(env_weights)
        train_rows: Rows = train
        eval_rows: Rows | None = held_out
    elif cfg.task == "jsonl":
        name, column = _legacy_jsonl(cfg), "prompt"
        train_rows = _jsonl_rows(cfg.dataset.path)
        eval_rows = _jsonl_rows(_eval_path(cfg)) if cfg.dataset.eval_split else None
    elif cfg.dataset.path:
        if not funcs:
            raise ConfigError(f"dataset {cfg.dataset.path}: reward_funcs is empty; a dataset needs its reward functions")
        name = data.spec_name(cfg.dataset, cfg.dataset.split)
        train_rows = data.load_rows(cfg.dataset.path, cfg.dataset.split)
        eval_rows = _load_eval(cfg) if cfg.dataset.eval_split else None
    else:
        from .envs import make_env, task_rows

        env = make_env(cfg.task)
        name, column = f"task:{cfg.task}", "prompt"
        train_rows = task_rows(env, BUILTIN_ROWS[cfg.task], random.Random(cfg.seed))
        eval_rows = task_rows(env, cfg.eval_max_prompts, random.Random(BUILTIN_EVAL_SEED))
    if not cfg.environment:
        funcs = funcs or [_BUILTIN_REWARDS[cfg.task]]
        weights = list(cfg.reward_weights) or [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ConfigError(f"reward_weights has {len(weights)} entries for {len(funcs)} reward_funcs")
    prepared = data.prepare(train_rows, column, renderer, cfg.max_prompt_tokens, name)
    source = data.PromptSource(prepared, column, renderer, cfg.seed, name)
    eval_items: list[PromptItem] = []
    if eval_rows is not None and len(eval_rows):
        held = data.prepare(eval_rows, column, renderer, cfg.max_prompt_tokens, f"{name} eval")
        eval_items = data.first_items(held, cfg.eval_max_prompts, column, renderer)
    return Recipe(source, eval_items, funcs, weights)


def _legacy_jsonl(cfg: HubConfig) -> str:
    if not cfg.dataset.path:
        raise ConfigError('task = "jsonl" needs dataset = {path = "FILE.jsonl"} (question/answer lines)')
    return f"jsonl:{cfg.dataset.path}"


def _jsonl_rows(path: str) -> list[dict[str, Any]]:
    """The old GSM8K-style file (``question``/``answer`` lines) as rows of the same kind as a task's."""
    from .envs import JsonlEnv

    try:
        env = JsonlEnv(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"dataset {path}: {exc}") from exc
    return [{"prompt": it.text, **it.row} for it in env.items]


def _eval_path(cfg: HubConfig) -> str:
    p = Path(cfg.dataset.eval_split).expanduser()
    if not p.is_file():
        raise ConfigError(f'task = "jsonl": eval_split must name a question/answer file, not {cfg.dataset.eval_split!r}')
    return str(p)


def _load_eval(cfg: HubConfig) -> Rows:
    """``eval_split`` is a split of the dataset, or (a single data file holding one split) a file."""
    from . import data

    if Path(cfg.dataset.eval_split).expanduser().is_file():
        return data.load_rows(cfg.dataset.eval_split, "train")
    if Path(cfg.dataset.path).expanduser().is_file():
        raise ConfigError(f"dataset {cfg.dataset.path}: a single file holds one split, so eval_split "
                          f"{cfg.dataset.eval_split!r} must be the path of another file")
    return data.load_rows(cfg.dataset.path, cfg.dataset.eval_split)
