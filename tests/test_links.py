"""What the broadcast planner may believe of a node (issue 15, A10): the hub's observations in
``learner_hub.links``, read through the fleet by the real hub, never the node's Announce. The
real dial-back and the hub-timed upload are in tests/test_probe.py."""

from __future__ import annotations

from pathlib import Path

from test_hub_results import admit

from echo2.learner_hub.config import HubConfig
from echo2.learner_hub.hub import Hub
from echo2.learner_hub.links import LinkBook, Scope, UNMEASURED_UPLOAD_Bps, announced_port, ip_scope
from echo2.learner_hub.planner import NodeInfo, check_plan, plan_broadcast
from echo2.protocol.identity import Identity
from echo2.protocol.messages import Announce


def claims(peer: str, data_addr: str, *, up_MBps: float = 0.0, cap_MBps: float = 0.0) -> Announce:
    return Announce(
        peer_id=peer, software_version="0.1.0", accelerator="", accelerator_count=0, accelerator_memory_bytes=0,
        cpu_model="test", cpu_cores=1, ram_bytes=1 << 30, free_disk_bytes=1 << 30, engine="transformers",
        engine_version="", tokens_per_s=0.0, rollouts_per_s=10.0, upload_MBps=up_MBps, download_MBps=0.0,
        price_usd_per_hour=0.0, listen_addrs=[], data_addr=data_addr, reachable=True, versions_held=[],
        max_upload_MBps=cap_MBps,
    )


def test_ip_scope() -> None:
    assert ip_scope("127.0.0.1") is Scope.LOOPBACK and ip_scope("::1") is Scope.LOOPBACK
    assert ip_scope("10.1.2.3") is Scope.PRIVATE and ip_scope("192.168.0.9") is Scope.PRIVATE
    assert ip_scope("8.8.8.8") is Scope.PUBLIC and ip_scope("2606:4700::1111") is Scope.PUBLIC
    assert ip_scope("::ffff:127.0.0.1") is Scope.LOOPBACK
    for never in ("0.0.0.0", "::", "224.0.0.1", "ff02::1", "169.254.1.1", "fe80::1", "255.255.255.255",
                  "240.0.0.1", "", "example.com"):
        assert ip_scope(never) is None, never
    assert announced_port("0.0.0.0:7000") == 7000 and announced_port("[::]:7000") == 7000
    assert announced_port("") is None and announced_port("nonsense") is None and announced_port("h:0") is None


