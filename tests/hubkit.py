"""What the tests that drive a real Hub object share: a node's Announce and a small hub config."""

from __future__ import annotations

from pathlib import Path

from echo2.learner_hub.config import HubConfig
from echo2.protocol.messages import Announce


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
