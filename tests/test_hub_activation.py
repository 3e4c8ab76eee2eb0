"""The hub activates free nodes always and the cheapest cover of the remaining R* among paid
ones, with hysteresis; the ledger bills only active time (real hub object, real store)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from echo2.learner_hub import fleet as fleet_mod
from echo2.learner_hub.config import HubConfig
from echo2.learner_hub.hub import Hub
from echo2.protocol import envelope
from echo2.protocol.identity import Identity
from echo2.protocol.messages import AdmissionRequest, Announce


def announce(peer: str, price: float) -> Announce:
    return Announce(
        peer_id=peer, software_version="0.1.0", accelerator="", accelerator_count=0, accelerator_memory_bytes=0,
        cpu_model="test", cpu_cores=1, ram_bytes=1 << 30, free_disk_bytes=1 << 30, engine="transformers",
        engine_version="", tokens_per_s=0.0, rollouts_per_s=0.0, upload_MBps=0.0, download_MBps=0.0,
        price_usd_per_hour=price, listen_addrs=[], data_addr="", reachable=False, versions_held=[],
        max_upload_MBps=0.0,
    )


def test_cost_aware_activation(tmp_path: Path) -> None:
    # B = 4 prompts x 4 = 16 rollouts per step; T_train = 0.5 s -> R* = 1.25 * 32 = 40 rollouts/s
    hub = Hub(HubConfig(dir=str(tmp_path), prompts_per_step=4, group_size=4, activation_margin=1.25))
    nodes = {name: Identity.generate() for name in ("free", "cheap", "pricey", "mid")}
    prices = {"free": 0.0, "cheap": 0.10, "pricey": 2.00, "mid": 0.50}
    rates = {"free": 10.0, "cheap": 20.0, "pricey": 100.0, "mid": 15.0}
    for name, ident in nodes.items():
        req = AdmissionRequest(peer_id=ident.peer_id, join_token="", announce=announce(ident.peer_id, prices[name]))
        trio.run(hub.on_admission, ident.peer_id, envelope.seal(ident, req))
        # as if the hub had timed a task of each (activation plans with measured rates only)
        hub.dispatcher.nodes[ident.peer_id].rate, hub.dispatcher.nodes[ident.peer_id].claimed = rates[name], False
    hub.history.append({"step": 1, "train_s": 0.5, "reward": 0.0, "t": 1.0})
    hub.activate()
    pid = {ident.peer_id: name for name, ident in nodes.items()}
    # free 10/s always; remaining 30/s: cheap (20) + mid (15) = $0.60/h beats pricey alone ($2/h)
    assert {pid[p] for p in hub.active or ()} == {"free", "cheap", "mid"}
    assert hub.last_activation["cost_usd_per_hour"] == 0.60
    # hysteresis: a slightly cheaper alternative does not churn the active set
    hub.fleet.announced(nodes["pricey"].peer_id, announce(nodes["pricey"].peer_id, 0.58))
    hub.activate()
    assert {pid[p] for p in hub.active or ()} == {"free", "cheap", "mid"}
    # a much cheaper one does
    hub.fleet.announced(nodes["pricey"].peer_id, announce(nodes["pricey"].peer_id, 0.05))
    hub.activate()
    assert {pid[p] for p in hub.active or ()} == {"free", "pricey"}
    st = {n["peer_id"]: n["state"] for n in hub.status()["nodes"]}
    assert st[nodes["cheap"].peer_id] == "standby" and st[nodes["pricey"].peer_id] == "active"


def test_the_periodic_decision_is_solved_off_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cost-aware, the housekeeping's decision every few seconds (Fleet.reactivate) reads the
    offers and solves the cover in a worker thread (on the loop it cost 15 ms of offers and 3-40 ms
    of solving every 5 s at 10,000 nodes), and decides as :meth:`Fleet.activate` does."""
    hub = Hub(HubConfig(dir=str(tmp_path), prompts_per_step=4, group_size=4, activation_margin=1.25))
    nodes = {name: Identity.generate() for name in ("free", "cheap", "pricey", "mid")}
    prices = {"free": 0.0, "cheap": 0.10, "pricey": 2.00, "mid": 0.50}
    rates = {"free": 10.0, "cheap": 20.0, "pricey": 100.0, "mid": 15.0}
    for name, ident in nodes.items():
        req = AdmissionRequest(peer_id=ident.peer_id, join_token="", announce=announce(ident.peer_id, prices[name]))
        trio.run(hub.on_admission, ident.peer_id, envelope.seal(ident, req))
        hub.dispatcher.nodes[ident.peer_id].rate, hub.dispatcher.nodes[ident.peer_id].claimed = rates[name], False
    hub.history.append({"step": 1, "train_s": 0.5, "reward": 0.0, "t": 1.0})
    threads: list[threading.Thread] = []
    real = fleet_mod.choose_active

    def recorded(*a: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread())
        return real(*a, **kw)

    monkeypatch.setattr(fleet_mod, "choose_active", recorded)
    trio.run(hub.fleet.reactivate)
    pid = {ident.peer_id: name for name, ident in nodes.items()}
    assert threads and all(t is not threading.main_thread() for t in threads)
    assert {pid[p] for p in hub.active or ()} == {"free", "cheap", "mid"}
    assert hub.last_activation["cost_usd_per_hour"] == 0.60
    assert hub.ledger.is_active(nodes["mid"].peer_id) and not hub.ledger.is_active(nodes["pricey"].peer_id)
