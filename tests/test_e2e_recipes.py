"""TRL reward functions from a file, unchanged, through a live swarm (a hub process and two node
processes on 127.0.0.1): the reward of a plain-text dataset and of a conversational one rises.

The policy is the tiny byte-level model (random init). ``reward_len`` pays -|20 - len(text)|: a
random byte model rarely stops (eos is 1 of 259 symbols), so its completions run to
``max_new_tokens`` (28) and score about -8; stopping near 20 characters is what it must learn.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from echo2.bench.demo import summarize
from echo2.bench.swarm import LocalSwarm
from echo2.learner_hub.config import DatasetSpec, HubConfig
from echo2.models import spec as ms

EXAMPLES = Path(__file__).parent / "trl_examples"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _prompts(n: int) -> list[str]:
    return [f"{i % 97:02d}{(7 * i) % 89:02d}=" for i in range(n)]


def _tiny_chat_model(d: Path) -> Path:
    """A local HF model directory: the tiny byte model with a chat template, as an operator's own."""
    cj, arts = ms.artifacts_for(ms.tiny_config(hidden=128, layers=2, heads=4), ms.tokenizer_json())
    torch.manual_seed(0)
    ms.model_from_config(cj).save_pretrained(d)
    (d / "tokenizer.json").write_bytes(arts["tokenizer.json"])
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}))
    return d


def _run(tmp_path: Path, cfg: HubConfig) -> dict[str, Any]:
    with LocalSwarm(tmp_path, cfg, n_nodes=2) as swarm:
        swarm.start()
        st = swarm.wait(400)
    assert st is not None, "hub wrote no status"
    logs = "\n".join(p.read_text()[-3000:] for p in tmp_path.glob("*/*.log"))
    assert st.get("final"), f"swarm did not finish its steps:\n{logs}"
    assert st["rewards"]["excluded"] == 0 if "excluded" in st.get("rewards", {}) else True, st.get("rewards")
    report = summarize(st, 2, cfg.steps, cfg.staleness, "recipe", 0.0)
    print("recipe report:", {k: report[k] for k in ("reward_first", "reward_last", "steps")})
    assert report["steps"] == cfg.steps
    return report


def _cfg(**kw: Any) -> HubConfig:
    return HubConfig(steps=80, staleness=1, seed=0, exit_when_done=True, max_new_tokens=28, group_size=8,
                     prompts_per_step=16, lr=5e-4, **kw)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(480)
def test_trl_reward_len_rises_on_a_plain_dataset(tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in _prompts(400)))
    cfg = _cfg(dataset=DatasetSpec(path=str(data)), reward_funcs=[f"{EXAMPLES / 'trl_doc_rewards.py'}:reward_len"])
    report = _run(tmp_path / "run", cfg)
    assert report["reward_last"] >= report["reward_first"] + 2.0, report


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(480)
def test_trl_style_conversational_reward_rises(tmp_path: Path) -> None:
    model = _tiny_chat_model(tmp_path / "model")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": p}]}) + "\n" for p in _prompts(400)))
    cfg = _cfg(model=str(model), dataset=DatasetSpec(path=str(data)),
               reward_funcs=[f"{EXAMPLES / 'chat_rewards.py'}:reward_len_chat"])
    report = _run(tmp_path / "run", cfg)
    assert report["reward_last"] >= report["reward_first"] + 2.0, report
