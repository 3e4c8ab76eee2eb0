"""A learner step's figures under TRL's metric names, and echo2's own under ``echo2/``.

Why TRL's names: an operator who follows GRPO runs made with TRL's ``GRPOTrainer`` (1.16) reads
``reward``, ``kl``, ``entropy``, ``clip_ratio/region_mean``... on every dashboard; the same names
here mean the same dashboard works on an echo2 run. The values follow TRL's definitions
(``grpo_trainer.py``: ``_generate_and_score_completions`` and ``_compute_loss``) where echo2
computes the same thing, with these differences, each for a reason:

* ``clip_ratio/*`` are token means over the tokens that entered the loss: echo2 leaves rows with
  zero advantage out of the loss (grpo.py), so they would only dilute the fraction.
* ``sampling/importance_sampling_ratio/*`` and ``sampling/sampling_logp_difference/*``: TRL logs
  them for vLLM sampling; in echo2 every rollout is sampled remotely, so they are always there,
  and over stale rows too: ``exp(logp_learner - logp_node)`` then shows how far the policy moved
  since the node sampled, which the clipped ratio corrects (BRIEF section 7). Untruncated.
* ``kl`` only with ``kl_coef > 0`` (TRL: ``beta != 0``); ``learning_rate`` is constant (no scheduler).

The dict of one step is plain ``str -> float``: status.json keeps the last ones
(``train_metrics``), the store keeps all (``train_metrics`` table), and tracking.py writes them
as transformers' callbacks write a Trainer's logs (``train/<name>``, ``eval/<name>``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .hubstatus import edge_refusals
from .learner import StepStats
from .rows import Group

if TYPE_CHECKING:
    from .hub import Hub

#: TRL's names that every echo2 step has (kl only with a KL penalty; rewards/<name>/* per function)
TRL_STEP_NAMES = (
    "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/min_length",
    "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length",
    "completions/min_terminated_length", "completions/max_terminated_length", "num_tokens", "loss", "grad_norm",
    "learning_rate", "entropy", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean",
    "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max", "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _std(xs: Sequence[float]) -> float:
    """Bessel-corrected, as TRL's ``nanstd`` (0.0 for fewer than two values, where TRL has NaN)."""
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def step_metrics(groups: Sequence[Group], stats: StepStats, *, learning_rate: float, num_tokens: int,
                 kl: bool) -> dict[str, float]:
    """One step's figures from the groups it trained and the learner's :class:`StepStats`.
    ``num_tokens`` is the run's running total of prompt + completion tokens (TRL's
    ``num_input_tokens_seen``)."""
    samples = [s for g in groups for s in g.samples]
    rewards = [float(s.reward) for s in samples]
    lengths = [float(len(s.token_ids)) for s in samples]
    clipped = [s.finish_reason == "length" for s in samples]
    term = [n for n, c in zip(lengths, clipped, strict=True) if not c] or [0.0]  # TRL: zeros(1) when none ended
    # a row whose group's rewards are all equal (TRL: isclose(std, 0), weighted by rows)
    flat_rows = sum(len(g.samples) for g in groups if g.samples and _std([s.reward for s in g.samples]) < 1e-8)
    out: dict[str, float] = {
        "reward": _mean(rewards),
        "reward_std": _std(rewards),
        "frac_reward_zero_std": flat_rows / len(samples) if samples else 0.0,
        "completions/mean_length": _mean(lengths),
        "completions/min_length": min(lengths, default=0.0),
        "completions/max_length": max(lengths, default=0.0),
        "completions/clipped_ratio": _mean([float(c) for c in clipped]),
        "completions/mean_terminated_length": _mean(term),
        "completions/min_terminated_length": min(term),
        "completions/max_terminated_length": max(term),
        "num_tokens": float(num_tokens),
        "loss": stats.loss,
        "grad_norm": stats.grad_norm,
        "learning_rate": learning_rate,
        "entropy": stats.entropy,
        "clip_ratio/region_mean": stats.clip_frac,
        "clip_ratio/low_mean": stats.clip_low,
        "clip_ratio/high_mean": stats.clip_high,
        "sampling/importance_sampling_ratio/min": stats.is_ratio_min,
        "sampling/importance_sampling_ratio/mean": stats.is_ratio_mean,
        "sampling/importance_sampling_ratio/max": stats.is_ratio_max,
        "sampling/sampling_logp_difference/mean": stats.logp_diff_mean,
        "sampling/sampling_logp_difference/max": stats.logp_diff_max,
    }
    if kl:
        out["kl"] = stats.kl_ref
    for name in sorted({k for s in samples for k in s.reward_parts}):
        vals = [s.reward_parts[name] for s in samples if name in s.reward_parts]
        out[f"rewards/{name}/mean"] = _mean(vals)
        out[f"rewards/{name}/std"] = _std(vals)
    # echo2's own figures of the step (the hub's are added by hub_metrics)
    out |= {
        "echo2/staleness_mean": stats.staleness_mean,
        "echo2/staleness_max": float(stats.staleness_max),
        "echo2/rows": float(stats.sequences),
        "echo2/active_rows": float(stats.active_rows),
        "echo2/kl_behaviour": stats.kl_behaviour,
        "echo2/mismatch_max": stats.mismatch_max,
        "echo2/step_s": stats.seconds,
    }
    return out


