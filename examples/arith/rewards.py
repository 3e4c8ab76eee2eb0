"""Reward functions in TRL's form: ``f(prompts, completions, answer, **kwargs) -> list[float]``.

The dataset is conversational, so each completion is a list of messages and the text is
``completion[0]["content"]`` (a plain string is accepted too, so the file also fits a plain-text
dataset). ``answer`` is the dataset column of the same name.
"""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d+")


def _text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    return str(completion[0]["content"])


def correctness(prompts: list[Any], completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the reply is exactly the right number (surrounding spaces and one final period
    allowed), else 0.0: "12" scores, "7 + 5 = 12" does not."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        t = _text(c).strip().removesuffix(".").strip()
        out.append(1.0 if t == str(a).strip() else 0.0)
    return out


def number_first(prompts: list[Any], completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """Partial credit that points the way: 1.0 when the first number in the reply is the right
    one, whatever follows it (the exact-format credit is ``correctness``'s)."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        m = _NUMBER.search(_text(c))
        out.append(1.0 if m is not None and m.group() == str(a).strip() else 0.0)
    return out


def brevity(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """A number with little around it scores high: 1.0 for a bare number, less for each extra
    character, 0.0 from 16 extra characters on and for a reply with no number at all (an empty
    reply must not win). The model's habit is "The answer is 12.", and the exact reply is rarely
    sampled without a push."""
    out = []
    for c in completions:
        t = _text(c).strip()
        m = _NUMBER.search(t)
        out.append(0.0 if m is None else max(0.0, 1.0 - (len(t) - len(m.group())) / 16))
    return out
