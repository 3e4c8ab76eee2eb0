"""Task environments: prompts with reference answers and verifiable rewards, computed at the hub.

A :class:`TaskEnv` hands out :class:`~.recipe.PromptItem` s (prompt text; the reference answer in
``row["answer"]``): :func:`task_rows` turns them into the rows of a generated dataset that the hub
draws from like any other (``learner_hub/data.py``); the hub
tokenizes the text with the policy's tokenizer, nodes sample completions, and the hub decodes
each completion (without its trailing eos) and calls ``env.reward(item, text, finish_reason)``.
``finish_reason`` is ``"stop"`` when the completion ended with eos and ``"length"`` when it was
cut off at ``max_new_tokens``: toy tasks pay full credit only for an answer that *stops*.

Reward design (all rewards lie in [0, 1]):

* ``copy`` ("copy the second digit"): prompt ``"73="``, answer ``"3"``. Three additive parts:
  ``correct_w`` (0.7) if the first character is the answer digit, ``stop_w`` (0.2) if the
  completion is exactly one character and then eos, ``digit_w`` (0.1) if the first character is
  any digit. So "3"+eos earns 1.0, "3" cut off 0.8, "7"+eos 0.3, "7" cut off 0.1, "x"+eos 0.2,
  "x3" 0.0.
  Why additive: a random-init byte model emits a digit with probability ~10/259 and eos with
  ~1/259; a stop bonus paid only on a correct answer is found ~1/2600 samples and was never
  learned in 300 steps (measured), while an independent stop bonus is found about once per
  256-sample step from the start. The format parts stay well below the answer credit, so
  "any digit then stop" (0.3 + 0.07 on average) is no resting point.
* ``reverse`` ("reverse three digits"): prompt ``"123="``, answer ``"321"``. 0.9 x (fraction
  of the three positions holding the right digit) + 0.1 if the completion is exactly three
  characters and stopped.
* ``arith`` (word problems with integer answers, for real models) and ``jsonl`` (GSM8K-style
  file): the *final number* in the completion is compared with the reference; 1.0 if equal and
  the completion stopped, ``truncated_credit`` (default 0.5) if equal but cut off (the last number
  of a truncated text is often an intermediate one, so it earns less), 0.0 otherwise.
"""

from __future__ import annotations

import json
import logging
import random
import re
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .recipe import PromptItem

logger = logging.getLogger(__name__)

DIGITS = "0123456789"


def make_item(text: str, answer: str, **columns: Any) -> PromptItem:
    """A built-in task's prompt: plain text, with ``answer`` (and e.g. ``kind``) as its dataset columns."""
    return PromptItem(text=text, prompt=text, row={"answer": answer, **columns})


def _answer(item: PromptItem) -> str:
    # a dataset without an `answer` column scores 0 rather than failing the hub
    return str(item.row.get("answer", ""))


def task_rows(env: TaskEnv, n: int, rng: random.Random) -> list[dict[str, Any]]:
    """``n`` prompts of a built-in task as dataset rows: columns ``prompt``, ``answer`` and its extras."""
    return [{"prompt": it.text, **it.row} for it in env.sample_prompts(n, rng)]


@runtime_checkable
class TaskEnv(Protocol):
    """What the hub needs from a task."""

    name: str
    max_new_tokens: int  # recommended completion budget for this task

    def sample_prompts(self, n: int, rng: random.Random) -> list[PromptItem]: ...

    def reward(self, item: PromptItem, completion_text: str, finish_reason: str = "stop") -> float: ...

    def check(self, item: PromptItem, completion_text: str, finish_reason: str = "stop") -> bool:
        """True when the completion is fully correct (reward 1.0)."""
        ...


# ---------------------------------------------------------------------------------------------
# toy tasks for byte-level tiny models