def eval_metrics(rec: dict[str, Any]) -> dict[str, float]:
    """An evaluation's record (evaluation.py) as TRL's ``eval_*`` names; ``eval_accuracy`` is
    echo2's (the share of completions whose reward reaches ``eval_pass_threshold``)."""
    out: dict[str, float] = {}
    for key, name in (("mean_reward", "eval_reward"), ("reward_std", "eval_reward_std"), ("accuracy", "eval_accuracy")):
        if rec.get(key) is not None:
            out[name] = float(rec[key])
    for fname, fig in (rec.get("rewards_by_func") or {}).items():
        for k in ("mean", "std"):
            if fig.get(k) is not None:
                out[f"eval_rewards/{fname}/{k}"] = float(fig[k])
    out["eval_num_completions"] = float(rec.get("n", 0))
    return out


class HubFigures:
    """The hub's ``echo2/`` figures at a step (read on the loop, like hub_status): rates are
    over the time since the previous call."""

    def __init__(self) -> None:
        self._prev: tuple[float, int] | None = None  # (time, accepted tokens)

    def __call__(self, hub: Hub, now: float) -> dict[str, float]:
        st, tr, fleet = hub.dispatcher.stats, hub.trainer, hub.fleet
        totals = hub.ledger.totals(now)
        tokens = totals.accepted_tokens
        rate = 0.0
        if self._prev is not None and now > self._prev[0]:
            rate = (tokens - self._prev[1]) / (now - self._prev[0])
        self._prev = (now, tokens)
        active = len(fleet.nodes) if fleet.active is None else sum(p in fleet.active for p in fleet.nodes)
        lag = hub.loop_lag.report()
        out: dict[str, float] = {
            "echo2/stale_dropped": float(st.stale_dropped + tr.buffer.stale_dropped),
            "echo2/learner_busy_fraction": tr.busy_fraction(),
            "echo2/predicted_busy_fraction": float(fleet.predicted_busy_fraction()),
            "echo2/active_nodes": float(active),
            "echo2/accepted_tokens_per_s": rate,
            "echo2/accepted_tokens": float(tokens),
            "echo2/cost_usd": totals.cost_usd,
            "echo2/loop_lag_p99_ms": float(lag.get("loop_lag_p99_ms", 0.0)),
            "echo2/loop_lag_max_ms": float(lag.get("loop_lag_max_ms", 0.0)),
        }
        usd_m = totals.usd_per_million_tokens
        if usd_m is not None:
            out["echo2/usd_per_accepted_m_tokens"] = float(usd_m)
        refused = Counter(st.refused_by_reason) + Counter(fleet.refusals) + edge_refusals(hub)
        for reason, n in sorted(refused.items()):
            out[f"echo2/refused/{reason}"] = float(n)
        return out


def broadcast_metrics(h: dict[str, Any]) -> dict[str, float]:
    """A version's broadcast figures once it has closed (publisher.py), logged at its step."""
    out = {"echo2/broadcast_nodes": float(h.get("nodes") or 0)}
    for key in ("last_s", "median_s", "first_s"):
        if h.get(key) is not None:
            out[f"echo2/broadcast_{key.replace('_s', '')}_node_s"] = float(h[key])
    return out
