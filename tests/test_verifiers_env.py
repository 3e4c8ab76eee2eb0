"""verifiers environments as echo2 recipes (issue 16 item 4): learner_hub/verifiers_env.py.

The environments are written in tests/vf_envs and found by verifiers' own loader (the module named
after the id, on sys.path). Everything but the not-installed case needs ``pip install echo2[verifiers]``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from echo2.learner_hub.config import ConfigError
from echo2.learner_hub.verifiers_env import load_environment_recipe

ENVS = Path(__file__).parent / "vf_envs"
SKIP = "verifiers not installed (pip install echo2[verifiers])"


@pytest.fixture(scope="module")
def vf() -> Iterator[Any]:
    vf = pytest.importorskip("verifiers.v1", reason=SKIP)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ENVS))
        yield vf


@pytest.fixture(scope="module")
def toy(vf: Any) -> tuple[Any, Any, list[Any], list[float]]:
    return load_environment_recipe("echo2-vf-toy", {"n": 3, "system": "Be terse."})


def _batch(dataset: Any, completions: list[Any]) -> dict[str, Any]:
    """What the hub hands a reward function on TRL's convention: every column of the rows."""
    rows = dataset[: len(completions)]
    return {
        "prompts": rows.pop("prompt"),
        "completions": completions,
        "completion_ids": [[1, 2]] * len(completions),
        "trainer_state": None,
        "finish_reason": ["stop"] * len(completions),  # an extra keyword echo2's runner adds
        **rows,
    }


def test_verifiers_missing_is_a_config_error_with_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "verifiers", None)  # what an absent package looks like to import
    monkeypatch.delitem(sys.modules, "verifiers.v1", raising=False)
    with pytest.raises(ConfigError, match=r"pip install echo2\[verifiers\]"):
        load_environment_recipe("echo2-vf-toy", {})


def test_single_turn_env_gives_dataset_and_weighted_rewards(toy: Any) -> None:
    dataset, eval_dataset, funcs, weights = toy
    assert eval_dataset is None
    assert len(dataset) == 3
    assert {"prompt", "answer", "info", "task"} <= set(dataset.column_names)
    assert dataset[1]["prompt"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "What is 1 + 1?"},
    ]
    assert dataset[1]["answer"] == "2"
    assert dataset[1]["task"] == "echo2-vf-toy"
    # verifiers' order (priority, then name) and the @vf.reward weights
    assert [f.__name__ for f in funcs] == ["echo2-vf-toy:brevity", "echo2-vf-toy:correct"]
    assert weights == [0.25, 1.0]


def test_rewards_equal_what_verifiers_scores(vf: Any, toy: Any) -> None:
    dataset, _, funcs, weights = toy
    replies = ["0", "3", " 4 "]
    conversational = [[{"role": "assistant", "content": r}] for r in replies]
    got = {f.__name__.split(":")[1]: f(**_batch(dataset, conversational)) for f in funcs}
    # the toy's rubric by hand: correct = reply == answer (stripped), brevity = 1 / (1 + len)
    assert got["correct"] == [1.0, 0.0, 1.0]
    assert got["brevity"] == pytest.approx([0.5, 0.5, 0.5])
    # and verifiers' own scoring (Task.score over a trace it would record) agrees, total included
    task_cls = vf.load_environment(vf.resolve_env_config({"taskset": {"id": "echo2-vf-toy"}})).taskset.task_type()
    for i, reply in enumerate(replies):
        data = task_cls.data_type().model_validate_json(dataset[i]["info"])
        task = task_cls(data, vf.TaskConfig())
        trace = vf.Trace(
            task=vf.TraceTask(type=task_cls.__name__, data=data),
            agent=vf.AgentInfo(config=vf.AgentConfig()),
            nodes=[
                vf.MessageNode(message=vf.SystemMessage(content="Be terse.")),
                vf.MessageNode(parent=0, message=vf.UserMessage(content=data.prompt)),
                vf.MessageNode(parent=1, message=vf.AssistantMessage(content=reply), sampled=True),
            ],
        )
        asyncio.run(task.score(trace))
        for name in ("correct", "brevity"):
            assert got[name][i] == pytest.approx(trace.rewards[name].score)
        total = sum(w * got[f.__name__.split(":")[1]][i] for f, w in zip(funcs, weights, strict=True))
        assert total == pytest.approx(trace.reward)


