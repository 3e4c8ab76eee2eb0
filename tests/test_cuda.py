"""The learner and the transformers engine on a CUDA GPU: the paths a hub or a node on a GPU
machine takes by default (``learner_device = "auto"``, engine device ``auto``). Skipped where
torch sees no CUDA device; run on a GPU machine with ``python -m pytest tests/test_cuda.py``."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from echo2.learner_hub.config import HubConfig
from echo2.learner_hub.learner import Group, Learner, Sample
from echo2.learner_hub.training import build_learner
from echo2.models import spec as modelspec
from echo2.models.engine import TransformersEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _tiny(seed: int = 0) -> tuple[torch.nn.Module, str, dict[str, bytes], object]:
    torch.manual_seed(seed)
    mc, arts = modelspec.artifacts_for(modelspec.tiny_config(hidden=64, layers=2), modelspec.tokenizer_json())
    return modelspec.model_from_config(mc), mc, arts, modelspec.load_tokenizer(arts)


def _groups(model: torch.nn.Module, vocab: int, pad_id: int, seed: int = 0) -> list[Group]:
    rng = random.Random(seed)
    out = []
    for _ in range(4):
        prompt = [rng.randrange(3, vocab) for _ in range(8)]
        comps = [[rng.randrange(3, vocab) for _ in range(12)] for _ in range(4)]
        with torch.no_grad():
            lp, _ = modelspec.teacher_forced_batch(model, [(prompt, c) for c in comps], pad_id=pad_id, temperature=1.0)
        out.append(Group(prompt_ids=prompt, samples=[
            Sample(c, [float(x) for x in lp[i].tolist()], float(i % 2), 0, node_id="n1") for i, c in enumerate(comps)]))
    return out


def test_learner_step_on_cuda_equals_cpu() -> None:
    model, _mc, _arts, tok = _tiny()
    groups = _groups(model, int(tok.vocab_size), tok.pad_id)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 against fp32: TF32 would cost ~1e-3 relative
    torch.backends.cudnn.allow_tf32 = False
    cpu = Learner(copy.deepcopy(model), tok, lr=1e-3, device="cpu")
    gpu = Learner(copy.deepcopy(model), tok, lr=1e-3, device="cuda:0")
    assert next(gpu.model.parameters()).is_cuda
    a, b = cpu.step(groups), gpu.step(groups)
    assert b.mismatch_max < 1e-4  # the behaviour log-probs (computed on the CPU) verify on the GPU
    assert abs(a.loss - b.loss) <= 1e-4 * max(1.0, abs(a.loss))
    assert abs(a.grad_norm - b.grad_norm) <= 1e-3 * a.grad_norm
    pa, pb = cpu.state_dict_for_publish(), gpu.state_dict_for_publish()
    assert all(t.device.type == "cpu" for t in pb.values())  # publication leaves the GPU
    worst = max(float((pa[k].float() - pb[k].float()).abs().max()) for k in pa)
    assert worst < 1e-2, worst  # bf16 publication of weights one AdamW step apart


def test_engine_on_cuda_logprobs_match_teacher_forced() -> None:
    model, mc, arts, tok = _tiny(1)
    eng = TransformersEngine(device="auto")
    assert eng.device.type == "cuda"
    eng.load_version(0, mc, arts, model.state_dict())
    prompts = [tok.encode(t, add_bos=True) for t in ("1+2=", "12+345=", "hello, world: ")]
    comps = eng.generate(prompts, 4, 16, 1.0, 1.0, 7)
    assert len(comps) == 12
    worst = 0.0
    for c in comps:
        ref = modelspec.teacher_forced_logprobs(model, prompts[c.prompt_index], c.token_ids, 1.0)
        worst = max(worst, max((abs(x - y) for x, y in zip(ref, c.logprobs, strict=True)), default=0.0))
    assert worst < 1e-3, worst  # GPU sampling against a CPU teacher-forced recompute


def test_hub_learner_takes_the_gpu_by_default() -> None:
    learner, _tok, _mc, _arts = build_learner(HubConfig())
    assert isinstance(learner, Learner)
    assert learner.device.type == "cuda"
    learner_cpu, *_ = build_learner(HubConfig(learner_device="cpu"))
    assert isinstance(learner_cpu, Learner) and learner_cpu.device.type == "cpu"
