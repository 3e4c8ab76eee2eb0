"""The built-in tasks' rewards as TRL reward functions (the values :mod:`.envs` documents).

Each reads the reference from the dataset's ``answer`` column and echo2's ``finish_reason``
(``"stop"``: the completion ended with a stop token; ``"length"``: cut off at
``max_new_tokens``), which the toy tasks need to pay for stopping. hub.toml names them
``"echo2.learner_hub.rewards_builtin:copy_reward"`` etc.; a built-in task uses its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .envs import DIGITS, final_number, parse_number

# copy task: answer credit, stop bonus, any-digit bonus (why additive: see envs.py)
COPY_CORRECT_W, COPY_STOP_W, COPY_DIGIT_W = 0.7, 0.2, 0.1
TRUNCATED_CREDIT = 0.5  # numeric tasks: right final number but cut off


def _text(c: Any) -> str:
    """A completion's text: a string, or the content of its first (assistant) message."""
    return c if isinstance(c, str) else str(c[0]["content"])


def _finishes(finish_reason: Sequence[str] | None, n: int) -> Sequence[str]:
    return finish_reason if finish_reason is not None else ["stop"] * n


def copy_one(answer: str, text: str, finish: str) -> float:
    if not text:
        return 0.0
    first, r = text[0], 0.0
    if first == answer:
        r += COPY_CORRECT_W
    if len(text) == 1 and finish == "stop":
        r += COPY_STOP_W
    if first in DIGITS:
        r += COPY_DIGIT_W
    return r


def reverse_one(answer: str, text: str, finish: str) -> float:
    hits = sum(1 for a, c in zip(answer, text, strict=False) if a == c)
    exact_len = len(text) == len(answer) and finish == "stop"
    return 0.9 * hits / len(answer) + (0.1 if exact_len else 0.0)


def numeric_one(answer: str, text: str, finish: str, truncated_credit: float = TRUNCATED_CREDIT) -> float:
    want, got = parse_number(str(answer)), final_number(text)
    if want is None or got is None or got != want:
        return 0.0
    return 1.0 if finish == "stop" else truncated_credit


def copy_reward(completions: list[Any], answer: list[str], finish_reason: list[str] | None = None, **kwargs: Any) -> list[float | None]:
    """Copy the second digit: 0.7 right digit + 0.2 exactly one character and stopped + 0.1 a digit."""
    fr = _finishes(finish_reason, len(completions))
    return [copy_one(str(a), _text(c), f) for c, a, f in zip(completions, answer, fr, strict=True)]


def reverse_reward(completions: list[Any], answer: list[str], finish_reason: list[str] | None = None, **kwargs: Any) -> list[float | None]:
    """Reverse the digits: 0.9 x share of right positions + 0.1 right length and stopped."""
    fr = _finishes(finish_reason, len(completions))
    return [reverse_one(str(a), _text(c), f) for c, a, f in zip(completions, answer, fr, strict=True)]


def numeric_reward(completions: list[Any], answer: list[str], finish_reason: list[str] | None = None, **kwargs: Any) -> list[float | None]:
    """The final number of the completion equals the answer: 1.0 if it stopped, 0.5 if cut off."""
    fr = _finishes(finish_reason, len(completions))
    return [numeric_one(str(a), _text(c), f) for c, a, f in zip(completions, answer, fr, strict=True)]


BUILTIN_REWARDS = {"copy": "copy_reward", "reverse": "reverse_reward", "arith": "numeric_reward", "jsonl": "numeric_reward"}


def builtin_reward_spec(task: str) -> str:
    """The spec string of a built-in task's reward (what hub.toml would name)."""
    return f"echo2.learner_hub.rewards_builtin:{BUILTIN_REWARDS[task]}"
