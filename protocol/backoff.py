"""Capped exponential backoff with jitter: the one retry policy of echo2 (pure, no I/O).

Jitter keeps a fleet that lost its hub at once from redialling in lockstep; the cap keeps a node
that was offline for an hour from waiting an hour after the hub is back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


def backoff_delay(
    failures: int,
    *,
    base_s: float = 0.5,
    cap_s: float = 30.0,
    rng: random.Random | None = None,
) -> float:
    """The delay after ``failures`` >= 1 consecutive failures: half to all of the capped step."""
    step = min(cap_s, base_s * 2.0 ** min(max(failures - 1, 0), 60))
    return step * (0.5 + 0.5 * (rng or random).random())


@dataclass
class Backoff:
    """Retry state for one loop: ``failed()`` returns the next delay, ``reset()`` on success."""

    base_s: float = 0.5
    cap_s: float = 30.0
    rng: random.Random | None = None
    failures: int = field(default=0, init=False)

    def failed(self) -> float:
        self.failures += 1
        return backoff_delay(self.failures, base_s=self.base_s, cap_s=self.cap_s, rng=self.rng)

    def reset(self) -> None:
        self.failures = 0
