"""The sharded learner (issue 17): 2 FSDP2 ranks over gloo against the one-process learner, on the
real tiny model, one identical batch and seed, fp32."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch

from echo2.learner_hub.distributed import RankError, ShardedLearner, split_plan
from echo2.learner_hub.learner import Group, Learner, Sample
from echo2.models import spec as modelspec

KW: dict[str, Any] = {"lr": 1e-3, "micro_batch_tokens": 64, "publish_dtype": torch.float32, "max_grad_norm": 1.0}


def _model(seed: int = 0) -> tuple[torch.nn.Module, str, Any]:
    torch.manual_seed(seed)
    mc, arts = modelspec.artifacts_for(modelspec.tiny_config(hidden=64, layers=2), modelspec.tokenizer_json())
    return modelspec.model_from_config(mc), mc, modelspec.load_tokenizer(arts)


def _groups(model: torch.nn.Module, tok: Any, n_groups: int = 6, g: int = 4, seed: int = 1) -> list[Group]:
    """Groups with varied rewards and lengths; behaviour log-probs are the model's own (fresh rows,
    version 0), nudged so the ratio is not exactly 1."""
    rng = random.Random(seed)
    out = []
    for k in range(n_groups):
        prompt = tok.encode(f"{k}{rng.randint(0, 999)}=", add_bos=True)
        samples = []
        for _ in range(g):
            comp = [rng.randint(3, 200) for _ in range(rng.randint(2, 7))]
            with torch.no_grad():
                own = modelspec.teacher_forced_batch(model, [(prompt, comp)], pad_id=tok.pad_id, temperature=1.0)[0][0]
            lp = [float(x) + rng.uniform(-0.05, 0.05) for x in own.tolist()]
            reward = 0.0 if k == 0 else float(rng.randint(0, 3))  # group 0: no signal (forward only)
            samples.append(Sample(comp, lp, reward, 0, node_id=f"n{k % 2}"))
        out.append(Group(prompt_ids=prompt, samples=samples))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def test_split_plan_pads_every_rank_to_the_same_micro_batches() -> None:
    model, _, tok = _model()
    learner = Learner(model, tok, **KW)
    plan = learner.plan(_groups(model, tok, n_groups=5))
    on, off = learner.plan_chunks(plan)
    pieces = split_plan(plan, (on, off), 3)
    assert {len(c[0]) for _, c, _ in pieces} == {-(-len(on) // 3)}
    assert {len(c[1]) for _, c, _ in pieces} == {-(-len(off) // 3)}
    seen = sorted(g for _, _, gidx in pieces for g in gidx)
    assert seen == sorted(i for c in on + off for i in c)  # every row on exactly one rank
    for sub, _, _ in pieces:
        assert sub.norm == plan.norm  # the global normaliser, not the rank's own


@pytest.mark.timeout(300)
def test_two_ranks_equal_one_process() -> None:
    model, mc, tok = _model()
    groups = _groups(model, tok)
    one = Learner(copy.deepcopy(model), tok, **KW)
    s1 = one.step(groups)
    sharded = ShardedLearner(copy.deepcopy(model), tok, mc, procs=2, **KW)
    try:
        s2 = sharded.step(groups)
        assert s2.version == s1.version == 1 == sharded.version
        assert s1.active_rows > 0 and s1.zero_adv_groups == 1
        assert abs(s2.loss - s1.loss) <= 1e-5 * abs(s1.loss)
        assert abs(s2.grad_norm - s1.grad_norm) <= 1e-5 * s1.grad_norm
        assert (s2.sequences, s2.tokens, s2.active_rows, s2.mismatch_rows) == (s1.sequences, s1.tokens, s1.active_rows, s1.mismatch_rows)
        assert s2.mismatch_max == pytest.approx(s1.mismatch_max, rel=1e-5)
        w1, w2 = one.state_dict_for_publish(), sharded.state_dict_for_publish()
        assert w1.keys() == w2.keys()
        moved = 0
        for k in w1:
            assert _rel(w2[k], w1[k]) <= 1e-5, k
            moved += int(not torch.equal(w1[k], model.state_dict()[k]))
        assert moved > 0
    finally:
        sharded.close()


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["version"] == b["version"]
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    oa, ob = a["optimizer"], b["optimizer"]
    assert [g["params"] for g in oa["param_groups"]] == [g["params"] for g in ob["param_groups"]]
    assert oa["state"].keys() == ob["state"].keys()
    for i, st in oa["state"].items():
        for name, t in st.items():
            assert torch.equal(torch.as_tensor(t), torch.as_tensor(ob["state"][i][name])), (i, name)


@pytest.mark.timeout(400)
def test_checkpoint_resumes_across_rank_counts(tmp_path: Any) -> None:
    """2 ranks -> sharded folder (each rank its shards) -> 1 process -> step-N.pt -> 2 ranks:
    weights, AdamW moments and version arrive exactly, and the resumed 2-rank step equals the
    1-process one."""
    from echo2.learner_hub import shardckpt

    model, mc, tok = _model()
    batches = [_groups(model, tok, seed=s) for s in (1, 2, 3)]
    sharded = ShardedLearner(copy.deepcopy(model), tok, mc, procs=2, **KW)
    try:
        sharded.step(batches[0])
        sharded.save_sharded(tmp_path / "step-1.dcp")
        a = sharded.checkpoint_state()  # the same state, gathered in the one-process format
    finally:
        sharded.close()
    assert len(list((tmp_path / "step-1.dcp").glob("*.distcp"))) == 2  # one file per rank
    one = Learner(copy.deepcopy(model), tok, **KW)
    shardckpt.load_into(one, tmp_path / "step-1.dcp", 1)
    _same_state(one.checkpoint_state(), a)
    one.step(batches[1])
    torch.save(one.checkpoint_state(), tmp_path / "b.pt")
    b = torch.load(tmp_path / "b.pt", weights_only=True)
    back = ShardedLearner(copy.deepcopy(model), tok, mc, procs=2, **KW)
    try:
        back.load_checkpoint_state(b)
        assert back.version == 2
        _same_state(back.checkpoint_state(), b)
        s2, s1 = back.step(batches[2]), one.step(batches[2])
        assert s2.version == s1.version == 3
        assert abs(s2.loss - s1.loss) <= 1e-5 * abs(s1.loss)
        w1, w2 = one.state_dict_for_publish(), back.state_dict_for_publish()
        for k in w1:
            # relative to the tensor's norm: a bias whose gradient is float noise (attention's
            # key bias) moves by AdamW's lr whichever sign the noise has
            assert float((w2[k] - w1[k]).norm() / w1[k].norm().clamp(min=1e-12)) <= 1e-5, k
        # and the folder reads back into 2 ranks too (DCP reshards; here the same N)
        shardckpt.load_into(back, tmp_path / "step-1.dcp", 1)
        _same_state(back.checkpoint_state(), a)
    finally:
        back.close()


@pytest.mark.timeout(200)
def test_rank_death_is_a_clear_error() -> None:
    model, mc, tok = _model()
    sharded = ShardedLearner(copy.deepcopy(model), tok, mc, procs=2, **KW)
    try:
        sharded._procs[1].kill()
        with pytest.raises(RankError, match="rank"):
            sharded.step(_groups(model, tok, n_groups=2))
        with pytest.raises(RankError):
            sharded.state_dict_for_publish()
        assert not any(p.is_alive() for p in sharded._procs)
    finally:
        sharded.close()


def test_activation_checkpointing_keeps_the_one_process_step() -> None:
    from echo2.learner_hub.distributed import apply_activation_checkpointing

    model, _, tok = _model()
    groups = _groups(model, tok)
    plain = Learner(copy.deepcopy(model), tok, **KW)
    wrapped_model = copy.deepcopy(model)
    assert apply_activation_checkpointing(wrapped_model) == 2
    wrapped = Learner(wrapped_model, tok, **KW)
    s1, s2 = plain.step(groups), wrapped.step(groups)
    assert abs(s2.loss - s1.loss) <= 1e-6 * abs(s1.loss)
    w1, w2 = plain.state_dict_for_publish(), wrapped.state_dict_for_publish()
    assert w1.keys() == w2.keys()  # the wrapper's hooks keep the parameter names
    for k in w1:
        assert _rel(w2[k], w1[k]) <= 1e-6, k


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_bf16_checkpointed_with_kl_reference() -> None:
    """bf16 FSDP2 parameters, activation checkpointing, a sharded KL reference and two
    optimiser passes: the step runs and stays close to the fp32 one-process step."""
    model, mc, tok = _model()
    groups = _groups(model, tok)
    kw = KW | {"kl_coef": 0.05, "num_iterations": 2}
    one = Learner(copy.deepcopy(model), tok, ref_model=copy.deepcopy(model).requires_grad_(False), **kw)
    s1 = one.step(groups)
    sharded = ShardedLearner(copy.deepcopy(model), tok, mc, procs=2, mixed_precision="bf16", activation_checkpointing=True, **kw)
    try:
        s2 = sharded.step(groups)
        assert s2.kl_ref == pytest.approx(s1.kl_ref, abs=1e-3)  # both 0 before the first update
        assert abs(s2.loss - s1.loss) <= 0.05 * abs(s1.loss) + 1e-3, (s1.loss, s2.loss)
        assert abs(s2.grad_norm - s1.grad_norm) <= 0.05 * s1.grad_norm
        w1, w2 = one.state_dict_for_publish(), sharded.state_dict_for_publish()
        assert w1.keys() == w2.keys()
        # over all weights together: AdamW moves a weight whose gradient is near zero by lr
        # whatever the gradient's sign, and bf16 flips some of those signs (attention's key bias,
        # whose gradient is float noise, differs by half its update; the embedding by 5.6%)
        init = model.state_dict()
        diff = sum(float((w2[k] - w1[k]).pow(2).sum()) for k in w1) ** 0.5
        update = sum(float((w1[k] - init[k]).pow(2).sum()) for k in w1) ** 0.5
        assert diff <= 0.1 * update, (diff, update)
    finally:
        sharded.close()


def test_config_keys_of_the_sharded_learner(tmp_path: Any) -> None:
    from echo2.learner_hub.config import ConfigError, HubConfig, load_config, render_config

    cfg = HubConfig(learner_procs=2, mixed_precision="bf16", activation_checkpointing=True, learner_master_port=29555)
    (tmp_path / "hub.toml").write_text(render_config(cfg))
    back = load_config(tmp_path / "hub.toml")
    assert (back.learner_procs, back.mixed_precision, back.activation_checkpointing, back.learner_master_port) == (2, "bf16", True, 29555)
    with pytest.raises(ConfigError, match="mixed_precision"):
        HubConfig(mixed_precision="bf16").validate()
    with pytest.raises(ConfigError, match="learner_procs"):
        HubConfig(learner_procs=0).validate()


def test_pruning_takes_sharded_folders_along(tmp_path: Any) -> None:
    from echo2.learner_hub.store import HubStore

    s = HubStore(tmp_path / "hub.sqlite", checkpoint_dir=tmp_path / "checkpoints", keep_checkpoints=2)
    try:
        ck = tmp_path / "checkpoints"
        for step in (1, 2, 3):
            (ck / f"step-{step}.dcp").mkdir(parents=True)
            (ck / f"step-{step}.dcp" / "__0_0.distcp").write_bytes(b"x")
            s.save_checkpoint(step, {"version": step, "dcp": f"step-{step}.dcp"})
        (ck / "step-4.dcp").mkdir()  # a newer write under way: its step-4.pt is not there yet
        s.save_checkpoint(3, {"version": 3, "dcp": "step-3.dcp"})
        assert sorted(p.name for p in ck.iterdir()) == ["step-2.dcp", "step-2.pt", "step-3.dcp", "step-3.pt", "step-4.dcp"]
    finally:
        s.close()
