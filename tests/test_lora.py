"""Issue 17 item 3: LoRA policies. Real tiny model, real peft, real learner, publisher, packing,
engine and verifier; only the rows are made here (by the real engine, as a node makes them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from echo2.learner_hub.config import ConfigError, HubConfig, LoraSpec, check_lora, load_config
from echo2.learner_hub.intake import TaskBook
from echo2.learner_hub.publisher import PolicyPublisher, StarSender
from echo2.learner_hub.rows import Group, Sample
from echo2.learner_hub.storeworker import StoreWorker
from echo2.learner_hub.training import Trainer, build_learner
from echo2.models import lora, statedict
from echo2.models.engine import TransformersEngine
from echo2.protocol.identity import Identity

LORA = LoraSpec(r=2, alpha=4)


def lora_cfg(tmp_path: Path, **kw: Any) -> HubConfig:
    base: dict[str, Any] = dict(dir=str(tmp_path), steps=3, prompts_per_step=2, group_size=4, max_new_tokens=6,
                                tiny_hidden=64, lora=LORA, lr=5e-2, chunk_bytes=16 * 1024, full_every=3)
    return HubConfig(**(base | kw))


def make_trainer(tmp_path: Path, **kw: Any) -> Trainer:
    cfg = lora_cfg(tmp_path, **kw)
    learner, _tok, mc, arts = build_learner(cfg)
    publisher = PolicyPublisher(Identity.generate(), mc, arts, cfg)
    trainer = Trainer(cfg, learner, publisher, StarSender(publisher), StoreWorker(tmp_path), TaskBook())
    trio.run(trainer.publish)  # version 0
    return trainer


def weights(trainer: Trainer, version: int) -> dict[str, torch.Tensor]:
    pub = trainer.publisher.recent[version]
    return statedict.assemble(pub.packed.manifest, pub.packed.raw_chunks)


def node_rows(trainer: Trainer, eng: TransformersEngine, node: str, seed: int, n_prompts: int = 2) -> list[Group]:
    """Groups as a node makes them with what ``eng`` holds; rewards alternate so every group teaches."""
    tok = eng.tokenizer
    assert tok is not None and eng.version is not None
    prompts = [tok.encode(f"{seed}{i}=", add_bos=True) for i in range(n_prompts)]
    cfg = trainer.cfg
    comps = eng.generate(prompts, cfg.group_size, cfg.max_new_tokens, cfg.temperature, 1.0, seed)
    groups = [Group(prompt_ids=p, samples=[]) for p in prompts]
    for c in comps:
        g = groups[c.prompt_index]
        g.samples.append(Sample(list(c.token_ids), list(c.logprobs), float(len(g.samples) % 2), eng.version, node_id=node))
    return groups


def load(eng: TransformersEngine, trainer: Trainer, version: int) -> None:
    m = trainer.publisher.recent[version].packed.manifest
    eng.load_version(version, m.model_config, dict(m.artifacts), weights(trainer, version))


def plain_base(trainer: Trainer) -> torch.nn.Module:
    """The base model alone, without peft: the learner's base tensors under publication names."""
    from echo2.models import spec as modelspec

    plain = modelspec.model_from_config(trainer.publisher.model_config)
    sd = lora.published_names(trainer.learner.model.state_dict())
    plain.load_state_dict({k: v for k, v in sd.items() if not k.startswith(lora.ADAPTER_PREFIX)}, strict=True)
    return plain


# --- configuration ---------------------------------------------------------------------------------

def test_lora_table_parses_and_defaults_off(tmp_path: Path) -> None:
    assert not HubConfig().lora.enabled
    p = tmp_path / "hub.toml"
    p.write_text('[hub]\nlora = {r = 16, alpha = 32, target_modules = ["q_proj", "v_proj"], dropout = 0.0}\n')
    cfg = load_config(p)
    assert cfg.lora == LoraSpec(r=16, alpha=32, target_modules=["q_proj", "v_proj"], dropout=0.0)
    p.write_text("[hub]\nlora = {r = 8}\n")
    assert load_config(p).lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.parametrize(("table", "words"), [
    ("{r = -1}", "lora = {r = -1}: must be a table"),
    ("{r = 8, dropout = 0.1}", "lora.dropout = 0.1"),
    ('{r = 8, target_modules = []}', "at least one module"),
    ('{r = 8, target_modules = ["all-linear", "q_proj"]}', "stands alone"),
    ("{r = 8, rank = 3}", "unknown key lora.rank"),
])
def test_lora_refusals(tmp_path: Path, table: str, words: str) -> None:
    p = tmp_path / "hub.toml"
    p.write_text(f"[hub]\nlora = {table}\n")
    with pytest.raises(ConfigError, match=words.replace("{", r"\{").replace("[", r"\[")):
        load_config(p)


