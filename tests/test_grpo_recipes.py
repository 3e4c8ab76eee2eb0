"""Issue 16 item 6: GRPO as TRL recipes need it, each option against a hand-computed value."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from echo2.learner_hub.grpo import LOGPROB_FLOOR, batch_advantages, grpo_loss

D = torch.float64


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # ratios 1.25, 1.0 (row 0, A = +1) and 1.6 (row 1, A = -2); row 1's second token is padding
    logp_new = torch.log(torch.tensor([[0.5, 0.25], [0.8, 1.0]], dtype=D)).requires_grad_(True)
    logp_b = torch.log(torch.tensor([[0.4, 0.25], [0.5, 1.0]], dtype=D))
    return logp_new, logp_b, torch.tensor([1.0, -2.0], dtype=D), torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=D)


# per-token losses at epsilon 0.2: -1.2 (1.25 clipped to 1.2), -1.0, +3.2 (A < 0: min takes 1.6 * -2)
@pytest.mark.parametrize(
    ("loss_type", "want"),
    [
        ("dapo", (-1.2 - 1.0 + 3.2) / 3),  # token mean over the step
        ("bnpo", (-1.2 - 1.0 + 3.2) / 3),  # the same: a step is one batch
        ("grpo", ((-1.2 - 1.0) / 2 + 3.2 / 1) / 2),  # sequence means, then their mean
        ("dr_grpo", (-1.2 - 1.0 + 3.2) / (2 * 4)),  # N rows x max_completion_length 4
    ],
)
def test_loss_types_hand_computed(loss_type: str, want: float) -> None:
    logp_new, logp_b, adv, mask = _case()
    loss, st = grpo_loss(logp_new, logp_b, adv, mask, clip_eps=0.2, loss_type=loss_type, max_completion_length=4)
    assert float(loss.detach()) == pytest.approx(want, abs=1e-12)
    assert st.tokens == 3 and st.rows == 2
    loss.backward()
    assert logp_new.grad is not None and bool(torch.isfinite(logp_new.grad).all())


def test_dr_grpo_needs_a_length() -> None:
    logp_new, logp_b, adv, mask = _case()
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(logp_new, logp_b, adv, mask, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(logp_new, logp_b, adv, mask, loss_type="sum")


def test_scale_rewards_group_batch_none() -> None:
    g1 = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=D)
    g2 = torch.tensor([0.0, 0.0, 3.0], dtype=D)
    flat = torch.tensor([0.5, 0.5], dtype=D)
    s2 = math.sqrt(2.0)
    got = batch_advantages([g1, g2, flat], "group", eps=0.0)
    assert got[0].tolist() == [1.0, -1.0, -1.0, 1.0]
    assert got[1].tolist() == pytest.approx([-1 / s2, -1 / s2, 2 / s2], abs=1e-12)
    none = batch_advantages([g1, g2, flat], "none")
    assert none[0].tolist() == [0.5, -0.5, -0.5, 0.5] and none[1].tolist() == [-1.0, -1.0, 2.0]
    # batch: group means, one std over all nine rewards of the step
    allr = torch.cat([g1, g2, flat])
    std = float(allr.std(unbiased=False))
    batch = batch_advantages([g1, g2, flat], "batch", eps=0.0)
    assert batch[0].tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], abs=1e-12)
    assert batch[1].tolist() == pytest.approx([-1 / std, -1 / std, 2 / std], abs=1e-12)
    for mode in ("group", "batch", "none"):  # a flat group carries no signal in any mode
        assert torch.equal(batch_advantages([g1, flat], mode)[1], torch.zeros(2, dtype=D))
    with pytest.raises(ValueError):
        batch_advantages([g1], "mean")


def test_clip_is_asymmetric() -> None:
    logp_new, logp_b, adv, mask = _case()
    # epsilon_high 0.3: the 1.25 ratio (A > 0) is no longer clipped
    loss, st = grpo_loss(logp_new, logp_b, adv, mask, clip_eps=0.2, epsilon_high=0.3)
    assert float(loss.detach()) == pytest.approx((-1.25 - 1.0 + 3.2) / 3, abs=1e-12)
    assert st.clip_frac == 0.0
    # the lower bound: ratio 0.5 with A = -1 is clipped at 1 - epsilon = 0.8, not at 1 - epsilon_high
    lo_new = torch.log(torch.tensor([[0.2]], dtype=D)).requires_grad_(True)
    lo_b = torch.log(torch.tensor([[0.4]], dtype=D))
    a, m = torch.tensor([-1.0], dtype=D), torch.ones(1, 1, dtype=D)
    loss, st = grpo_loss(lo_new, lo_b, a, m, clip_eps=0.2, epsilon_high=0.6)
    assert float(loss.detach()) == pytest.approx(0.8) and st.clip_frac == 1.0
    (g,) = torch.autograd.grad(loss, lo_new)
    assert float(g) == 0.0  # clipped: no gradient
    loss, st = grpo_loss(lo_new, lo_b, a, m, clip_eps=0.6, epsilon_high=0.2)
    assert float(loss.detach()) == pytest.approx(0.5) and st.clip_frac == 0.0


def test_truncated_importance_weight_of_stale_rows() -> None:
    # π_old (the learner's version) 0.5, 0.5; the stale behaviour policy sampled at 0.1, 0.4:
    # weights π_old / π_b = 5 and 1.25, capped at 2; the ratio is taken against π_old (1 here).
    logp_new = torch.log(torch.tensor([[0.5, 0.5]], dtype=D)).requires_grad_(True)
    logp_b = torch.log(torch.tensor([[0.1, 0.4]], dtype=D))
    a, m = torch.tensor([1.0], dtype=D), torch.ones(1, 2, dtype=D)
    loss, st = grpo_loss(logp_new, logp_b, a, m, max_is_ratio=2.0)
    assert float(loss.detach()) == pytest.approx((-2.0 - 1.25) / 2, abs=1e-12)
    assert st.is_weight_mean == pytest.approx((2.0 + 1.25) / 2) and st.ratio_mean == pytest.approx(1.0)
    (g,) = torch.autograd.grad(loss, logp_new)
    assert g[0].tolist() == pytest.approx([-1.0, -0.625], abs=1e-12)
    # a later pass: the ratio moves against π_old (given), the weight stays π_old / π_b
    old = logp_new.detach().clone()
    moved = torch.log(torch.tensor([[0.55, 0.5]], dtype=D))
    loss2, _ = grpo_loss(moved, logp_b, a, m, max_is_ratio=2.0, logp_old=old)
    assert float(loss2) == pytest.approx((-1.1 * 2.0 - 1.0 * 1.25) / 2, abs=1e-12)
    # without the cap the ratio is against the behaviour policy and clipped at 1.2
    loss0, st0 = grpo_loss(logp_new, logp_b, a, m)
    assert float(loss0.detach()) == pytest.approx(-1.2, abs=1e-12) and st0.is_weight_mean == 1.0


def test_masked_tokens_and_zero_advantage_rows_enter_no_normaliser() -> None:
    logp_new, logp_b, adv, mask = _case()
    row0 = (logp_new[:1], logp_b[:1], adv[:1], mask[:1])
    for lt in ("dapo", "grpo", "dr_grpo"):
        alone, _ = grpo_loss(*row0, loss_type=lt, max_completion_length=4)
        # row 1 with a zero advantage (its group was flat), or fully masked (truncated): row 0's loss
        zero = torch.tensor([1.0, 0.0], dtype=D)
        l1, st1 = grpo_loss(logp_new, logp_b, zero, mask, loss_type=lt, max_completion_length=4)
        m = mask.clone()
        m[1] = 0.0
        l2, st2 = grpo_loss(logp_new, logp_b, adv, m, loss_type=lt, max_completion_length=4)
        assert float(l1.detach()) == pytest.approx(float(alone.detach()), abs=1e-12), lt
        assert float(l2.detach()) == pytest.approx(float(alone.detach()), abs=1e-12), lt
        assert st1.rows == st2.rows == 1 and st1.tokens == st2.tokens == 2


@pytest.mark.parametrize("bad", [-1e30, float("nan"), float("-inf"), LOGPROB_FLOOR * 2])
def test_unsound_behaviour_logprob_cannot_poison_the_loss(bad: float) -> None:
    logp_new, logp_b, adv, mask = _case()
    alone, _ = grpo_loss(logp_new[:1], logp_b[:1], adv[:1], mask[:1])
    lb = logp_b.clone()
    lb[1, 0] = bad
    loss, st = grpo_loss(logp_new, lb, adv, mask)
    assert math.isfinite(float(loss.detach())) and float(loss.detach()) == pytest.approx(float(alone.detach()))
    assert st.bad_rows == 1 and st.rows == 1
    (g,) = torch.autograd.grad(loss, logp_new)
    assert bool(torch.isfinite(g).all()) and g[1].abs().sum() == 0


def test_log_ratio_is_clamped_before_exp() -> None:
    # float32: exp(100) is inf; a behaviour log-prob of -100 (above the floor) stays finite
    logp_new = torch.tensor([[-0.01]], dtype=torch.float32, requires_grad=True)
    logp_b = torch.tensor([[-100.0]], dtype=torch.float32)
    loss, st = grpo_loss(logp_new, logp_b, torch.tensor([-1.0]), torch.ones(1, 1))
    assert math.isfinite(float(loss.detach())) and st.ratio_max == pytest.approx(math.exp(20.0), rel=1e-5)
    (g,) = torch.autograd.grad(loss, logp_new)
    assert bool(torch.isfinite(g).all())


# ---------------------------------------------------------------------------------------- learner


def _learner(sgd_lr: float = 0.5, **kw: Any) -> Any:
    from echo2.learner_hub.learner import Learner
    from echo2.models import spec as modelspec

    torch.manual_seed(0)
    mc, arts = modelspec.artifacts_for(modelspec.tiny_config(hidden=32, layers=1), modelspec.tokenizer_json())
    learner = Learner(modelspec.model_from_config(mc), modelspec.load_tokenizer(arts), max_grad_norm=0.0, **kw)
    learner.optimizer = torch.optim.SGD(learner.model.parameters(), lr=sgd_lr)
    return learner


def _groups(learner: Any, rewards: list[list[float]], finish: str = "stop") -> list[Any]:
    """Groups whose behaviour log-probs are the learner's own (fresh, honest rows)."""
    from echo2.learner_hub.rows import Group, Sample

    gen = torch.Generator().manual_seed(1)
    out = []
    for gi, rs in enumerate(rewards):
        prompt = [1, 10 + gi, 20 + gi]
        comps = [torch.randint(30, 200, (3 + j % 2,), generator=gen).tolist() for j in range(len(rs))]
        lps = learner.recompute_logprobs_batch([(prompt, c) for c in comps])
        out.append(Group(prompt, [Sample(c, lp, r, learner.version, "n1", finish) for c, lp, r in zip(comps, lps, rs, strict=True)]))
    return out


