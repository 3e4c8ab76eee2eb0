"""GRPO maths as pure tensor functions (no model, no optimizer, no I/O).

Design choices, fixed here so every caller and test agrees:

* Advantages use the *population* standard deviation of the group (``unbiased=False``): it is
  defined for a group of one (giving a zero advantage instead of NaN) and is what the usual GRPO
  implementations compute. A group whose rewards are all equal gets advantages that are exactly
  zero (special-cased, so float rounding of the mean cannot leak a tiny non-zero signal).
* The loss is aggregated as a *global token mean*: the per-token terms of every row in the batch
  are summed over the masked (completion) tokens and divided by the total number of masked
  tokens. Long completions therefore weigh in proportion to their length, and no per-sequence
  normalisation biases the gradient towards short answers (the length bias noted in Dr. GRPO /
  DAPO).
* The clipped surrogate is PPO's ``min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)`` with the
  ratio ``exp(logp_new - logp_behaviour)`` per token; ``logp_behaviour`` is what the rollout node
  reported, which is what makes stale rollouts usable (BRIEF section 7).
* The optional KL penalty is the k3 estimator ``exp(ref - new) - (ref - new) - 1`` per token
  (non-negative, unbiased for KL(new || ref)), added with weight ``kl_coef``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """(r - mean) / (population std + eps) over one group of rewards (1-D tensor).

    Returns a float tensor of the same shape; all-equal rewards give exact zeros.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    r = rewards.to(torch.float32) if not rewards.is_floating_point() else rewards
    if r.numel() == 0:
        return r.clone()
    if bool((r == r[0]).all()):
        return torch.zeros_like(r)
    mean = r.mean()
    std = r.std(unbiased=False)
    return (r - mean) / (std + eps)


@dataclass(frozen=True)
class LossStats:
    """Diagnostics of one loss evaluation (plain floats, detached)."""

    ratio_mean: float  # mean importance ratio over masked tokens (1.0 when the ratio is disabled)
    ratio_max: float
    clip_frac: float  # fraction of masked tokens whose clipped branch was taken (gradient zeroed)
    kl_ref: float  # mean k3 KL against the reference policy (0.0 without a reference)
    kl_behaviour: float  # mean k3 KL of the current policy against the behaviour policy
    pg_loss: float  # the policy-gradient part of the loss
    tokens: int  # masked tokens that entered the mean


def _k3(logp_other: Tensor, logp_new: Tensor) -> Tensor:
    d = logp_other - logp_new
    return torch.exp(d) - d - 1.0


def grpo_loss(
    logp_new: Tensor,
    logp_behaviour: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    logp_ref: Tensor | None = None,
    *,
    use_importance_ratio: bool = True,
) -> tuple[Tensor, LossStats]:
    """Clipped importance-weighted policy-gradient loss (to be minimised).

    Shapes: ``logp_new``, ``logp_behaviour``, ``mask`` (and ``logp_ref``) are ``[B, L]`` per
    completion token; ``advantages`` is ``[B]`` (one per completion, broadcast over its tokens)
    or ``[B, L]``. ``mask`` is 1 on completion tokens and 0 on padding.

    With ``use_importance_ratio=False`` the policy term is vanilla REINFORCE with the group
    baseline, ``-A * logp_new``, and ``logp_behaviour`` is ignored (except for the KL stat).
    Aggregation: global token mean over masked tokens (see module docstring).
    """
    if logp_new.shape != logp_behaviour.shape or logp_new.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: new {tuple(logp_new.shape)}, behaviour {tuple(logp_behaviour.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    if logp_ref is not None and logp_ref.shape != logp_new.shape:
        raise ValueError(f"logp_ref shape {tuple(logp_ref.shape)} != {tuple(logp_new.shape)}")
    adv = advantages.to(logp_new.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    adv = adv.expand_as(logp_new)
    m = mask.to(logp_new.dtype)
    n_tok = m.sum()
    denom = n_tok.clamp(min=1.0)

    log_ratio = logp_new - logp_behaviour.detach()
    if use_importance_ratio:
        ratio = torch.exp(log_ratio)
        surr1 = ratio * adv
        surr2 = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
        per_tok = -torch.minimum(surr1, surr2)
        clipped = (surr2 < surr1).to(m.dtype)
    else:
        ratio = torch.ones_like(logp_new)
        per_tok = -adv * logp_new
        clipped = torch.zeros_like(m)
    pg = (per_tok * m).sum() / denom
    loss = pg

    kl_ref_val = 0.0
    if logp_ref is not None:
        kl_tok = _k3(logp_ref.detach(), logp_new)
        kl_mean = (kl_tok * m).sum() / denom
        if kl_coef != 0.0:
            loss = loss + kl_coef * kl_mean
        kl_ref_val = float(kl_mean.detach())

    with torch.no_grad():
        r_masked = ratio.detach()
        sel = m > 0
        stats = LossStats(
            ratio_mean=float((r_masked * m).sum() / denom),
            ratio_max=float(r_masked[sel].max()) if bool(sel.any()) else 1.0,
            clip_frac=float((clipped * m).sum() / denom),
            kl_ref=kl_ref_val,
            kl_behaviour=float((_k3(logp_behaviour.detach(), logp_new.detach()) * m).sum() / denom),
            pg_loss=float(pg.detach()),
            tokens=int(n_tok.item()),
        )
    return loss, stats