def test_lora_with_several_learner_ranks_is_refused() -> None:
    cfg = HubConfig(lora=LORA)
    cfg.learner_procs = 2  # type: ignore[attr-defined]  # the FSDP2 setting, on another branch
    with pytest.raises(ConfigError, match="learner_procs = 2"):
        check_lora(cfg)


# --- the learner -----------------------------------------------------------------------------------

def test_lora_learner_trains_only_the_adapters(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path)
    learner = trainer.learner
    before = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
    adapters = {k for k in before if lora.is_adapter_key(k)}
    assert adapters and len(adapters) < len(before)
    opt_params = [p for g in learner.optimizer.param_groups for p in g["params"]]
    named = {id(p): n for n, p in learner.model.named_parameters()}
    assert opt_params and all(lora.is_adapter_key(named[id(p)]) for p in opt_params)
    eng = TransformersEngine(device="cpu")
    load(eng, trainer, 0)
    stats = learner.step(node_rows(trainer, eng, "n", seed=1))
    assert stats.active_rows > 0
    after = learner.model.state_dict()
    for k, v in before.items():
        if k in adapters:
            continue
        assert torch.equal(v, after[k]), k  # the base, bit for bit
    # lora_B starts at zero and lora_A random: the step moves B (and through it the policy)
    assert any(not torch.equal(before[k], after[k]) for k in adapters)
    trainer.store.close()


def test_lora_kl_reference_is_the_base_with_adapters_off(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, kl_coef=0.1)
    learner = trainer.learner
    assert isinstance(learner.ref_model, lora.AdapterOff)
    eng = TransformersEngine(device="cpu")
    load(eng, trainer, 0)
    rows = node_rows(trainer, eng, "n", seed=2)
    learner.step(rows)
    learner.step(rows)
    pairs = [(g.prompt_ids, s.token_ids) for g in rows for s in g.samples]
    ref = learner.reference_logprobs(learner.ref_model, pairs)
    cur = learner.reference_logprobs(learner.model, pairs)
    # a plain copy of the base model (publication names, adapters dropped) computes the reference
    want = learner.reference_logprobs(plain_base(trainer), pairs)
    assert max(abs(a - b) for r, w in zip(ref, want, strict=True) for a, b in zip(r, w, strict=True)) < 1e-5
    assert max(abs(a - b) for r, w in zip(ref, cur, strict=True) for a, b in zip(r, w, strict=True)) > 1e-4
    assert learner.model.training is False and any(p.requires_grad for p in learner.model.parameters())
    trainer.store.close()


# --- publication, nodes, verification --------------------------------------------------------------

def test_lora_publish_apply_round_trip_and_bytes(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, publish_dtype="float32")
    learner, pub = trainer.learner, trainer.publisher
    eng = TransformersEngine(device="cpu")
    load(eng, trainer, 0)
    v0 = pub.recent[0].packed
    assert lora.ADAPTER_CONFIG in v0.manifest.artifacts
    full_enc = sum(len(e) for e in v0.encoded)
    for v in (1, 2, 3):  # 3 is a snapshot version (full_every = 3)
        learner.step(node_rows(trainer, eng, "n", seed=10 + v))
        trio.run(trainer.publish)
        load(eng, trainer, v)
        packed = pub.recent[v].packed
        enc = sum(len(e) for e in packed.encoded)
        # the base's chunks are the very chunks of version 0 (content addressed: never fetched again)
        base_idx = [c.index for c in packed.manifest.chunks if c.raw_hash in {x.raw_hash for x in v0.manifest.chunks}]
        assert len(base_idx) >= len(packed.manifest.chunks) - 2, (v, len(base_idx), len(packed.manifest.chunks))
        assert enc <= 0.05 * full_enc, (v, enc, full_enc)
    # the node's engine, on the published version, gives the learner's own log-probs
    rows = node_rows(trainer, eng, "n", seed=99)
    pairs = [(g.prompt_ids, s.token_ids) for g in rows for s in g.samples]
    want = learner.recompute_logprobs_batch(pairs)
    got = [s.logprobs for g in rows for s in g.samples]
    assert max(abs(a - b) for r, w in zip(got, want, strict=True) for a, b in zip(r, w, strict=True)) < 1e-4
    # and the adapter mattered: the base alone differs
    base_lp = learner.reference_logprobs(plain_base(trainer), pairs)
    assert max(abs(a - b) for r, w in zip(base_lp, want, strict=True) for a, b in zip(r, w, strict=True)) > 1e-3
    trainer.store.close()


