"""A recipe: what the operator brings (prompts from a dataset, reward functions) in the hub's terms.

One prompt travels as a :class:`PromptItem`: the dataset row it came from, the prompt as the
dataset holds it (what TRL hands reward functions as ``prompts``), and the text the policy's
tokenizer encodes (a conversational prompt rendered with the chat template). Reward functions see
``item.prompt`` and every other column of ``item.row``; nodes see only the token ids of ``text``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Message = dict[str, str]


@dataclass(frozen=True)
class PromptItem:
    """One prompt of a recipe."""

    text: str  # what the tokenizer encodes (chat template applied for a conversational prompt)
    prompt: str | list[Message]  # as in the dataset: a string, or a list of {"role", "content"} messages
    row: dict[str, Any] = field(default_factory=dict, compare=False)  # the other columns (e.g. "answer")
    index: int = -1  # position in its split (for logs and the stored dataset position)

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)
