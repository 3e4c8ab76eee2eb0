"""Datasets as prompt sources (learner_hub/data.py) and recipe assembly (learner_hub/recipe.py)."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import datasets
import pytest
from hubkit import small_hub_cfg

from echo2.learner_hub.config import ConfigError, DatasetSpec, HubConfig
from echo2.learner_hub.data import POSITION_KEY, PromptSource, Renderer, load_rows, prepare
from echo2.learner_hub.envs import make_env
from echo2.learner_hub.hub import Hub
from echo2.learner_hub.recipe import BUILTIN_EVAL_SEED, build_recipe
from echo2.learner_hub.store import HubStore
from echo2.models import spec

ROWS = [{"prompt": f"question {i}?", "answer": str(i), "level": i % 3} for i in range(12)]
TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}"
)


def _tok(template: str = "") -> tuple[Any, dict[str, bytes]]:
    _mc, arts = spec.artifacts_for(spec.tiny_config(hidden=8, layers=1), spec.tokenizer_json())
    if template:
        arts = arts | {"tokenizer_config.json": json.dumps({"chat_template": template, "bos_token": "<bos>",
                                                            "eos_token": "<eos>"}).encode()}
    return spec.load_tokenizer(arts), arts


def _source(rows: Any, tok: Any, *, seed: int = 0, max_tokens: int = 512, column: str = "prompt",
            renderer: Renderer | None = None) -> PromptSource:
    r = renderer or Renderer(tok)
    return PromptSource(prepare(rows, column, r, max_tokens, "test"), column, r, seed, "test")


def _cfg(tmp_path: Path, **kw: Any) -> HubConfig:
    return HubConfig(dir=str(tmp_path), **kw)


# --- file formats ----------------------------------------------------------------------------------
def _write_formats(tmp_path: Path) -> dict[str, Path]:
    ds = datasets.Dataset.from_list(ROWS)
    out: dict[str, Path] = {}
    out["jsonl"] = tmp_path / "d.jsonl"
    out["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out["json"] = tmp_path / "d.json"
    out["json"].write_text(json.dumps(ROWS))
    out["parquet"] = tmp_path / "d.parquet"
    ds.to_parquet(str(out["parquet"]))
    out["csv"] = tmp_path / "d.csv"
    ds.to_csv(str(out["csv"]), index=False)
    ds.save_to_disk(str(tmp_path / "disk"))
    out["disk"] = tmp_path / "disk"
    out["arrow"] = next((tmp_path / "disk").glob("*.arrow"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(tmp_path / "dict"))
    out["dict"] = tmp_path / "dict"
    return out


def test_each_file_format_gives_the_same_prompts(tmp_path: Path) -> None:
    tok, _ = _tok()
    for kind, path in _write_formats(tmp_path).items():
        rows = load_rows(path, "train")
        assert len(rows) == len(ROWS), kind
        items = sorted(_source(rows, tok).draw(len(ROWS)), key=lambda it: it.index)
        assert [it.prompt for it in items] == [r["prompt"] for r in ROWS], kind
        # every other column goes into row (csv keeps what it parsed: answer is then an int)
        assert [str(it.row["answer"]) for it in items] == [r["answer"] for r in ROWS], kind
        assert set(items[0].row) == {"answer", "level"}, kind
        assert items[0].ids == tuple(tok.encode(items[0].text)) and not items[0].conversational  # no bos: as TRL
    test = load_rows(tmp_path / "dict", "test")
    assert len(test) == 3
    with pytest.raises(ConfigError, match="no split 'validation'"):
        load_rows(tmp_path / "dict", "validation")


def test_folder_of_split_files(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    assert len(load_rows(tmp_path, "train")) == 12 and len(load_rows(tmp_path, "test")) == 2


# --- conversational prompts ------------------------------------------------------------------------
def test_conversational_rendered_with_the_chat_template(tmp_path: Path) -> None:
    tok, arts = _tok(TEMPLATE)
    msgs = [{"prompt": [{"role": "user", "content": f"hi {i}"}], "answer": str(i)} for i in range(3)]
    r = Renderer(tok, arts, system_prompt="be brief")
    item = min(_source(msgs, tok, renderer=r).draw(3), key=lambda it: it.index)
    assert item.conversational and item.prompt == [{"role": "user", "content": "hi 0"}]
    assert item.text == "<bos>system: be brief\n<bos>user: hi 0\n<bos>assistant:"
    # the template's special tokens are tokens, not their bytes; no extra bos in front
    assert item.ids.count(tok.bos_id) == 3 and item.ids[0] == tok.bos_id and item.ids[1] != tok.bos_id
    assert tok.decode(list(item.ids)) == item.text.replace("<bos>", "")
    # an existing system message is not doubled
    own = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]
    assert r.render(own)[0] == "<bos>system: S\n<bos>user: u\n<bos>assistant:"
    # a conversational dataset file (a list of messages per row) reads back as messages
    p = tmp_path / "chat.jsonl"
    p.write_text("".join(json.dumps(m) + "\n" for m in msgs))
    got = _source(load_rows(p, "train"), tok, renderer=Renderer(tok, arts)).draw(1)[0]
    assert got.conversational and got.text.endswith("<bos>assistant:")


def test_conversational_without_a_chat_template_is_a_config_error() -> None:
    tok, arts = _tok()
    msgs = [{"prompt": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(ConfigError, match="no chat template"):
        _source(msgs, tok, renderer=Renderer(tok, arts))


# --- budget, errors --------------------------------------------------------------------------------
def test_long_prompts_skipped_and_counted_once(caplog: pytest.LogCaptureFixture) -> None:
    tok, _ = _tok()
    rows = [{"prompt": "x" * n} for n in (3, 50, 4, 60, 70)]
    with caplog.at_level(logging.WARNING, logger="echo2.learner_hub.data"):
        src = _source(rows, tok, max_tokens=10)
    assert len(src) == 2 and src.skipped == 3
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "3 of 5 prompts are longer than max_prompt_tokens=10" in notes[0]
    assert sorted(len(it.text) for it in src.draw(4)) == [3, 3, 4, 4]  # never a long one, over two epochs
    with pytest.raises(ConfigError, match="no prompt fits"):
        _source(rows, tok, max_tokens=1)


def test_malformed_file_missing_column_wrong_type(tmp_path: Path) -> None:
    tok, _ = _tok()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{not json\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl: cannot be read"):
        load_rows(bad, "train")
    with pytest.raises(ConfigError, match="no such file"):
        load_rows(tmp_path / "nope.jsonl", "train")
    odd = tmp_path / "d.txt"
    odd.write_text("x")
    with pytest.raises(ConfigError, match="unknown file type"):
        load_rows(odd, "train")
    good = tmp_path / "q.jsonl"
    good.write_text(json.dumps({"question": "a", "answer": "1"}) + "\n")
    with pytest.raises(ConfigError, match=r"no column 'prompt' \(prompt_column\); it has question, answer"):
        _source(load_rows(good, "train"), tok)
    typed = tmp_path / "t.jsonl"
    typed.write_text(json.dumps({"prompt": 7}) + "\n")
    with pytest.raises(ConfigError, match=r"row 0, column 'prompt': must be a string or a list"):
        _source(load_rows(typed, "train"), tok)
    with pytest.raises(ConfigError, match=r"message 0 must be"):
        _source([{"prompt": [{"role": "user"}]}], tok)
    # the same through build_recipe, the way the hub starts
    cfg = _cfg(tmp_path, dataset=DatasetSpec(path=str(bad)), reward_funcs=["r.py:f"])
    with pytest.raises(ConfigError, match=r"bad\.jsonl"):
        build_recipe(cfg, tok)


# --- seeded epochs and the saved position -------------------------------------------------------------
def test_epochs_are_seeded_permutations() -> None:
    tok, _ = _tok()
    src = _source(ROWS, tok, seed=5)
    e0, e1 = [it.index for it in src.draw(12)], [it.index for it in src.draw(12)]
    assert sorted(e0) == sorted(e1) == list(range(12)) and e0 != e1
    assert src.position()["epoch"] == 1 and src.position()["index"] == 12
    order = list(range(12))
    random.Random(5).shuffle(order)
    assert e0 == order  # epoch e is the permutation seeded with seed + e
    assert [it.index for it in _source(ROWS, tok, seed=5).draw(12)] == e0
    assert [it.index for it in _source(ROWS, tok, seed=6).draw(12)] != e0


def test_restart_resumes_the_sequence_exactly(tmp_path: Path) -> None:
    """Through the hub's store: a restarted source neither repeats nor skips a prompt."""
    tok, _ = _tok()
    straight = [it.index for it in _source(ROWS, tok, seed=3).draw(30)]
    got: list[int] = []
    for cut in (5, 12, 7, 6):  # four hub runs; the second ends exactly at an epoch's end
        src = _source(ROWS, tok, seed=3)
        with HubStore.in_dir(tmp_path) as store:
            src.restore(store.get_meta(POSITION_KEY))
            got += [it.index for it in src.draw(cut)]
            store.set_meta(POSITION_KEY, src.position())
    assert got == straight
    # a saved position of another dataset (size), or another seed, starts afresh rather than misplacing
    other = _source(ROWS[:5], tok, seed=3)
    with HubStore.in_dir(tmp_path) as store:
        assert not other.restore(store.get_meta(POSITION_KEY))
    assert not _source(ROWS, tok, seed=4).restore(_source(ROWS, tok, seed=3).position())
    assert not _source(ROWS, tok).restore({"epoch": -1, "index": 0, "size": 12, "name": "test", "seed": 0})