def test_lora_verification_passes_honest_rows_and_fails_forged(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path)  # bf16 publication, the default
    eng = TransformersEngine(device="cpu")
    load(eng, trainer, 0)
    trainer.learner.step(node_rows(trainer, eng, "n", seed=3))
    trio.run(trainer.publish)
    load(eng, trainer, 1)
    honest = node_rows(trainer, eng, "honest", seed=4)
    forged = node_rows(trainer, eng, "liar", seed=5)
    s = forged[0].samples[1]
    s.logprobs = [x - 0.5 for x in s.logprobs]
    # a node that ran the base without the adapter, claiming version 1
    eng0 = TransformersEngine(device="cpu")
    load(eng0, trainer, 0)
    stale = node_rows(trainer, eng0, "no-adapter", seed=6)
    for g in stale:
        for smp in g.samples:
            smp.version = 1
    out = trainer.verifier.check(honest + forged + stale)
    assert out.failed == {"liar", "no-adapter"}, out.worst
    assert out.worst["honest"] < 1e-5 and out.kept == [0, 1]
    trainer.store.close()


def test_lora_version_refused_by_a_node_when_the_adapter_config_is_bad(tmp_path: Path) -> None:
    from echo2.protocol.errors import ManifestError

    trainer = make_trainer(tmp_path)
    m = trainer.publisher.recent[0].packed.manifest
    eng = TransformersEngine(device="cpu")
    bad = dict(m.artifacts) | {lora.ADAPTER_CONFIG: b'{"r": 0, "lora_alpha": 4, "target_modules": ["q_proj"]}'}
    with pytest.raises(ManifestError, match="r must be"):
        eng.load_version(0, m.model_config, bad, weights(trainer, 0))
    other = dict(m.artifacts) | {lora.ADAPTER_CONFIG: b'{"r": 3, "lora_alpha": 4, "target_modules": ["q_proj"]}'}
    with pytest.raises(ManifestError, match="does not fit"):
        eng.load_version(0, m.model_config, other, weights(trainer, 0))
    assert eng.model is None  # nothing half-loaded
    trainer.store.close()


def test_vllm_adapter_names_are_peft_saved_names(tmp_path: Path) -> None:
    """The vLLM engine's adapter directory uses peft's saved names: what peft itself loads back."""
    from peft import PeftModel

    from echo2.models import spec as modelspec
    from echo2.models.engine_vllm import split_lora, vllm_lora_rank

    trainer = make_trainer(tmp_path)
    sd = weights(trainer, 0)
    base, adapter = split_lora(sd)
    assert adapter and all(k.startswith("base_model.model.") and ".default." not in k for k in adapter)
    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_bytes(trainer.publisher.artifacts[lora.ADAPTER_CONFIG])
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in adapter.items()}, str(d / "adapter_model.safetensors"))
    plain = modelspec.model_from_config(trainer.publisher.model_config)
    plain.load_state_dict(base, strict=True)
    loaded = PeftModel.from_pretrained(plain, str(d)).get_base_model()
    got = lora.published_names(loaded.state_dict())
    assert set(got) == set(sd) and all(torch.equal(got[k].to(sd[k].dtype), sd[k]) for k in sd)
    assert vllm_lora_rank(2) == 8 and vllm_lora_rank(16) == 16
    trainer.store.close()


