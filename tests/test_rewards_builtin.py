"""The built-in tasks' rewards as TRL reward functions: the values tests/test_envs.py pins for
the environments, now read from the ``answer`` column and ``finish_reason``."""

from __future__ import annotations

import pytest

from echo2.learner_hub.envs import make_env
from echo2.learner_hub.rewards import load_reward_func
from echo2.learner_hub.rewards_builtin import builtin_reward_spec, copy_reward, numeric_reward, reverse_reward


def one(f: object, answer: str, text: str, finish: str, chat: bool = False) -> float:
    c: object = [{"role": "assistant", "content": text}] if chat else text
    out = f(prompts=["p"], completions=[c], completion_ids=[[1]], answer=[answer], finish_reason=[finish])  # type: ignore[operator]
    assert isinstance(out, list) and len(out) == 1
    return float(out[0])


def test_copy_reward_values() -> None:
    for chat in (False, True):
        def r(text: str, finish: str, chat: bool = chat) -> float:
            return one(copy_reward, "3", text, finish, chat)

        assert r("3", "stop") == pytest.approx(1.0)
        assert r("3", "length") == pytest.approx(0.8)  # right digit, never stopped
        assert r("37", "stop") == pytest.approx(0.8)  # right digit, then junk
        assert r("7", "stop") == pytest.approx(0.3)  # a digit, the wrong one, stopped
        assert r("77", "length") == pytest.approx(0.1)  # a wrong digit, no stop
        assert r("x", "stop") == pytest.approx(0.2)  # malformed but stopped
        assert r("x3", "stop") == 0.0  # malformed
        assert r("", "stop") == 0.0


def test_reverse_reward_values() -> None:
    r = lambda text, finish: one(reverse_reward, "321", text, finish)  # noqa: E731
    assert r("321", "stop") == pytest.approx(1.0)
    assert r("324", "stop") == pytest.approx(0.9 * 2 / 3 + 0.1)
    assert r("321", "length") == pytest.approx(0.9)
    assert r("3214", "stop") == pytest.approx(0.9)
    assert r("3", "stop") == pytest.approx(0.3)
    assert r("abc", "stop") == pytest.approx(0.1)  # right length, all wrong
    assert r("", "length") == 0.0


def test_numeric_reward_values() -> None:
    r = lambda ans, text, finish: one(numeric_reward, ans, text, finish)  # noqa: E731
    assert r("14", "12 + 7 - 5 = 14", "stop") == 1.0
    assert r("14", "12 + 7 - 5 = 14", "length") == 0.5
    assert r("14", "The answer is 14.0", "stop") == 1.0
    assert r("14", "14 ... no wait, 15", "stop") == 0.0  # final number decides
    assert r("14", "fourteen", "stop") == 0.0
    assert r("3.5", "so 3.50", "stop") == 1.0 and r("3.5", "so 3", "stop") == 0.0
    assert r("5", "", "stop") == 0.0


def test_builtin_rewards_agree_with_the_environments() -> None:
    """Same values as the environments' own reward on their own prompts."""
    import random

    rng = random.Random(0)
    texts = ["3", "37", "7", "x", "", "321", "12", "5", "The answer is 42", "0"]
    for task in ("copy", "reverse", "arith"):
        env, f = make_env(task), load_reward_func(builtin_reward_spec(task))
        for item in env.sample_prompts(20, rng):
            for t in texts + [item.row["answer"]]:
                for finish in ("stop", "length"):
                    assert one(f, item.row["answer"], t, finish) == pytest.approx(env.reward(item, t, finish))