# --- recipes --------------------------------------------------------------------------------------
def test_builtin_tasks_produce_the_prompts_they_did(tmp_path: Path) -> None:
    tok, arts = _tok()
    for task, fn in (("copy", "copy_reward"), ("reverse", "reverse_reward"), ("arith", "numeric_reward")):
        r = build_recipe(_cfg(tmp_path, task=task, seed=2, eval_max_prompts=8), tok, arts)
        assert r.reward_funcs == [f"echo2.learner_hub.rewards_builtin:{fn}"] and r.reward_weights == [1.0]
        env = make_env(task)
        # the generated dataset is the task's own generator, seeded with the hub's seed
        want = env.sample_prompts(len(r.source), random.Random(2))
        drawn = sorted(r.source.draw(len(r.source)), key=lambda it: it.index)
        assert [(it.text, it.row) for it in drawn] == [(w.text, w.row) for w in want]
        assert all(it.ids == tuple(tok.encode(it.text, add_bos=True)) for it in drawn[:20])
        fixed = env.sample_prompts(8, random.Random(BUILTIN_EVAL_SEED))
        assert [(it.text, it.row) for it in r.eval_items] == [(w.text, w.row) for w in fixed]
        assert env.check(drawn[0], drawn[0].row["answer"], "stop")  # the reward side still reads answer


