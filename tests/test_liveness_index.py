"""Liveness by order of last contact (issue 20): the silent nodes it finds are those a scan over
every node finds, whatever order (or clock steps) the contacts came in."""

from __future__ import annotations

import random

import pytest
from hubkit import announce

from echo2.learner_hub.fleet import NodeInfo
from echo2.learner_hub.silence import SilenceOrder


@pytest.mark.parametrize("seed", range(6))
def test_silence_order_equals_the_scan(seed: int) -> None:
    rng = random.Random(seed)
    order, nodes, now = SilenceOrder(), {}, 1000.0
    for _ in range(500):
        now += rng.choice([0.0, 0.5, 2.0, 10.0])
        ev = rng.random()
        if ev < 0.2:
            p = f"n{rng.randrange(50)}"
            if p not in nodes:
                n = nodes[p] = NodeInfo(p, announce(p), now, now)
                n.__dict__["_seen"] = order
                order.heard(p, now)
        elif ev < 0.7 and nodes:
            # heard now, or (a clock step, a test) at an earlier time
            nodes[rng.choice(sorted(nodes))].last_seen = now if rng.random() < 0.9 else now - rng.uniform(0, 60)
        elif ev < 0.75 and nodes:
            p = rng.choice(sorted(nodes))
            del nodes[p]
            order.forget(p)
        else:
            silence = rng.choice([5.0, 20.0, 60.0])
            scan = {p for p, n in nodes.items() if now - n.last_seen > silence}
            assert set(order.silent(nodes, now, silence)) == scan
