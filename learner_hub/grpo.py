"""GRPO maths as pure tensor functions (no model, no optimizer, no I/O), with TRL's names.

Notation, per completion token ``t`` of row ``i`` of the step (``B`` rows): ``π`` the policy being
trained, ``π_b`` the behaviour policy (the log-probs the rollout node reported), ``π_old`` the
learner's own policy before the step's first optimiser pass, ``A_i`` the row's advantage,
``m_it`` the loss mask, ``ε_lo = epsilon``, ``ε_hi = epsilon_high``.

Advantages (``scale_rewards``, TRL's choices), rewards ``r`` of one group ``g``:

* ``"group"``: ``A = (r - mean_g) / (std_g + eps)``
* ``"batch"``: ``A = (r - mean_g) / (std_batch + eps)`` (std over every reward of the step)
* ``"none"``:  ``A = r - mean_g`` (Dr. GRPO: no difficulty bias from the std)

The std is the *population* std (defined for a group of one; TRL applies Bessel's correction,
which only rescales ``A`` by ``sqrt(G / (G - 1))``) and a group whose rewards are all equal gets
advantages that are exactly zero (float rounding of the mean cannot leak a tiny signal).

Per-token policy term, with ``ρ = exp(clamp(log π - log π_den, ±20))`` (the log-ratio is clamped
before ``exp`` so a wild log-prob gives a large but finite ratio, never inf/NaN):

    ℓ_it = -min(ρ_it A_i, clip(ρ_it, 1 - ε_lo, 1 + ε_hi) A_i) · w_it

* Without the IS cap (``max_is_ratio = 0``): ``π_den = π_b`` and ``w = 1``. The clipped ratio
  itself corrects a stale row (BRIEF section 7); for a fresh row ``π_b = π_old`` within the hub's
  verification tolerance.
* With the cap (``max_is_ratio = C > 0``, decoupled PPO): ``π_den = π_old`` and
  ``w_it = min(π_old / π_b, C)`` (detached): the truncated importance weight of the behaviour
  policy against the current version, TRL's ``token_truncate`` correction.
* ``num_iterations = μ > 1``: μ optimiser passes over the step's rows; ``π_old`` and ``π_b`` stay
  those from before the first pass, so passes 2..μ are clipped against them (TRL's μ).
* KL (``kl_coef = β > 0``): ``+ β · k3``, ``k3 = exp(ref - log π) - (ref - log π) - 1``.

Aggregation (``loss_type``), over the *active* rows and tokens of the whole step (echo2 has no
gradient accumulation across local batches: micro-batches are weighted to give exactly the
full-batch loss, so ``bnpo`` and ``dapo`` coincide):

* ``"grpo"``:    ``L = 1/N · Σ_i (Σ_t ℓ_it m_it) / (Σ_t m_it)``  (sequence mean, then batch mean)
* ``"bnpo"``:    ``L = Σ_it ℓ_it m_it / Σ_it m_it``                (token mean over the batch)
* ``"dapo"``:    ``L = Σ_it ℓ_it m_it / Σ_it m_it``                (token mean over the step)
* ``"dr_grpo"``: ``L = Σ_it ℓ_it m_it / (N · max_completion_length)``  (a constant normaliser)

where ``N`` counts active rows. A row is *inactive* (``m_i· = 0``, and it counts in no normaliser,
which is where echo2 departs from TRL, whose ``grpo``/``dr_grpo`` keep such rows in ``B``) when
its advantage is zero (a group with equal rewards carries no signal, so it does not dilute the
informative ones, as DAPO's dynamic sampling intends), when it was truncated and
``mask_truncated_completions`` is set, or when a behaviour log-prob is non-finite or below
:data:`LOGPROB_FLOOR` (intake refuses those; this is the learner's own guard).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from .behaviour import LOGPROB_FLOOR

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ScaleRewards = Literal["group", "batch", "none"]
LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo")
#: |log-ratio| bound before exp (TRL clamps its IS log-ratios at 20 too)
LOG_RATIO_CLAMP = 20.0

__all__ = [
    "LOGPROB_FLOOR", "LOSS_TYPES", "LossStats", "Normaliser", "batch_advantages", "group_advantages",
    "grpo_loss", "token_weights",
]


def _centred(rewards: Tensor) -> tuple[Tensor, bool]:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    r = rewards.to(torch.float32) if not rewards.is_floating_point() else rewards
    if r.numel() == 0 or bool((r == r[0]).all()):
        return torch.zeros_like(r), True
    return r - r.mean(), False


def group_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """(r - mean) / (population std + eps) over one group of rewards (1-D tensor).

    Returns a float tensor of the same shape; all-equal rewards give exact zeros.
    """
    c, flat = _centred(rewards)
    if flat:
        return c
    return c / (rewards.to(c.dtype).std(unbiased=False) + eps)


def batch_advantages(groups: Sequence[Tensor], scale_rewards: str = "group", eps: float = 1e-6) -> list[Tensor]:
    """Advantages of each group of a step under ``scale_rewards`` (module docstring)."""
    if scale_rewards == "group":
        return [group_advantages(r, eps) for r in groups]
    if scale_rewards not in ("batch", "none"):
        raise ValueError(f"scale_rewards must be group, batch or none, not {scale_rewards!r}")
    centred = [_centred(r)[0] for r in groups]
    if scale_rewards == "none":
        return centred
    flat = [r.reshape(-1).to(torch.float64) for r in groups if r.numel()]
    allr = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)
    std = float(allr.std(unbiased=False)) if allr.numel() else 0.0
    return [c / (std + eps) for c in centred]


@dataclass(frozen=True)
class Normaliser:
    """What a step's loss is divided by: its loss_type and the step's active rows and tokens."""

    loss_type: str = "dapo"
    rows: int = 0
    tokens: int = 0
    max_completion_length: int = 0

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, not {self.loss_type!r}")
        if self.loss_type == "dr_grpo" and self.max_completion_length < 1:
            raise ValueError("loss_type dr_grpo needs max_completion_length >= 1")


def token_weights(mask: Tensor, norm: Normaliser) -> Tensor:
    """Per-token weights with ``loss = Σ ℓ · weights`` for ``norm.loss_type`` (``mask`` already
    holds only active tokens)."""
    rows = max(norm.rows, 1)
    if norm.loss_type == "grpo":
        return mask / mask.sum(-1, keepdim=True).clamp(min=1.0) / rows
    if norm.loss_type == "dr_grpo":
        return mask / float(rows * norm.max_completion_length)
    return mask / float(max(norm.tokens, 1))


@dataclass(frozen=True)
class LossStats:
    """Diagnostics of one loss evaluation (plain floats, detached)."""

    ratio_mean: float  # mean importance ratio over active tokens (1.0 when the ratio is disabled)
    ratio_max: float
    clip_frac: float  # fraction of active tokens whose clipped branch was taken (gradient zeroed)
    kl_ref: float  # mean k3 KL against the reference policy (0.0 without a reference)
    kl_behaviour: float  # mean k3 KL of the current policy against the behaviour policy
    pg_loss: float  # the policy-gradient part of the loss
    tokens: int  # active tokens that entered the loss
    rows: int = 0  # active rows
    bad_rows: int = 0  # rows dropped for a non-finite or below-floor behaviour log-prob
    is_weight_mean: float = 1.0  # mean truncated IS weight over active tokens (1.0 without a cap)
    # the two sides of clip_frac (which is their sum), as TRL splits it: ratio < 1 - epsilon with
    # A < 0 (clip_ratio/low_mean) and ratio > 1 + epsilon_high with A > 0 (clip_ratio/high_mean)
    clip_low: float = 0.0
    clip_high: float = 0.0


def _k3(logp_other: Tensor, logp_new: Tensor) -> Tensor:
    d = (logp_other - logp_new).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
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
    epsilon_high: float | None = None,
    loss_type: str = "dapo",
    max_completion_length: int = 0,
    logp_old: Tensor | None = None,
    max_is_ratio: float = 0.0,
    norm: Normaliser | None = None,
) -> tuple[Tensor, LossStats]:
    """The clipped, importance-weighted policy-gradient loss of the module docstring (minimised).

    Shapes: ``logp_new``, ``logp_behaviour``, ``mask`` (and ``logp_ref``, ``logp_old``) are
    ``[B, L]`` per completion token; ``advantages`` is ``[B]`` (broadcast over the row's tokens)
    or ``[B, L]``. ``mask`` is 1 on completion tokens and 0 on padding. ``clip_eps`` is TRL's
    ``epsilon`` (lower clip); ``epsilon_high`` defaults to it. ``norm`` carries the whole step's
    active rows/tokens when this call sees one micro-batch of it; without it they are counted
    here. ``logp_old`` is only used with ``max_is_ratio > 0`` (``logp_new`` detached when
    omitted: the first pass). With ``use_importance_ratio=False`` the policy term is REINFORCE
    with the group baseline, ``-A · log π``.
    """
    if logp_new.shape != logp_behaviour.shape or logp_new.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: new {tuple(logp_new.shape)}, behaviour {tuple(logp_behaviour.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    for name, t in (("logp_ref", logp_ref), ("logp_old", logp_old)):
        if t is not None and t.shape != logp_new.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != {tuple(logp_new.shape)}")
    eps_hi = clip_eps if epsilon_high is None or epsilon_high <= 0 else epsilon_high
    adv = advantages.to(logp_new.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    adv = adv.expand_as(logp_new)
    m = mask.to(logp_new.dtype)

    # Inactive rows leave the mask before anything is multiplied: NaN * 0 is NaN.
    lb = logp_behaviour.detach()
    bad_tok = (~torch.isfinite(lb) | (lb < LOGPROB_FLOOR)) & (m > 0)
    bad_row = bad_tok.any(dim=-1)
    lb = torch.where(bad_tok, torch.zeros_like(lb), lb)
    row_on = (m.sum(-1) > 0) & ~bad_row & (adv != 0).any(dim=-1)
    m = m * row_on.unsqueeze(-1).to(m.dtype)
    n_tok = m.sum()
    if norm is None:
        norm = Normaliser(loss_type, int(row_on.sum()), int(n_tok.item()), max_completion_length)
    weights = token_weights(m, norm)
    denom = n_tok.clamp(min=1.0)  # statistics are token means whatever the loss_type

    if max_is_ratio > 0:
        old = (logp_old if logp_old is not None else logp_new).detach()
        is_w = torch.exp((old - lb).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=max_is_ratio) * m
        den = old
    else:
        is_w = m
        den = lb
    if use_importance_ratio:
        ratio = torch.exp((logp_new - den).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        surr1 = ratio * adv
        surr2 = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_hi) * adv
        per_tok = -torch.minimum(surr1, surr2)
        clipped = (surr2 < surr1).to(m.dtype)
        clip_low = ((ratio < 1.0 - clip_eps) & (adv < 0)).to(m.dtype)
        clip_high = ((ratio > 1.0 + eps_hi) & (adv > 0)).to(m.dtype)
    else:
        ratio = torch.ones_like(logp_new)
        per_tok = -adv * logp_new
        clipped = clip_low = clip_high = torch.zeros_like(m)
    per_tok = torch.where(m > 0, per_tok * is_w, torch.zeros_like(per_tok))
    pg = (per_tok * weights).sum()
    loss = pg

    kl_ref_val = 0.0
    if logp_ref is not None:
        kl_tok = torch.where(m > 0, _k3(logp_ref.detach(), logp_new), torch.zeros_like(logp_new))
        if kl_coef != 0.0:
            loss = loss + kl_coef * (kl_tok * weights).sum()
        kl_ref_val = float((kl_tok.detach() * m).sum() / denom)

    with torch.no_grad():
        sel = m > 0
        r_d = ratio.detach()
        kb = torch.where(sel, _k3(lb, logp_new.detach()), torch.zeros_like(lb))
        stats = LossStats(
            ratio_mean=float((r_d * m).sum() / denom) if bool(sel.any()) else 1.0,
            ratio_max=float(r_d[sel].max()) if bool(sel.any()) else 1.0,
            clip_frac=float((clipped * m).sum() / denom),
            kl_ref=kl_ref_val,
            kl_behaviour=float(kb.sum() / denom),
            pg_loss=float(pg.detach()),
            tokens=int(n_tok.item()),
            rows=int(row_on.sum()),
            bad_rows=int(bad_row.sum()),
            is_weight_mean=float(is_w.sum() / denom) if max_is_ratio > 0 and bool(sel.any()) else 1.0,
            clip_low=float((clip_low.detach() * m).sum() / denom),
            clip_high=float((clip_high.detach() * m).sum() / denom),
        )
    return loss, stats