def test_dataset_recipe_and_eval_split(tmp_path: Path) -> None:
    tok, arts = _tok()
    paths = _write_formats(tmp_path)
    cfg = _cfg(tmp_path, dataset=DatasetSpec(path=str(paths["dict"]), eval_split="test"), reward_funcs=["a.py:f", "b:g"],
               reward_weights=[1.0, 0.5], eval_max_prompts=2)
    r = build_recipe(cfg, tok, arts)
    assert r.reward_funcs == ["a.py:f", "b:g"] and r.reward_weights == [1.0, 0.5]
    assert len(r.source) == 12 and [it.prompt for it in r.eval_items] == ["question 0?", "question 1?"]
    # a single file is one split: the eval split is then another file
    cfg.dataset = DatasetSpec(path=str(paths["jsonl"]), eval_split=str(paths["csv"]))
    assert len(build_recipe(cfg, tok, arts).eval_items) == 2
    cfg.dataset = DatasetSpec(path=str(paths["jsonl"]), eval_split="test")
    with pytest.raises(ConfigError, match="single file holds one split"):
        build_recipe(cfg, tok, arts)
    cfg.dataset, cfg.reward_weights = DatasetSpec(path=str(paths["jsonl"])), [1.0]
    with pytest.raises(ConfigError, match="reward_weights has 1 entries for 2"):
        build_recipe(cfg, tok, arts)
    cfg.reward_funcs, cfg.reward_weights = [], []
    with pytest.raises(ConfigError, match="reward_funcs is empty"):
        build_recipe(cfg, tok, arts)