def test_a10_planner_never_believes_announced_address_reachability_or_upload(tmp_path: Path) -> None:
    """A10: a node announcing ``0.0.0.0``, ``reachable`` and 1 GB/s was planned as a parent. Now
    the fleet hands the planner the observed IP (announced port only), reachable only after a
    dial-back proved it there, and the hub-measured upload (a conservative default until then)."""
    cfg = HubConfig(dir=str(tmp_path), steps=10, prompts_per_step=2, group_size=4, staleness=1, max_new_tokens=4,
                    broadcast="pipelined")
    hub = Hub(cfg)
    liar, honest, late = Identity.generate(), Identity.generate(), Identity.generate()
    for n in (liar, honest, late):
        assert admit(hub, n).admitted
    hub.fleet.announced(liar.peer_id, claims(liar.peer_id, "0.0.0.0:7000", up_MBps=1e3))
    hub.fleet.announced(honest.peer_id, claims(honest.peer_id, "127.0.0.1:7001"))
    hub.fleet.announced(late.peer_id, claims(late.peer_id, "127.0.0.1:7002"))

    info = hub.fleet.peer_info(liar.peer_id)
    assert info is not None and not info.reachable and info.data_addr == ""  # no observed IP yet
    assert info.upload_Bps == UNMEASURED_UPLOAD_Bps
    # not admitted: never None (None made the sender fall back to the node's own hello)
    stranger = hub.fleet.peer_info(Identity.generate().peer_id)
    assert stranger is not None and not stranger.reachable and stranger.data_addr == ""

    # what the hub observed: all three at 127.0.0.1; only `honest` was dialled back and timed
    links = hub.fleet.links
    for n in (liar, honest, late):
        links.observed(n.peer_id, "127.0.0.1")
    links.verified(honest.peer_id, "127.0.0.1", 7001)
    links.record_upload(honest.peer_id, 8 << 20, 0.1)
    liar_info = hub.fleet.peer_info(liar.peer_id)
    assert liar_info is not None and liar_info.data_addr == "127.0.0.1:7000" and not liar_info.reachable
    honest_info = hub.fleet.peer_info(honest.peer_id)
    assert honest_info is not None and honest_info.reachable and honest_info.data_addr == "127.0.0.1:7001"
    assert honest_info.upload_Bps > 50e6

    # the plan the pipelined sender would make from this (its own construction of NodeInfo)
    infos = []
    for n in (liar, honest, late):
        i = hub.fleet.peer_info(n.peer_id)
        assert i is not None
        infos.append(NodeInfo(n.peer_id, i.upload_Bps, i.reachable and bool(i.data_addr)))
    plan = plan_broadcast(1, 1e6, infos, 8, hub=hub.identity.peer_id)
    check_plan(plan)
    assert liar.peer_id not in plan.interior and late.peer_id not in plan.interior
    assert honest.peer_id in plan.interior
    for s in range(plan.stripes):
        assert not plan.children[s].get(liar.peer_id)

    # a verification made at one address is void once the node is seen elsewhere or moves port
    links.observed(honest.peer_id, "127.0.0.2")
    moved = hub.fleet.peer_info(honest.peer_id)
    assert moved is not None and not moved.reachable and moved.data_addr == "127.0.0.2:7001"
    links.verified(honest.peer_id, "127.0.0.2", 7001)
    hub.fleet.announced(honest.peer_id, claims(honest.peer_id, "127.0.0.2:7003"))
    again = hub.fleet.peer_info(honest.peer_id)
    assert again is not None and not again.reachable


def test_a10_scope_a_loopback_or_private_node_never_parents_a_wider_fleet() -> None:
    book = LinkBook()
    for peer, ip in (("local", "127.0.0.1"), ("lan", "10.0.0.7"), ("net", "8.8.4.4")):
        book.verified(peer, ip, 7000)
    everyone = ["local", "lan", "net"]
    assert not book.view("local", "x:7000", 0.0, everyone).reachable
    assert not book.view("lan", "x:7000", 0.0, everyone).reachable
    assert book.view("net", "x:7000", 0.0, everyone).reachable
    # a fleet on the hub's own LAN: the LAN node may serve it, the loopback one still not
    assert book.view("lan", "x:7000", 0.0, ["local", "lan"]).reachable
    assert not book.view("local", "x:7000", 0.0, ["local", "lan"]).reachable
    # all on the hub's host (tests, benches): loopback is fine
    assert book.view("local", "x:7000", 0.0, ["local"]).reachable
    # an observed address that is no unicast host is never a parent, whatever was verified
    book.verified("odd", "0.0.0.0", 7000)
    assert book.view("odd", "x:7000", 0.0, ["odd"]).data_addr == ""
    assert not book.view("odd", "x:7000", 0.0, ["odd"]).reachable


def test_link_book_keeps_the_largest_measurement_and_stays_bounded() -> None:
    book = LinkBook(max_peers=3)
    book.record_upload("a", 1024, 0.001)  # too small to say anything: ignored
    assert book.get("a") is None
    book.record_upload("a", 4 << 20, 0.1)
    book.record_upload("a", 1 << 20, 0.001)  # smaller transfer: the larger one stands
    got = book.get("a")
    assert got is not None and abs(got.upload_Bps - (4 << 20) / 0.1) < 1
    book.record_upload("a", 8 << 20, float("inf"))  # nonsense timing: ignored
    for p in ("b", "c", "d"):
        book.observed(p, "127.0.0.1")
    assert len(book) == 3 and book.get("a") is None
