"""GRPO advantages and loss against small hand-computed references."""

from __future__ import annotations

import math

import pytest
import torch

from echo2.learner_hub.grpo import group_advantages, grpo_loss


def test_advantages_population_std() -> None:
    # mean 0.5, population std 0.5 -> exactly +-1 with eps = 0
    a = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), eps=0.0)
    assert a.tolist() == [1.0, -1.0, -1.0, 1.0]
    # mean 1, population std sqrt(2): (-1, -1, 2) / sqrt(2)
    a = group_advantages(torch.tensor([0.0, 0.0, 3.0], dtype=torch.float64), eps=0.0)
    s = math.sqrt(2.0)
    assert a.tolist() == pytest.approx([-1 / s, -1 / s, 2 / s], abs=1e-12)
    # default eps only shrinks slightly
    a = group_advantages(torch.tensor([1.0, 0.0]))
    assert a.tolist() == pytest.approx([1 / (1 + 2e-6), -1 / (1 + 2e-6)], rel=1e-6)


def test_advantages_equal_rewards_exactly_zero() -> None:
    for r in ([0.1, 0.1, 0.1], [0.7] * 16, [1.0]):
        a = group_advantages(torch.tensor(r, dtype=torch.float32))
        assert torch.equal(a, torch.zeros(len(r)))
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 2))


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logp_new = torch.log(torch.tensor([[0.5, 0.25], [0.8, 1.0]], dtype=torch.float64)).requires_grad_(True)
    logp_b = torch.log(torch.tensor([[0.4, 0.25], [0.5, 1.0]], dtype=torch.float64))
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    return logp_new, logp_b, adv, mask


def test_clipped_loss_hand_computed() -> None:
    logp_new, logp_b, adv, mask = _case()
    loss, st = grpo_loss(logp_new, logp_b, adv, mask, clip_eps=0.2)
    # ratios: 1.25 (A=+1, clipped to 1.2), 1.0 (A=+1), 1.6 (A=-2: min picks -3.2, unclipped);
    # per-token losses -1.2, -1.0, +3.2; global token mean over 3 tokens.
    assert float(loss.detach()) == pytest.approx(1.0 / 3.0, abs=1e-12)
    assert st.clip_frac == pytest.approx(1.0 / 3.0)
    assert st.ratio_mean == pytest.approx((1.25 + 1.0 + 1.6) / 3.0)
    assert st.ratio_max == pytest.approx(1.6)
    assert st.tokens == 3
    loss.backward()
    assert logp_new.grad is not None
    # d/dlogp of -ratio*A is -ratio*A; the clipped token gets no gradient; padding none.
    expected = torch.tensor([[0.0, -1.0 / 3.0], [3.2 / 3.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(logp_new.grad, expected, atol=1e-12)


def test_reinforce_without_ratio() -> None:
    logp_new, logp_b, adv, mask = _case()
    loss, st = grpo_loss(logp_new, logp_b, adv, mask, use_importance_ratio=False)
    want = (-(math.log(0.5) + math.log(0.25)) * 1.0 + 2.0 * math.log(0.8)) / 3.0
    assert float(loss.detach()) == pytest.approx(want, abs=1e-12)
    assert st.clip_frac == 0.0 and st.ratio_mean == 1.0
    loss.backward()
    assert logp_new.grad is not None
    expected = torch.tensor([[-1 / 3, -1 / 3], [2 / 3, 0.0]], dtype=torch.float64)
    assert torch.allclose(logp_new.grad, expected, atol=1e-12)


def test_on_policy_ratio_equals_reinforce_gradient() -> None:
    # At ratio 1 (on-policy) the clipped objective's gradient equals REINFORCE's.
    lp = torch.log(torch.tensor([[0.3, 0.6, 0.9]], dtype=torch.float64))
    adv = torch.tensor([0.7], dtype=torch.float64)
    mask = torch.ones_like(lp)
    a = lp.clone().requires_grad_(True)
    grpo_loss(a, lp, adv, mask)[0].backward()
    b = lp.clone().requires_grad_(True)
    grpo_loss(b, lp, adv, mask, use_importance_ratio=False)[0].backward()
    assert a.grad is not None and b.grad is not None
    assert torch.allclose(a.grad, b.grad, atol=1e-12)


def test_k3_kl_term() -> None:
    logp_new, logp_b, adv, mask = _case()
    ref = logp_b.clone()
    base, _ = grpo_loss(logp_new, logp_b, adv, mask)
    loss, st = grpo_loss(logp_new, logp_b, adv, mask, kl_coef=0.1, logp_ref=ref)
    k3 = [0.8 - math.log(0.8) - 1.0, 0.0, 0.625 - math.log(0.625) - 1.0]
    kl = sum(k3) / 3.0
    assert st.kl_ref == pytest.approx(kl, abs=1e-12)
    assert st.kl_behaviour == pytest.approx(kl, abs=1e-12)  # ref == behaviour here
    assert float(loss.detach()) == pytest.approx(float(base.detach()) + 0.1 * kl, abs=1e-12)
    # kl_coef 0 with a reference: reported but not added
    loss0, st0 = grpo_loss(logp_new, logp_b, adv, mask, kl_coef=0.0, logp_ref=ref)
    assert float(loss0.detach()) == pytest.approx(float(base.detach())) and st0.kl_ref > 0


def test_equal_rewards_zero_loss_and_gradient() -> None:
    adv = group_advantages(torch.tensor([0.3, 0.3, 0.3, 0.3]))
    logp_new = torch.log(torch.rand(4, 5, dtype=torch.float64) * 0.9 + 0.05).requires_grad_(True)
    logp_b = logp_new.detach() + 0.3 * torch.randn(4, 5, dtype=torch.float64)
    mask = torch.ones(4, 5, dtype=torch.float64)
    for use_ratio in (True, False):
        loss, _ = grpo_loss(logp_new, logp_b, adv, mask, use_importance_ratio=use_ratio)
        assert float(loss.detach()) == 0.0
        (g,) = torch.autograd.grad(loss, logp_new)
        assert torch.count_nonzero(g) == 0


def test_shape_checks() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError):
        grpo_loss(x, torch.zeros(2, 2), torch.zeros(2), x)
    with pytest.raises(ValueError):
        grpo_loss(x, x, torch.zeros(2), x, logp_ref=torch.zeros(3))
