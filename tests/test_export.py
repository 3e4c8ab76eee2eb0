"""Issue 21 item 5: ``echo2 hub export``. A real hub (tiny model, real learner, publisher, store
and checkpoints) trains a few steps on rows its own engine makes, as a node makes them; the
exported directory is loaded by transformers alone (offline) and compared with what the hub
published: the same greedy answers on the eval split, the same tensors bit for bit."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from hubkit import small_hub_cfg

from echo2.cli import main as cli_main
from echo2.learner_hub.config import LoraSpec, render_config
from echo2.learner_hub.export import ExportError, choose_step, export
from echo2.learner_hub.hub import Hub
from echo2.learner_hub.rows import Group, Sample
from echo2.learner_hub.store import HubStore
from echo2.models import statedict
from echo2.models.engine import TransformersEngine


def make_hub(tmp_path: Path, **kw: Any) -> Hub:
    hub_dir = tmp_path / "hub"
    hub_dir.mkdir(parents=True)
    cfg = small_hub_cfg(hub_dir, task="copy", steps=3, max_new_tokens=8, eval_every=1, eval_max_prompts=6,
                        checkpoint_every=1, **kw)
    (hub_dir / "hub.toml").write_text(render_config(cfg))  # the run's config, as `echo2 hub init` leaves it
    hub = Hub(cfg)
    trio.run(hub.trainer.publish)  # version 0
    return hub


def published(hub: Hub, version: int) -> dict[str, torch.Tensor]:
    """The weights of ``version`` as a node reconstructs them from the hub's packed chunks."""
    pub = hub.publisher.recent[version]
    return statedict.assemble(pub.packed.manifest, pub.packed.raw_chunks)


def engine_at(hub: Hub, version: int) -> TransformersEngine:
    eng = TransformersEngine(device="cpu")
    m = hub.publisher.recent[version].packed.manifest
    eng.load_version(version, m.model_config, dict(m.artifacts), published(hub, version))
    return eng


def train(hub: Hub, steps: int) -> dict[int, dict[str, torch.Tensor]]:
    """``steps`` learner steps on rows the hub's published policy samples; each version published
    and checkpointed as the hub's loop does. Returns the master weights the hub had at each step."""
    masters = {0: {k: v.clone() for k, v in hub.learner.model.state_dict().items()}}
    trio.run(hub.trainer.checkpoint)
    tok = hub.tok
    for s in range(steps):
        eng = engine_at(hub, hub.learner.version)
        prompts = [tok.encode(f"{s}{i}ab", add_bos=True) for i in range(2)]
        comps = eng.generate(prompts, 4, 6, 1.0, 1.0, seed=s)
        groups = [Group(prompt_ids=p, samples=[]) for p in prompts]
        for c in comps:
            g = groups[c.prompt_index]  # alternating rewards: every group teaches
            g.samples.append(Sample(list(c.token_ids), list(c.logprobs), float(len(g.samples) % 2), eng.version or 0, node_id="n"))
        hub.learner.step(groups)
        trio.run(hub.trainer.publish)
        trio.run(hub.trainer.checkpoint)
        masters[hub.learner.version] = {k: v.clone() for k, v in hub.learner.model.state_dict().items()}
    return masters


