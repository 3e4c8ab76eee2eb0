"""A node's settings (what ``echo2 node run`` flags and node.toml give) and its running counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["NodeConfig", "NodeStats", "hub_peer_id"]


@dataclass
class NodeConfig:
    hub: str
    data_dir: Path
    engine: str = "auto"
    price_usd_per_hour: float = 0.0
    max_upload_MBps: float = 0.0
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    join_token: str = ""
    threads: int = 0
    max_tasks: int = 0  # stop after this many tasks (0 = run until stopped); for tests and demos
    # what a hub may make this node allocate (0 = most of the RAM / accelerator memory); see budget.py
    memory_budget_MiB: int = 0
    # transformers and huggingface_hub never touch the network (False: the operator allows it)
    model_hub_offline: bool = True
    # heartbeats, holds and results on one long-lived channel to the hub when it offers one (hublink.py)
    channel: bool = True
    # ask the home router to forward our ports (UPnP IGD / NAT-PMP, node/portmap.py): auto|upnp|natpmp|off
    port_map: str = "auto"
    # how long a finished result may wait for the next one to share its ResultBatch, when that
    # one is expected in time (outbox.plan; 0: what is ready goes at once)
    result_linger_ms: float = 0.0
    json_events: bool = False  # progress as JSON lines on stdout (`node run --json`), not log lines
    # computing preferences given as flags (prefs.Prefs field -> value); they override DATA_DIR/node.toml
    prefs: dict[str, Any] = field(default_factory=dict)


@dataclass
class NodeStats:
    tasks_done: int = 0
    tasks_declined: int = 0
    tasks_refused: int = 0
    results_refused: int = 0
    tokens: int = 0
    versions_loaded: list[int] = field(default_factory=list)
    admitted: bool = False
    admission_reason: str = ""


def hub_peer_id(multiaddr: str) -> str:
    parts = multiaddr.rstrip("/").split("/")
    if "p2p" not in parts or parts.index("p2p") + 1 >= len(parts):
        raise ValueError(f"hub address must end with /p2p/<peer ID>: {multiaddr}")
    return parts[parts.index("p2p") + 1]