def test_plain_string_completions_score_like_messages(toy: Any) -> None:
    dataset, _, funcs, _ = toy
    plain = [f(**_batch(dataset, ["0", "9"])) for f in funcs]
    chat = [f(**_batch(dataset, [[{"role": "assistant", "content": c}] for c in ("0", "9")])) for f in funcs]
    assert plain == chat


def test_a_malformed_batch_raises_for_the_hub_to_count(toy: Any) -> None:
    """The hub's reward runner turns a raise into excluded, counted rows: the adapter must raise."""
    dataset, _, funcs, _ = toy
    with pytest.raises(ValueError, match="neither a string nor a list"):
        funcs[0](**_batch(dataset, ["0", 7]))
    with pytest.raises(ValueError, match="not an assistant message"):
        funcs[0](**_batch(dataset, [[{"role": "user", "content": "0"}]]))


def test_async_reward_runs_in_a_worker_thread_under_the_hub_trio_loop(toy: Any) -> None:
    """The hub calls rewards via trio.to_thread; the async one gets its own loop in that thread."""
    import trio

    dataset, _, funcs, _ = toy
    kwargs = _batch(dataset, [[{"role": "assistant", "content": "0"}]])

    async def main() -> list[list[float | None]]:
        return [await trio.to_thread.run_sync(lambda f=f: f(**kwargs)) for f in funcs]

    assert trio.run(main) == [[0.5], [1.0]]


@pytest.mark.parametrize(
    ("env_id", "names"),
    [
        ("echo2_vf_tools", ["ToolTask.toolsets()", "tool loop"]),
        ("echo2_vf_duo", ["DuoEnv", "run()"]),
        ("echo2_vf_sandbox", ["BoxTask.NEEDS_CONTAINER", "sandbox"]),
        ("echo2_vf_stop", ["LoopTask stop hooks (solved)"]),
        ("echo2_vf_runtime", ["CheckTask.tests_pass()", "runtime"]),
    ],
)
def test_multi_turn_env_is_refused_naming_what_is_missing(vf: Any, env_id: str, names: list[str]) -> None:
    with pytest.raises(ConfigError, match="not single-turn") as err:
        load_environment_recipe(env_id, {})
    for name in names:
        assert name in str(err.value)


def test_llm_judge_is_refused_naming_it(vf: Any) -> None:
    with pytest.raises(ConfigError, match=r"judges \(decision\).*Judge.score\(\)"):
        load_environment_recipe("echo2-vf-toy", {"task": {"judges": [{"id": "decision"}]}})


def test_classic_api_env_is_refused_with_what_to_port_to(vf: Any) -> None:
    with pytest.raises(ConfigError, match="classic verifiers API") as err:
        load_environment_recipe("echo2-vf-classic", {})
    assert "vf.Taskset" in str(err.value)


def test_unknown_env_and_bad_args_are_config_errors(vf: Any) -> None:
    with pytest.raises(ConfigError, match="no-such-env"):
        load_environment_recipe("no-such-env", {})
    with pytest.raises(ConfigError, match="echo2_no_such_dependency"):
        load_environment_recipe("echo2-vf-missingdep", {})
    with pytest.raises(ConfigError, match="failed to load its tasks: FileNotFoundError"):
        load_environment_recipe("echo2-vf-broken", {})
    with pytest.raises(ConfigError, match="bogus"):
        load_environment_recipe("echo2-vf-toy", {"bogus": 1})
