"""``echo2 bench learn``: the recipe it runs, and the report and plot it makes from status.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from echo2.bench import learn

STATUS = {
    "step": 12,
    "wall_s": 100.0,
    "nodes": [{"tokens": 3000}, {"tokens": 2000}],
    "history": [{"step": s, "t": 8.0 * s, "reward": 0.1 * s} for s in range(1, 13)],
    "eval": {"history": [
        {"step": 0, "wall_s": 5.0, "mean_reward": 0.2, "accuracy": 0.05, "n": 100},
        {"step": 5, "wall_s": 50.0, "mean_reward": 0.6, "accuracy": 0.15, "n": 100},
        {"step": 10, "wall_s": 95.0, "mean_reward": 0.9, "accuracy": 0.30, "n": 100},
    ]},
}


def test_report_has_before_after_gain_steps_and_tokens_per_s() -> None:
    rep = learn.build_report(STATUS, model="tiny", minutes=2.0, wall_s=110.0, nodes=2)
    assert rep["steps"] == 12 and rep["nodes"] == 2
    assert rep["eval_before"]["step"] == 0 and rep["eval_before"]["accuracy"] == 0.05
    assert rep["eval_after"]["step"] == 10 and rep["eval_after"]["accuracy"] == 0.30
    assert rep["accuracy_gain"] == pytest.approx(0.25)
    assert rep["tokens_per_s"] == pytest.approx(50.0)
    assert [e["step"] for e in rep["evals"]] == [0, 5, 10]
    assert len(rep["train"]) == 12 and rep["train"][-1] == {"step": 12, "wall_s": 96.0, "reward": pytest.approx(1.2)}
    json.dumps(rep)  # the report is JSON as it stands
    assert any("+0.250" in line for line in learn.summary_lines(rep))


def test_report_without_evaluations_says_so() -> None:
    rep = learn.build_report({"step": 3, "history": [], "nodes": []}, model="tiny", minutes=1.0, wall_s=0.0, nodes=2)
    assert rep["eval_before"] is None and rep["eval_after"] is None and rep["accuracy_gain"] is None
    assert rep["tokens_per_s"] == 0.0
    assert any("no evaluation" in line for line in learn.summary_lines(rep))
    # one evaluation only: a "before", no "after", no gain
    one = dict(STATUS, eval={"history": STATUS["eval"]["history"][:1]})  # type: ignore[index]
    rep = learn.build_report(one, model="tiny", minutes=1.0, wall_s=10.0, nodes=2)
    assert rep["eval_before"] is not None and rep["eval_after"] is None and rep["accuracy_gain"] is None


def test_plot_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rep = learn.build_report(STATUS, model="tiny", minutes=2.0, wall_s=110.0, nodes=2)
    out = tmp_path / "learn.png"
    from echo2.bench import plotting

    plotting.learn_figure(rep, out)
    assert out.stat().st_size > 1000


def test_shipped_recipe_config_is_valid_and_made_absolute(tmp_path: Path) -> None:
    cfg = learn.recipe_config(learn.DEFAULT_RECIPE, "tiny")
    cfg.validate()
    assert cfg.model == "tiny" and cfg.exit_when_done is False
    assert Path(cfg.dataset.path).is_absolute() and (Path(cfg.dataset.path) / "train.jsonl").is_file()
    assert cfg.dataset.eval_split == "test" and cfg.eval_every > 0
    for f in cfg.reward_funcs:
        file, _, name = f.rpartition(":")
        assert Path(file).is_absolute() and Path(file).is_file() and name
    assert len(cfg.reward_weights) == len(cfg.reward_funcs)


def test_tiny_gets_plain_text_prompts(tmp_path: Path) -> None:
    src = learn.DEFAULT_RECIPE / "data"
    out = learn.plain_text_copy(src, tmp_path / "plain")
    assert sorted(p.name for p in out.iterdir()) == ["test.jsonl", "train.jsonl"]
    a = [json.loads(x) for x in (src / "test.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (out / "test.jsonl").read_text().splitlines()]
    assert len(a) == len(b)
    assert b[0]["prompt"] == a[0]["prompt"][-1]["content"] and b[0]["answer"] == a[0]["answer"]


def test_shipped_recipe_builds_for_tiny_and_smollm2(tmp_path: Path) -> None:
    """The hub's own recipe builder takes the shipped recipe: tiny on its plain-text copy, and
    SmolLM2 (when converted) on the conversational files through its chat template."""
    from echo2.learner_hub.recipe import build_recipe
    from echo2.models import gguf
    from echo2.models import spec as modelspec

    cfg = learn.recipe_config(learn.DEFAULT_RECIPE, "tiny")
    cfg.dataset.path = str(learn.plain_text_copy(Path(cfg.dataset.path), tmp_path / "plain"))
    _, arts = modelspec.artifacts_for(modelspec.tiny_config(), modelspec.tokenizer_json())
    rec = build_recipe(cfg, modelspec.load_tokenizer(arts), arts)
    assert len(rec.eval_items) == 30 and rec.reward_weights == [1.0, 0.5, 0.3]
    smol = gguf.cache_dir() / gguf.SMOLLM2_DIRNAME
    if not gguf.is_model_dir(smol):
        pytest.skip("SmolLM2 not converted here (echo2 model import-gguf smollm2 --out ...)")
    cfg = learn.recipe_config(learn.DEFAULT_RECIPE, "smollm2")
    arts = {n: (smol / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json") if (smol / n).is_file()}
    rec = build_recipe(cfg, modelspec.load_tokenizer(arts), arts)
    item = rec.eval_items[0]
    assert item.conversational and len(rec.eval_items) == 30
    assert item.text.startswith("<|im_start|>system\nReply with only the number.") and item.text.endswith("<|im_start|>assistant\n")
