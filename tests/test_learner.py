"""The GRPO learner over a real tiny transformers model, checked against the real sampling engine."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import torch

from echo2.learner_hub.envs import TaskEnv, make_env
from echo2.learner_hub.learner import Group, Learner, Sample
from echo2.models import spec as modelspec
from echo2.models.engine import TransformersEngine


def _setup(seed: int = 0, hidden: int = 64, layers: int = 2) -> tuple[Any, str, dict[str, bytes], Any]:
    torch.manual_seed(seed)
    cfg = modelspec.tiny_config(hidden=hidden, layers=layers)
    mc, arts = modelspec.artifacts_for(cfg, modelspec.tokenizer_json())
    model = modelspec.model_from_config(mc)
    return model, mc, arts, modelspec.load_tokenizer(arts)


def _rollout(
    learner: Learner,
    engine: TransformersEngine,
    env: TaskEnv,
    tok: Any,
    mc: str,
    arts: dict[str, bytes],
    n_prompts: int,
    group: int,
    rng: random.Random,
    seed: int,
) -> list[Group]:
    engine.load_version(learner.version, mc, arts, learner.state_dict_for_publish())
    items = env.sample_prompts(n_prompts, rng)
    prompts = [tok.encode(it.text, add_bos=True) for it in items]
    comps = engine.generate(prompts, group, env.max_new_tokens, learner.temperature, 1.0, seed)
    groups = [Group(prompt_ids=p, samples=[]) for p in prompts]
    for c in comps:
        stopped = c.finish_reason == "stop"
        text = tok.decode(c.token_ids[:-1] if stopped else c.token_ids)
        r = env.reward(items[c.prompt_index], text, c.finish_reason)
        groups[c.prompt_index].samples.append(
            Sample(list(c.token_ids), list(c.logprobs), r, learner.version, node_id="n1")
        )
    return groups


def test_recompute_matches_engine_logprobs() -> None:
    model, mc, arts, tok = _setup()
    for temp in (1.0, 0.7):
        learner = Learner(model, tok, temperature=temp)
        eng = TransformersEngine(device="cpu")
        eng.load_version(0, mc, arts, learner.state_dict_for_publish())
        # prompts of different lengths exercise the engine's left padding and our right padding
        prompts = [tok.encode(t, add_bos=True) for t in ("12=", "7=", "hello world=")]
        comps = eng.generate(prompts, 3, 6, temp, 1.0, 5)
        rows = [(prompts[c.prompt_index], c.token_ids) for c in comps]
        batch = learner.recompute_logprobs_batch(rows)
        worst = 0.0
        for c, b in zip(comps, batch, strict=True):
            one = learner.recompute_logprobs(prompts[c.prompt_index], c.token_ids)
            ref = modelspec.teacher_forced_logprobs(learner.model, prompts[c.prompt_index], c.token_ids, temp)
            assert len(one) == len(c.logprobs) == len(b)
            for x, y, z, w in zip(one, c.logprobs, b, ref, strict=True):
                worst = max(worst, abs(x - y), abs(z - y), abs(w - y))
        assert worst < 1e-4, worst


def test_step_changes_weights_and_reports_stats() -> None:
    model, mc, arts, tok = _setup()
    learner = Learner(model, tok, lr=1e-3)
    eng = TransformersEngine(device="cpu")
    env = make_env("copy")
    before = {k: v.clone() for k, v in learner.state_dict_for_publish().items()}
    groups = _rollout(learner, eng, env, tok, mc, arts, 4, 4, random.Random(0), 1)
    # make sure the batch carries a learning signal whatever was sampled
    groups[0].samples[0].reward = 1.0
    st = learner.step(groups)
    assert learner.version == 1 and st.version == 1
    after = learner.state_dict_for_publish()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (
        st.sequences == 16
        and st.groups == 4
        and st.tokens == sum(len(s.token_ids) for g in groups for s in g.samples)
    )
    # on-policy rollouts: ratio 1, nothing clipped, node log-probs verified
    assert st.ratio_mean == pytest.approx(1.0, abs=1e-4)
    assert st.clip_frac == 0.0
    assert st.mismatch_rows == 16 and st.mismatch_max < 1e-4
    assert set(st.mismatch_by_node) == {"n1"}
    assert st.staleness_mean == 0.0 and st.seconds > 0

    # the same (now stale) groups again: rows are one version behind, not verified, ratio != 1
    st2 = learner.step(groups)
    assert learner.version == 2 and st2.staleness_mean == 1.0 and st2.mismatch_rows == 0
    assert st2.ratio_mean != pytest.approx(1.0, abs=1e-7)


def test_equal_rewards_do_not_move_weights() -> None:
    model, mc, arts, tok = _setup()
    learner = Learner(model, tok, lr=1e-3)
    eng = TransformersEngine(device="cpu")
    groups = _rollout(learner, eng, make_env("copy"), tok, mc, arts, 2, 4, random.Random(0), 2)
    for g in groups:
        for s in g.samples:
            s.reward = 0.5
    before = learner.state_dict_for_publish()
    st = learner.step(groups)
    assert st.zero_adv_groups == 2 and st.loss == 0.0 and st.grad_norm == 0.0
    after = learner.state_dict_for_publish()
    assert all(torch.equal(before[k], after[k]) for k in before)  # AdamW, no weight decay
    assert learner.version == 1


def test_micro_batches_give_the_full_batch_step() -> None:
    model, mc, arts, tok = _setup()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    eng = TransformersEngine(device="cpu")
    a = Learner(model, tok, max_grad_norm=0.0)
    # SGD(lr=1): the weight change is the gradient itself (Adam's first step is ~lr*sign(g),
    # which flips on rounding noise in near-zero components)
    a.optimizer = torch.optim.SGD(a.model.parameters(), lr=1.0)
    groups = _rollout(a, eng, make_env("reverse"), tok, mc, arts, 3, 4, random.Random(1), 3)
    groups[0].samples[1].reward += 0.5
    a.step(groups)
    m2 = modelspec.model_from_config(mc)
    m2.load_state_dict(init)
    b = Learner(m2, tok, max_grad_norm=0.0, micro_batch_tokens=20)  # forces several micro-batches
    b.optimizer = torch.optim.SGD(b.model.parameters(), lr=1.0)
    assert len(list(b._micro_batches([(g.prompt_ids, s.token_ids) for g in groups for s in g.samples]))) > 2
    b.step(groups)
    sa, sb = a.state_dict_for_publish(), b.state_dict_for_publish()
    for k in sa:
        assert torch.allclose(sa[k], sb[k], atol=1e-6), k


def test_publish_dtype_and_checkpoint_roundtrip() -> None:
    model, mc, arts, tok = _setup()
    learner = Learner(model, tok, lr=1e-3, publish_dtype=torch.bfloat16)
    pub = learner.state_dict_for_publish()
    assert all(
        v.dtype == torch.bfloat16 and v.is_contiguous() and v.device.type == "cpu" for v in pub.values()
    )
    eng = TransformersEngine(device="cpu")
    groups = _rollout(learner, eng, make_env("copy"), tok, mc, arts, 2, 4, random.Random(2), 4)
    groups[0].samples[0].reward = 1.0
    learner.step(groups)
    ck = learner.checkpoint_state()
    learner.step(groups)
    want = learner.checkpoint_state()["model"]

    m2 = modelspec.model_from_config(mc)  # different random init
    other = Learner(m2, tok, lr=1e-3)
    other.load_checkpoint_state(ck)
    assert other.version == 1
    other.step(groups)
    got = other.checkpoint_state()["model"]
    assert other.version == 2
    for k in want:
        assert torch.allclose(want[k], got[k], atol=1e-6), k


def test_bad_input() -> None:
    model, _, _, tok = _setup()
    learner = Learner(model, tok)
    with pytest.raises(ValueError):
        learner.step([])
    with pytest.raises(ValueError):
        learner.step([Group([5, 6], [Sample([7, 8], [-1.0], 1.0, 0)])])
    with pytest.raises(ValueError):
        Learner(model, tok, kl_coef=0.1)


@pytest.mark.slow
def test_copy_task_learns() -> None:
    """GRPO from random init on the copy task (BRIEF section 10 settings, lr as tuned)."""
    torch.set_num_threads(1)
    model, mc, arts, tok = _setup(seed=0, hidden=128, layers=2)
    learner = Learner(model, tok, lr=5e-4, seed=0)
    eng = TransformersEngine(device="cpu")
    env = make_env("copy")
    rng = random.Random(0)
    curve: list[float] = []
    t0 = time.perf_counter()
    for step in range(300):
        groups = _rollout(learner, eng, env, tok, mc, arts, 16, 16, rng, step)
        st = learner.step(groups)
        curve.append(st.reward_mean)
        assert st.mismatch_max < 1e-4
    first, last = sum(curve[:20]) / 20, sum(curve[-20:]) / 20
    print(f"copy: first20={first:.3f} last20={last:.3f} wall={time.perf_counter() - t0:.1f}s")
    assert last >= 0.4 and last >= 2 * first
