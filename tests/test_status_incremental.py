"""status.json's per-node list is rebuilt only where it changed (issue 20, status_nodes.py).

Pure: which entries a write rebuilds (changed, joined, due for a time-moving figure, all on a
fleet-wide change), the text it joins, the entries of departed nodes forgotten. With a real Hub:
after each change to the fleet (a pause, a proof of holding, tokens, a punishment, a refusal, a
node silent past the limit, a node joining), the written status.json lists every node as a
status built from scratch lists it, and a node nothing happened to keeps its entry."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from hubkit import hold, small_hub_cfg
from test_hub_pause import pause
from test_hub_results import admit

from echo2.learner_hub.hub import Hub
from echo2.learner_hub.hubstatus import node_entry
from echo2.learner_hub.reputation import Event
from echo2.learner_hub.status_nodes import BODY_PART, NodeFragments
from echo2.protocol.identity import Identity


def _entry(p: str, rate: float | None = 0.0, state: str = "active", **kw: Any) -> tuple[dict[str, Any], bool]:
    billed = bool(kw.pop("billed", False))
    return {"peer_id": p, "state": state, "tokens_per_s_1m": rate, "tokens_per_s_5m": rate, **kw}, billed


def _listed(f: NodeFragments, peers: list[str]) -> Any:
    return json.loads(b"".join(f.body(peers)))


def test_fragments_rebuild_what_changed_joined_or_is_due() -> None:
    f = NodeFragments(refresh_s=10.0)
    peers = ["a", "b", "c"]
    assert f.select(0.0, peers, [], key=1) == {"a", "b", "c"}  # the first write: everything
    f.update([_entry("a"), _entry("b", rate=None), _entry("c", billed=True)], 0.0)
    assert _listed(f, peers) == [_entry(p, rate=None if p == "b" else 0.0)[0] for p in peers]
    assert f.select(1.0, peers, [], key=1) == set()  # nothing changed, nothing due yet
    assert f.select(2.0, peers, ["a"], key=1) == {"a"}
    f.update([_entry("a", tokens=5)], 2.0)
    # b's unknown rate and c's billed cost move with time: rebuilt once refresh_s has passed
    assert f.select(10.0, peers, [], key=1) == {"b", "c"}
    f.update([_entry("b"), _entry("c", billed=True)], 10.0)
    assert f.select(15.0, peers, [], key=1) == set()
    assert f.select(20.0, peers, [], key=1) == {"c"}  # b's rate is 0 now: it no longer moves
    f.update([_entry("c", billed=True)], 20.0)
    assert f.select(21.0, peers + ["d"], ["d"], key=1) == {"d"}  # a joiner is named in the changes
    assert f.missing(peers + ["d", "e"]) == ["d", "e"]
    f.update([_entry("d", state="standby"), _entry("e")], 21.0)
    assert f.states(peers + ["d"]) == {"active": 3, "standby": 1}
    assert f.select(22.0, peers, [], key=2) == set(peers)  # a fleet-wide input changed: all
    assert [e["peer_id"] for e in f.first(peers + ["d"], 2)] == ["a", "b"]


def test_fragments_reuse_the_joined_list_until_an_entry_changes() -> None:
    f = NodeFragments()
    f.update([_entry("a"), _entry("b")], 0.0)
    one = f.body(["a", "b"])
    assert f.body(["a", "b"]) is one  # nothing changed: the same bytes
    assert _listed(f, ["b"]) == [_entry("b")[0]]  # another list: joined anew
    f.update([_entry("a", tokens=1)], 1.0)
    assert _listed(f, ["a", "b"])[0]["tokens"] == 1


def test_fragments_join_the_list_in_parts() -> None:
    """The list of a large fleet comes as parts of BODY_PART entries (each joined apart, none a
    long C call): in order, and together the JSON list of every entry."""
    f = NodeFragments()
    peers = [f"n{i}" for i in range(2 * BODY_PART + 3)]
    f.update([_entry(p) for p in peers], 0.0)
    parts = f.body(peers)
    assert len(parts) == 4 and parts[-1] == b"]"
    assert max(p.count(b'"peer_id"') for p in parts) == BODY_PART
    assert [e["peer_id"] for e in _listed(f, peers)] == peers
    assert _listed(f, []) == []


def test_fragments_forget_departed_nodes_when_they_are_many() -> None:
    f = NodeFragments(refresh_s=1.0)
    everyone = [f"n{i}" for i in range(300)]
    f.update([_entry(p, rate=None) for p in everyone], 0.0)
    f.forget_absent(everyone[:250])  # 50 gone: kept for now (amortised)
    assert len(f.text) == 300
    f.forget_absent(everyone[:10])
    assert set(f.text) == set(everyone[:10]) == set(f.entry) == set(f.state)
    assert f.select(5.0, everyone[:10], [], key=None) == set(everyone[:10])  # due: the present ones only


def test_fragments_strict_json() -> None:
    f = NodeFragments()
    f.update([_entry("a", staleness_mean=float("nan"))], 0.0)
    assert _listed(f, ["a"])[0]["staleness_mean"] is None


TIME_FIELDS = ("as_of", "cost_usd", "tokens_per_s_1m", "tokens_per_s_5m")


def _written(hub: Hub, path: Path) -> dict[str, dict[str, Any]]:
    trio.run(hub.write_status)
    return {e["peer_id"]: e for e in json.loads(path.read_text())["nodes"]}


def _check_against_a_full_build(hub: Hub, written: dict[str, dict[str, Any]]) -> None:
    latest = hub.publisher.latest_version
    assert list(written) == list(hub.nodes)  # every node, in admission order
    for p, e in written.items():
        fresh = node_entry(hub, hub.nodes[p], e["as_of"], latest)
        assert {k: v for k, v in e.items() if k not in TIME_FIELDS} == {k: v for k, v in fresh.items() if k not in TIME_FIELDS}
        row = hub.ledger.row(p, e["as_of"])  # its cost as of when its entry was built
        assert row is not None and e["cost_usd"] == pytest.approx(row.cost_usd, abs=1e-6)


def test_status_json_follows_the_fleet_as_nodes_change(tmp_path: Path) -> None:
    hub = Hub(small_hub_cfg(tmp_path, node_silence_s=60.0))
    hub.status_nodes.refresh_s = 3600.0  # no time-moving figure comes due during the test (the pure tests time those)
    path = tmp_path / "status.json"
    nodes = [Identity.generate() for _ in range(4)]
    try:
        for n in nodes:
            assert admit(hub, n).admitted
        trio.run(hub.publish)
        first = _written(hub, path)
        _check_against_a_full_build(hub, first)
        a, b, c, d = (n.peer_id for n in nodes)

        pause(hub, nodes[0], True)  # state, paused
        trio.run(hold, hub, nodes[1])  # held_version, versions_behind
        hub.nodes[c].tokens += 640  # what an accepted result adds (with its ledger and reputation entries)
        hub.nodes[c].tasks_done += 1
        hub.ledger.accept(c, 8, 640)
        hub.fleet.punish(d, Event.TIMEOUT, "a task expired")  # reputation, refused
        hub.ledger.refuse(d, "stale")
        second = _written(hub, path)
        _check_against_a_full_build(hub, second)
        assert second[a]["state"] == "paused" and second[b]["held_version"] == 0 and second[c]["tokens"] == 640
        assert second[d]["reputation"] < first[d]["reputation"] and second[d]["refused"] == 1

        # nothing happened to anyone (entries of billed nodes move only every REFRESH_S): same entries
        third = _written(hub, path)
        assert third == second

        # one node goes silent past the limit and is dropped; another joins
        hub.nodes[d].last_seen = time.time() - 120.0
        assert hub.fleet.drop_silent(time.time(), 60.0) == [d]
        late = Identity.generate()
        assert admit(hub, late).admitted
        fourth = _written(hub, path)
        _check_against_a_full_build(hub, fourth)
        assert d not in fourth and late.peer_id in fourth
        assert {p: fourth[p] for p in (a, b, c)} == {p: third[p] for p in (a, b, c)}  # untouched: kept
    finally:
        hub.store.close()