_HAS_VLLM = __import__("importlib").util.find_spec("vllm") is not None and torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_VLLM, reason="needs a CUDA GPU and vllm")
def test_vllm_engine_applies_lora_versions(tmp_path: Path) -> None:
    from echo2.models.engine_vllm import VLLMEngine

    trainer = make_trainer(tmp_path, publish_dtype="float32")
    eng = TransformersEngine(device="cpu")
    load(eng, trainer, 0)
    trainer.learner.step(node_rows(trainer, eng, "n", seed=1))
    trio.run(trainer.publish)
    veng = VLLMEngine(dtype=torch.float32, gpu_memory_utilization=0.3, enforce_eager=True)
    for v in (0, 1):
        m = trainer.publisher.recent[v].packed.manifest
        veng.load_version(v, m.model_config, dict(m.artifacts), weights(trainer, v))
        assert veng.version == v
    rows = node_rows(trainer, eng, "cpu", seed=2)  # eng still holds v0: compare vLLM on v1 with the verifier
    prompts = [g.prompt_ids for g in rows]
    comps = veng.generate(prompts, trainer.cfg.group_size, trainer.cfg.max_new_tokens, 1.0, 1.0, 3)
    groups = [Group(prompt_ids=p, samples=[]) for p in prompts]
    for c in comps:
        groups[c.prompt_index].samples.append(Sample(list(c.token_ids), list(c.logprobs), 0.0, 1, node_id="vllm"))
    out = trainer.verifier.check(groups)
    assert out.worst["vllm"] < 1e-3, out.worst
    trainer.store.close()


def test_lora_checkpoint_resumes_adapters_and_publishes_the_same_bytes(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path / "a")
    eng = TransformersEngine(device="cpu")
    load(eng, trainer, 0)
    rows = node_rows(trainer, eng, "n", seed=7)
    trainer.learner.step(rows)
    state = trainer.learner.checkpoint_state()
    again = make_trainer(tmp_path / "b")
    again.learner.load_checkpoint_state(state)
    a, b = trainer.learner.state_dict_for_publish(), again.learner.state_dict_for_publish()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # and both take the same next step (optimizer moments of the adapters came back too)
    trainer.learner.step(rows)
    again.learner.step(rows)
    a, b = trainer.learner.state_dict_for_publish(), again.learner.state_dict_for_publish()
    assert all(torch.equal(a[k], b[k]) for k in a)
    trainer.store.close()
    again.store.close()


def test_bench_pack_lora_case(tmp_path: Path) -> None:
    import argparse
    import json

    from echo2.bench.pack_lora import run_lora

    out = tmp_path / "pack.json"
    args = argparse.Namespace(model="tiny", lora=4, lr=1e-3, warmup=1, chunk_bytes=64 * 1024, level=1, no_split=False,
                              seed=0, json=str(out))
    assert run_lora(args) == 0
    rep = json.loads(out.read_text())
    assert rep["equal"] and rep["adapter_params"] > 0
    # 64 KiB chunks: the adapter is the buffer's tail, the base's chunks are version 0's
    assert rep["v2"]["chunks_new"] <= 2 < rep["v2"]["chunks"]
    assert rep["max_ratio"] <= 0.05, rep


def test_lora_version_over_a_plain_parent_packs_and_round_trips(tmp_path: Path) -> None:
    """A LoRA version whose parent is a plain full version (another layout: the adapter tensors
    are extra) packs without error, and decodes bit for bit against that parent."""
    from echo2.protocol import packing

    trainer = make_trainer(tmp_path)
    sd = weights(trainer, 0)
    plain = {k: v for k, v in sd.items() if not k.startswith(lora.ADAPTER_PREFIX)}
    common: dict[str, Any] = dict(chunk_size=16 * 1024, model_config=trainer.publisher.model_config, artifacts={})
    parent = statedict.pack_version(plain, version=0, parent=None, **common)
    child = statedict.pack_version(sd, version=1, parent=parent, keep_unchanged=True, **common)
    m = child.manifest
    raws = [packing.decode_chunk(c, e, parent.raw_chunks[c.index] if c.encoding == "delta" else None)
            for c, e in zip(m.chunks, child.encoded, strict=True)]
    out = statedict.assemble(m, raws)
    assert set(out) == set(sd) and all(torch.equal(out[k], sd[k]) for k in sd)
    trainer.store.close()