def _weights(learner: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


def _moved(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("bad", [-1e30, float("nan")])
def test_learner_step_with_one_unsound_row_is_neither_skipped_nor_poisoned(bad: float) -> None:
    """A row that reached the learner with a -1e30/NaN log-prob: the step still happens, finite,
    and is exactly the step with that row left out as a masked (truncated) row would be."""
    a = _learner()
    init = _weights(a)
    groups = _groups(a, [[1.0, 0.0, 0.25], [0.0, 1.0]])
    groups[0].samples[1].logprobs[0] = bad
    st = a.step(groups)
    assert st.bad_rows == 1 and st.active_rows == 4 and math.isfinite(st.loss) and math.isfinite(st.grad_norm)
    after = _weights(a)
    assert all(bool(torch.isfinite(v).all()) for v in after.values()) and _moved(init, after) > 0

    b = _learner(mask_truncated_completions=True)
    b.model.load_state_dict(init)
    ref = _groups(b, [[1.0, 0.0, 0.25], [0.0, 1.0]])
    ref[0].samples[1].finish_reason = "length"
    st_b = b.step(ref)
    assert st_b.masked_truncated == 1 and st_b.active_rows == 4
    assert _moved(after, _weights(b)) < 1e-6


def test_learner_masks_truncated_completions() -> None:
    a = _learner(mask_truncated_completions=True)
    st = a.step(_groups(a, [[1.0, 0.0], [0.0, 1.0]], finish="length"))
    assert st.masked_truncated == 4 and st.active_rows == 0 and st.grad_norm == 0.0
    b = _learner()
    st = b.step(_groups(b, [[1.0, 0.0], [0.0, 1.0]], finish="length"))
    assert st.masked_truncated == 0 and st.active_rows == 4 and st.grad_norm > 0


def test_num_iterations_passes_against_the_first_pass_logprobs() -> None:
    # a small step keeps every ratio inside the clip, so each pass adds about one step's movement
    one = _learner(sgd_lr=0.01)
    init = _weights(one)
    one.step(_groups(one, [[1.0, 0.0], [0.0, 1.0]]))
    three = _learner(sgd_lr=0.01, num_iterations=3, max_is_ratio=5.0)
    three.model.load_state_dict(init)
    calls = []
    orig = three.optimizer.step

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return orig(*args, **kw)

    three.optimizer.step = counted  # type: ignore[method-assign]
    groups = _groups(three, [[1.0, 0.0], [0.0, 1.0]])
    st = three.step(groups)
    assert len(calls) == 3 and three.version == 1
    # the statistics are the first pass's: ratio 1 against π_old, IS weight 1 for fresh rows
    assert st.ratio_mean == pytest.approx(1.0, abs=1e-6) and st.is_weight_mean == pytest.approx(1.0, abs=1e-4)
    assert _moved(init, _weights(three)) > 2.5 * _moved(init, _weights(one))
    # a step where nothing can teach makes no pass at all (AdamW would still move)
    calls.clear()
    three.step(_groups(three, [[0.5, 0.5]]))
    assert calls == []


def test_teacher_forced_logprobs_are_chunked_without_changing_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from echo2.models import spec as modelspec

    learner = _learner()
    rows = [([1, 5, 6], [40, 41, 42, 43]), ([1, 7], [50, 51])]
    whole = learner.recompute_logprobs_batch(rows)
    monkeypatch.setattr(modelspec, "LOGPROB_CHUNK_POSITIONS", 1)
    chunked = learner.recompute_logprobs_batch(rows)
    for c, w in zip(chunked, whole, strict=True):
        assert c == pytest.approx(w, abs=1e-6)
    single = modelspec.teacher_forced_logprobs(learner.model, rows[0][0], rows[0][1], learner.temperature)
    assert single == pytest.approx(whole[0], abs=1e-5)


# ---------------------------------------------------------------------------------------- intake / config


@pytest.mark.parametrize(("bad", "words"), [(-1e30, "below the floor"), (float("nan"), "finite"), (float("-inf"), "finite")])
def test_node_reporting_an_unsound_logprob_is_punished_at_intake(bad: float, words: str) -> None:
    from test_intake import answer, issue, make_intake, submit

    from echo2.learner_hub.intake import Accept, Punish

    intake = make_intake()
    submit(intake, 2)
    t = issue(intake)[0]
    r = answer(t)
    r.completions[1].logprobs[0] = bad
    v = intake.judge(t.node_id, r, 1.0, 0)
    assert isinstance(v, Punish) and words in v.error.message and "log-prob 0" in v.error.message
    assert isinstance(intake.judge(t.node_id, answer(t), 1.0, 0), Accept)  # the task was not closed by it


def test_nan_logprob_never_decodes_from_the_wire() -> None:
    from echo2.protocol.errors import Echo2Error
    from echo2.protocol.messages import Completion

    for bad in (float("nan"), float("inf")):
        with pytest.raises(Echo2Error):
            Completion.from_wire({"prompt_index": 0, "token_ids": [5], "logprobs": [bad], "finish_reason": "stop"})


def test_truncated_sampling_is_refused_at_config_load(tmp_path: Any) -> None:
    from echo2.learner_hub.config import ConfigError, HubConfig, load_config
    from echo2.learner_hub.training import build_learner

    for line in ("top_p = 0.9", "top_k = 20"):
        p = tmp_path / "hub.toml"
        p.write_text(f"[hub]\n{line}\n")
        with pytest.raises(ConfigError, match="top_p = 1.0 and top_k = 0"):
            load_config(p)
    p.write_text("[hub]\ntop_p = 1.0\ntop_k = 0\nloss_type = \"dr_grpo\"\n")
    assert load_config(p).loss_type == "dr_grpo"
    with pytest.raises(ConfigError, match="top_p"):
        build_learner(HubConfig(top_k=5))


def test_kl_reference_is_computed_once_and_reported() -> None:
    import copy

    base = _learner(sgd_lr=0.01)
    ref_model = copy.deepcopy(base.model).eval().requires_grad_(False)
    calls: list[int] = []
    fwd = ref_model.forward

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return fwd(*args, **kw)

    ref_model.forward = counted  # type: ignore[method-assign]
    learner = _learner(sgd_lr=0.01, kl_coef=0.1, ref_model=ref_model, num_iterations=2)
    learner.model.load_state_dict(base.model.state_dict())
    st = learner.step(_groups(learner, [[1.0, 0.0], [0.0, 1.0]]))
    assert len(calls) == 1  # one micro-batch, two passes: the frozen reference runs once
    assert st.kl_ref == pytest.approx(0.0, abs=1e-6) and math.isfinite(st.loss)  # first pass: policy == reference
