"""The publisher keeps chunk bytes only for the versions still in use (a SmolLM2 hub that kept 16
versions whole reached 20 GB and was OOM-killed within 30 steps)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import trio

from echo2.learner_hub.publisher import KEEP_RECENT, PolicyPublisher
from echo2.learner_hub.verify import published_weights
from echo2.protocol.identity import Identity


def test_old_versions_shed_their_chunks_but_keep_their_figures() -> None:
    pub = PolicyPublisher(Identity.generate(), "{}", {}, SimpleNamespace(chunk_bytes=4096, full_every=10, staleness=1))
    weights = published_weights(pub)

    async def main() -> None:
        for v in range(KEEP_RECENT + 4):
            await pub.publish(v, {"w": torch.full((4096,), float(v), dtype=torch.bfloat16)})

    trio.run(main)
    versions = sorted(pub.recent)
    assert len(versions) == KEEP_RECENT  # figures for late holds reports
    with_data = [v for v in versions if pub.recent[v].has_data]
    assert with_data == versions[-pub.keep_data:] and pub.keep_data == 3  # S + 2
    assert weights(versions[0]) is None  # a shed version cannot be verified against: unverifiable, not wrong
    w = weights(versions[-1])
    assert w is not None and float(w["w"][0]) == float(versions[-1])
