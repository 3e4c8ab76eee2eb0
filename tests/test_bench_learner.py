"""``echo2 bench learner`` on the tiny model: 2 FSDP2 ranks against one process (issue 17's
must-show figures: equality within 1e-5, parameter + optimizer bytes per rank <= 0.6x)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from echo2.bench import learner as bench_learner


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_learner_two_ranks_vs_one(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench_learner.add_arguments(parser)
    out = tmp_path / "l.json"
    args = parser.parse_args(["--procs", "1,2", "--steps", "2", "--prompts", "4", "--group", "4", "--json", str(out)])
    assert bench_learner.run(args) == 0
    rep = json.loads(out.read_text())
    one, two = rep["configs"]
    assert (one["procs"], two["procs"]) == (1, 2)
    assert two["equality"]["ok"] and two["equality"]["loss_rel"] <= 1e-5
    assert two["params_optimizer_ratio_vs_1"] <= 0.6
    assert len(two["memory_per_rank"]) == 2 and all(m["grads"] > 0 for m in two["memory_per_rank"])
    assert two["publish_bytes"] == one["publish_bytes"] > 0  # the same full bf16 version
    assert one["tokens_per_s"] > 0 and two["tokens_per_s"] > 0


@pytest.mark.timeout(240)
def test_bench_learner_lora_one_process(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench_learner.add_arguments(parser)
    out = tmp_path / "l.json"
    args = parser.parse_args(["--procs", "1,2", "--lora", "--lora-r", "4", "--steps", "2", "--prompts", "2", "--group", "4",
                              "--json", str(out)])
    assert bench_learner.run(args) == 0
    rep = json.loads(out.read_text())
    assert [c["procs"] for c in rep["configs"]] == [1]  # a sharded LoRA learner is refused, as by the hub
    (one,) = rep["configs"]
    assert 0 < rep["lora"]["trainable"] < rep["parameters"]
    # only the adapters train: AdamW holds two moments of the adapter parameters, not of the model
    assert one["memory_per_rank"][0]["optimizer"] <= 2 * 4 * rep["lora"]["trainable"] + 4096
    assert 0 < one["adapter_bytes"] < 0.2 * one["publish_bytes"]
