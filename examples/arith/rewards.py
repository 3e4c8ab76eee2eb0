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


def brevity(prompts: list[Any], completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """The right number with little around it scores high: 1.0 for the bare answer, less for each
    extra character, 0.0 from 16 extra characters on. Only a reply whose first number is the
    answer earns it: an empty reply, or the question echoed back ("16 - 10"), must not be a way
    to score (SmolLM2 found both when this credit did not look at the answer)."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        t = _text(c).strip()
        m = _NUMBER.search(t)
        ok = m is not None and m.group() == str(a).strip()
        out.append(max(0.0, 1.0 - (len(t) - len(m.group())) / 16) if ok and m is not None else 0.0)
    return out
