"""Capacity model and provisioning rule (BRIEF section 5), as pure functions.

Notation: ``B`` rollouts per learner step, ``T_train`` seconds of learner work per step, per node
``D_i`` (seconds to receive and load a new version), ``G_i`` (seconds for one task), ``r_i``
(rollouts/s), ``S`` the staleness bound, ``margin`` a safety factor (>= 1).

Formulas (and why):

* Required rate ``R* = margin * B / T_train``: the learner consumes B rollouts every T_train.
* Freshness, S >= 1: a rollout made with version v must arrive before step v+S begins. Node i
  learns of v when step v-1 ends (v is published), needs ``D_i`` to load it and ``G_i`` to run a
  task, and must be done before ``S`` more steps of ``T_train`` elapse: ``D_i + G_i <= S*T_train``.
  We use ``T_train`` as the step period, i.e. the period of a busy learner; when the learner is
  starved steps last longer and the condition is conservative.
* S = 0 is *synchronous*: step t waits for rollouts made with version t, so every node is
  eligible but the learner idles every step while the version is loaded and the batch generated.
  With work split across the set in proportion to rates, the batch takes ``G_batch = B / sum r``
  after the slowest load ``D = max D_i``::

      U(S=0) = T_train / (T_train + O + D + G_batch)

  where ``O`` is the hub's own serial work per step besides training (packing and publishing the
  version, persisting): measured, and overlapped by nothing.

* S >= 1 is *pipelined*: generation overlaps training. A step lasts
  ``tau = max(T_train + O, B / sum r, L / S)`` where ``L`` is the rate-weighted mean of ``D_i + G_i``:
  throughput bounds the step from below by ``B / sum r``, and freshness by ``L / S``: the hub only
  hands a node work it can return within S steps, so a fleet slower than ``S * T_train``
  stretches the learner's steps rather than feeding it stale rollouts (echo2's dispatcher asks
  each task for a version that will still be admissible when the result lands)::

      U(S>=1) = T_train / max(T_train + O, B / sum r, L / S)

  When every node is fresh (``D_i + G_i <= S * T_train``) this is ``min(1, sum r * T_train / B)``,
  the classical throughput bound. The provisioning rule below still uses the strict freshness
  condition to pick eligible nodes.
* Smallest S keeping the learner busy: node i needs ``s_i = max(1, ceil((D_i+G_i)/T_train))``;
  sort by ``s_i`` and accumulate rates; the answer is the first ``s`` whose cumulative eligible
  rate reaches ``R*`` (None if the whole fleet falls short).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

_EPS = 1e-9


@dataclass(frozen=True)
class NodeCapacity:
    node_id: str
    load_s: float  # D_i
    task_s: float  # G_i
    rate: float  # r_i, rollouts/s

    def __post_init__(self) -> None:
        if self.load_s < 0 or self.task_s < 0 or self.rate < 0:
            raise ValueError(f"node {self.node_id}: D, G and r must be >= 0")


def task_seconds(task_rollouts: int, rate: float) -> float:
    """G_i for a task of ``task_rollouts`` completions at ``rate`` rollouts/s."""
    return math.inf if rate <= 0 else task_rollouts / rate


def required_rate(batch: int, t_train: float, margin: float = 1.0) -> float:
    if batch <= 0 or t_train <= 0 or margin <= 0:
        raise ValueError("B, T_train and margin must be > 0")
    return margin * batch / t_train


def is_fresh(node: NodeCapacity, staleness: int, t_train: float) -> bool:
    """Freshness condition; with S = 0 (synchronous) every node is eligible by definition."""
    if staleness == 0:
        return True
    return node.load_s + node.task_s <= staleness * t_train + _EPS


def eligible(nodes: Sequence[NodeCapacity], staleness: int, t_train: float) -> list[NodeCapacity]:
    return [n for n in nodes if is_fresh(n, staleness, t_train)]


def predicted_utilization(
    batch: int, t_train: float, staleness: int, nodes: Sequence[NodeCapacity], overhead_s: float = 0.0
) -> float:
    """Fraction of wall time the learner trains, for the given *active* set (see module doc).

    ``overhead_s`` is the hub's serial work per step besides training (packing and publishing
    the new version, persisting), which no staleness bound can overlap."""
    if batch <= 0 or t_train <= 0:
        raise ValueError("B and T_train must be > 0")
    if staleness == 0:
        total = sum(n.rate for n in nodes)
        if total <= 0:
            return 0.0
        d = max(n.load_s for n in nodes)
        return t_train / (t_train + overhead_s + d + batch / total)
    # Pipelined: a learner step lasts tau = max(T + O, B / sum r, (D + G) / S). The last term is
    # freshness: a rollout of version v must land before step v + S starts, S·tau after v was
    # published, so nodes slower than S·T stretch the step instead of being useless. When every
    # node is fresh this is min(1, sum r · T / B), the throughput bound.
    total = sum(n.rate for n in nodes)
    if total <= 0:
        return 0.0
    lag = sum(n.rate * (n.load_s + n.task_s) for n in nodes) / total  # rate-weighted D + G
    tau = max(t_train + overhead_s, batch / total, lag / staleness)
    return t_train / tau


def node_min_staleness(node: NodeCapacity, t_train: float) -> int:
    return max(1, math.ceil((node.load_s + node.task_s) / t_train - _EPS))


def min_busy_staleness(
    batch: int, t_train: float, nodes: Sequence[NodeCapacity], margin: float = 1.0
) -> int | None:
    """Smallest S >= 1 whose eligible nodes together reach R*; None if no S suffices."""
    need = required_rate(batch, t_train, margin)
    cum = 0.0
    for s, rate in sorted((node_min_staleness(n, t_train), n.rate) for n in nodes if n.rate > 0):
        cum += rate
        if cum + _EPS >= need:
            return s
    return None


@dataclass(frozen=True)
class CapacityReport:
    batch: int
    t_train: float
    staleness: int
    margin: float
    required_rate: float  # R*
    fleet_rate: float
    eligible_ids: tuple[str, ...]
    eligible_rate: float
    ineligible: dict[str, float] = field(default_factory=dict)  # id -> D_i + G_i
    synchronous: bool = False
    meets_throughput: bool = False
    predicted_utilization: float = 0.0  # with every eligible node active
    min_busy_staleness: int | None = None

    def format(self) -> str:
        mode = "synchronous (S=0)" if self.synchronous else f"pipelined (S={self.staleness})"
        lines = [
            f"capacity model: {mode}",
            f"  B={self.batch} rollouts/step  T_train={self.t_train:.3g}s  margin={self.margin:.3g}",
            f"  required rate R* = {self.required_rate:.4g} rollouts/s",
            f"  fleet rate {self.fleet_rate:.4g}/s, eligible {len(self.eligible_ids)} nodes "
            f"at {self.eligible_rate:.4g}/s ({'meets' if self.meets_throughput else 'BELOW'} R*)",
        ]
        if self.ineligible:
            worst = sorted(self.ineligible.items(), key=lambda kv: -kv[1])[:5]
            shown = ", ".join(f"{k} (D+G={v:.3g}s)" for k, v in worst)
            lines.append(
                f"  {len(self.ineligible)} nodes fail freshness D+G <= S*T_train="
                f"{self.staleness * self.t_train:.3g}s: {shown}"
            )
        lines.append(f"  predicted learner utilization {self.predicted_utilization:.1%}")
        mbs = "none (fleet too slow)" if self.min_busy_staleness is None else str(self.min_busy_staleness)
        lines.append(f"  smallest S keeping the learner busy: {mbs}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def capacity_report(
    batch: int,
    t_train: float,
    staleness: int,
    nodes: Sequence[NodeCapacity],
    margin: float = 1.0,
    overhead_s: float = 0.0,
) -> CapacityReport:
    if staleness < 0:
        raise ValueError("staleness must be >= 0")
    need = required_rate(batch, t_train, margin)
    el = eligible(nodes, staleness, t_train)
    el_ids = {n.node_id for n in el}
    el_rate = sum(n.rate for n in el)
    return CapacityReport(
        batch=batch,
        t_train=t_train,
        staleness=staleness,
        margin=margin,
        required_rate=need,
        fleet_rate=sum(n.rate for n in nodes),
        eligible_ids=tuple(n.node_id for n in el),
        eligible_rate=el_rate,
        ineligible={n.node_id: n.load_s + n.task_s for n in nodes if n.node_id not in el_ids},
        synchronous=staleness == 0,
        meets_throughput=el_rate + _EPS >= need,
        # the step-time model accounts for stale nodes itself (they stretch steps)
        predicted_utilization=predicted_utilization(batch, t_train, staleness, nodes, overhead_s) if nodes else 0.0,
        min_busy_staleness=min_busy_staleness(batch, t_train, nodes, margin),
    )