class CopyEnv:
    """Copy the second of ``n_digits`` random digits: ``"73="`` -> ``"3"``."""

    name = "copy"

    def __init__(
        self,
        n_digits: int = 2,
        position: int = 1,
        max_new_tokens: int = 4,
        correct_w: float = 0.7,
        stop_w: float = 0.2,
        digit_w: float = 0.1,
        sep: str = "=",
    ) -> None:
        if not 0 <= position < n_digits:
            raise ValueError("position must index one of the prompt digits")
        if min(correct_w, stop_w, digit_w) < 0 or correct_w + stop_w + digit_w > 1.0 + 1e-9:
            raise ValueError("reward weights must be >= 0 and sum to at most 1")
        self.n_digits = n_digits
        self.position = position
        self.max_new_tokens = max_new_tokens
        self.correct_w, self.stop_w, self.digit_w = correct_w, stop_w, digit_w
        self.sep = sep

    def sample_prompts(self, n: int, rng: random.Random) -> list[PromptItem]:
        out = []
        for _ in range(n):
            digits = "".join(rng.choice(DIGITS) for _ in range(self.n_digits))
            out.append(make_item(digits + self.sep, digits[self.position]))
        return out

    def reward(self, item: PromptItem, completion_text: str, finish_reason: str = "stop") -> float:
        if not completion_text:
            return 0.0
        first = completion_text[0]
        r = 0.0
        if first == _answer(item):
            r += self.correct_w
        if len(completion_text) == 1 and finish_reason == "stop":
            r += self.stop_w
        if first in DIGITS:
            r += self.digit_w
        return r

    def check(self, item: PromptItem, completion_text: str, finish_reason: str = "stop") -> bool:
        return completion_text == _answer(item) and finish_reason == "stop"


class ReverseEnv:
    """Reverse ``n_digits`` random digits: ``"123="`` -> ``"321"`` (partial credit per position)."""

    name = "reverse"

    def __init__(self, n_digits: int = 3, max_new_tokens: int = 6) -> None:
        self.n_digits = n_digits
        self.max_new_tokens = max_new_tokens

    def sample_prompts(self, n: int, rng: random.Random) -> list[PromptItem]:
        out = []
        for _ in range(n):
            digits = "".join(rng.choice(DIGITS) for _ in range(self.n_digits))
            out.append(make_item(digits + "=", digits[::-1]))
        return out

    def reward(self, item: PromptItem, completion_text: str, finish_reason: str = "stop") -> float:
        ans = _answer(item)
        if not ans:
            return 0.0
        hits = sum(1 for a, c in zip(ans, completion_text, strict=False) if a == c)
        exact_len = len(completion_text) == len(ans) and finish_reason == "stop"
        return 0.9 * hits / len(ans) + (0.1 if exact_len else 0.0)

    def check(self, item: PromptItem, completion_text: str, finish_reason: str = "stop") -> bool:
        return completion_text == _answer(item) and finish_reason == "stop"


# ---------------------------------------------------------------------------------------------
# numeric-answer tasks for real models

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def parse_number(s: str) -> Fraction | None:
    """Parse one number token ("1,234", "-3.5", "$12" already stripped) exactly; None if not one."""
    t = s.replace(",", "").strip()
    if not t or t in {"-", "."}:
        return None
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def final_number(text: str) -> Fraction | None:
    """The last number appearing in ``text`` (commas as thousands separators allowed)."""
    for m in reversed(list(_NUMBER_RE.finditer(text))):
        tok = m.group(0).rstrip(",")
        v = parse_number(tok)
        if v is not None:
            return v
    return None


def reference_number(answer: str) -> Fraction | None:
    """GSM8K reference: the number after the last '####' if present, else the final number."""
    if "####" in answer:
        tail = answer.rsplit("####", 1)[1]
        v = final_number(tail.split("\n", 1)[0])
        if v is None:
            v = final_number(tail)
        if v is not None:
            return v
    return final_number(answer)


def _numeric_reward(ref: str, completion_text: str, finish_reason: str, truncated_credit: float) -> float:
    want = parse_number(ref)
    got = final_number(completion_text)
    if want is None or got is None or got != want:
        return 0.0
    return 1.0 if finish_reason == "stop" else truncated_credit


_ARITH_TEMPLATES: tuple[tuple[str, str], ...] = (
    (
        "{name} has {a} {thing}. {pron} buys {b} more and then gives away {c}. "
        "How many {thing} does {name} have now?",
        "a+b-c",
    ),
    (
        "A box holds {a} {thing}. How many {thing} are there in {b} boxes?",
        "a*b",
    ),
    (
        "{name} shares {ab} {thing} equally among {b} friends. How many {thing} does each friend get?",
        "ab/b",
    ),
    (
        "{name} had {a} {thing} and lost {c} of them. Then {pron_l} found {b} more. "
        "How many {thing} does {name} have?",
        "a-c+b",
    ),
    (
        "Each of {b} bags contains {a} {thing}, and {name} adds {c} loose {thing}. "
        "How many {thing} are there in total?",
        "a*b+c",
    ),
)
_NAMES = (("Tom", "He"), ("Anna", "She"), ("Ravi", "He"), ("Mei", "She"), ("Lucas", "He"), ("Sara", "She"))
_THINGS = ("apples", "marbles", "pencils", "stickers", "cookies", "coins", "books")


