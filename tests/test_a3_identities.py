"""A3 (replay-flood by throwaway keys) at its root: how many new identities one address may bring.

Under open admission every throwaway key the hub opens is admitted, so bounding the flood means
bounding (a) new identities per address at admission, apart from known keys re-admitting, and
(b) the connections an address with admitted peers may open: only those peers' own, not the
whole address's (session 9 exempted the address, so a flood that got one key admitted was no
longer gated at all). Real Hub objects, real ControlHosts on 127.0.0.1, real signatures.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hubkit import announce as _announce
from hubkit import small_hub_cfg

from echo2.learner_hub.admission_gate import AdmissionGate, AdmissionLimits
from echo2.learner_hub.hub import Hub
from echo2.protocol import envelope
from echo2.protocol.errors import RateLimited
from echo2.protocol.identity import Identity
from echo2.protocol.messages import AdmissionDecision, AdmissionRequest
from echo2.protocol.net import reqresp
from echo2.protocol.net.conngate import MemberAllowance, MemberBook
from echo2.protocol.net.control import ControlHost, RequestLimits

ECHO = "/echo2/test-a3/1.0.0"


def test_a3_gate_new_identities_apart_from_known_keys() -> None:
    gate = AdmissionGate(AdmissionLimits(new_per_s=0.5, new_burst=4, known_per_s=10, known_burst=8, key_per_s=0.5,
                                         key_burst=2), known=["old"])
    t = 0.0
    passed = [gate.refusal(f"k{i}", "198.51.100.9", t) is None for i in range(10)]
    assert sum(passed) == 4  # the burst, then nothing
    assert gate.refusal("k99", "198.51.100.9", t + 10.0) is None  # refills at 0.5/s
    assert gate.refusal("k98", "203.0.113.5", t) is None  # another address has its own
    # a known key is not charged to (nor refused by) the exhausted new-identity bucket
    assert gate.refusal("old", "198.51.100.9", t) is None
    gate.admitted("k0")
    assert gate.is_known("k0") and gate.refusal("k0", "198.51.100.9", t) is None
    # ...but has a bucket of its own
    assert gate.refusal("old", "198.51.100.9", t) is None
    assert gate.refusal("old", "198.51.100.9", t) is not None
    assert gate.refused["new_identity"] == 6 and gate.refused["known_key"] == 1


def test_a3_gate_known_keys_bounded() -> None:
    gate = AdmissionGate(AdmissionLimits(max_known=3), known=["a", "b", "c", "d"])
    assert len(gate) == 3 and not gate.is_known("d")  # the store lists the most recent first
    gate.admitted("e")
    assert len(gate) == 3 and gate.is_known("e") and not gate.is_known("c")


@pytest.fixture()
def hub(tmp_path: Path) -> Any:
    h = Hub(small_hub_cfg(tmp_path))
    yield h
    h.store.close()


async def _admit_from(hub: Hub, ip: str, node: Identity) -> bool:
    token = reqresp._REMOTE_IP.set(ip)  # what ControlHost sets while serving a stream from ip
    try:
        req = AdmissionRequest(peer_id=node.peer_id, join_token="", announce=_announce(node.peer_id))
        reply = await hub.on_admission(node.peer_id, envelope.seal(node, req))
        return bool(envelope.open_envelope(reply, AdmissionDecision, replay=None).message.admitted)
    except RateLimited as exc:
        assert "too many admission requests" in exc.message
        return False
    finally:
        reqresp._REMOTE_IP.reset(token)


def test_a3_fresh_keys_from_one_address_bounded_per_second(hub: Hub) -> None:
    """One address mints a key every 0.1 s for 60 s (virtual clock): the hub admits its burst and
    then 0.5 new identities a second (session 9 admitted 5/s: ~320 of these 600), and a node it
    admitted before still re-admits from that same address at once (a hub restart or a silence
    drop must not starve it behind the flood)."""
    clock = trio.testing.MockClock()

    async def main() -> None:
        honest = Identity.generate()
        assert await _admit_from(hub, "198.51.100.9", honest)
        admitted = 0
        for _ in range(600):
            admitted += await _admit_from(hub, "198.51.100.9", Identity.generate())
            clock.jump(0.1)
        lim = hub.admission_gate.limits
        assert admitted <= lim.new_burst + lim.new_per_s * 60 + 1
        assert admitted >= lim.new_burst  # an honest fleet's first join still gets its burst
        hub.nodes.pop(honest.peer_id)  # dropped (silent) or the hub restarted: it asks again
        assert await _admit_from(hub, "198.51.100.9", honest)

    trio.run(main, clock=clock)


def test_a3_restarted_hub_knows_its_nodes(tmp_path: Path) -> None:
    node = Identity.generate()
    first = Hub(small_hub_cfg(tmp_path))
    try:
        assert trio.run(_admit_from, first, "198.51.100.9", node)
    finally:
        first.store.close()
    again = Hub(small_hub_cfg(tmp_path))
    try:
        assert again.admission_gate.is_known(node.peer_id)
        assert not again.admission_gate.is_known(Identity.generate().peer_id)
    finally:
        again.store.close()


# --- (b) the connection gate: admitted peers widen only their own allowance ----------------------


def test_a3_member_allowance_follows_the_members() -> None:
    m = MemberAllowance(per_s=0.5, burst=2)
    assert not m.allow("ip", 0, 0.0)  # no admitted peer: no member allowance at all
    assert [m.allow("ip", 3, 0.0) for _ in range(7)] == [True] * 6 + [False]
    assert m.allow("ip", 3, 1.0)  # 3 members refill 1.5/s
    trusted = {"p1"}
    book = MemberBook(trusted.__contains__, memory_s=60.0, cache_s=0.0)
    book.connected("ip", "p1", 0.0)
    book.connected("ip", "s1", 0.0)
    assert book.members("ip", 0.0) == 1
    book.disconnected("ip", "p1", 5.0)
    book.disconnected("ip", "s1", 5.0)
    assert book.members("ip", 60.0) == 1  # remembered a while after its connection closed
    assert book.members("ip", 66.0) == 0


async def _echo(_peer: str, data: bytes) -> bytes:
    return data


def test_a3_admitted_peer_does_not_exempt_its_address() -> None:
    """An admitted peer is connected from an address; fresh keys from the same address open
    connections past the stranger rate: they are cut right after Noise (never identified, never
    served), while the admitted peer itself reconnects on its own allowance. Session 9 let every
    one of them in (the address was exempt)."""

    async def main() -> None:
        limits = RequestLimits(stranger_conns_per_ip_s=0.01, stranger_conns_burst=3, refused_hold_s=0.0,
                               member_conns_burst=100.0)
        served: list[str] = []

        async def echo(peer: str, data: bytes) -> bytes:
            served.append(peer)
            return data

        async with ControlHost(Identity.generate(), gossip=False, limits=limits) as server:
            server.set_handler(ECHO, echo, max_request=1024)
            addr = server.addrs[0]
            honest_id = Identity.generate()
            server.is_trusted = lambda peer: peer == honest_id.peer_id
            async with ControlHost(honest_id, gossip=False) as honest:
                assert await honest.request(addr, ECHO, b"hi", max_response=64) == b"hi"  # stranger token 1 of 3
                strangers_ok = 0
                for _ in range(6):
                    async with ControlHost(Identity.generate(), gossip=False, dial_timeout_s=3) as s:
                        try:
                            strangers_ok += await s.request(addr, ECHO, b"x", max_response=64, timeout_s=3) == b"x"
                        except Exception:
                            pass
                assert strangers_ok == 2  # the rest of the stranger burst, no more
                cut = server._inbound.cut_after_noise
                assert cut >= 4  # each of the other four at least once (a dialler may retry)
                assert len([p for p in served if p != honest_id.peer_id]) == 2
            for _ in range(3):  # the admitted peer reconnects (remembered after it disconnected)
                async with ControlHost(honest_id, gossip=False) as honest:
                    assert await honest.request(addr, ECHO, b"hi", max_response=64, timeout_s=5) == b"hi"
            assert server._inbound.cut_after_noise == cut

    run(main)


def run(fn: Callable[[], Awaitable[Any]], limit_s: float = 60.0) -> Any:
    async def main() -> Any:
        with trio.fail_after(limit_s):
            return await fn()

    return trio.run(main)


def _fleet_behind_one_address(n: int, known: bool) -> float:
    """Seconds until ``n`` nodes behind one address, all starting at once against a hub that
    knows none of them connected (it restarted, or they are new), are all admitted. Each node
    does what node/runtime.py does: connect, open its join streams (identify, gossip, admission:
    3 inbound streams), ask for admission on its open connection, and back off (0.5 s doubling,
    capped at 5 s: HUB_BACKOFF_CAP_S) after a refused connection, a closed one or a refused
    request. The gates are the hub's own objects with the default limits, on a virtual clock."""
    from echo2.protocol.backoff import Backoff
    from echo2.protocol.net.conngate import InboundGate
    from echo2.protocol.peerlimit import KeyedRateLimiter

    lim = RequestLimits()
    admitted: set[str] = set()
    book = MemberBook(admitted.__contains__, memory_s=lim.member_memory_s, cache_s=0.0)
    conns: dict[str, int] = {}
    gate = InboundGate(lim, members=lambda ip: book.members(ip, now), trusts=admitted.__contains__,
                       ip_conns=lambda ip: conns.get(ip, 0), refuse=lambda *a: None)
    streams = KeyedRateLimiter(lim.stranger_streams_per_ip_s, lim.stranger_streams_burst)
    peers = [f"node{i}" for i in range(n)]
    adm = AdmissionGate(known=peers if known else ())
    ip = "198.51.100.7"
    backoff = {p: Backoff(base_s=0.5, cap_s=5.0) for p in peers}
    due = {p: 0.0 for p in peers}
    connected: set[str] = set()
    now = 0.0
    while len(admitted) < n:
        assert now < 3600, "the fleet never got in"
        for p in [p for p in peers if p not in admitted and due[p] <= now]:
            if p not in connected:
                if gate.admit(ip, now)[1] is not None:
                    due[p] = now + backoff[p].failed()
                    continue
                connected.add(p)
                conns[ip] = conns.get(ip, 0) + 1
                book.connected(ip, p, now)
                if not all(streams.allow(ip, now) for _ in range(2)):  # identify, gossip: over the rate, closed
                    connected.discard(p)
                    conns[ip] -= 1
                    book.disconnected(ip, p, now)
                    due[p] = now + backoff[p].failed()
                    continue
            if not streams.allow(ip, now) or adm.refusal(p, ip, now) is not None:
                due[p] = now + backoff[p].failed()
                continue
            admitted.add(p)
            adm.admitted(p)
        now += 0.05
    return now


def test_a3_nat_fleet_gets_in_within_bounded_time() -> None:
    """The cost of the per-address bounds for an honest fleet behind one NAT address (README, A11):
    100 nodes the hub knew (it restarted) and 100 brand-new nodes, all starting at once."""
    restarted = _fleet_behind_one_address(100, known=True)
    fresh = _fleet_behind_one_address(100, known=False)
    # known keys: paced by the strangers' connection (20, then 2/s) and stream (40, then 5/s) rates
    assert restarted <= 120, restarted
    # new keys: 32 at once, then 0.5/s: (100 - 32) / 0.5 = 136 s, plus backoff
    assert 100 <= fresh <= 200, fresh