def greedy_hf(model: Any, ids: list[int], n: int, eos: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


def greedy_engine(eng: TransformersEngine, ids: list[int], n: int) -> list[int]:
    return list(eng.generate([ids], 1, n, 0.0, 1.0, seed=0)[0].token_ids)


def tree_digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


def test_export_loads_in_transformers_and_matches_the_hubs_policy(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hub = make_hub(tmp_path)
    masters = train(hub, 3)
    hub_dir = Path(hub.cfg.dir)
    hub.store.submit(HubStore.record_eval, {"step": 1, "wall_s": 1.0, "mean_reward": 0.5, "accuracy": 0.5, "n": 6}, 0.0)
    hub.store.submit(HubStore.record_eval, {"step": 3, "wall_s": 2.0, "mean_reward": 0.2, "accuracy": 0.25, "n": 6}, 0.0)
    hub.store.flush()  # written
    # while the hub is up (its store open in its own thread): the newest version, the run's publish dtype
    out = tmp_path / "latest"
    res = export(hub_dir, out)
    assert res.step == 3 and res.dtype == "bfloat16" and not res.lora
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md"} <= set(res.files)

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)  # a node computes in float32
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    eng = engine_at(hub, 3)
    n, eos = hub.cfg.max_new_tokens, hub.tok.eos_id
    assert tok.eos_token_id == eos and model.generation_config.eos_token_id == eos
    items = hub.recipe.eval_items
    assert len(items) == 6
    answers = []
    for it in items:
        ids = list(it.ids)
        # the exported tokenizer gives the ids the hub sent (built-in tasks put <bos> first)
        assert [tok.bos_token_id] + tok(it.text, add_special_tokens=False).input_ids == ids
        mine = greedy_hf(model, ids, n, eos)
        assert mine == greedy_engine(eng, ids, n), it.text
        answers.append(tok.decode(mine))
    assert len(set(answers)) >= 1 and all(isinstance(a, str) for a in answers)

    # --version of an older step, through the CLI: that step's published tensors, bit for bit
    old = tmp_path / "v1"
    assert cli_main(["hub", "export", "--dir", str(hub_dir), "--out", str(old), "--version", "1"]) == 0
    got = AutoModelForCausalLM.from_pretrained(old, local_files_only=True, dtype=torch.bfloat16).state_dict()
    want = published(hub, 1)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert not all(torch.equal(got[k], published(hub, 3)[k]) for k in want)  # not just any version
    # --dtype float32: the learner's master weights of that step, bit for bit
    f32 = export(hub_dir, tmp_path / "v2f", version=2, dtype="float32")
    sd = load_file(f32.out / "model.safetensors")
    assert all(torch.equal(sd[k], masters[2][k]) for k in sd) and len(sd) >= len(masters[2]) - 1  # tied lm_head saved once
    # --best-eval: step 1 evaluated best
    assert export(hub_dir, tmp_path / "best", best_eval=True).step == 1
    card = (tmp_path / "best" / "README.md").read_text()
    assert "version 1" in card and "| 1 | 0.5 | 0.5 | 6 | **exported** |" in card and "copy_reward" in card
    assert 'task = "copy"' in card  # the run's hub.toml

    # after the hub stopped: exports still work and never change the hub directory
    hub.store.close()
    before = tree_digest(hub_dir)
    sharded = export(hub_dir, tmp_path / "sharded", version=2, max_shard_size="100KB")
    assert "model.safetensors.index.json" in sharded.files
    again = AutoModelForCausalLM.from_pretrained(sharded.out, local_files_only=True, dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(again[k], published(hub, 2)[k]) for k in again)
    with pytest.raises(ExportError, match="no checkpoint"):
        export(hub_dir, tmp_path / "nope", version=0)  # pruned: the newest 3 are kept
    with pytest.raises(ExportError, match="not empty"):
        export(hub_dir, out)
    with pytest.raises(ExportError, match="LoRA run"):
        export(hub_dir, tmp_path / "m", merge=True)
    with pytest.raises(ExportError, match="would replace the hub directory"):
        export(hub_dir, tmp_path, force=True)
    assert tree_digest(hub_dir) == before


def test_choose_step() -> None:
    evals = [{"step": 0, "accuracy": 0.0, "mean_reward": 0.1}, {"step": 5, "accuracy": 0.5, "mean_reward": 0.6},
             {"step": 10, "accuracy": 0.5, "mean_reward": 0.7}, {"step": 15, "accuracy": 0.9, "mean_reward": 0.9}]
    assert choose_step([10, 20], evals, None, False)[0] == 20
    assert choose_step([5, 10, 20], evals, None, True)[0] == 10  # ties on accuracy go to the mean reward
    step, note = choose_step([5, 10, 20], evals, None, True)
    assert "step 15, has no checkpoint" in note
    with pytest.raises(ExportError, match="no evaluated step"):
        choose_step([20], evals, None, True)
    with pytest.raises(ExportError, match="no checkpoint yet"):
        choose_step([], evals, None, False)


@pytest.mark.slow
def test_lora_export_adapter_and_merged(tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from echo2.models import lora

    hub = make_hub(tmp_path, tiny_hidden=64, lora=LoraSpec(r=2, alpha=4), lr=5e-2)
    train(hub, 2)
    hub_dir = Path(hub.cfg.dir)
    hub.store.close()
    res = export(hub_dir, tmp_path / "ad")
    assert res.lora and {"adapter_config.json", "adapter_model.safetensors"} <= set(res.files)
    conf = json.loads((res.out / "adapter_config.json").read_text())
    assert conf["r"] == 2 and conf["lora_alpha"] == 4 and conf["peft_type"] == "LORA"
    assert Path(conf["base_model_name_or_path"]) == (res.out / "base").resolve()
    pub = published(hub, 2)
    adapters = {k: v for k, v in pub.items() if k.startswith(lora.ADAPTER_PREFIX)}
    saved = load_file(res.out / "adapter_model.safetensors")
    assert len(saved) == len(adapters) > 0
    for k, v in saved.items():  # peft's names drop the adapter name: ...lora_A.weight
        inner = k.removeprefix("base_model.model.").replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
        assert torch.equal(v, adapters[lora.ADAPTER_PREFIX + inner]), k
    # base + adapter through peft: the greedy answers of the hub's version 2
    base = AutoModelForCausalLM.from_pretrained(res.out / "base", local_files_only=True, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, res.out, local_files_only=True).eval()
    eng = engine_at(hub, 2)
    n, eos = hub.cfg.max_new_tokens, hub.tok.eos_id
    for it in hub.recipe.eval_items:
        assert greedy_hf(model, list(it.ids), n, eos) == greedy_engine(eng, list(it.ids), n)
    # --merge: the merged full model at the top, the adapter beside it
    merged = export(hub_dir, tmp_path / "merged", merge=True, dtype="float32")
    assert "adapter/adapter_model.safetensors" in merged.files and "model.safetensors" in merged.files
    full = AutoModelForCausalLM.from_pretrained(merged.out, local_files_only=True, dtype=torch.float32)
    ids = torch.tensor([list(hub.recipe.eval_items[0].ids)])
    with torch.no_grad():
        a, b = full(ids).logits, model(ids).logits
    # merged in float32 from the master weights vs bf16-published adapters applied unmerged
    assert torch.allclose(a, b, atol=5e-2), (a - b).abs().max()


def test_export_reads_a_sharded_checkpoint(tmp_path: Path) -> None:
    """A checkpoint of sharded learner ranks (step-N.pt naming a step-N.dcp folder, shardckpt.py)
    exports the same weights as the learner held; written here by one process, which DCP reads
    like N ranks' shards."""
    from safetensors.torch import load_file

    from echo2.learner_hub import shardckpt

    hub = make_hub(tmp_path)
    masters = train(hub, 1)
    learner: Any = hub.learner
    learner.save_sharded = lambda folder: shardckpt.save(learner.model, learner.optimizer, folder)  # what each rank runs
    trio.run(hub.trainer.checkpoint)
    hub.store.close()
    ck = torch.load(Path(hub.cfg.dir) / "checkpoints" / "step-1.pt", weights_only=True)
    assert ck["dcp"] == "step-1.dcp" and "model" not in ck
    res = export(Path(hub.cfg.dir), tmp_path / "out", dtype="float32")
    sd = load_file(res.out / "model.safetensors")
    assert res.step == 1 and all(torch.equal(sd[k], masters[1][k]) for k in sd)
