"""Reward functions on TRL's convention: loading, calling, combining, and every bad case
excluded and counted with the hub alive (the runner alone, then a real Hub object)."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from hubkit import small_hub_cfg

from echo2.learner_hub.config import ConfigError, load_config
from echo2.learner_hub.recipe import PromptItem
from echo2.learner_hub.rewards import (
    Batch,
    RewardRunner,
    Scored,
    TrainerState,
    apply_scores,
    load_reward_func,
    load_reward_funcs,
)
from echo2.learner_hub.rows import Group, Sample

EXAMPLES = Path(__file__).parent / "trl_examples" / "trl_doc_rewards.py"


def plain(texts: list[str], **row: Any) -> Batch:
    it = PromptItem(text="Q:", prompt="Q:", row=row)
    return Batch([it] * len(texts), list(texts), [[1] * len(t) for t in texts], ["stop"] * len(texts))


def chat(texts: list[str], **row: Any) -> Batch:
    it = PromptItem(text="<user>Q</user>", prompt=[{"role": "user", "content": "Q"}], row=row)
    return Batch([it] * len(texts), list(texts), [[1] * len(t) for t in texts], ["stop"] * len(texts))


def score(runner: RewardRunner, batch: Batch, step: int = 0) -> Scored:
    return trio.run(runner.score, batch, TrainerState(global_step=step, max_steps=10))


def test_trl_documented_examples_run_unchanged_from_a_file() -> None:
    reward_len = load_reward_func(f"{EXAMPLES}:reward_len")
    fmt = load_reward_func(f"{EXAMPLES.name}:format_reward_func", base_dir=EXAMPLES.parent)
    boxed = load_reward_func(f"{EXAMPLES}:reward_func")
    # plain text: completions are strings
    r = score(RewardRunner([reward_len], [1.0]), plain(["x" * 20, "x" * 5, "x" * 26]))
    assert r.rewards == [0.0, -15.0, -6.0]
    # conversational: completions are [{"role": "assistant", "content": ...}]
    good, bad = "<think>a</think><answer>4</answer>", "4"
    r = score(RewardRunner([fmt], [1.0]), chat([good, bad]))
    assert r.rewards == [1.0, 0.0]
    # a dataset column (ground_truth) reaches the function as a keyword argument, one per completion
    r = score(RewardRunner([boxed], [1.0]), plain([r"so \boxed{4}", r"\boxed{5}"], ground_truth="4"))
    assert r.rewards == [1.0, 0.0]


def test_kwargs_are_trls_plus_finish_reason() -> None:
    seen: dict[str, Any] = {}

    def spy(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **kw: Any) -> list[float]:
        seen.update(kw, prompts=prompts, completions=completions, completion_ids=completion_ids)
        return [1.0] * len(completions)

    b = plain(["ab", "c"], answer="7", prompts="a column that must not replace prompts")
    b.finish_reasons[1] = "length"
    score(RewardRunner([spy], [1.0]), b, step=3)
    assert seen["prompts"] == ["Q:", "Q:"] and seen["completions"] == ["ab", "c"]
    assert seen["completion_ids"] == [[1, 1], [1]] and seen["answer"] == ["7", "7"]
    assert seen["finish_reason"] == ["stop", "length"]
    assert seen["trainer_state"].global_step == 3 and seen["trainer_state"].max_steps == 10
    seen["log_metric"]("m", 1.0)
    seen["log_extra"]("col", [1, 2])


def test_weights_and_none_combine_as_trls_nansum() -> None:
    def a(completions: list[str], **_: Any) -> list[float | None]:
        return [1.0, None, None]

    def b(completions: list[str], **_: Any) -> list[float | None]:
        return [2.0, 3.0, None]

    runner = RewardRunner([a, b], [1.0, 0.5])
    r = score(runner, plain(["x", "y", "z"]))
    assert r.rewards == [2.0, 1.5, None] and r.reasons == [None, None, "all_none"]
    assert runner.excluded == {"all_none": 1} and runner.scored == 2


def test_weights_must_match_the_functions() -> None:
    with pytest.raises(ConfigError, match="one weight per function"):
        load_reward_funcs([f"{EXAMPLES}:reward_len", f"{EXAMPLES}:reward_func"], [1.0])
    funcs, ws = load_reward_funcs([f"{EXAMPLES}:reward_len", f"{EXAMPLES}:reward_func"])
    assert ws == [1.0, 1.0] and len(funcs) == 2
    for bad, msg in ((f"{EXAMPLES}:nope", "no callable"), ("missing_file.py:f", "no file"),
                     ("no_such_pkg_xyz.mod:f", "importing"), ("reward_len", "expected")):
        with pytest.raises(ConfigError, match=msg):
            load_reward_func(bad)


def test_a_reward_file_is_named_relative_to_hub_toml(tmp_path: Path) -> None:
    (tmp_path / "my_rewards.py").write_text(EXAMPLES.read_text())
    (tmp_path / "hub.toml").write_text('[hub]\nreward_funcs = ["my_rewards.py:reward_len", "echo2.learner_hub.rewards_builtin:copy_reward"]\n')
    cfg = load_config(tmp_path / "hub.toml")
    assert cfg.reward_funcs[0] == f"{(tmp_path / 'my_rewards.py').resolve()}:reward_len"
    assert cfg.reward_funcs[1] == "echo2.learner_hub.rewards_builtin:copy_reward"
    funcs, _ = load_reward_funcs(cfg.reward_funcs)
    assert funcs[0](completions=["x" * 20]) == [0]


# --- bad functions: excluded, counted, logged once; the runner keeps going --------------------------
def ok(completions: list[str], **_: Any) -> list[float]:
    return [1.0] * len(completions)


def raises(completions: list[str], **_: Any) -> list[float]:
    raise RuntimeError("boom")


def wrong_length(completions: list[str], **_: Any) -> list[float]:
    return [1.0]


def wrong_type(completions: list[str], **_: Any) -> Any:
    return ["high"] * len(completions)


def nan_one(completions: list[str], **_: Any) -> list[float]:
    return [math.nan] + [1.0] * (len(completions) - 1)


def inf_one(completions: list[str], **_: Any) -> list[float]:
    return [1.0] * (len(completions) - 1) + [math.inf]


@pytest.mark.parametrize(("func", "reason", "n_excluded"), [
    (raises, "raised", 3), (wrong_length, "wrong_length", 3), (wrong_type, "wrong_type", 3),
    (nan_one, "nonfinite", 1), (inf_one, "nonfinite", 1),
])
def test_bad_function_excludes_its_rows_counted_and_logged_once(
    func: Any, reason: str, n_excluded: int, caplog: pytest.LogCaptureFixture
) -> None:
    runner = RewardRunner([ok, func], [1.0, 1.0], timeout_s=5.0)
    for _ in range(2):
        r = score(runner, plain(["a", "b", "c"]))
        assert sum(x is None for x in r.rewards) == n_excluded
        assert all(x == 2.0 for x in r.rewards if x is not None)
    assert runner.excluded == {reason: 2 * n_excluded}
    assert runner.report()["failures"] == [{"function": func.__name__, "reason": reason, "batches": 2}]
    logged = [rec.getMessage() for rec in caplog.records if func.__name__ in rec.getMessage()]
    assert len(logged) == 1  # once per (function, reason), however many batches


def test_hung_function_is_abandoned_at_the_timeout_and_the_loop_stays_free() -> None:
    release = threading.Event()

    def hangs(completions: list[str], **_: Any) -> list[float]:
        release.wait(10.0)
        return [1.0] * len(completions)

    runner = RewardRunner([ok, hangs], [1.0, 1.0], timeout_s=0.3)
    ticks = 0

    async def main() -> tuple[Scored, Scored]:
        nonlocal ticks

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await trio.sleep(0.02)
                ticks += 1

        async with trio.open_nursery() as n:
            n.start_soon(ticker)
            first = await runner.score(plain(["a", "b"]), TrainerState())
            second = await runner.score(plain(["a", "b"]), TrainerState())  # its thread is still held
            n.cancel_scope.cancel()
        return first, second

    t0 = time.monotonic()
    try:
        first, second = trio.run(main)
    finally:
        release.set()
    assert time.monotonic() - t0 < 3.0
    assert first.rewards == [None, None] and second.rewards == [None, None]
    assert runner.excluded == {"timeout": 4} and ticks >= 10  # the loop ran while the function hung


def test_apply_scores_drops_excluded_samples_and_thin_groups() -> None:
    def group(n: int) -> Group:
        return Group([1], [Sample([2], [-0.1], 0.0, 0) for _ in range(n)])

    groups = [group(3), group(2)]
    kept, dropped = apply_scores(groups, Scored([1.0, None, 0.5, 1.0, None], [None, "raised", None, None, "raised"]))
    assert dropped == 1 and len(kept) == 1 and [s.reward for s in kept[0].samples] == [1.0, 0.5]


# --- through a real hub ----------------------------------------------------------------------------
def test_bad_reward_functions_through_a_real_hub(tmp_path: Path) -> None:
    """Each bad case on the hub's accept path: the result is accepted and stored, its rows are
    excluded and counted in status, and the hub goes on accepting the next result."""
    from test_hub_results import admit, run_task, take_task

    from echo2.learner_hub.hub import Hub
    from echo2.learner_hub.store import HubStore
    from echo2.protocol import envelope
    from echo2.protocol.identity import Identity

    mod = tmp_path / "bad_rewards.py"
    mod.write_text(
        "import math, time\n"
        "def raises(completions, **kw):\n    raise ValueError('bad')\n"
        "def hangs(completions, **kw):\n    time.sleep(1.5)\n    return [1.0] * len(completions)\n"
        "def short(completions, **kw):\n    return [1.0]\n"
        "def nan(completions, **kw):\n    return [math.nan] * len(completions)\n"
    )
    cfg = small_hub_cfg(tmp_path / "hub", reward_funcs=[f"{mod}:{f}" for f in ("raises", "hangs", "short", "nan")]
                        + ["echo2.learner_hub.rewards_builtin:copy_reward"], reward_timeout_s=0.5)
    hub = Hub(cfg)
    node = Identity.generate()
    assert admit(hub, node).admitted
    n, done = 0, []
    for _ in range(2):
        task = take_task(hub, node)
        result = run_task(hub, node, task)
        n += len(result.completions)
        done.append(task.task_id)
        trio.run(hub.on_result, node.peer_id, envelope.seal(node, result))
    st = hub.status()
    assert hub.dispatcher.stats.accepted == 2 and len(hub.buffer) == 0
    # every completion excluded once (under the first failing function's reason), the hub alive
    assert st["rewards"]["excluded_by_reason"] == {"raised": n}
    assert {(f["function"], f["reason"]) for f in st["rewards"]["failures"]} == {
        ("raises", "raised"), ("hangs", "timeout"), ("short", "wrong_length"), ("nan", "nonfinite")}
    assert st["rewards"]["groups_dropped"] >= 2
    assert not any(t in hub.intake.book for t in done)  # nothing left waiting for rows that will never come
    hub.store.flush()
    assert hub.store.call_sync(HubStore.pending_results) == []  # nothing to restore into training
    # metrics carry the counts
    from echo2.learner_hub.status_http import hub_metrics, render_metrics

    assert "echo2_reward_excluded_total" in render_metrics(hub_metrics(st))
    hub.store.close()


def test_good_reward_function_through_a_real_hub(tmp_path: Path) -> None:
    from test_hub_results import admit, run_task, take_task

    from echo2.learner_hub.hub import Hub
    from echo2.protocol import envelope
    from echo2.protocol.identity import Identity

    cfg = small_hub_cfg(tmp_path, reward_funcs=[f"{EXAMPLES}:reward_len"])
    hub = Hub(cfg)
    node = Identity.generate()
    admit(hub, node)
    task = take_task(hub, node)
    result = run_task(hub, node, task)
    trio.run(hub.on_result, node.peer_id, envelope.seal(node, result))
    st = hub.status()["rewards"]
    assert st["completions_scored"] == len(result.completions) and st["excluded_by_reason"] == {}
    assert len(hub.buffer) == len(task.prompts)
    # the trained rows carry reward_len of each completion's text (stop token left out)
    groups = [item[1] for _, _, item in hub.buffer._heap]
    for g in groups:
        for s in g.samples:
            ids = s.token_ids[:-1] if s.finish_reason == "stop" else s.token_ids
            assert s.reward == -abs(20 - len(hub.tok.decode(ids)))
    hub.store.close()


def test_bad_reward_spec_is_a_clear_startup_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from echo2.cli import main

    (tmp_path / "hub.toml").write_text('[hub]\ndir = "h"\nreward_funcs = ["nothere.py:f"]\n')
    assert main(["hub", "run", "--config", str(tmp_path / "hub.toml")]) == 1
    err = capsys.readouterr().err
    assert "nothere.py" in err and "no file" in err and "Traceback" not in err
    (tmp_path / "hub.toml").write_text(f'[hub]\ndir = "h"\nreward_funcs = ["{EXAMPLES}:reward_len"]\nreward_weights = [1.0, 2.0]\n')
    assert main(["hub", "run", "--config", str(tmp_path / "hub.toml")]) == 1
    assert "reward_weights has 2 entries" in capsys.readouterr().err
