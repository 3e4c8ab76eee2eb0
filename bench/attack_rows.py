"""The rows of ``echo2 bench attack`` (pure: no I/O, no processes, no clock).

One row per attack id. The figures come from the harness (honest accepted rollouts per second
before and during the attack, RSS samples, liveness, refusal counters read before and after);
``effect`` is what the attack itself measured and ``prevented`` its verdict on that effect:
True only when the effect was measured as prevented, False when it was measured as achieved,
None when it could not be measured. ``blocked`` is True only for a measured prevention on hosts
that all stayed up: a host that died is never a block.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: An honest rate below this fraction of its baseline counts as a stall in the summary.
STALL_RATIO = 0.5
#: What the issue asks of a fixed hub (the "must show" bounds), used by the summary's verdict.
PASS_RATIO = 0.8
PASS_RSS_MIB = 128.0


def rate(count0: float | None, count1: float | None, seconds: float) -> float | None:
    """Events per second between two counter readings; None if either reading is missing."""
    if count0 is None or count1 is None or seconds <= 0:
        return None
    return max(0.0, float(count1) - float(count0)) / seconds


def rate_ratio(baseline: float | None, during: float | None) -> float | None:
    """``during / baseline``; None when the baseline is unknown or zero (nothing to compare)."""
    if baseline is None or during is None or baseline <= 0 or not math.isfinite(baseline):
        return None
    return round(during / baseline, 3)


def growth(samples: Sequence[float]) -> float:
    """RSS growth over a window: the highest sample above the first (never negative)."""
    if not samples:
        return 0.0
    return round(max(0.0, max(samples) - samples[0]), 1)


def counter_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What each reason counter rose by (reasons that did not rise are left out)."""
    out: dict[str, float] = {}
    for k, v in after.items():
        d = float(v) - float(before.get(k, 0))
        if d > 0:
            out[k] = int(d) if d == int(d) else round(d, 3)
    return dict(sorted(out.items()))


def is_blocked(prevented: bool | None, hosts_alive: bool) -> bool:
    return prevented is True and hosts_alive


@dataclass
class Window:
    """What the harness measured over one attack (and the baseline window before it)."""

    baseline_rate: float | None
    attack_rate: float | None
    hub_rss: list[float] = field(default_factory=list)
    node_rss: list[list[float]] = field(default_factory=list)
    hosts_alive: bool = True
    dead: list[str] = field(default_factory=list)
    refusals: dict[str, dict[str, float]] = field(default_factory=dict)
    seconds: float = 0.0


def build_row(attack_id: str, w: Window, effect: dict[str, Any] | str, prevented: bool | None) -> dict[str, Any]:
    node_growth = [growth(s) for s in w.node_rss]
    return {
        "id": attack_id,
        "honest_rate_ratio": rate_ratio(w.baseline_rate, w.attack_rate),
        "hub_rss_growth_mib": growth(w.hub_rss),
        "node_rss_growth_mib": max(node_growth, default=0.0),
        "hosts_alive": w.hosts_alive,
        "effect": effect,
        "blocked": is_blocked(prevented, w.hosts_alive),
        "refusals": w.refusals,
        "detail": {
            "baseline_rollouts_per_s": None if w.baseline_rate is None else round(w.baseline_rate, 2),
            "attack_rollouts_per_s": None if w.attack_rate is None else round(w.attack_rate, 2),
            "node_rss_growth_mib_each": node_growth,
            "dead": w.dead,
            "seconds": round(w.seconds, 1),
            "prevented": prevented,
        },
    }


def error_row(attack_id: str, message: str) -> dict[str, Any]:
    """The row of an attack the bench could not run (a bug or a swarm that would not come up)."""
    return {
        "id": attack_id, "honest_rate_ratio": None, "hub_rss_growth_mib": 0.0, "node_rss_growth_mib": 0.0,
        "hosts_alive": False, "effect": f"not measured: {message}", "blocked": False, "refusals": {},
        "detail": {"error": message},
    }


def outcome(row: Mapping[str, Any]) -> str:
    """One word for the summary: crashed (a host died), stalled (honest rate under half its
    baseline), degraded (a bound of the issue missed), open (effect not prevented) or blocked."""
    if not row.get("hosts_alive"):
        return "crashed"
    ratio = row.get("honest_rate_ratio")
    if ratio is not None and ratio < STALL_RATIO:
        return "stalled"
    if not row.get("blocked"):
        return "open"
    if (ratio is not None and ratio < PASS_RATIO) or max(
        float(row.get("hub_rss_growth_mib") or 0), float(row.get("node_rss_growth_mib") or 0)
    ) > PASS_RSS_MIB:
        return "degraded"
    return "blocked"


def summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in rows:
        out.setdefault(outcome(r), []).append(str(r["id"]))
    return out


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = [f"{'id':4s} {'ratio':>6s} {'hubMiB':>7s} {'nodeMiB':>7s} {'alive':>5s} {'blocked':>7s}  outcome   effect"]
    for r in rows:
        ratio = r.get("honest_rate_ratio")
        eff = r.get("effect") or {}
        eff_s = eff if isinstance(eff, str) else ", ".join(f"{k}={v}" for k, v in list(eff.items())[:5])
        lines.append(
            f"{r['id']:4s} {'-' if ratio is None else f'{ratio:.2f}':>6s} {r['hub_rss_growth_mib']:7.1f} "
            f"{r['node_rss_growth_mib']:7.1f} {str(r['hosts_alive']):>5s} {str(r['blocked']):>7s}  "
            f"{outcome(r):9s} {eff_s[:110]}"
        )
    return "\n".join(lines)
