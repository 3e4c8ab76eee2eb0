"""What the tests that drive a real Hub object share: a node's Announce and a small hub config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from echo2.learner_hub.config import HubConfig
from echo2.protocol import envelope, holdsproof
from echo2.protocol.identity import Identity
from echo2.protocol.messages import Announce, HoldsChallenge, HoldsProof, HoldsVersion


def announce(peer: str, *, rollouts_per_s: float = 10.0, price_usd_per_hour: float = 0.1) -> Announce:
    return Announce(
        peer_id=peer, software_version="0.1.0", accelerator="", accelerator_count=0, accelerator_memory_bytes=0,
        cpu_model="test", cpu_cores=1, ram_bytes=1 << 30, free_disk_bytes=1 << 30, engine="transformers",
        engine_version="", tokens_per_s=0.0, rollouts_per_s=rollouts_per_s, upload_MBps=0.0, download_MBps=0.0,
        price_usd_per_hour=price_usd_per_hour, listen_addrs=[], data_addr="", reachable=False, versions_held=[],
        max_upload_MBps=0.0,
    )


def small_hub_cfg(tmp_path: Path, **kw: object) -> HubConfig:
    base: dict[str, object] = dict(dir=str(tmp_path), steps=10, prompts_per_step=2, group_size=4, staleness=1, max_new_tokens=4)
    return HubConfig(**(base | kw))  # type: ignore[arg-type]


async def hold(hub: Any, node: Identity, version: int = 0) -> bytes:
    """What a node holding ``version`` does (A5): report it, then answer the hub's challenge from
    the version's bytes (an in-process node runs the weights the hub published, so those are the
    bytes it holds). Returns the hub's answer to the proof."""
    reply = await hub.on_holds(node.peer_id, envelope.seal(node, HoldsVersion(peer_id=node.peer_id, version=version,
                                                                               seconds=0.1)))
    ch = envelope.open_envelope(reply, HoldsChallenge, replay=None).message
    raw = hub.publisher.recent[version].packed.raw_chunks[ch.index]
    proof = HoldsProof(peer_id=node.peer_id, version=version, nonce=ch.nonce,
                       digest=holdsproof.answer(ch.nonce, raw, ch.offset, ch.length))
    answer: bytes = await hub.on_holds(node.peer_id, envelope.seal(node, proof))
    return answer
