"""The learner's memory plan (learner_hub/memory.py): exact state terms against real models,
sharding arithmetic, LoRA counts against peft's own, and the start-up refusal."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from echo2.learner_hub import memory
from echo2.learner_hub.config import HubConfig
from echo2.learner_hub.training import learner_memory
from echo2.models import spec as modelspec


def _tiny_json(hidden: int = 64, layers: int = 2) -> str:
    conf = modelspec.tiny_config(hidden=hidden, layers=layers)
    return modelspec.artifacts_for(conf, modelspec.tokenizer_json())[0]


def test_count_params_matches_the_built_model() -> None:
    mc = _tiny_json(128, 3)
    shape = memory.count_params(mc)
    model = modelspec.model_from_config(mc)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.trainable == shape.params
    assert shape.layers == 3 and shape.hidden == 128
    assert shape.largest_layer_params == sum(p.numel() for p in model.model.layers[0].parameters())


def test_lora_count_matches_peft() -> None:
    peft = pytest.importorskip("peft")
    mc = _tiny_json(64, 2)
    targets = ["q_proj", "v_proj", "o_proj"]
    shape = memory.count_params(mc, {"r": 8, "target_modules": targets})
    model = peft.get_peft_model(
        modelspec.model_from_config(mc), peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets)
    )
    assert shape.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    # all-linear: every linear but the head, as peft does
    shape_all = memory.count_params(mc, {"r": 4, "target_modules": "all-linear"})
    model_all = peft.get_peft_model(
        modelspec.model_from_config(mc), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    )
    assert shape_all.trainable == sum(p.numel() for p in model_all.parameters() if p.requires_grad)


def test_sharding_divides_the_state() -> None:
    shape = memory.count_params(_tiny_json(256, 4))
    one, two = memory.plan(shape, ranks=1), memory.plan(shape, ranks=2)
    state = ("parameters", "gradients", "adamw")
    s1 = sum(one.rank_terms[k] for k in state)
    s2 = sum(two.rank_terms[k] for k in state)
    assert s1 == 16 * shape.params
    assert s2 <= 0.6 * s1
    # LoRA keeps the base's parameters but only the adapters' gradients and moments
    lo = memory.plan(dataclasses.replace(shape, trainable=shape.params // 100), ranks=1, lora=True, kl_reference=True)
    assert lo.rank_terms["adamw"] == 8 * (shape.params // 100) and "kl_reference" not in lo.rank_terms
    assert memory.plan(shape, kl_reference=True).rank_terms["kl_reference"] == 4 * shape.params


def test_step_tokens_cap_the_activations() -> None:
    shape = memory.count_params(_tiny_json())
    big = memory.plan(shape, micro_batch_tokens=16384)
    capped = memory.plan(shape, micro_batch_tokens=16384, step_tokens=1024)
    assert capped.rank_terms["logits"] * 16 == big.rank_terms["logits"]


def test_check_refuses_state_and_warns_on_activations() -> None:
    shape = memory.count_params(_tiny_json())
    mem = memory.plan(shape, micro_batch_tokens=4096)
    state = mem.per_rank - sum(mem.rank_terms[k] for k in memory.ACTIVATION_TERMS)
    assert memory.check(mem, mem.per_rank) is None
    warn = memory.check(mem, state + 1, micro_batch_tokens=4096)
    assert warn is not None and "micro_batch_tokens =" in warn
    with pytest.raises(memory.LearnerMemoryError, match="learner_procs"):
        memory.check(mem, state - 1)


def test_hub_refuses_a_model_no_rank_can_hold() -> None:
    # ~10 B parameters counted on the meta device: 150+ GB of AdamW state on a 24 GB machine
    cfg = HubConfig(model="tiny", tiny_hidden=4096, tiny_layers=48)
    with pytest.raises(memory.LearnerMemoryError, match="model's state alone"):
        learner_memory(cfg)
    # the operator may know better
    mem = learner_memory(dataclasses.replace(cfg, memory_check=False))
    assert mem.per_rank > 100 * memory.GiB
    assert torch.get_default_device().type == "cpu"  # the meta device context did not leak