class ArithEnv:
    """Arithmetic word problems generated in code; the answer is an integer checked exactly."""

    name = "arith"

    def __init__(
        self,
        max_value: int = 50,
        max_new_tokens: int = 128,
        truncated_credit: float = 0.5,
        prompt_template: str = "Question: {question}\nGive the final answer as a number.\nAnswer:",
    ) -> None:
        self.max_value = max_value
        self.max_new_tokens = max_new_tokens
        self.truncated_credit = truncated_credit
        self.prompt_template = prompt_template

    def _one(self, rng: random.Random) -> PromptItem:
        tmpl, kind = rng.choice(_ARITH_TEMPLATES)
        name, pron = rng.choice(_NAMES)
        thing = rng.choice(_THINGS)
        a = rng.randint(2, self.max_value)
        b = rng.randint(2, max(2, self.max_value // 5))
        c = rng.randint(1, a)  # keeps every intermediate count non-negative
        ab = a * b
        answer = {
            "a+b-c": a + b - c,
            "a*b": a * b,
            "ab/b": a,
            "a-c+b": a - c + b,
            "a*b+c": a * b + c,
        }[kind]
        q = tmpl.format(name=name, pron=pron, pron_l=pron.lower(), thing=thing, a=a, b=b, c=c, ab=ab)
        return make_item(self.prompt_template.format(question=q), str(answer), kind=kind)

    def sample_prompts(self, n: int, rng: random.Random) -> list[PromptItem]:
        return [self._one(rng) for _ in range(n)]

    def reward(self, item: PromptItem, completion_text: str, finish_reason: str = "stop") -> float:
        return _numeric_reward(_answer(item), completion_text, finish_reason, self.truncated_credit)

    def check(self, item: PromptItem, completion_text: str, finish_reason: str = "stop") -> bool:
        return self.reward(item, completion_text, finish_reason) == 1.0


class JsonlEnv:
    """GSM8K-style local JSONL file: one object per line with ``question`` and ``answer``."""

    name = "jsonl"

    def __init__(
        self,
        path: str | Path,
        max_new_tokens: int = 256,
        truncated_credit: float = 0.5,
        prompt_template: str = "Question: {question}\nAnswer:",
        max_rows: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.max_new_tokens = max_new_tokens
        self.truncated_credit = truncated_credit
        self.prompt_template = prompt_template
        self.items: list[PromptItem] = []
        skipped = 0
        with self.path.open("r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    q, a = row["question"], row["answer"]
                    if not isinstance(q, str) or not isinstance(a, str):
                        raise TypeError("question/answer must be strings")
                except (ValueError, KeyError, TypeError) as e:
                    skipped += 1
                    logger.warning("jsonl env: %s line %d skipped: %s", self.path, lineno, e)
                    continue
                ref = reference_number(a)
                if ref is None:
                    skipped += 1
                    logger.warning("jsonl env: %s line %d skipped: no numeric answer", self.path, lineno)
                    continue
                self.items.append(
                    make_item(self.prompt_template.format(question=q.strip()), _fraction_text(ref), line=lineno)
                )
                if max_rows is not None and len(self.items) >= max_rows:
                    break
        if not self.items:
            raise ValueError(f"{self.path}: no usable question/answer rows ({skipped} skipped)")
        self.skipped = skipped

    def sample_prompts(self, n: int, rng: random.Random) -> list[PromptItem]:
        return [rng.choice(self.items) for _ in range(n)]

    def reward(self, item: PromptItem, completion_text: str, finish_reason: str = "stop") -> float:
        return _numeric_reward(_answer(item), completion_text, finish_reason, self.truncated_credit)

    def check(self, item: PromptItem, completion_text: str, finish_reason: str = "stop") -> bool:
        return self.reward(item, completion_text, finish_reason) == 1.0


def _fraction_text(v: Fraction) -> str:
    if v.denominator == 1:
        return str(v.numerator)
    return str(v.numerator / v.denominator) if v.denominator in (2, 4, 5, 8, 10, 20, 25, 50, 100) else str(v)


ENVS: dict[str, type] = {"copy": CopyEnv, "reverse": ReverseEnv, "arith": ArithEnv, "jsonl": JsonlEnv}


def make_env(name: str, **kw: Any) -> TaskEnv:
    """Build an environment by name (``copy``, ``reverse``, ``arith``, ``jsonl``)."""
    try:
        cls = ENVS[name]
    except KeyError:
        raise ValueError(f"unknown task env {name!r}; choose from {sorted(ENVS)}") from None
    env: TaskEnv = cls(**kw)
    return env
