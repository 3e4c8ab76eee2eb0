"""Task environments: prompts, reference answers and reward functions."""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

import pytest

from echo2.learner_hub.envs import (
    ArithEnv,
    TaskEnv,
    final_number,
    make_env,
    make_item,
    reference_number,
)


def test_make_env_and_protocol() -> None:
    for name in ("copy", "reverse", "arith"):
        env = make_env(name)
        assert isinstance(env, TaskEnv) and env.name == name and env.max_new_tokens > 0
    with pytest.raises(ValueError, match="unknown task env"):
        make_env("nope")


def test_copy_prompts_and_rewards() -> None:
    env = make_env("copy")
    items = env.sample_prompts(50, random.Random(1))
    assert items == env.sample_prompts(50, random.Random(1))  # deterministic per rng seed
    for it in items:
        assert len(it.text) == 3 and it.text[2] == "=" and it.text[:2].isdigit()
        assert it.row["answer"] == it.text[1]
    it = make_item("73=", "3")
    assert env.reward(it, "3", "stop") == pytest.approx(1.0) and env.check(it, "3", "stop")
    assert env.reward(it, "3", "length") == pytest.approx(0.8)  # right digit, never stopped
    assert env.reward(it, "37", "stop") == pytest.approx(0.8)  # right digit, then junk
    assert env.reward(it, "7", "stop") == pytest.approx(0.3)  # a digit, the wrong one, stopped
    assert env.reward(it, "77", "length") == pytest.approx(0.1)  # a wrong digit, no stop
    assert env.reward(it, "x", "stop") == pytest.approx(0.2)  # malformed but stopped
    assert env.reward(it, "x3", "stop") == 0.0  # malformed
    assert env.reward(it, "", "stop") == 0.0
    strict = make_env("copy", correct_w=1.0, stop_w=0.0, digit_w=0.0)
    assert strict.reward(it, "3", "length") == 1.0 and strict.reward(it, "7", "stop") == 0.0
    with pytest.raises(ValueError):
        make_env("copy", correct_w=0.9, stop_w=0.2)
    assert not env.check(it, "3", "length")


def test_reverse_partial_credit() -> None:
    env = make_env("reverse")
    for it in env.sample_prompts(20, random.Random(2)):
        assert it.row["answer"] == it.text[:3][::-1] and it.text.endswith("=")
    it = make_item("123=", "321")
    assert env.reward(it, "321", "stop") == pytest.approx(1.0)
    assert env.reward(it, "324", "stop") == pytest.approx(0.9 * 2 / 3 + 0.1)
    assert env.reward(it, "321", "length") == pytest.approx(0.9)
    assert env.reward(it, "3214", "stop") == pytest.approx(0.9)
    assert env.reward(it, "3", "stop") == pytest.approx(0.3)
    assert env.reward(it, "abc", "stop") == pytest.approx(0.1)  # right length, all wrong
    assert env.reward(it, "", "length") == 0.0
    assert env.check(it, "321") and not env.check(it, "3214")


def test_number_parsing() -> None:
    assert final_number("so 12 + 3 = 15.") == 15
    assert final_number("The total is 1,234 apples") == 1234
    assert final_number("he owes -7") == -7
    assert final_number("3.5 then 0.25") == Fraction(1, 4)
    assert final_number("no digits here") is None
    assert final_number("answer: 42, done") == 42
    assert reference_number("He has 3 + 4 = 7.\n#### 7") == 7
    assert reference_number("#### 1,000\nextra 5") == 1000
    assert reference_number("#### 0") == 0
    assert reference_number("total 9") == 9


def test_arith_prompts_answers_and_reward() -> None:
    env = ArithEnv(max_value=30)
    items = env.sample_prompts(200, random.Random(3))
    assert {it.row["kind"] for it in items} == {"a+b-c", "a*b", "ab/b", "a-c+b", "a*b+c"}
    for it in items:
        assert int(it.row["answer"]) >= 0 and "Question:" in it.text
    it = make_item("q", "14")
    assert env.reward(it, "12 + 7 - 5 = 14", "stop") == 1.0
    assert env.reward(it, "12 + 7 - 5 = 14", "length") == 0.5
    assert env.reward(it, "The answer is 14.0", "stop") == 1.0
    assert env.reward(it, "14 ... no wait, 15", "stop") == 0.0  # final number decides
    assert env.reward(it, "fourteen", "stop") == 0.0
    assert env.check(it, "14") and not env.check(it, "14", "length")


def test_arith_answers_are_consistent() -> None:
    # Recompute the answer from the numbers in a known template.
    env = ArithEnv()
    for it in env.sample_prompts(100, random.Random(4)):
        if it.row["kind"] == "a*b":
            nums = [int(x) for x in __import__("re").findall(r"\d+", it.text)]
            assert int(it.row["answer"]) == nums[0] * nums[1]


def test_jsonl_env(tmp_path: Path) -> None:
    p = tmp_path / "gsm.jsonl"
    rows = [
        {"question": "What is 2+3?", "answer": "2+3=5\n#### 5"},
        {"question": "Half of 7?", "answer": "7/2 = 3.5\n#### 3.5"},
        {"question": "No marker", "answer": "It is 12"},
    ]
    lines = [json.dumps(r) for r in rows]
    lines += ["{not json", json.dumps({"question": "q"}), json.dumps({"question": 1, "answer": "2"}), ""]
    lines.append(json.dumps({"question": "words", "answer": "none"}))
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    env = make_env("jsonl", path=p)
    assert len(env.items) == 3 and env.skipped == 4  # type: ignore[attr-defined]
    assert [it.row["answer"] for it in env.items] == ["5", "3.5", "12"]  # type: ignore[attr-defined]
    assert env.items[0].text == "Question: What is 2+3?\nAnswer:"  # type: ignore[attr-defined]
    got = env.sample_prompts(10, random.Random(0))
    assert len(got) == 10 and all(g in env.items for g in got)  # type: ignore[attr-defined]
    five, half, _ = env.items  # type: ignore[attr-defined]
    assert env.reward(five, "2 plus 3 is 5", "stop") == 1.0
    assert env.reward(half, "so 3.50", "stop") == 1.0
    assert env.reward(half, "so 3", "stop") == 0.0
    assert env.reward(five, "", "stop") == 0.0

    empty = tmp_path / "empty.jsonl"
    empty.write_text("{bad\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no usable"):
        make_env("jsonl", path=empty)
