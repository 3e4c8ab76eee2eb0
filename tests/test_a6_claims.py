"""A6 claims: a node's claimed rate and asked price are bounded, a claim only buys a probation
until the hub has timed the node, an overclaim is punished, a price moves at a bounded rate and
only for later tasks, and the ledger counts integer micro-USD (real hub object, real store)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio

from echo2.learner_hub.claims import ClaimLimits, PriceBook, claim_problem
from echo2.learner_hub.config import ConfigError, HubConfig
from echo2.learner_hub.dispatch import DispatchConfig, Dispatcher, PromptGroup, TaskAssignment
from echo2.learner_hub.hub import Hub
from echo2.learner_hub.ledger import Ledger
from echo2.learner_hub.reputation import Event, ReputationBook
from echo2.protocol import envelope
from echo2.protocol.identity import Identity
from echo2.protocol.messages import AdmissionDecision, AdmissionRequest, Announce


def announce(peer: str, price: float = 0.0, rate: float = 0.0) -> Announce:
    return Announce(
        peer_id=peer, software_version="0.1.0", accelerator="", accelerator_count=0, accelerator_memory_bytes=0,
        cpu_model="test", cpu_cores=1, ram_bytes=1 << 30, free_disk_bytes=1 << 30, engine="transformers",
        engine_version="", tokens_per_s=0.0, rollouts_per_s=rate, upload_MBps=0.0, download_MBps=0.0,
        price_usd_per_hour=price, listen_addrs=[], data_addr="", reachable=False, versions_held=[],
        max_upload_MBps=0.0,
    )


def admit(hub: Hub, ident: Identity, price: float = 0.0, rate: float = 0.0) -> AdmissionDecision:
    req = AdmissionRequest(peer_id=ident.peer_id, join_token="", announce=announce(ident.peer_id, price, rate))
    reply = trio.run(hub.on_admission, ident.peer_id, envelope.seal(ident, req))
    return envelope.open_envelope(reply, AdmissionDecision, replay=envelope.ReplayGuard()).message


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Hub:
    d = tmp_path_factory.mktemp("hub")
    return Hub(HubConfig(dir=str(d), prompts_per_step=4, group_size=4, activation_margin=1.0, max_price=5.0,
                         price_change_every_s=600.0))


def test_a6_absurd_claims_are_refused_at_admission(hub: Hub) -> None:
    for rate, price in ((1e9, 0.1), (1e308, 0.1), (10.0, 1e300), (10.0, 5.01)):
        ident = Identity.generate()
        d = admit(hub, ident, price, rate)
        assert not d.admitted and "announcement refused" in d.reason, (rate, price, d.reason)
        assert ident.peer_id not in hub.nodes and ident.peer_id not in hub.dispatcher.nodes
    ok = Identity.generate()
    assert admit(hub, ok, 5.0, 1e4).admitted  # the bounds themselves are allowed
    hub.fleet.ban(ok.peer_id, "test over")


def test_a6_claimed_rate_buys_only_a_probation_share() -> None:
    d = Dispatcher(DispatchConfig(staleness=1, target_task_s=10.0), task_id_prefix="t")
    for honest in ("h1", "h2"):
        d.add_node(honest, 2.0)  # timed by the hub (e.g. restored): trusted
    d.add_node("liar", 9_999.0, claimed=True)
    d.submit(PromptGroup(f"p{i}", (1, 2), 4) for i in range(64))
    tasks = d.next_tasks(0.0, 0)
    liar = sum(len(t.groups) for t in tasks if t.node_id == "liar")
    assert liar == 1 and sum(1 for t in tasks if t.node_id == "liar") == 1
    assert d.measured_rate("liar") is None and d.planning_rate("liar") == 2.0  # the fleet's median, not 9999
    # the first timing replaces the claim outright (no average with it): 4 rollouts in 4 s
    (task,) = [t for t in tasks if t.node_id == "liar"]
    assert d.on_result(4.0, task.task_id, "liar", 0, 0, 4).accepted
    assert d.measured_rate("liar") == pytest.approx(1.0)


def test_a6_activation_plans_with_measured_rates(hub: Hub) -> None:
    honest = [Identity.generate() for _ in range(2)]
    liar = Identity.generate()
    for ident in honest:
        assert admit(hub, ident, 1.0, 20.0).admitted
        st = hub.dispatcher.nodes[ident.peer_id]
        st.rate, st.claimed = 20.0, False  # as if timed
    assert admit(hub, liar, 0.01, 9_000.0).admitted  # cheap and claims to cover everything
    hub.history.append({"step": 1, "train_s": 0.5, "reward": 0.0, "t": 1.0})  # R* = 16 / 0.5 = 32/s
    hub.activate()
    active = hub.active or set()
    assert {i.peer_id for i in honest} <= active, "the honest nodes must cover R*: the liar's claim counts for nothing"
    assert hub.last_activation["cost_usd_per_hour"] == pytest.approx(2.0)
    assert liar.peer_id in active  # on probation, so that the hub can time it
    # the capacity model plans the liar at the fleet's measured median, not its claim
    caps = {c.node_id: c.rate for c in hub.fleet.capacity()}
    assert caps[liar.peer_id] <= 20.0
    for ident in (*honest, liar):
        hub.fleet.ban(ident.peer_id, "test over")
    hub.history.clear()


def test_a6_overclaim_is_punished_once_per_claim(hub: Hub) -> None:
    ident = Identity.generate()
    assert admit(hub, ident, 0.0, 500.0).admitted
    st = hub.dispatcher.nodes[ident.peer_id]
    st.rate, st.claimed, st.completed_tasks = 2.0, False, 3  # the hub timed 3 tasks at 2/s
    before = hub.reputation.score(ident.peer_id)
    hub.fleet.tick(1000.0)
    hub.fleet.tick(1001.0)
    rep = hub.reputation.get(ident.peer_id)
    assert rep.overclaims == 1 and rep.score == pytest.approx(before * 0.8)
    hub.fleet.ban(ident.peer_id, "test over")


def test_a6_overclaim_event_in_the_book() -> None:
    book = ReputationBook()
    out = book.record("n", Event.OVERCLAIM, "claimed 100, measured 1")
    assert out.ban is None and out.score == pytest.approx(0.4)
    assert book.snapshot("n")["overclaims"] == 1


def test_a6_price_change_is_bounded_and_applies_to_later_tasks(hub: Hub) -> None:
    ident = Identity.generate()
    peer = ident.peer_id
    assert admit(hub, ident, 0.01, 5.0).admitted
    fleet, now = hub.fleet, time.time()
    hub.ledger.activate(peer, now)
    # a task in flight, issued at the admission price
    hub.dispatcher.in_flight["old-task"] = TaskAssignment("old-task", peer, (), 0, 1, now, now + 30, 1.0)
    st = hub.dispatcher.nodes[peer]
    st.in_flight.add("old-task")
    fleet.task_issued("old-task", peer)
    fleet.announced(peer, announce(peer, 1e300, 5.0))  # above max_price: ignored
    assert fleet.refusals["announce_bad_claim"] >= 1 and fleet.prices.offered(peer) == pytest.approx(0.01)
    fleet.announced(peer, announce(peer, 4.0, 5.0))
    fleet.tick(now + 1.0)  # too soon after admission: the price in force stays
    assert fleet.prices.offered(peer) == pytest.approx(0.01)
    fleet.tick(now + 1e6)  # allowed now, but by x2 only, and not billed while the old task runs
    assert fleet.prices.offered(peer) == pytest.approx(0.02)
    assert hub.ledger.price_micro(peer) == 10_000
    fleet.task_issued("new-task", peer)
    assert fleet.task_price_micro("old-task", peer) == 10_000 and fleet.task_price_micro("new-task", peer) == 20_000
    st.in_flight.discard("old-task")
    del hub.dispatcher.in_flight["old-task"]
    fleet.tick(now + 1e6 + 1)
    assert hub.ledger.price_micro(peer) == 20_000
    # an hour later the bill is bounded by what the operator allows, not by what was asked
    row = hub.ledger.row(peer, now + 1e6 + 3601)
    assert row is not None and row.cost_usd < 5.0
    hub.fleet.ban(peer, "test over")


def test_a6_price_book_rules() -> None:
    book = PriceBook(ClaimLimits(max_price=10.0, change_every_s=60.0))
    assert book.admit("a", 1.0, 0.0) == 1.0
    book.ask("a", 0.5)  # a decrease applies at once
    assert book.offered("a") == 0.5
    book.ask("a", 10.0)
    assert book.step("a", 30.0, ()) is None or book.offered("a") == 0.5
    book.step("a", 61.0, ())
    assert book.offered("a") == 1.0  # x2
    book.step("a", 62.0, ())
    assert book.offered("a") == 1.0  # once per 60 s
    assert book.admit("b", 3.0, 0.0, known=0.5) == 0.5  # a node seen before keeps its price in force
    assert claim_problem(float("inf"), 0.0, ClaimLimits()) is not None
    assert claim_problem(0.0, float("nan"), ClaimLimits()) is not None


def test_a6_ledger_counts_integer_micro_usd() -> None:
    led = Ledger()
    led.activate("a", 0.0, price=3.6)  # 3.6 $/h = 1 micro-USD per millisecond
    for i in range(1, 100_001):  # 100k price "changes" at the same price: 100k closed intervals
        led.set_price("a", 3.6, i / 1000.0)
    row = led.row("a", 100.0)
    assert row is not None and row.cost_micro == 100_000 and row.active_ms == 100_000
    assert isinstance(row.cost_micro, int) and row.cost_usd == 0.1
    # the largest price an operator may allow, for a century: an exact integer, never inf
    led.activate("b", 0.0, price=1e6)
    big = led.row("b", 100 * 365 * 86400.0)
    assert big is not None and big.cost_micro == 10**6 * 10**6 * 100 * 365 * 24


def test_a6_max_price_is_a_validated_config_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_price"):
        HubConfig(max_price=-1.0).validate()
    with pytest.raises(ConfigError, match="max_claimed_rate"):
        HubConfig(max_claimed_rate=float("inf")).validate()
    p = tmp_path / "hub.toml"
    p.write_text('[hub]\nmax_price = "lots"\n')
    from echo2.learner_hub.config import load_config

    with pytest.raises(ConfigError, match="max_price"):
        load_config(p)


def test_a6_price_from_before_a_restart_obeys_todays_max_price() -> None:
    book = PriceBook(ClaimLimits(max_price=2.0))
    assert book.admit("a", 2.0, 0.0, known=50.0) == 2.0
    assert book.admit("b", 1.0, 0.0, known=50.0) == 1.0  # asking less than before: at once


def test_a3_a_flood_of_untimed_nodes_holds_only_the_probation_slots() -> None:
    """Admission is cheap (open mode: a key), so 90 fresh nodes that never answer must neither
    hold 90 tasks until their deadlines nor take their weight out of the timed nodes' shares."""
    d = Dispatcher(DispatchConfig(staleness=1, target_task_s=10.0, probation_max_in_flight=4), task_id_prefix="t")
    for honest in ("h1", "h2"):
        d.add_node(honest, 2.0)  # timed
    for i in range(90):
        d.add_node(f"sybil{i}", 1e4, claimed=True)
    d.submit(PromptGroup(f"p{i}", (1, 2), 4) for i in range(64))
    tasks = d.next_tasks(0.0, 0)
    sybil = [t for t in tasks if t.node_id.startswith("sybil")]
    honest = [t for t in tasks if t.node_id.startswith("h")]
    assert len(sybil) == 4 and sum(len(t.groups) for t in sybil) == 4
    # the honest nodes' tasks are sized as if the flood were 4 nodes, not 90: 5 groups each
    # (20 rollouts at 2/s in 10 s), not the 1 group a 92-node split would leave them
    assert all(len(t.groups) == 5 for t in honest), [len(t.groups) for t in honest]
    # nothing more while the slots are held
    assert not [t for t in d.next_tasks(1.0, 0) if t.node_id.startswith("sybil")]


def test_a3_probation_slots_grow_with_the_timed_fleet() -> None:
    d = Dispatcher(DispatchConfig(staleness=1, target_task_s=10.0, probation_max_in_flight=4), task_id_prefix="t")
    for i in range(10):
        d.add_node(f"h{i}", 2.0)
    for i in range(20):
        d.add_node(f"new{i}", 2.0, claimed=True)
    d.submit(PromptGroup(f"p{i}", (1, 2), 4) for i in range(200))
    tasks = d.next_tasks(0.0, 0)
    assert sum(1 for t in tasks if t.node_id.startswith("new")) == 10
