"""The admission buffer between accepted results and the learner (BRIEF section 7), and the
staleness rule both it and the dispatcher apply: pure, sans-IO."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar


def admissible(version: int, learner_step: int, staleness: int) -> bool:
    """BRIEF section 7: at learner step t a result made with ``version`` is usable iff
    ``version >= t - S``."""
    return version >= learner_step - staleness


T = TypeVar("T")


@dataclass
class BufferStats:
    accepted: int = 0
    taken: int = 0
    stale_dropped: int = 0  # refused at add time or aged out before being taken
    refused_by_reason: dict[str, int] = field(default_factory=dict)

    def refuse(self, reason: str, n: int = 1) -> None:
        self.refused_by_reason[reason] = self.refused_by_reason.get(reason, 0) + n


class ReplayBuffer(Generic[T]):
    """Admission buffer between accepted results and the learner (BRIEF section 7).

    Items are whatever the learner needs per GRPO group; each carries the policy version it was
    generated with. Batches are taken oldest version first, because those items are the next to
    become inadmissible. When full, the oldest-version item is evicted (``refused_by_reason
    ["evicted"]``): it is the most stale and the first that would be dropped anyway.
    """

    def __init__(self, staleness: int, max_items: int = 100_000, on_drop: Callable[[T], None] | None = None) -> None:
        if staleness < 0:
            raise ValueError("staleness must be >= 0")
        self.staleness = staleness
        self.max_items = max_items
        self.on_drop = on_drop  # told of every item that leaves other than in a batch
        self._heap: list[tuple[int, int, T]] = []
        self._seq = itertools.count()
        self.stats = BufferStats()

    def __len__(self) -> int:
        return len(self._heap)

    @property
    def stale_dropped(self) -> int:
        return self.stats.stale_dropped

    @property
    def accepted(self) -> int:
        return self.stats.accepted

    @property
    def refused_by_reason(self) -> dict[str, int]:
        return self.stats.refused_by_reason

    def add(self, item: T, version: int, learner_step: int) -> bool:
        if not admissible(version, learner_step, self.staleness):
            self.stats.stale_dropped += 1
            self.stats.refuse("stale")
            return False
        heapq.heappush(self._heap, (version, next(self._seq), item))
        self.stats.accepted += 1
        if len(self._heap) > self.max_items:
            self._dropped(heapq.heappop(self._heap)[2])
            self.stats.refuse("evicted")
        return True

    def remove_if(self, pred: Callable[[T], bool]) -> int:
        """Drop buffered items matching ``pred`` (e.g. rollouts of a node just banned)."""
        keep = [e for e in self._heap if not pred(e[2])]
        n = len(self._heap) - len(keep)
        if n:
            for e in self._heap:
                if pred(e[2]):
                    self._dropped(e[2])
            self._heap = keep
            heapq.heapify(self._heap)
            self.stats.refuse("removed", n)
        return n

    def drop_stale(self, learner_step: int) -> int:
        n = 0
        while self._heap and not admissible(self._heap[0][0], learner_step, self.staleness):
            self._dropped(heapq.heappop(self._heap)[2])
            n += 1
        if n:
            self.stats.stale_dropped += n
            self.stats.refuse("stale", n)
        return n

    def _dropped(self, item: T) -> None:
        if self.on_drop is not None:
            self.on_drop(item)

    def take_batch(self, learner_step: int, n_groups: int) -> list[tuple[int, T]] | None:
        """``n_groups`` (version, item) pairs admissible at ``learner_step``, oldest version
        first, or None (nothing removed) if fewer are available."""
        self.drop_stale(learner_step)
        if len(self._heap) < n_groups:
            return None
        out = [heapq.heappop(self._heap) for _ in range(n_groups)]
        self.stats.taken += n_groups
        return [(v, item) for v, _, item in out]

    def versions(self) -> Sequence[int]:
        return sorted(v for v, _, _ in self._heap)