def test_old_jsonl_task_still_works(tmp_path: Path) -> None:
    tok, _ = _tok()
    p = tmp_path / "gsm.jsonl"
    p.write_text(json.dumps({"question": "What is 2+3?", "answer": "2+3=5\n#### 5"}) + "\n"
                 + json.dumps({"question": "No number", "answer": "none"}) + "\n")
    cfg = _cfg(tmp_path, task="jsonl", dataset=DatasetSpec(path=str(p)))
    r = build_recipe(cfg, tok)
    (item,) = r.source.draw(1)
    assert item.text == "Question: What is 2+3?\nAnswer:" and item.row["answer"] == "5"
    assert r.reward_funcs == ["echo2.learner_hub.rewards_builtin:numeric_reward"]
    with pytest.raises(ConfigError, match='task = "jsonl" needs dataset'):
        build_recipe(_cfg(tmp_path, task="jsonl"), tok)


def test_hub_restart_continues_the_prompt_sequence(tmp_path: Path) -> None:
    """A real hub's refill saves the position in its store; the next hub in that folder continues."""
    cfg = small_hub_cfg(tmp_path, prompts_per_step=4, steps=100)
    tok, arts = _tok()
    straight = [it.index for it in build_recipe(cfg, tok, arts).source.draw(8)]
    got: list[int] = []
    for _ in range(2):
        hub = Hub(cfg)
        try:
            hub._refill()
            got += [g.item.index for g in hub.dispatcher.queue]
            assert all(g.prompt == g.item.ids for g in hub.dispatcher.queue)
        finally:
            hub.store.close()
    assert got == straight


def test_environment_recipe_uses_its_dataset_and_rubric(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The assembly only: the verifiers adapter (learner_hub/verifiers_env.py) is tested on its own;
    here a stand-in returns what it returns (train/eval Datasets with a `prompt` column, callables, weights)."""
    import types

    tok, arts = _tok(TEMPLATE)
    train = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i)}
                                        for i in range(4)])

    def reward(**_kw: Any) -> list[float]:
        return []

    calls: list[tuple[str, dict[str, Any]]] = []

    def load_environment_recipe(env_id: str, env_args: dict[str, Any]) -> Any:
        calls.append((env_id, env_args))
        return train, train.select(range(2)), [reward], [0.5]

    stand_in = types.ModuleType("echo2.learner_hub.verifiers_env")
    stand_in.load_environment_recipe = load_environment_recipe  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "echo2.learner_hub.verifiers_env", stand_in)
    cfg = _cfg(tmp_path, environment="my-env", environment_args={"n": 1}, reward_funcs=["ignored.py:f"])
    r = build_recipe(cfg, tok, arts)
    assert calls == [("my-env", {"n": 1})] and r.reward_funcs == [reward] and r.reward_weights == [0.5]
    assert len(r.source) == 4 and len(r.eval_items) == 2 and r.eval_items[0].conversational
    assert r.eval_items[0].row == {"answer": "0"} and r.eval_items[0].text.endswith("<bos>assistant:")


SMOLLM2 = Path.home() / ".cache/echo2/models/smollm2-135m-instruct"


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer_config.json").exists(), reason="no converted SmolLM2 (echo2 model import-gguf)")
def test_chat_ids_equal_transformers_apply_chat_template() -> None:
    from transformers import AutoTokenizer

    arts = {n: (SMOLLM2 / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json")}
    tok = spec.load_tokenizer(arts)
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    _text, ids = Renderer(tok, arts, system_prompt="Be brief.").render(msgs)
    ref = AutoTokenizer.from_pretrained(str(SMOLLM2)).apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *msgs], tokenize=True, add_generation_prompt=True)
    assert ids == list(ref["input_ids"] if hasattr(ref, "keys") else ref)
